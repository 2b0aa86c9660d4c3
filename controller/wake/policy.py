"""The wake policy: which stored event should end an `rgt watch`, and what to say about it.

Pure functions, no I/O: the watch loop (controller.wake.watch) reads the store and
hands each event here with the run's merged policy, the time, and the keys
that already woke someone (Store.woken()).

Material by default (the wake contract): a state change at the policy's min_sev or
above (an onset or an escalation; never a clear, never telemetry), any
`job.exited`, and the controller's own `sidecar.silent`. `link.lost` is not:
a broken transport says nothing about the job, so the watch judges it by its
budget (exit 4), not as an event. The policy then adds kinds (always
material), mutes kinds (never), and sets quiet hours (only critical events
and job exits wake).

Wake keys are conditions (kind and identity), not events: a condition that woke
someone wakes again only when it re-opens after a clear (and not inside
flap_window_s, so a flapping condition wakes once), or escalates (warn ->
critical, an OOM kill). One made moot by a later, graver event never wakes
(superseded: memory pressure by the OOM kill it led to, a failed `rgt verify` by
a later pass, an onset by its escalation, a dead-man warning by the firing). The
dead-man's warnings are keyed by the lease they warn about, not by the renewal
each late renewal moves. A job exit is judged by controller.runs.life (a stop by
request is not a failure). What a wake says is in controller.runs.explain; what kinds mean in
controller.kinds.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import protocol

from controller.kinds import (
    LINK_KINDS,
    SUPERSEDED_BY,
    base_condition,
    condition_key,
    condition_kinds,
    escalation,
    is_clear,
    severity,
)
from controller.runs.explain import AnyEvent, explain, next_command, stack_lines
from controller.runs.life import END_KINDS, Life, closes
from controller.store.db import LocalEvent

POLICY_KEYS = ("add", "mute", "min_sev", "quiet", "flap_window_s", "link_budget_s")
_WINDOW = re.compile(r"^([01]\d|2[0-4]):([0-5]\d)-([01]\d|2[0-4]):([0-5]\d)$")
_KIND = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\*?$")



# ---- the policy -----------------------------------------------------------------


def parse_kinds(value: Any, key: str) -> Tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"policy {key!r} must be a list of kinds, got {value!r}")
    out: List[str] = []
    for item in value:
        if not isinstance(item, str) or not _KIND.match(item):
            raise ValueError(f"policy {key!r}: {item!r} is not a kind or a prefix "
                             "(like gpu.xid, gpu. or gpu.*)")
        name = item[:-1] if item.endswith("*") else item
        if not name:
            raise ValueError(f"policy {key!r}: '*' alone would match every kind")
        if name not in out:
            out.append(name)
    return tuple(out)


def _seconds(value: Any, key: str, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"policy {key!r} must be a number of seconds, got {value!r}")
    if value < minimum:
        raise ValueError(f"policy {key!r} must be at least {minimum:g} s, got {value!r}")
    return float(value)


def parse_window(text: str) -> Tuple[int, int]:
    """"HH:MM-HH:MM" as (start, end) minutes of the day; end may be 24:00; may cross midnight."""
    m = _WINDOW.match(text.strip()) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"quiet window {text!r} must look like HH:MM-HH:MM (22:00-07:00)")
    h1, m1, h2, m2 = (int(g) for g in m.groups())
    start, end = h1 * 60 + m1, h2 * 60 + m2
    if start >= 24 * 60 or end > 24 * 60:
        raise ValueError(f"quiet window {text!r}: 24:00 is the latest end, 23:59 the latest start")
    if start == end:
        raise ValueError(f"quiet window {text!r} is empty; 00:00-24:00 is the whole day")
    return start, end


def in_window(window: str, minute_of_day: int) -> bool:
    start, end = parse_window(window)
    if start < end:
        return start <= minute_of_day < end
    return minute_of_day >= start or minute_of_day < end


def check_layer(layer: Mapping[str, Any]) -> Dict[str, Any]:
    """A policy layer (any subset of POLICY_KEYS) validated and normalized; ValueError if bad."""
    if not isinstance(layer, Mapping):
        raise ValueError(f"a policy is an object, got {layer!r}")
    unknown = sorted(set(layer) - set(POLICY_KEYS))
    if unknown:
        raise ValueError(f"unknown policy key(s) {', '.join(unknown)} (known: {', '.join(POLICY_KEYS)})")
    out: Dict[str, Any] = {}
    for key in ("add", "mute"):
        if key in layer:
            out[key] = list(parse_kinds(layer[key], key))
    both = set(out.get("add", ())) & set(out.get("mute", ()))
    if both:
        raise ValueError(f"{', '.join(sorted(both))} cannot be both added and muted")
    if any(k in END_KINDS for k in out.get("mute", ())):
        raise ValueError("job.exited and run.closed cannot be muted: a run's end always ends a watch")
    if "min_sev" in layer:
        if layer["min_sev"] not in protocol.SEVERITIES:
            raise ValueError(f"min_sev must be one of {', '.join(protocol.SEVERITIES)}, "
                             f"got {layer['min_sev']!r}")
        out["min_sev"] = layer["min_sev"]
    if "quiet" in layer:
        quiet = layer["quiet"]
        if not isinstance(quiet, (list, tuple)):
            raise ValueError(f"quiet must be a list of HH:MM-HH:MM windows, got {quiet!r}")
        for window in quiet:
            parse_window(window)
        out["quiet"] = [w.strip() for w in quiet]
    if "flap_window_s" in layer:
        out["flap_window_s"] = _seconds(layer["flap_window_s"], "flap_window_s", 0.0)
    if "link_budget_s" in layer:
        out["link_budget_s"] = _seconds(layer["link_budget_s"], "link_budget_s", 0.0)
    return out


@dataclasses.dataclass(frozen=True)
class Policy:
    """What wakes a watcher of one run. Kinds in add/mute are names or prefixes ending in '.'."""

    add: Tuple[str, ...] = ()
    mute: Tuple[str, ...] = ()
    min_sev: str = "warn"
    quiet: Tuple[str, ...] = ()
    flap_window_s: float = 1800.0
    link_budget_s: float = 900.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Policy:
        """A full policy from one layer over the defaults; ValueError with the reason if bad."""
        return cls().updated(d)

    def to_dict(self) -> Dict[str, Any]:
        return {"add": list(self.add), "mute": list(self.mute), "min_sev": self.min_sev,
                "quiet": list(self.quiet), "flap_window_s": self.flap_window_s,
                "link_budget_s": self.link_budget_s}

    def updated(self, layer: Mapping[str, Any]) -> Policy:
        """This policy with a more specific layer on top.

        add/mute accumulate (a kind the layer adds leaves mute, and the other way
        round); quiet is replaced when the layer has it; numbers are replaced.
        """
        clean = check_layer(layer)
        add, mute = list(self.add), list(self.mute)
        for kind in clean.get("add", ()):
            mute = [k for k in mute if k != kind]
            add += [kind] if kind not in add else []
        for kind in clean.get("mute", ()):
            add = [k for k in add if k != kind]
            mute += [kind] if kind not in mute else []
        return dataclasses.replace(
            self, add=tuple(add), mute=tuple(mute), min_sev=clean.get("min_sev", self.min_sev),
            quiet=tuple(clean.get("quiet", self.quiet)),
            flap_window_s=clean.get("flap_window_s", self.flap_window_s),
            link_budget_s=clean.get("link_budget_s", self.link_budget_s))

    def choice(self, kind: str) -> Optional[str]:
        """"add", "mute" or None: the most specific pattern that matches kind decides."""
        best: Tuple[int, Optional[str]] = (-1, None)
        for verdict, patterns in (("add", self.add), ("mute", self.mute)):
            for p in patterns:
                exact = p == kind
                prefix = p.endswith(".") and kind.startswith(p)
                if (exact or prefix) and (len(p) + (1 if exact else 0)) > best[0]:
                    best = (len(p) + (1 if exact else 0), verdict)
        return best[1]

    def quiet_now(self, now: float) -> bool:
        if not self.quiet:
            return False
        t = time.localtime(now)
        minute = t.tm_hour * 60 + t.tm_min
        return any(in_window(w, minute) for w in self.quiet)


def merged(*layers: Mapping[str, Any]) -> Policy:
    """default <- each layer in turn (store "*", store run, command line); ValueError if one is bad."""
    policy = Policy()
    for layer in layers:
        policy = policy.updated(layer)
    return policy


# ---- events and conditions ---------------------------------------------------------


def event_key(event: AnyEvent) -> str:
    """The key Store.mark_woken records for an event: seq:N (sidecar) or local:N (controller)."""
    if isinstance(event, LocalEvent):
        return f"local:{event.id}"
    return f"seq:{event.seq}"


def absorbed_key(key: str) -> str:
    """The key that marks an event an earlier wake covered (flapping, still open, superseded)."""
    return f"absorbed:{key}"


def mark_key(key: str, woken: Mapping[str, float]) -> str:
    """The key to record a new wake of `key` under: key itself the first time, then key#N.

    Store.mark_woken keeps the first time a key was marked, so a condition that
    wakes again after its flap window is recorded under a fresh key.
    """
    n = 1
    found = key
    while found in woken:
        n += 1
        found = f"{key}#{n}"
    return found


def last_woken(key: str, woken: Mapping[str, float]) -> Optional[float]:
    """When `key` (or a later mark_key of it) last ended a watch, or None."""
    times = [t for k, t in woken.items() if k == key or k.startswith(key + "#")]
    return max(times) if times else None


def _position(event: AnyEvent) -> Tuple[int, float]:
    return (event.id, event.ts) if isinstance(event, LocalEvent) else (event.seq, event.ts)


def after(a: AnyEvent, b: AnyEvent) -> bool:
    """a was stored after b: by seq (box) or id (controller) within a stream, by time across."""
    if isinstance(a, LocalEvent) == isinstance(b, LocalEvent):
        return _position(a)[0] > _position(b)[0]
    return a.ts > b.ts


def reopened(event: AnyEvent, history: Sequence[AnyEvent], woken: Mapping[str, float],
             lease: Optional[str] = None) -> bool:
    """Whether `event` opens its condition again since it last woke a watch: a clear of the
    condition lies between the newest of its events that woke one and `event`.

    history: the condition's events (condition_kinds) stored before `event`, oldest first.
    Without a woken event of the condition in it, it cannot tell, and says True."""
    cond, base = condition_key(event, lease), base_condition(event, lease)
    past = [e for e in history if after(event, e)]
    woke = None
    for i, e in enumerate(past):
        if condition_key(e, lease) == cond and event_key(e) in woken:
            woke = i
    if woke is None:
        return True
    return any(is_clear(e) and base_condition(e, lease) == base for e in past[woke + 1:])


def supersede_kinds(event: AnyEvent) -> Tuple[str, ...]:
    """The kinds that may make `event` moot (see superseded); the watch reads them."""
    if is_clear(event):
        return ()
    if event.kind == "verify.done":
        return ("verify.done",) if event.data.get("ok") is not True else ()
    out: List[str] = list(condition_kinds(event.kind)) if escalation(event) is None else []
    out += list(SUPERSEDED_BY.get(event.kind, ()))
    return tuple(dict.fromkeys(out))


def superseded(event: AnyEvent, others: Sequence[AnyEvent],
               lease: Optional[str] = None) -> Optional[AnyEvent]:
    """The later, graver event that makes `event` moot, so that it never wakes, or None.

    others: events of supersede_kinds(event) from the same attempt of the run (for dead-man
    events: of the same lease), oldest first, before and after it. What supersedes:
      an onset        an escalation of the same condition after it, with no clear between
      memory pressure the OOM kill it led to (a job.exited with oom_killed of the attempt)
      a non-finite loss  the exit of its attempt after it (controller.runs.life fails that exit
                      for it, and its wake tells the loss as its cause)
      a failed `rgt verify` (verify.done, ok false)   a later one that passed
      a dead-man warning  the dead-man firing after it (the expiry wakes on its own)
    """
    if is_clear(event):
        return None
    later = [o for o in others if after(o, event)]
    if event.kind == "verify.done":
        if event.data.get("ok") is True:
            return None
        return next((o for o in later if o.kind == "verify.done" and o.data.get("ok") is True), None)
    if event.kind == "mem.pressure":
        oom = next((o for o in others if o.kind == "job.exited" and o.data.get("oom_killed") is True), None)
        if oom is not None:
            return oom
    if event.kind == "train.nonfinite":
        ended = next((o for o in later if o.kind == "job.exited"), None)
        if ended is not None:
            return ended
    if event.kind == "deadman.expiring":
        fired = next((o for o in later if o.kind in ("deadman.firing", "deadman.fired")), None)
        if fired is not None:
            return fired
    if escalation(event) is not None:
        return None
    base = base_condition(event, lease)
    for o in later:
        if base_condition(o, lease) != base:
            continue
        if is_clear(o):
            return None
        if escalation(o) is not None:
            return o
    return None


def _plain(value: Any) -> Any:
    """JSON-able the way the wire is: non-finite floats as "nan" / "inf" / "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def envelope(event: AnyEvent) -> Dict[str, Any]:
    """The event as JSON: the sidecar envelope, or for a controller event id/origin and no seq."""
    if isinstance(event, LocalEvent):
        return {"v": protocol.PROTOCOL_VERSION, "run": event.run, "host": "", "seq": None,
                "id": event.id, "origin": "controller", "ts": event.ts, "kind": event.kind,
                "sev": event.sev, "data": _plain(event.data)}
    out: Dict[str, Any] = _plain(event.to_dict())
    return out


