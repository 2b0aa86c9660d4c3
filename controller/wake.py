"""The wake policy: which stored event should end an `rgt watch`, and what to say about it.

Pure functions, no I/O: the watch loop (controller.watch) reads the store and
hands each event here with the run's merged policy, the time, and the keys
that already woke someone (Store.woken()).

Material by default (the wake contract): a state change at the policy's min_sev or
above (an onset or an escalation; never a clear, never telemetry), any
`job.exited`, and the controller's own `sidecar.silent`. `link.lost` is not:
a broken transport says nothing about the job, so the watch judges it by its
budget (exit 4), not as an event. The policy then adds kinds (always
material), mutes kinds (never), and sets quiet hours (only critical events
and job exits wake). A condition that woke someone does not wake again for the
same kind and identity inside flap_window_s, so a flapping condition wakes once.
"""
from __future__ import annotations

import dataclasses
import math
import re
import shlex
import signal
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import protocol

from controller.render import printable, summarize
from controller.store import LocalEvent

AnyEvent = Union[protocol.Event, LocalEvent]

# Kinds whose every event is the end of a condition (their onsets are other kinds).
CLEAR_KINDS: Dict[str, str] = {
    "gpu.throttle_cleared": "gpu.throttle",
    "gpu.foreign_memory_cleared": "gpu.foreign_memory",
    "disk.ok": "disk.low",
    "mem.ok": "mem.pressure",
    "job.progressing": "job.stalled",
    "sidecar.recovered": "sidecar.degraded",
    "link.restored": "link.lost",
}
# Judged by the watch's link budget instead (exit 4), never as a wake of their own.
LINK_KINDS = ("link.lost", "link.restored")
# Fields that tell two conditions of one kind apart, in this order (all present ones count).
IDENT_FIELDS = ("gpu", "name", "path", "resource", "part", "code")
POLICY_KEYS = ("add", "mute", "min_sev", "quiet", "flap_window_s", "link_budget_s")
_WINDOW = re.compile(r"^([01]\d|2[0-4]):([0-5]\d)-([01]\d|2[0-4]):([0-5]\d)$")
_KIND = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\*?$")
EXPLAIN_MAX = 240


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
    if any(k == "job.exited" for k in out.get("mute", ())):
        raise ValueError("job.exited cannot be muted: a job exit always ends a watch")
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


# ---- events ---------------------------------------------------------------------


def event_key(event: AnyEvent) -> str:
    """The key Store.mark_woken records for an event: seq:N (sidecar) or local:N (controller)."""
    if isinstance(event, LocalEvent):
        return f"local:{event.id}"
    return f"seq:{event.seq}"


def absorbed_key(key: str) -> str:
    """The key that marks an event a flapping condition's earlier wake covered."""
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


def identity(event: AnyEvent) -> str:
    parts = []
    for name in IDENT_FIELDS:
        value = event.data.get(name)
        if value is not None and not isinstance(value, (dict, list)):
            parts.append(_str(value))
    return "/".join(parts)


def condition_key(event: AnyEvent) -> str:
    """cond:<kind>:<identity>; an escalation (warn -> critical) is a condition of its own."""
    base = CLEAR_KINDS.get(event.kind, event.kind)
    key = f"cond:{base}:{identity(event)}"
    return key + ":escalated" if event.data.get("state") == "escalated" else key


def is_clear(event: AnyEvent) -> bool:
    return event.kind in CLEAR_KINDS or event.data.get("state") == "cleared"


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
    """For job.exited: True when code 0 and the sidecar's final verdict is not a failure."""
    if event.kind != "job.exited":
        return None
    return event.data.get("code") == 0 and event.data.get("final_ok") is not False


