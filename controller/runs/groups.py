"""Multi-node runs: one logical run, one stream per node, and the verdicts only the group can give.

`rgt-onbox launch --run-id RUN --node NODE` starts one sidecar per node, each with its own
journal: the stream RUN.NODE (onbox/launch/nodes.py). `rgt track HOST RUN` records each stream as a run
of the store tied to RUN (group_run=RUN, node=NODE), and RUN itself as a row whose group_run is
its own id. That row has no sidecar, no host and no events from a box (no watcher starts for it,
and commands that need a box find none): it holds the controller's verdicts about the whole
group, so `rgt watch RUN`, `rgt status RUN` and `rgt runs` name it like any other run.

Two failures show only across nodes (a sidecar sees its own node's job only), so no one sidecar reports them:

    job.rank_failed  critical  one node's job exited while the others still run: they wait for it
                               in their next collective. A failed exit counts at once; a clean
                               exit once the others ran on for CLEAN_EXIT_GRACE_S. A node stopped
                               by request (controller.runs.life: `rgt stop` recorded it) never counts,
                               nor one that ended after a stop was asked for another node, nor
                               one the scheduler ended for the whole job (a Slurm requeue,
                               cancel, time limit or preemption: the exit's `preempt_reason`):
                               the other nodes were told too, and end within the grace.
    job.stalled      warn      verdict "hung", scope "all nodes": every node's newest job.stalled
                               is open. Names the node whose progress stopped first (the oldest
                               last train.progress), which is where to look.
    job.progressing  info      scope "all nodes": a node progresses again after that verdict.

check() decides them from the node streams in the store. It runs where events arrive: in each
node stream's watcher once it stored a job event (and every so often, for the clean-exit grace),
and in `rgt watch` of the group before it judges. It is idempotent: a verdict carries the evidence
it was drawn from (the seqs of the node events), is recorded once per evidence, and is decided
again inside one IMMEDIATE transaction before it is written, so watchers that race record one event.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import protocol

from controller.runs import life
from controller.store.db import LocalEvent, RunNotFound, Store

log = logging.getLogger(__name__)

CLEAN_EXIT_GRACE_S = 120.0   # a node that finished cleanly while others still run, this long after
PROGRESS_LOOKBACK = 5000     # seqs before a stall searched for the node's last train.progress
SCOPE = "all nodes"
# Event kinds after which a node stream's watcher checks its group at once.
TRIGGERS = ("job.", "sidecar.stopping")
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")   # onbox/launch/nodes.py's rule for node names


# ---- membership ---------------------------------------------------------------------


def is_group(info: Mapping[str, Any]) -> bool:
    """Whether a store row (Store.runs()) is a multi-node group's own row."""
    return bool(info.get("group_run")) and info.get("group_run") == info.get("run")


def node_of(group: str, stream: str) -> Optional[str]:
    """NODE when `stream` is GROUP.NODE (a node stream's id), else None."""
    prefix = group + "."
    if not stream.startswith(prefix):
        return None
    node = stream[len(prefix):]
    return node if _NODE.match(node) else None


def members(store: Store, group: str,
            infos: Optional[Sequence[Mapping[str, Any]]] = None) -> List[Dict[str, Any]]:
    """The node streams of GROUP (rows as Store.runs() gives them), by node name."""
    rows = store.runs() if infos is None else infos
    found = [dict(r) for r in rows if r.get("group_run") == group and r.get("run") != group]
    return sorted(found, key=lambda r: (str(r.get("node") or ""), str(r["run"])))


def group_of(store: Store, run: str) -> Optional[str]:
    """The group RUN belongs to (itself for a group's row), or None for a plain run."""
    try:
        info = store.run(run)
    except RunNotFound:
        return None
    return str(info.get("group_run") or "") or None


def is_trigger(kind: str) -> bool:
    return kind.startswith(TRIGGERS)


# ---- what one node stream says --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NodeView:
    """One node stream as check() sees it, from its stored events."""

    node: str
    stream: str
    started_seq: int = 0                        # the newest job.started (0: none stored yet)
    exit: Optional[protocol.Event] = None       # the job's exit after that start
    over: bool = False                          # the job exited, or the sidecar stopped after it
    stall: Optional[protocol.Event] = None      # the open job.stalled onset, if there is one
    progress: Optional[protocol.Event] = None   # the newest train.progress (read when all stalled)
    stop_ts: Optional[float] = None             # when a stop of this attempt was asked (laptop clock)
    stopped: bool = False                       # its exit is a stop by request (controller.runs.life)

    def stopped_at(self) -> Optional[float]:
        """When the node's progress stopped, as well as its events tell: the time of the last
        metrics record its last train.progress reported, else the stall detector's last activity."""
        if self.progress is not None:
            return self.progress.ts - _seconds(self.progress.data.get("data_age_s"))
        if self.stall is not None:
            return self.stall.ts - _seconds(self.stall.data.get("idle_s"))
        return None

    def step(self) -> Any:
        for ev in (self.progress, self.stall):
            if ev is not None and ev.data.get("step") is not None:
                return ev.data.get("step")
        return None