def finished_cleanly(event: AnyEvent) -> Optional[bool]:
    """For job.exited / run.closed: True when code 0 and the sidecar's final verdict is not a failure
    (the bare exit; controller.runs.life judges it with the run's stop request and what came before)."""
    if event.kind not in END_KINDS:
        return None
    return event.data.get("code") == 0 and event.data.get("final_ok") is not False


# ---- the judgement ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Context:
    """What the watch read from the store about one event, so that judge stays pure.

    life: for a job.exited, how it ends the run (controller.runs.life.exit_life with the run's stop
    request). history: the condition's events stored before it (condition_kinds), oldest
    first; None when not read (then a woken condition wakes again once its flap window
    passed). others: events that may supersede it (supersede_kinds). lease: for dead-man
    events, the lease (arm) they are about. host: the run's host here, for the next command.
    cause: for a job.exited that life fails for a non-finite loss, that train.nonfinite.
    cut: for a job.exited whose close-out follows (closing), the sidecar stopped without closing
    (controller.runs.life.close_cut): the exit itself ends the run. Else the run.closed does.
    """

    life: Optional[Life] = None
    history: Optional[Tuple[AnyEvent, ...]] = None
    others: Tuple[AnyEvent, ...] = ()
    lease: Optional[str] = None
    host: Optional[str] = None
    cause: Optional[AnyEvent] = None
    cut: bool = False