# ---- the judgement ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Wake:
    """An event that ends a watch, with what to tell the person or agent."""

    run: str
    key: str            # for Store.mark_woken: "seq:123" / "local:45"
    condition: str      # for flapping: "cond:<kind>:<identity>"
    event: Dict[str, Any]
    explain: str        # one line, safe to print
    next: str           # the command to run next
    clean_exit: Optional[bool]   # job.exited only: finished cleanly or not
    stacks: Tuple[str, ...] = ()  # job.stalled: a short form of each process's stack

    def record(self, woke_at: float) -> Dict[str, Any]:
        out: Dict[str, Any] = {"exit": 0 if self.clean_exit else 10, "run": self.run, "event": self.event,
               "explain": self.explain, "next": self.next, "woke_at": woke_at}
        if self.stacks:
            out["stacks"] = list(self.stacks)
        return out


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Why an event does or does not wake: reason is "wake" or the rule that held it back."""

    reason: str
    key: str
    wake: Optional[Wake] = None


def judge(event: AnyEvent, policy: Policy, now: float, woken: Mapping[str, float],
          job_started_at: Optional[float] = None) -> Verdict:
    """The full verdict: "wake", or one of "woken", "absorbed", "muted", "link", "telemetry",
    "clear", "below_min_sev", "quiet", "flapping". The watch defers "quiet" events until the
    quiet hours end and records "flapping" ones as absorbed."""
    key = event_key(event)
    if key in woken:
        return Verdict("woken", key)
    if absorbed_key(key) in woken:
        return Verdict("absorbed", key)
    kind, sev = event.kind, event.sev
    exit_event = kind == "job.exited"
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
    if policy.quiet_now(now) and not exit_event and sev != "critical":
        return Verdict("quiet", key)
    cond = condition_key(event)
    woke_at = last_woken(cond, woken)
    if not exit_event and woke_at is not None and now - woke_at < policy.flap_window_s:
        return Verdict("flapping", key)
    run = event.run
    wake = Wake(run=run, key=key, condition=cond, event=envelope(event),
                explain=explain(event, job_started_at), next=next_command(event),
                clean_exit=finished_cleanly(event),
                stacks=tuple(stack_lines(event.data)) if kind == "job.stalled" else ())
    return Verdict("wake", key, wake)


def classify(event: AnyEvent, policy: Policy, now: float, woken: Mapping[str, float],
             job_started_at: Optional[float] = None) -> Optional[Wake]:
    """The Wake for a material event not yet woken, else None (see judge for why not)."""
    return judge(event, policy, now, woken, job_started_at).wake


def severity(sev: str) -> int:
    try:
        return protocol.severity_rank(sev)
    except KeyError:
        return 0  # an unknown severity from a newer sidecar: treated as info


# ---- what to say ----------------------------------------------------------------
# Box data is printed through render.printable and cut to one line: a hostile path
# or error text can neither move the cursor nor add lines.


def _huge(value: Any) -> str:
    """An integer past 64 bits by its size (Python prints none over 4300 digits), else ''."""
    return f"(an integer of {value.bit_length():,} bits)" if type(value) is int and abs(value) >> 64 else ""


def _str(value: Any) -> str:
    """str(value) that never raises: a huge integer by its size, anything unprintable by its type."""
    try:
        return _huge(value) or str(value)
    except Exception:  # box data: a list of huge integers, a broken __str__
        return f"({type(value).__name__})"


def number(value: Any) -> str:
    """1,204 / 0.5123 / NaN / Inf: a value as a person reads it."""
    if isinstance(value, str) and value.lower() in ("nan", "inf", "+inf", "-inf"):
        value = float(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "NaN" if math.isnan(value) else ("Inf" if value > 0 else "-Inf")
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return _huge(value) or f"{value:,}"
    return _str(value)


def seconds(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or _huge(value):
        return f"{_huge(value)} s" if _huge(value) else "?"
    return f"{value:,.0f} s" if value >= 10 else f"{value:.3g} s"


def size(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or _huge(value):
        return f"{_huge(value)} B" if _huge(value) else "?"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def signal_name(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and not _huge(value):
        try:
            return f"{value} ({signal.Signals(value).name})"
        except ValueError:
            return str(value)
    return _str(value)


class _Fields(Dict[str, Any]):
    """Event data for str.format_map: each value formatted by its name's unit, '?' when missing."""

    def __missing__(self, key: str) -> str:
        return "?"

    def __getitem__(self, key: str) -> str:
        value = self.get(key)
        if key == "at":
            return _at(self)
        if key == "where":
            gpu, pci = self.get("gpu"), self.get("pci")
            return (f"GPU {_str(gpu)}" if gpu is not None else "a GPU") + (f" ({_str(pci)})" if pci else "")
        if value is None:
            return "?"
        if isinstance(value, list):
            return ", ".join(map(_str, value)) or "?"
        if key.endswith("bytes"):
            return size(value)
        return seconds(value) if key.endswith("_s") else number(value)


def _at(d: Mapping[str, Any]) -> str:
    if d.get("step") is not None:
        return f" at step {number(d['step'])}"
    return f" at epoch {number(d['epoch'])}" if d.get("epoch") is not None else ""


