"""`rgt status`: what a run is doing, from its stored events, on one screen (or one JSON object).

Everything comes from the store: the sidecar's events (observation time `ts`,
and for training values the box's own `data_age_s`) and what the controller
saw itself (link.lost / link.restored / sidecar.silent). Ages are `now - ts`,
so a run whose link is down shows its last numbers with their true age, never
a guess. JSON keys are stable and carry their units (age_s, bytes, steps_per_s).
"""
from __future__ import annotations

import heapq
import math
import shlex
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import protocol
from protocol.metrics import is_metric_name

from controller import kinds
from controller.render import local_time, number, printable, seconds, size
from controller.runs import explain, life
from controller.runs import metrics as metricref
from controller.runs.explain import AnyEvent
from controller.store.db import LocalEvent, Store

PAGE = 5000
RECENT = 5  # recent problems listed
# One-shot kinds that stay open until something ends them (they have no "state").
STICKY = ("gpu.lost", "ckpt.stale", "ckpt.sync_failed", "sidecar.degraded")
# Kinds that end conditions of another kind without being their clear kind.
ENDS = {"ckpt.saved": ("ckpt.stale",), "ckpt.durable": ("ckpt.sync_failed",),
        "job.exited": ("job.stalled", "train.slow"),
        # A new job attempt is judged afresh: its detectors forget the old episodes without events.
        "job.started": ("train.", "job.stalled"),
        # A new sidecar re-detects box conditions from scratch (their state is not kept).
        "sidecar.started": ("gpu.", "disk.", "mem.", "sidecar.degraded")}
LIFECYCLE = ("job.started", "job.exited", "sidecar.started", "sidecar.stopping")
LABELS = {life.STOPPED: "stopped by request", life.LOST: "lost contact"}
FRESH_INTERVALS = 3          # heartbeats (the watcher's SILENT_INTERVALS): box data this recent: link up
DEFAULT_HEARTBEAT_S = 30.0   # the sidecar's default heartbeat interval


def _num(value: Any) -> Optional[float]:
    """A finite number, else None ("nan" strings, None, text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _age(now: float, ts: Optional[float]) -> Optional[float]:
    return None if ts is None else round(max(0.0, now - ts), 1)


def all_events(store: Store, run: str, kind_prefix: Optional[str] = None) -> Iterator[protocol.Event]:
    pos = 0
    while True:
        batch = store.events(run, since=pos, kind_prefix=kind_prefix, limit=PAGE)
        yield from batch
        if len(batch) < PAGE:
            return
        pos = batch[-1].seq


def _cond_id(event: AnyEvent) -> Tuple[str, str]:
    base = kinds.CLEAR_KINDS.get(event.kind, event.kind)
    if base == "sidecar.degraded":
        return base, str(event.data.get("part", ""))
    return base, kinds.identity(event)


class _Reader:
    """One pass over a run's events, keeping only what the summary shows."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.latest: Dict[str, AnyEvent] = {}          # newest event per kind
        self.gpus: Dict[Any, AnyEvent] = {}              # newest gpu.sample per GPU
        self.open: Dict[Tuple[str, str], Dict[str, Any]] = {}
        self.recent: List[AnyEvent] = []
        self.lifecycle: Optional[AnyEvent] = None
        self.job_started_at: Optional[float] = None
        self.durable: set[str] = set()
        self.counts = {"info": 0, "warn": 0, "critical": 0}

    def feed(self, ev: AnyEvent) -> None:
        kind = ev.kind
        self.latest[kind] = ev
        if ev.sev in self.counts and not protocol.is_telemetry(kind):
            self.counts[ev.sev] += 1
        if kind == "gpu.sample":
            self.gpus[ev.data.get("gpu")] = ev
        elif kind == "ckpt.durable":
            self.durable.add(str(ev.data.get("sha256")))
        # A sidecar that stops (or restarts) after the job's exit does not hide that exit.
        hides_exit = kind.startswith("sidecar.") and self.lifecycle is not None \
            and self.lifecycle.kind == "job.exited"
        if kind in LIFECYCLE and isinstance(ev, protocol.Event) and not hides_exit:
            self.lifecycle = ev
            if kind == "job.started":
                self.job_started_at = ev.ts
        self._conditions(ev)

    def _conditions(self, ev: AnyEvent) -> None:
        for prefix in ENDS.get(ev.kind, ()):
            self.open = {k: v for k, v in self.open.items() if not k[0].startswith(prefix)}
        key = _cond_id(ev)
        if kinds.is_clear(ev):
            self.open.pop(key, None)
            return
        if protocol.is_telemetry(ev.kind) or ev.kind in kinds.LINK_KINDS or ev.sev == "info":
            return
        state = ev.data.get("state")
        if state in ("onset", "escalated") or ev.kind in STICKY:
            since = self.open.get(key, {}).get("since_ts", ev.ts)
            self.open[key] = {"kind": key[0], "ident": key[1], "sev": ev.sev, "since_ts": since,
                              "age_s": _age(self.now, since), "explain": explain.explain(ev)}
        elif ev.kind not in life.END_KINDS:   # the end is the state line's
            self.recent = (self.recent + [ev])[-RECENT:]