def _seconds(value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else 0.0


def read_view(store: Store, stream: str, node: str) -> NodeView:
    """A node stream's job lifecycle and open stall, from its job.* and sidecar.st* events."""
    found = store.events(stream, kind_prefix="job.") + store.events(stream, kind_prefix="sidecar.st")
    started, exited, stall, stopped = 0, None, None, False
    for ev in sorted(found, key=lambda e: e.seq):
        if ev.kind == "job.started":
            started, exited, stall, stopped = ev.seq, None, None, False
        elif ev.kind == "job.exited":
            exited, stall = ev, None
        elif ev.kind == "job.stalled":
            stall = None if ev.data.get("state") == "cleared" else ev
        elif ev.kind == "job.progressing":
            stall = None
        elif ev.kind == "sidecar.stopping":
            stopped = True
        elif ev.kind == "sidecar.started":
            stopped = False
    since_ts = next((e.ts for e in found if e.seq == started), 0.0) if started else 0.0
    asked = life.stop_request(life.stop_events(store, stream), since_ts)
    by_request = exited is not None and life.of_run(store, stream).state == life.STOPPED
    return NodeView(node=node, stream=stream, started_seq=started, exit=exited,
                    over=exited is not None or stopped, stall=stall,
                    stop_ts=asked.ts if asked is not None else None, stopped=by_request)


def with_progress(store: Store, view: NodeView) -> NodeView:
    """The view with its newest train.progress, looked for only near its stall (bounded)."""
    if view.stall is None:
        return view
    since = max(view.started_seq, view.stall.seq - PROGRESS_LOOKBACK, 0)
    found = store.events(view.stream, since=since, kind_prefix="train.progress")
    return dataclasses.replace(view, progress=found[-1]) if found else view


def views(store: Store, group: str) -> List[NodeView]:
    """Every node stream of GROUP; with their last progress when every one of them is stalled."""
    out = [read_view(store, str(m["run"]), str(m.get("node") or m["run"])) for m in members(store, group)]
    if out and all(v.stall is not None and not v.over for v in out):
        out = [with_progress(store, v) for v in out]
    return out


# ---- the verdicts -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A local event to record on the group's row."""

    kind: str
    sev: str
    data: Dict[str, Any]


def clean_exit(event: protocol.Event) -> bool:
    return event.data.get("code") == 0 and event.data.get("final_ok") is not False


def _same_episode(recorded: Mapping[str, Any], starts: Mapping[str, int]) -> bool:
    """Whether no node that was there when `recorded` was decided has started its job again."""
    return all(starts.get(stream, seq) == seq for stream, seq in recorded.items())


# Why a scheduler ended a job that holds for every node of it (onbox/sources/slurm.py's reasons).
JOB_WIDE_ENDS = ("requeued", "cancelled", "time_limit", "preempted")


def _ended_by_scheduler(exit_event: protocol.Event) -> bool:
    return exit_event.data.get("preempt_reason") in JOB_WIDE_ENDS


def rank_failed(nodes: Sequence[NodeView], recorded: Iterable[LocalEvent], now: float) -> Optional[Verdict]:
    """One node's job exited while others still run; at most one per episode (until a job restarts).
    A stop asked for through rgt is no failed rank: not the stopped node, nor one that ended after it."""
    starts = {v.stream: v.started_seq for v in nodes}
    for ev in recorded:
        before = ev.data.get("starts")
        if ev.kind == "job.rank_failed" and isinstance(before, dict) and _same_episode(before, starts):
            return None
    waiting = [v for v in nodes if not v.over]
    asked = [v.stop_ts for v in nodes if v.stop_ts is not None]
    first_stop = min(asked) if asked else None
    failed = [v for v in nodes if v.exit is not None and not v.stopped
              and not (first_stop is not None and v.exit.ts >= first_stop) and not _ended_by_scheduler(v.exit)
              and (not clean_exit(v.exit) or now - v.exit.ts >= CLEAN_EXIT_GRACE_S)]
    if not waiting or not failed:
        return None
    first = min(failed, key=lambda v: (v.exit.ts if v.exit else 0.0, v.node))
    assert first.exit is not None
    d = first.exit.data
    return Verdict("job.rank_failed", "critical", {
        "node": first.node, "how": _how(first.exit), "stream": first.stream, "code": d.get("code"),
        "signal": d.get("signal"),
        "oom_killed": d.get("oom_killed"), "preempted": bool(d.get("preempted")),
        "clean": clean_exit(first.exit), "exit_seq": first.exit.seq, "exited_ts": first.exit.ts,
        "waiting": [v.node for v in waiting], "nodes": [v.node for v in nodes], "starts": starts})


def _how(exit_event: protocol.Event) -> str:
    """How a node's job ended, in a few words (wake.py's job.rank_failed line shows it)."""
    d = exit_event.data
    if d.get("oom_killed"):
        return "OOM-killed"
    if d.get("vanished"):
        return "vanished without an exit record"
    if d.get("signal"):
        return f"signal {d.get('signal')}" + (", preempted" if d.get("preempted") else "")
    if clean_exit(exit_event):
        return "code 0, before the others"
    return f"code {d.get('code')}"


def _latest_hung(recorded: Iterable[LocalEvent]) -> Optional[LocalEvent]:
    """The group's newest verdict about stalls: its hung onset or the clear after it."""
    found = [e for e in recorded if e.kind in ("job.stalled", "job.progressing")
             and e.data.get("scope") == SCOPE]
    return found[-1] if found else None


def hung(nodes: Sequence[NodeView], recorded: Sequence[LocalEvent], now: float) -> Optional[Verdict]:
    """Every node stalled (each newest job.stalled open): one verdict per set of stalls, and its
    clear once a node progresses again."""
    latest = _latest_hung(recorded)
    open_onset = latest is not None and latest.kind == "job.stalled"
    if not nodes or any(v.over for v in nodes) or any(v.stall is None for v in nodes):
        moving = [v.node for v in nodes if not v.over and v.stall is None]
        if open_onset and moving and latest is not None:
            return Verdict("job.progressing", "info", {"state": "cleared", "scope": SCOPE, "nodes": moving,
                                                        "stalls": latest.data.get("stalls")})
        return None
    stalls = {v.stream: v.stall.seq for v in nodes if v.stall is not None}
    if any(e.kind == "job.stalled" and e.data.get("stalls") == stalls for e in recorded):
        return None
    stopped = {v.node: v.stopped_at() for v in nodes}
    first = min(nodes, key=lambda v: (_order(stopped[v.node]), v.node))
    since = stopped[first.node]
    budgets = [_seconds(v.stall.data.get("budget_s")) for v in nodes if v.stall is not None]
    return Verdict("job.stalled", "warn", {
        "state": "onset", "verdict": "hung", "scope": SCOPE, "first_node": first.node,
        "first_stream": first.stream, "step": first.step(),
        "idle_s": round(now - since, 1) if since is not None else None,
        "budget_s": max(budgets) if budgets else None,
        "stopped_at": {n: (round(t, 3) if t is not None else None) for n, t in stopped.items()},
        "nodes": [v.node for v in nodes], "stalls": stalls})


def _order(ts: Optional[float]) -> float:
    return ts if ts is not None else math.inf


def decide(nodes: Sequence[NodeView], recorded: Sequence[LocalEvent], now: float) -> List[Verdict]:
    """What to record on the group's row now, given its nodes and what it recorded before."""
    return [v for v in (rank_failed(nodes, recorded, now), hung(nodes, recorded, now)) if v is not None]


def check(store: Store, run: str, now: Optional[float] = None) -> List[LocalEvent]:
    """Decide and record the group verdicts of the group RUN belongs to; the events recorded.

    Cheap when nothing is due (no write lock); what is due is decided again under the lock.
    """
    group = group_of(store, run)
    if group is None:
        return []
    t = time.time() if now is None else now
    if not decide(views(store, group), store.local_events(group, kind_prefix="job."), t):
        return []
    with store.transaction():
        due = decide(views(store, group), store.local_events(group, kind_prefix="job."), t)
        added = [store.add_local_event(group, v.kind, v.sev, v.data) for v in due]
    for ev in added:
        log.info("group %s: %s %s", group, ev.kind, ev.data.get("node") or ev.data.get("first_node") or "")
    return added


__all__ = ["CLEAN_EXIT_GRACE_S", "SCOPE", "NodeView", "Verdict", "check", "clean_exit", "decide",
           "group_of", "hung", "is_group", "is_trigger", "members", "node_of", "rank_failed",
           "read_view", "views"]