def _exited(d: Mapping[str, Any], duration: str) -> str:
    code, sig = d.get("code"), d.get("signal")
    if d.get("vanished"):
        head = "the job vanished without an exit record"
        head += " (OOM kill counted)" if d.get("oom_killed") else ""
    elif d.get("oom_killed"):
        what = f"signal {signal_name(sig)}" if sig else f"code {_str(code)}"
        limit = d.get("oom_limit")
        head = (f"the job was OOM-killed ({what}): limit hit: {limit}" if isinstance(limit, str) and limit
                else f"the job was OOM-killed ({what})")
    elif d.get("preempted"):
        head = f"the job was preempted: stopped by {signal_name(sig) if sig else 'a signal'} rgt did not send"
    elif sig:
        head = f"the job was killed by signal {signal_name(sig)}"
    elif code == 0 and d.get("final_ok") is not False:
        head = "the job finished cleanly (code 0)"
    else:
        head = f"the job exited with code {_str(code)}"
    reasons = d.get("final_reasons")
    if code == 0 and d.get("final_ok") is False:
        why = "; ".join(map(_str, reasons)) if isinstance(reasons, list) and reasons else "see its events"
        return f"{head}{duration}, but the run failed: {why}"
    return head + duration


def stack_lines(d: Mapping[str, Any], limit: int = 8) -> List[str]:
    """A short form of a job.stalled's stacks (box data: checked, escaped later): one line per
    process, "rank 1 (pid 12): f (a.py:3) < g (b.py:9)", innermost frame first."""
    stacks = d.get("stacks")
    if not isinstance(stacks, list):
        return []
    out: List[str] = []
    for s in stacks[:limit]:
        if not isinstance(s, Mapping):
            continue
        rank, pid, threads = s.get("rank"), s.get("pid"), s.get("threads")
        who = f"rank {number(rank)} (pid {number(pid)})" if rank is not None else f"pid {number(pid)}"
        first: Mapping[str, Any] = {}
        if isinstance(threads, list) and threads and isinstance(threads[0], Mapping):
            first = threads[0]
        frames = first.get("frames") if isinstance(first.get("frames"), list) else []
        body = " < ".join(_str(f)[:120] for f in frames[:4]) if frames else _str(s.get("error") or "no stack")
        out.append(printable(f"{who}: {body}")[:300])
    return out


def _stalled(d: Mapping[str, Any]) -> str:
    if d.get("verdict") == "stopped (SIGSTOP)":
        return "process {stopped_pids} of the job is stopped (SIGSTOP, state T): nothing runs until SIGCONT"
    line = "no progress for {idle_s} (budget {budget_s}){at}; verdict {verdict}" + (
        ", GPU {gpu_util_pct}% busy" if d.get("gpu_util_pct") is not None else "") + (
        " on every node; {first_node} stopped first" if d.get("scope") == "all nodes" else "")
    hang = d.get("hang")
    if isinstance(hang, Mapping) and isinstance(hang.get("detail"), str):
        return line + "; " + str(hang["detail"]).replace("{", "(").replace("}", ")")
    lines = stack_lines(d, 1)
    return line + ("; " + lines[0].replace("{", "(").replace("}", ")") if lines else "")


def _silent(d: Mapping[str, Any]) -> str:
    silent_s, every = d.get("silent_s"), d.get("heartbeat_interval_s")
    if isinstance(silent_s, (int, float)) and isinstance(every, (int, float)) and every > 0:
        return (f"the link is up but no heartbeat for {silent_s / every:.0f} intervals ({{silent_s}}): "
                "the sidecar or the whole box is frozen (a paused spot instance sends no signal)")
    return "the link is up but no heartbeat arrived"