def _read(store: Store, run: str, now: float) -> Tuple[_Reader, List[LocalEvent]]:
    reader = _Reader(now)
    local = store.local_events(run)
    merged: Iterator[AnyEvent] = heapq.merge(all_events(store, run), local, key=lambda e: e.ts)
    for ev in merged:
        reader.feed(ev)
    return reader, local


def link_state(local: Sequence[LocalEvent], now: float, *, ended_ts: Optional[float] = None,
               ended: bool = False, fresh_ts: Optional[float] = None,
               fresh_budget_s: float = FRESH_INTERVALS * DEFAULT_HEARTBEAT_S) -> Dict[str, Any]:
    """up / down / silent / unknown / ended, with since when.

    The controller's own link events say it first. A watcher records none until a loss, so with
    none recorded, box data stored within fresh_budget_s (fresh_ts: the newest box event's time)
    says the link is up: it carried that data. An ended run has no link to judge: "ended", never a
    "down" that lasts forever after the box went away."""
    if ended:
        return {"state": "ended", "since_ts": ended_ts, "age_s": _age(now, ended_ts)}
    state, since = "unknown", None
    for ev in local:
        if ev.kind == "link.lost":
            state, since = "down", ev.ts
        elif ev.kind == "link.restored":
            state, since = "up", ev.ts
        elif ev.kind == "sidecar.silent" and state != "down":
            cleared = kinds.is_clear(ev)
            state, since = ("up" if cleared else "silent"), ev.ts
    if state == "unknown" and fresh_ts is not None and now - fresh_ts <= fresh_budget_s:
        return {"state": "up", "since_ts": None, "age_s": None, "by": "box data"}
    return {"state": state, "since_ts": since, "age_s": _age(now, since)}


def _fresh_budget(heartbeat: Optional[AnyEvent]) -> float:
    """How recent box data must be to say the link is up: the watcher's own silence budget."""
    interval = _num(heartbeat.data.get("interval_s")) if heartbeat is not None else None
    return FRESH_INTERVALS * (interval if interval and interval > 0 else DEFAULT_HEARTBEAT_S)


def link_for(store: Store, run: str, now: float, run_life: Optional[life.Life] = None) -> Dict[str, Any]:
    """link_state of a stored run, cheaply (`rgt runs`): its link events, its newest box event,
    and whether its life has ended."""
    run_life = run_life or life.of_run(store, run)
    local = store.local_events(run)
    newest = store.events(run, since=max(0, store.cursor(run) - 1))
    return link_state(local, now, ended=run_life.ended, ended_ts=_num(run_life.evidence.get("ts")),
                      fresh_ts=newest[-1].ts if newest else None)


def _progress(reader: _Reader, meta: Mapping[str, Any], now: float) -> Dict[str, Any]:
    ev = reader.latest.get("train.progress")
    d: Mapping[str, Any] = ev.data if ev is not None else {}
    watch = meta.get("watch")
    found = (meta.get("expected_steps"), watch.get("expected_steps") if isinstance(watch, Mapping) else None,
             d.get("expected_steps"), d.get("total_steps"))
    expected = next((n for n in map(_num, found) if n), None)
    step, rate = _num(d.get("step")), _num(d.get("steps_per_s"))
    eta = _num(d.get("eta_s"))  # the box's own (from the framework's total), else ours
    if eta is None and step is not None and expected and rate and rate > 0:
        eta = round(max(0.0, expected - step) / rate, 1)
    age, box_age = _age(now, ev.ts if ev else None), _num(d.get("data_age_s"))
    total_age = None if age is None else round(age + (box_age or 0.0), 1)
    raw = d.get("scalars")
    pairs = raw.items() if isinstance(raw, Mapping) else ()
    scalars = {str(name): {"value": value, "data_age_s": total_age}   # an older sidecar still sends `time`
               for name, value in pairs if is_metric_name(str(name))}
    pct = round(100.0 * step / expected, 1) if expected and step is not None else None
    return {"step": d.get("step"), "epoch": d.get("epoch"), "steps_per_s": rate, "expected_steps": expected,
            "progress_pct": pct, "eta_s": eta, "scalars": scalars,
            "progress_age_s": age, "box_data_age_s": box_age, "data_age_s": total_age}