@dataclasses.dataclass(frozen=True)
class Wake:
    """An event that ends a watch, with what to tell the person or agent."""

    run: str
    key: str            # for Store.mark_woken: "seq:123" / "local:45"
    condition: str      # for flapping: "cond:<kind>:<identity>"
    event: Dict[str, Any]
    explain: str        # one line, safe to print
    next: str           # the command to run next (one shell line)
    clean_exit: Optional[bool]   # job.exited only: the run ended ok (finished, or stopped by request)
    stacks: Tuple[str, ...] = ()  # job.stalled: a short form of each process's stack
    life: Optional[Life] = None   # job.exited only: how it ended the run
    cause: Optional[Dict[str, Any]] = None   # job.exited only: the event that made it fail (envelope)

    def record(self, woke_at: float) -> Dict[str, Any]:
        out: Dict[str, Any] = {"exit": 0 if self.clean_exit else 10, "run": self.run, "event": self.event,
                               "explain": self.explain, "next": self.next, "woke_at": woke_at}
        if self.stacks:
            out["stacks"] = list(self.stacks)
        if self.life is not None:
            out["life"] = self.life.to_dict()
            if self.life.stopped_by:
                out["stopped_by"] = self.life.stopped_by
        if self.cause is not None:
            out["cause"] = self.cause
        return out


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Why an event does or does not wake: reason is "wake" or the rule that held it back."""

    reason: str
    key: str
    wake: Optional[Wake] = None


ABSORBED = ("flapping", "open", "superseded")   # verdicts the watch records as absorbed


def judge(event: AnyEvent, policy: Policy, now: float, woken: Mapping[str, float],
          job_started_at: Optional[float] = None, context: Optional[Context] = None) -> Verdict:
    """The full verdict: "wake", or one of "woken", "absorbed", "muted", "link", "telemetry",
    "closing" (a job exit whose run.closed is the end: it follows once custody is final),
    "clear", "below_min_sev", "superseded" (a graver event made it moot), "open" (its condition
    woke and never cleared since), "quiet", "flapping". The watch defers "quiet" events until
    the quiet hours end and records those in ABSORBED as absorbed."""
    key = event_key(event)
    if key in woken:
        return Verdict("woken", key)
    if absorbed_key(key) in woken:
        return Verdict("absorbed", key)
    ctx = context or Context()
    kind, sev = event.kind, event.sev
    exit_event = kind in END_KINDS
    if exit_event and closes(event) and not ctx.cut:
        return Verdict("closing", key)
    choice = None if exit_event else policy.choice(kind)
    if choice == "mute":
        return Verdict("muted", key)
    if choice != "add" and not exit_event:
        if kind in LINK_KINDS:
            return Verdict("link", key)
        if protocol.is_telemetry(kind):
            return Verdict("telemetry", key)
        if is_clear(event):
            return Verdict("clear", key)
        silent = kind == "sidecar.silent" and isinstance(event, LocalEvent)
        if not silent and severity(sev) < severity(policy.min_sev):
            return Verdict("below_min_sev", key)
    cond = condition_key(event, ctx.lease)
    woke_at = None if exit_event else last_woken(cond, woken)
    if not exit_event and superseded(event, ctx.others, ctx.lease) is not None:
        return Verdict("superseded", key)
    if woke_at is not None and ctx.history is not None and not reopened(event, ctx.history, woken, ctx.lease):
        return Verdict("open", key)
    if policy.quiet_now(now) and not exit_event and sev != "critical":
        return Verdict("quiet", key)
    if woke_at is not None and now - woke_at < policy.flap_window_s:
        return Verdict("flapping", key)
    lived = ctx.life if exit_event else None
    cause = ctx.cause if exit_event else None
    wake = Wake(run=event.run, key=key, condition=cond, event=envelope(event),
                explain=explain(event, job_started_at, lived, cause),
                next=next_command(event, lived, ctx.host),
                clean_exit=lived.ok if lived is not None else finished_cleanly(event),
                stacks=tuple(stack_lines(event.data)) if kind == "job.stalled" else (), life=lived,
                cause=envelope(cause) if cause is not None else None)
    return Verdict("wake", key, wake)


def classify(event: AnyEvent, policy: Policy, now: float, woken: Mapping[str, float],
             job_started_at: Optional[float] = None, context: Optional[Context] = None) -> Optional[Wake]:
    """The Wake for a material event not yet woken, else None (see judge for why not)."""
    return judge(event, policy, now, woken, job_started_at, context).wake


__all__ = ["ABSORBED", "Context", "Policy", "Verdict", "Wake", "absorbed_key", "after", "check_layer",
           "classify", "envelope", "event_key", "finished_cleanly", "judge", "last_woken", "mark_key",
           "merged", "parse_kinds", "parse_window", "reopened", "supersede_kinds", "superseded"]