Template = Union[str, Callable[[Mapping[str, Any]], str]]
_TEMPLATES: Dict[str, Template] = {
    "train.nonfinite": "{name} is {value}{at} ({source})",
    "train.loss_spike": "{name} spiked to {value}{at} (window mean {mean}, sigma {sigma})",
    "train.metric_zero": ("{name} stayed at exactly 0 for {evaluations} evaluations{at} while the loss "
                          "fell ({loss_then} -> {loss_now})"),
    "train.restarted_from_zero": lambda d: (
        "training restarted at step {new_step} (it had reached step {last_step})"
        if d.get("new_step") is not None else
        "training restarted at epoch {new_epoch} (it had reached epoch {last_epoch})"),
    "train.slow": "steps advance while the GPU idles ({gpu_util_pct}% busy): data-bound",
    "train.short_run": "the job finished early: {fraction} of its expected {by}",
    "job.stalled": lambda d: _stalled(d),
    "gpu.xid": lambda d: "Xid {code} ({xid_name}) on {where}" + (": {advice}" if d.get("advice") else ""),
    "gpu.lost": "{where} was lost (evidence: {evidence})",
    "gpu.ecc": lambda d: (
        "row remapping failed on {where}: the GPU needs replacing" if d.get("reason") == "row_remap_failure"
        else "uncorrected ECC errors rose on {where} (+{volatile_uncorrected_delta} volatile, "
             "+{aggregate_uncorrected_delta} aggregate)"),
    "gpu.throttle": "{where} is throttled: {reasons}",
    "gpu.foreign_memory": "processes that are not the job hold {bytes} on {where} (pids {pids})",
    "disk.low": lambda d: "disk {path} is {used_pct}% full ({resource}): " + (
        "{inodes_free} inodes free" if d.get("resource") == "inodes" else "{avail_bytes} free") + (
        ", full in ~{eta_to_full_s}" if d.get("eta_to_full_s") is not None else ""),
    "mem.pressure": lambda d: (
        "the kernel OOM-killed a process in the job's memory group (+{oom_kill_delta})"
        if d.get("state") == "oom_kill"
        else "job memory at {used_pct}% of its limit ({used_bytes} of {limit_bytes})"),
    "ckpt.suspect": "checkpoint {path} looks suspect: {reason}",
    "ckpt.stale": lambda d: "no good checkpoint for {age_s} (limit {stale_after_s})" + (
        "; the last is {last_path} (step {last_step})" if d.get("last_path") else ""),
    "ckpt.sync_failed": "the durable copy of {path} failed: {error}",
    "sidecar.silent": _silent,
    "sidecar.degraded": lambda d: ("the controller's watcher failed: {error}"
                                   if d.get("source") == "controller"
                                   else "sidecar part {part} is failing: {error}"),
    "deadman.fired": "the dead-man lease expired and its safe action ran",
    "job.preempted": lambda d: "the job was told to stop by someone else than rgt (preemption), " + (
        "grace {grace_s} before SIGKILL" if d.get("grace_s") is not None else "grace unknown"),
    "job.rank_failed": "node {node} exited ({how}) while {waiting} still wait on it",
}


def explain(event: AnyEvent, job_started_at: Optional[float] = None) -> str:
    """One printable line saying what happened (box text escaped, <= EXPLAIN_MAX chars); never raises."""
    d = event.data
    template = _TEMPLATES.get(event.kind)
    try:
        if event.kind == "job.exited":
            took = event.ts - job_started_at if job_started_at is not None else None
            text = _exited(d, f" after {seconds(took)}" if took is not None and took >= 0 else "")
        elif template is not None:
            text = (template if isinstance(template, str) else template(d)).format_map(_Fields(d))
        else:
            text = f"{event.kind} ({event.sev}): {summarize(d, 120)}"
    except Exception as e:  # odd stored data: say so rather than fail the watch
        text = f"{_str(event.kind)} ({_str(event.sev)}): its data could not be shown ({type(e).__name__})"
    text = printable(text)
    return text if len(text) <= EXPLAIN_MAX else text[: EXPLAIN_MAX - 3] + "..."


def next_command(event: AnyEvent) -> str:
    """The command a person or agent should run next, concrete and short."""
    run = printable(shlex.quote(event.run))
    if event.kind == "job.preempted" or (event.kind == "job.exited" and event.data.get("preempted")):
        return f"rgt pull {run}, then rgt resume {run} --on HOST"
    if event.kind == "job.exited":
        return f"rgt status {run}, then rgt pull {run}"
    for prefix in ("train.", "gpu.", "ckpt.", "sidecar.degraded"):
        if event.kind.startswith(prefix):
            return f"rgt events {run} --kind {prefix.split('.')[0]}."
    return f"rgt status {run}"


__all__ = ["CLEAR_KINDS", "Policy", "Verdict", "Wake", "absorbed_key", "check_layer", "classify",
           "condition_key", "envelope", "event_key", "explain", "finished_cleanly", "identity", "is_clear",
           "judge", "last_woken", "mark_key", "merged", "next_command", "number", "parse_kinds",
           "parse_window", "seconds", "severity", "size", "stack_lines"]