def state_label(run_life: life.Life) -> str:
    """The state `rgt status` shows for a life: finished, stopped by request, preempted,
    failed (oom), vanished, lost contact, running, launched."""
    if run_life.state == life.FAILED:
        return f"failed ({run_life.outcome})"
    return LABELS.get(run_life.state, run_life.state)


def _state(reader: _Reader, link: Mapping[str, Any], run_life: life.Life) -> Tuple[str, str]:
    stalled = reader.open.get(("job.stalled", ""))
    # The end the life read: the run.closed (its line names the final manifest), else the exit.
    exited = reader.latest.get(str(run_life.evidence.get("kind"))) or reader.latest.get("job.exited")
    if run_life.ended:
        if run_life.state in (life.FINISHED, life.FAILED, life.VANISHED) and exited is not None:
            return state_label(run_life), explain.explain(exited, reader.job_started_at)
        return state_label(run_life), run_life.reason
    if run_life.state == life.CLOSING and exited is not None:
        return state_label(run_life), (explain.explain(exited, reader.job_started_at) + "; the sidecar is "
                                       "closing the run: the verdict comes with run.closed")
    if stalled is not None:
        state, reason = "stalled", str(stalled["explain"])
    elif run_life.state == life.RUNNING:
        state, reason = "running", "no job exit stored"
    else:
        return state_label(run_life), run_life.reason
    if link.get("state") == "down":
        reason += (f"; as last seen: the link is down for {seconds(link.get('age_s'))}, "
                   "which says nothing about the job")
    return state, reason


def _stat(d: Mapping[str, Any], name: str, which: str) -> Any:
    """One of min/mean/max of a gpu.sample gauge, or None."""
    gauge = d.get(name)
    return gauge.get(which) if isinstance(gauge, Mapping) else None


def _gpus(reader: _Reader, now: float) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    rows = []
    for ev in sorted(reader.gpus.values(), key=lambda e: str(e.data.get("gpu"))):
        d = ev.data
        rows.append({"gpu": d.get("gpu"), "util_pct": _stat(d, "utilization_gpu_pct", "mean"),
                     "memory_used_bytes": _stat(d, "memory_used_bytes", "max"),
                     "memory_total_bytes": d.get("memory_total_bytes"),
                     "temperature_c": _stat(d, "temperature_c", "max"),
                     "power_mw": _stat(d, "power_mw", "mean"),
                     "clock_event_reasons": d.get("clock_event_reason_names") or [],
                     "age_s": _age(now, ev.ts)})
    problems = [c for c in reader.open.values() if c["kind"].startswith("gpu.")]
    if problems:
        worst = max(problems, key=lambda c: kinds.severity(str(c["sev"])))
        health = {"state": worst["sev"], "problems": [c["explain"] for c in problems]}
    else:
        health = {"state": "ok" if rows else "unknown", "problems": []}
    return rows, health


def _checkpoint(reader: _Reader, now: float) -> Optional[Dict[str, Any]]:
    ev = reader.latest.get("ckpt.saved")
    if ev is None:
        return None
    d = ev.data
    sha = str(d.get("sha256") or "")
    return {"path": d.get("path"), "step": d.get("step"), "size_bytes": d.get("size"),
            "sha256_prefix": sha[:12], "age_s": _age(now, ev.ts), "durable": sha in reader.durable}


def nonfinite_checkpoints(local: Sequence[LocalEvent]) -> List[Dict[str, Any]]:
    """The checkpoints the newest `rgt verify` found NaN/Inf weights in ({path, unit, step}): from
    its verify.done record (an older verify's finding is superseded by a newer one's)."""
    for ev in reversed(local):
        if ev.kind == "verify.done" and isinstance(ev.data.get("nonfinite"), list):
            return [{"path": str(x.get("path")), "unit": x.get("unit"), "step": x.get("step")}
                    for x in ev.data["nonfinite"] if isinstance(x, dict) and isinstance(x.get("path"), str)]
    return []


def _disk(reader: _Reader, now: float) -> Dict[str, Any]:
    ev = reader.latest.get("disk.sample")
    rows = ev.data.get("filesystems") if ev is not None else None
    keep = ("path", "avail_bytes", "total_bytes", "used_pct", "inodes_used_pct", "eta_to_full_s")
    fs = [{k: row.get(k) for k in keep} for row in rows or [] if isinstance(row, Mapping)]
    return {"filesystems": fs, "age_s": _age(now, ev.ts if ev is not None else None)}


# ---- one history over boxes (`rgt resume`) -----------------------------------------------


def _chain(runs: Mapping[str, Mapping[str, Any]], run_id: str) -> List[str]:
    """The run ids of run_id's history: back to the first run, then every run resumed from one in it
    (each generation by first_seen)."""
    root, seen = run_id, {run_id}
    while str(runs[root].get("resumed_from") or "") in runs and runs[root]["resumed_from"] not in seen:
        root = str(runs[root]["resumed_from"])
        seen.add(root)
    chain, level = [root], [root]
    while level:
        level = sorted((r for r, info in runs.items() if info.get("resumed_from") in level
                        and r not in chain), key=lambda r: float(runs[r].get("first_seen") or 0.0))
        chain += level
    return chain


def _step(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _life(store: Store, run: str) -> Dict[str, Any]:
    """A run's state, first and last step and newest checkpoint's step, cheaply: its life
    (controller.runs.life), and its train.progress and ckpt.saved events (the last step is the furthest
    either reported)."""
    run_life = life.of_run(store, run)
    first = last = ckpt = None
    for ev in all_events(store, run, "train.progress"):  # rate-limited: the job may have gone further
        step = _step(ev.data.get("step"))
        first = step if first is None else first
        last = step if step is not None else last
    for ev in all_events(store, run, "ckpt.saved"):
        ckpt = _step(ev.data.get("step")) if _step(ev.data.get("step")) is not None else ckpt
    known = [s for s in (last, ckpt) if s is not None]
    return {"state": state_label(run_life), "life": run_life.to_dict(), "first_step": first,
            "last_step": max(known) if known else None, "checkpoint_step": ckpt}


def history(store: Store, run_id: str) -> List[Dict[str, Any]]:
    """The runs that continue one another through `rgt resume`, oldest first, or [] for a run alone:
    each with its host, state (preempted, finished, stopped by request, failed (...), running), first
    and last step, and the
    step of its newest hashed checkpoint."""
    runs = {str(r["run"]): r for r in store.runs()}
    if run_id not in runs:
        return []
    chain = _chain(runs, run_id)
    if len(chain) < 2:
        return []
    return [{"run": r, "host": runs[r].get("target") or runs[r].get("host") or None,
             "resumed_from": runs[r].get("resumed_from") or None, "current": r == run_id, **_life(store, r)}
            for r in chain]


def summarize(store: Store, run: str, ref: Optional[str] = None,
              now: Optional[float] = None) -> Dict[str, Any]:
    """Everything `rgt status` shows about one run, as a JSON-able dict (see the module doc)."""
    now = time.time() if now is None else now
    info = store.run(run)
    run_id = str(info["run"])
    reader, local = _read(store, run_id, now)
    run_life = life.of_run(store, run_id)
    box_events = [e for e in reader.latest.values() if isinstance(e, protocol.Event)]
    link = link_state(local, now, ended=run_life.ended, ended_ts=_num(run_life.evidence.get("ts")),
                      fresh_ts=max((e.ts for e in box_events), default=None),
                      fresh_budget_s=_fresh_budget(reader.latest.get("heartbeat")))
    state, reason = _state(reader, link, run_life)
    progress = _progress(reader, info.get("meta") or {}, now)
    gpus, gpu_health = _gpus(reader, now)
    heartbeat = reader.latest.get("heartbeat")
    gaps = store.gaps(run_id)
    out: Dict[str, Any] = {
        "run": run_id, "host": info.get("host"), "target": info.get("target"), "generated_at": now,
        "state": state, "state_reason": reason, "life": run_life.to_dict(), **progress,
        "gpus": gpus, "gpu_health": gpu_health, "checkpoint": _checkpoint(reader, now),
        "nonfinite_checkpoints": nonfinite_checkpoints(local),
        "disk": _disk(reader, now),
        "open_conditions": sorted(reader.open.values(), key=lambda c: float(c["since_ts"])),
        "recent_problems": [{"kind": e.kind, "sev": e.sev, "ts": e.ts, "age_s": _age(now, e.ts),
                             "explain": explain.explain(e)} for e in reader.recent],
        "link": link, "heartbeat_age_s": _age(now, heartbeat.ts if heartbeat else None),
        "events": {"stored": store.count_events(run_id), "local": len(local), **reader.counts,
                   "cursor": store.cursor(run_id)},
        "gaps": gaps, "missing_events": sum(g["last_seq"] - g["first_seq"] + 1 for g in gaps),
        "ref": metricref.reference(store, ref, progress, run=run_id) if ref else None,
        "deadman": _deadman(reader, now),
        "history": history(store, run_id),
    }
    return out


def _deadman(reader: _Reader, now: float) -> Optional[Dict[str, Any]]:
    """The box's dead-man as its newest record relayed into this run says, or None."""
    found = [ev for kind, ev in reader.latest.items() if kind.startswith("deadman.")]
    if not found:
        return None
    ev = max(found, key=lambda e: e.ts)
    d = ev.data
    text = {"deadman.armed": "armed", "deadman.renewed": "renewed", "deadman.disarmed": "disarmed",
            "deadman.held": "expired, held: a run still progresses",
            "deadman.authorized": f"authorized to {d.get('action')}",
            "deadman.expiring": f"expiring: {d.get('minutes_left')} min left",
            "deadman.firing": f"firing: {d.get('action')}",
            "deadman.fired": f"fired: {d.get('action')} ({d.get('outcome') or 'done'})"}.get(ev.kind, ev.kind)
    return {"kind": ev.kind, "state": text, "ts": ev.ts, "age_s": _age(now, ev.ts)}


# ---- for people ---------------------------------------------------------------


def _scalars(summary: Mapping[str, Any]) -> str:
    parts = [f"{name} {number(s.get('value'))}" for name, s in summary.get("scalars", {}).items()]
    age = summary.get("data_age_s")
    return "  ".join(parts) + (f"  ({seconds(age)} old)" if parts and age is not None else "")


def one_line(summary: Mapping[str, Any]) -> str:
    """state, step, loss and link in one printable line (the timeout record of `rgt watch`)."""
    parts = [str(summary["state"])]
    if summary.get("step") is not None:
        total = summary.get("expected_steps")
        parts.append(f"step {number(summary['step'])}" + (f"/{number(total)}" if total else ""))
    if summary.get("scalars"):
        parts.append(_scalars(summary))
    parts.append(f"link {summary['link']['state']}")
    return printable(", ".join(parts))


def _progress_line(s: Mapping[str, Any]) -> str:
    if s.get("step") is None and s.get("epoch") is None:
        return "no training progress stored"
    text = f"step {number(s.get('step'))}"
    if s.get("expected_steps"):
        text += f"/{number(s['expected_steps'])} ({s.get('progress_pct')}%)"
    text += f", epoch {number(s['epoch'])}" if s.get("epoch") is not None else ""
    text += f", {number(s['steps_per_s'])} steps/s" if s.get("steps_per_s") is not None else ""
    return text + (f", ETA {seconds(s['eta_s'])}" if s.get("eta_s") is not None else "")


def _gpu_line(g: Mapping[str, Any]) -> str:
    text = (f"{g.get('gpu')}: {number(g.get('util_pct'))}% util, {size(g.get('memory_used_bytes'))}"
            f"/{size(g.get('memory_total_bytes'))}, {number(g.get('temperature_c'))} C, "
            f"{number((_num(g.get('power_mw')) or 0) / 1000)} W ({seconds(g.get('age_s'))} old)")
    reasons = ", ".join(map(str, g.get("clock_event_reasons") or []))
    return text + (f" [{reasons}]" if reasons else "")


def render(s: Mapping[str, Any]) -> str:
    """One screen for people; every line escaped (run ids, paths and names come from the box)."""
    lines = [f"run {s['run']} on {s.get('host') or '?'}"
             + (f" (via {s['target']})" if s.get("target") else ""),
             f"  state     {s['state']}: {s['state_reason']}", f"  progress  {_progress_line(s)}"]
    if s.get("history"):
        lines.append("  history   " + " -> ".join(
            f"{h['run']} ({h['host'] or '?'}, {h['state']}, step {number(h['last_step'])})"
            + (" *" if h["current"] else "") for h in s["history"]))
    if s.get("scalars"):
        lines.append(f"  metrics   {_scalars(s)}")
    ref = s.get("ref")
    if ref:
        cmp = [f"{n} {number(m['ref_value'])} {m['note']} (diff {number(m['diff'])}"
               + (f", {100 * m['rel_diff']:+.1f}%" if m.get("rel_diff") is not None else "") + ")"
               for n, m in ref["metrics"].items()]
        cmp += [f"{n}: not compared ({why})" for n, why in (ref.get("skipped") or {}).items()]
        lines.append(f"  vs ref    {ref['run']}: " + ("; ".join(cmp) or "no comparable point"))
    lines += [f"  gpu       {_gpu_line(g)}" for g in s["gpus"]] or ["  gpu       no GPU samples stored"]
    ck = s.get("checkpoint")
    lines.append("  ckpt      " + (f"{ck['path']}  step {number(ck['step'])}  {size(ck['size_bytes'])}  "
                                   f"sha256 {ck['sha256_prefix']}  {seconds(ck['age_s'])} old"
                                   + ("  durable" if ck["durable"] else "") if ck else "none hashed yet"))
    for bad in s.get("nonfinite_checkpoints") or []:
        name = bad.get("unit") or bad["path"]
        lines.append(f"  ckpt      NON-FINITE: {name} (step {number(bad.get('step'))}) holds NaN/Inf "
                     "weights (rgt verify); rgt resume skips it")
    for fs in s["disk"]["filesystems"]:
        lines.append(f"  disk      {fs['path']}  {size(fs['avail_bytes'])} free of {size(fs['total_bytes'])}"
                     f" ({number(fs['used_pct'])}% used, inodes {number(fs['inodes_used_pct'])}%)")
    for c in s["open_conditions"]:
        lines.append(f"  open      {c['sev']}: {c['explain']} (since {local_time(c['since_ts'])})")
    for p in s["recent_problems"]:
        lines.append(f"  recent    {p['sev']}: {p['explain']} ({seconds(p['age_s'])} ago)")
    link, hb = s["link"], s.get("heartbeat_age_s")
    lines.append(f"  link      {link['state']}"
                 + (f" for {seconds(link['age_s'])}" if link.get("age_s") is not None else "")
                 + (f", last heartbeat {seconds(hb)} ago" if hb is not None else ""))
    dm = s.get("deadman")
    if dm:
        where = shlex.quote(str(s.get("target") or s.get("host") or "HOST"))
        lines.append(f"  deadman   {dm['state']} ({seconds(dm['age_s'])} ago; rgt deadman {where} status)")
    ev = s["events"]
    lines.append(f"  events    {number(ev['stored'])} stored ({ev['warn']} warn, {ev['critical']} critical), "
                 f"{ev['local']} local; " + (f"{s['missing_events']} lost in {len(s['gaps'])} gap(s)"
                                             if s["gaps"] else "no gaps"))
    return "\n".join(printable(line) for line in lines)


def run_state(store: Store, run: str, now: float) -> Dict[str, Any]:
    """What the store knows of a run's life, cheaply (for `rgt runs`): its life state (launched,
    running, finished, stopped, failed, preempted, vanished, lost: controller.runs.life, the same story
    `rgt watch` and `rgt status` tell), the last event's time and the link state of `rgt status`."""
    now_life = life.of_run(store, run)
    last = store.events(run, since=max(0, store.cursor(run) - 1))
    state: Dict[str, Any] = {"state": now_life.state, "outcome": now_life.outcome, "life": now_life.to_dict()}
    if now_life.stopped_by:
        state["stopped_by"] = now_life.stopped_by
    kind = now_life.evidence.get("kind")   # the end: a run.closed carries its exit's data
    seq = now_life.evidence.get("seq") if kind in life.END_KINDS else None
    exited = store.events(run, since=seq - 1, kind_prefix=str(kind), limit=1) if isinstance(seq, int) else []
    if exited:
        data = exited[0].data
        state.update({"code": data.get("code"), "signal": data.get("signal"),
                      "oom_killed": data.get("oom_killed")})
    if last:
        state["last_event_ts"] = last[-1].ts
    state["link"] = link_for(store, run, now, now_life)["state"]
    return state


__all__ = ["all_events", "link_for", "link_state", "nonfinite_checkpoints", "one_line", "render", "run_state",
           "state_label", "summarize"]
