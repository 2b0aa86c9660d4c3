"""`rgt watch`: wait until something material happens to a run, then end with a code, the wake contract.

    10  a material event (controller.wake.policy decides which); the record explains it.
        Also at once for a run that had already ended badly (already_reported says
        whether a watch told it before): 0 never stands for a failed run.
     0  every watched run ended well: finished cleanly, or stopped by request
        ("stopped_by" in the record); with all_runs also when nothing is left to watch
     3  the timeout passed with nothing material
     4  the link stayed down past the policy's link budget: the transport is
        down, which says nothing about the job
(the command adds 2 usage, 5 store unusable, 1 internal error, 130 interrupted: controller.cli.watch)

How a job exit ends a run is controller.runs.life's verdict: a stop rgt was asked for (the laptop's
run.stop_requested, or the box's stop_requested) is "stopped", not a failure, whatever the
code; a SIGTERM (143) nobody asked for is a preemption. Every record that ends on an exit, or
on a run found ended, carries `ended`: run -> life.to_dict() for every run the watch covered.
Of several runs (or --all), one that ends well is recorded (it does not wake the next watch)
and the watch goes on; it ends 0 only when every run it covers has ended, queue cells that
have not launched yet (all_runs) included.

It always ends, and an event that ended one watch never ends the next:
Store.mark_woken records each wake, and controller.wake.policy keys conditions, not events (a
condition still open, or made moot by a graver event, is recorded as absorbed). Without
from_now every stored event of the run that has not woken anyone yet is judged first, so an
agent that starts watching late still learns of a NaN. Events may land out of seq order (gap
repair), so the loop remembers which seqs it judged above the run's cursor rather than only the
largest one. Waiting is a cheap PRAGMA data_version poll; the events are re-read only when
another connection committed.

A multi-node run (controller.runs.groups) is watched as its group's row and every node stream. The
group's verdicts (job.rank_failed, the hung verdict) are recorded by one writer, the follower
daemon (controller.follow.daemon), as its node streams' events arrive. The watch only reads them;
it asks the daemon to check them (`check_group`, which answers once they are recorded) as it
starts, at most every GROUP_CHECK_S while events arrive, and when a node's failed exit is about to
wake it while other nodes run: it then wakes on the job.rank_failed that explains the exit, and
that exit does not wake the next watch again.
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Set

import protocol

from controller import kinds, render
from controller.runs import group_status as status_group
from controller.runs import groups
from controller.runs import life as life_mod
from controller.runs import status as status_mod
from controller.runs.explain import AnyEvent, cut
from controller.store.db import LocalEvent, Store
from controller.wake import policy as wake
from controller.wake.ends import (
    Ended,
    again_command,
    ended_record,
    exit_cause,
    exit_life,
    link_record,
    waiting_cells,
)
from controller.wake.policy import Policy

log = logging.getLogger(__name__)

CheckGroup = Callable[[str], Any]

EXIT_CLEAN = 0
EXIT_MATERIAL = 10
EXIT_TIMEOUT = 3
EXIT_LINK = 4
POLL_S = 0.05
ENSURE_EVERY_S = 5.0
PAGE = 5000
GROUP_CHECK_S = 1.0   # how often a watch has its groups checked (the daemon does it on events too)


@dataclasses.dataclass(frozen=True)
class WatchResult:
    exit_code: int
    record: Dict[str, Any]


@dataclasses.dataclass
class _Run:
    """What the watch knows of one run between polls."""

    run: str
    policy: Policy
    host: Optional[str] = None
    floor: int = 0                        # every sidecar seq <= floor was judged
    seen: Set[int] = dataclasses.field(default_factory=set)   # judged seqs above floor
    local_floor: int = 0                  # every local event id <= this was judged
    job_started_at: Optional[float] = None
    last_life: Optional[AnyEvent] = None  # newest job.started/exited, sidecar.started/stopping
    exited: bool = False                  # the newest attempt ended: its run.closed, or a job.exited
    #                                       with no close-out after it
    closing: Optional[AnyEvent] = None    # a job.exited whose run.closed has not come yet
    link_lost: Optional[LocalEvent] = None   # the newest link.* event, when it is link.lost
    deferred: List[AnyEvent] = dataclasses.field(default_factory=list)  # held back by quiet hours
    group: bool = False                   # a multi-node group's row: its nodes are watched with it
    members: List[str] = dataclasses.field(default_factory=list)       # a group's node streams
    siblings: List[_Run] = dataclasses.field(default_factory=list)     # its group's row and other nodes

    def over(self) -> bool:
        """Nothing more will happen: the job exited (a sidecar.stopping after it changes nothing),
        or the sidecar's newest lifecycle event is its stop."""
        if self.group:
            return all(s.over() for s in self.siblings)
        return self.exited or (self.last_life is not None and self.last_life.kind == "sidecar.stopping")

    def others_live(self) -> bool:
        return any(not s.over() for s in self.siblings if not s.group)

    def note(self, ev: AnyEvent) -> None:
        if isinstance(ev, LocalEvent):
            if ev.kind in kinds.LINK_KINDS:
                self.link_lost = ev if ev.kind == "link.lost" else None
            return
        if ev.kind == life_mod.CLOSED_KIND:
            self.exited, self.closing = True, None
        elif ev.kind in status_mod.LIFECYCLE:
            self.last_life = ev
            if ev.kind == "job.started":
                self.job_started_at = ev.ts
                self.exited, self.closing = False, None
            elif ev.kind == "job.exited" and life_mod.closes(ev):
                self.closing = ev
            elif ev.kind == "job.exited":
                self.exited = True


def policy_for(store: Store, run: str, overrides: Mapping[str, Any]) -> Policy:
    """default <- stored "*" <- stored for the run <- the command line's overrides."""
    return wake.merged(store.policy("*"), store.policy(run), overrides)


def live_runs(store: Store) -> List[str]:
    """Runs whose job has not exited and whose sidecar's newest lifecycle event is not its stop,
    newest first; a multi-node group's row while one of its node streams is."""
    infos = store.runs()
    live = set()
    for info in infos:
        st = _Run(str(info["run"]), Policy())
        _lifecycle(store, st)
        if not groups.is_group(info) and not st.over():
            live.add(st.run)

    def group_live(info: Mapping[str, Any]) -> bool:
        return any(m["run"] in live for m in groups.members(store, str(info["run"]), infos))

    return [str(i["run"]) for i in infos if i["run"] in live or (groups.is_group(i) and group_live(i))]


def _expand(store: Store, names: Sequence[str]) -> List[str]:
    """The runs to watch for these: a multi-node group's row brings its node streams along."""
    infos = store.runs()
    by_id = {str(i["run"]): i for i in infos}
    out: List[str] = []
    for name in names:
        out.append(name)
        if name in by_id and groups.is_group(by_id[name]):
            out += [str(m["run"]) for m in groups.members(store, name, infos)]
    return list(dict.fromkeys(out))


def _link_groups(store: Store, states: Dict[str, _Run]) -> None:
    """Tie each watched group's row to its watched node streams, and the streams to each other."""
    infos = store.runs()
    for info in infos:
        run = str(info["run"])
        if run not in states or not groups.is_group(info):
            continue
        st = states[run]
        st.group = True
        st.members = [str(m["run"]) for m in groups.members(store, run, infos)]
        nodes = [states[m] for m in st.members if m in states]
        st.siblings = nodes
        for node in nodes:
            node.siblings = [st, *(other for other in nodes if other is not node)]


def _check_groups(check_group: Optional[CheckGroup], states: Mapping[str, _Run]) -> None:
    """Have what the watched groups' nodes say together recorded before anything is judged."""
    if check_group is None:
        return
    for st in states.values():
        if st.group:
            try:
                check_group(st.run)
            except Exception:  # the watch goes on with what is stored; the reason is logged
                log.warning("could not check the group %s", st.run, exc_info=True)


def _lifecycle(store: Store, st: _Run) -> None:
    events = store.events(st.run, kind_prefix="job.") + store.events(st.run, kind_prefix="sidecar.st")
    for ev in sorted(events, key=lambda e: e.seq):
        st.note(ev)


def _start(store: Store, run: str, overrides: Mapping[str, Any], from_now: bool) -> _Run:
    info = store.run(run)
    host = info.get("target") or info.get("host")   # the rgt host name (HOST in `rgt track HOST RUN`)
    st = _Run(run, policy_for(store, run, overrides), host=host if isinstance(host, str) and host else None)
    _lifecycle(store, st)
    for ev in store.local_events(run, kind_prefix="link."):
        st.note(ev)
    if from_now:
        st.floor = store.cursor(run)
        st.seen = {e.seq for e in store.events(run, since=st.floor)}
        local = store.local_events(run)
        st.local_floor = local[-1].id if local else 0
    return st


def _fresh(store: Store, st: _Run) -> Iterator[AnyEvent]:
    """Events of the run not judged yet, page by page (a long run's backlog never sits in memory
    whole): sidecar ones in seq order, merged by time with the controller's own."""
    settled = store.cursor(st.run)  # read first: every event <= it is visible to the reads below
    local = store.local_events(st.run, since_id=st.local_floor)
    if local:
        st.local_floor = local[-1].id

    def sidecar() -> Iterator[AnyEvent]:
        pos = st.floor
        while True:
            batch = store.events(st.run, since=pos, limit=PAGE)
            for e in batch:
                if e.seq not in st.seen:
                    if e.seq > settled:   # may be followed by a repair below it: remember it
                        st.seen.add(e.seq)
                    yield e
            if len(batch) < PAGE:
                break
            pos = batch[-1].seq
        st.floor = max(st.floor, settled)
        st.seen = {seq for seq in st.seen if seq > st.floor}

    theirs: List[AnyEvent] = list(local)
    return heapq.merge(sidecar(), theirs, key=_ts)


def _priority(found: wake.Wake) -> int:
    """A failed job exit first (the run is over), then by severity; a clean exit only when
    nothing else woke (exit 0 means nothing material is left unreported)."""
    if found.clean_exit is not None:
        return 3 if not found.clean_exit else -1
    return kinds.severity(str(found.event.get("sev")))


def _ts(event: AnyEvent) -> float:
    return event.ts


def _mark(store: Store, run: str, key: str, woken: Dict[str, float], t: float) -> None:
    fresh = wake.mark_key(key, woken)
    store.mark_woken(run, fresh)
    woken[fresh] = t


def _absorb_reported_exit(store: Store, found: wake.Wake) -> None:
    """A job.rank_failed told of its node's failed exit: that exit does not wake the next watch."""
    data = found.event.get("data")
    if found.event.get("kind") != "job.rank_failed" or not isinstance(data, dict):
        return
    stream, seq = data.get("stream"), data.get("exit_seq")
    if isinstance(stream, str) and isinstance(seq, int) and not isinstance(seq, bool):
        store.mark_woken(stream, wake.absorbed_key(f"seq:{seq}"))


# ---- what the store says about one event's condition ---------------------------------------


def _of_kinds(store: Store, ev: AnyEvent, kinds: Sequence[str]) -> List[AnyEvent]:
    """The run's events of exactly these kinds from ev's own stream (box or controller), oldest first."""
    out: List[AnyEvent] = []
    for kind in kinds:
        if isinstance(ev, LocalEvent):
            out += [e for e in store.local_events(ev.run, kind_prefix=kind) if e.kind == kind]
        else:
            out += [e for e in store.events(ev.run, kind_prefix=kind) if e.kind == kind]
    return sorted(out, key=lambda e: e.id if isinstance(e, LocalEvent) else e.seq)


def _bounded(store: Store, ev: AnyEvent, events: List[AnyEvent]) -> List[AnyEvent]:
    """Those of ev's attempt (between the job.started around it), or for a dead-man event those
    of its lease (between the deadman.armed around it); a controller event's are all its run's."""
    if isinstance(ev, LocalEvent):
        return events
    marks = [e.seq for e in store.events(ev.run, kind_prefix=_boundary(ev)) if e.kind == _boundary(ev)]
    lo = max((s for s in marks if s < ev.seq), default=0)
    hi = min((s for s in marks if s > ev.seq), default=None)
    return [e for e in events if isinstance(e, LocalEvent) or (e.seq > lo and (hi is None or e.seq < hi))]


def _boundary(ev: AnyEvent) -> str:
    return "deadman.armed" if ev.kind.startswith(kinds.DEADMAN) else "job.started"


def _lease(store: Store, ev: AnyEvent) -> Optional[str]:
    """The arm a dead-man event is about: the newest deadman.armed stored before it."""
    if not ev.kind.startswith(kinds.DEADMAN) or isinstance(ev, LocalEvent):
        return None
    arms = [e for e in store.events(ev.run, kind_prefix="deadman.armed")
            if e.kind == "deadman.armed" and e.seq < ev.seq]
    if not arms:
        return None
    seq = arms[-1].data.get("deadman_seq")
    return f"arm:{seq if isinstance(seq, int) and not isinstance(seq, bool) else 'seq' + str(arms[-1].seq)}"


class _Watch:
    def __init__(self, store: Store, now: Callable[[], float], all_runs: bool = False,
                 check_group: Optional[CheckGroup] = None) -> None:
        self.store = store
        self.now = now
        self.check_group = check_group
        self.all_runs = all_runs
        self.marks: Dict[str, Any] = {}   # Store.change_marks() as last judged
        self.states: Dict[str, _Run] = {}
        self.covered: List[str] = []          # every plain run this watch covered, in order
        self.ended: Dict[str, Ended] = {}     # runs that ended well while watched (not woken)
        self.waiting: Dict[str, str] = {}     # all_runs: queue cells not launched yet -> state

    def context(self, st: _Run, ev: AnyEvent, woken: Mapping[str, float], full: bool) -> wake.Context:
        """What judge needs from the store for ev; `full` adds what may supersede it."""
        lease = _lease(self.store, ev)
        ended = ev.kind in life_mod.END_KINDS
        cut = ended and life_mod.closes(ev) and isinstance(ev, protocol.Event) and \
            life_mod.close_cut(self.store, st.run, ev)
        lived = exit_life(self.store, st.run, ev) if ended else None
        cause = exit_cause(self.store, st.run, ev, lived) if lived is not None else None
        history = None
        if not ended and wake.last_woken(kinds.condition_key(ev, lease), woken) is not None:
            history = tuple(e for e in _of_kinds(self.store, ev, kinds.condition_kinds(ev.kind))
                            if wake.after(ev, e))
        others: Sequence[AnyEvent] = ()
        later = wake.supersede_kinds(ev) if full else ()
        if later:
            others = _bounded(self.store, ev, _of_kinds(self.store, ev, later))
        return wake.Context(life=lived, history=history, others=tuple(others), lease=lease, host=st.host,
                            cause=cause, cut=cut)

    def verdict(self, st: _Run, ev: AnyEvent, woken: Dict[str, float]) -> wake.Verdict:
        t = self.now()
        found = wake.judge(ev, st.policy, t, woken, st.job_started_at, self.context(st, ev, woken, False))
        if found.wake is None or ev.kind in life_mod.END_KINDS:
            return found
        # it would wake: read what may make it moot (rarely needed, so only now)
        return wake.judge(ev, st.policy, t, woken, st.job_started_at, self.context(st, ev, woken, True))

    def others_live(self, st: _Run) -> bool:
        """Another watched run (or a queue cell not launched yet) has not ended."""
        if st.others_live() or self.waiting:
            return True
        return any(not s.over() for s in self.states.values() if s is not st and not s.group)

    def judge(self, st: _Run, events: Iterable[AnyEvent], woken: Dict[str, float],
              noting: bool) -> Optional[WatchResult]:
        """Judge events in order; of those that would wake, report the most important (see
        _priority) and leave the others to the next watches."""
        found: List[wake.Wake] = []
        for ev in events:
            closing = st.closing
            if noting:
                st.note(ev)
            if ev.kind == "sidecar.stopping" and closing is not None and st.closing is closing:
                ev = closing  # stopped without closing: the exit ends the run (Context.cut)
            verdict = self.verdict(st, ev, woken)
            if verdict.reason == "quiet":
                st.deferred.append(ev)
            elif verdict.reason in wake.ABSORBED:
                _mark(self.store, st.run, wake.absorbed_key(verdict.key), woken, self.now())
            elif verdict.wake is not None:
                found.append(verdict.wake)
        if not found:
            return None
        best = max(found, key=_priority)  # max keeps the first of equals: the oldest
        if best.clean_exit is False and st.others_live():
            told = self.rank_failed(st, best)
            if told is not None:
                return told
        t = self.now()
        _mark(self.store, st.run, best.key, woken, t)
        if best.clean_exit and self.others_live(st):
            # one run (or node) ended well; the watch ends when every run it covers has
            self.ended[st.run] = Ended(best, t)
            return None
        if best.clean_exit is None:
            _mark(self.store, st.run, best.condition, woken, t)
        _absorb_reported_exit(self.store, best)
        record = best.record(t)
        others = {w.condition for w in found if w.condition != best.condition}
        record["pending"] = len(others)  # material events the next watches will report
        if best.clean_exit is not None:
            return self.all_ended(t, Ended(best, t), record)
        return WatchResult(int(record["exit"]), record)

    def rank_failed(self, st: _Run, exit_wake: wake.Wake) -> Optional[WatchResult]:
        """A node's failed exit while other nodes of a watched group run is what job.rank_failed
        says: make sure it is recorded (by the daemon: check_group) and wake on it, on the group's row."""
        group = next((s for s in st.siblings if s.group), None)
        if group is None or self.check_group is None:
            return None
        try:
            self.check_group(group.run)
        except Exception:  # the exit itself still wakes; the reason is logged
            log.warning("could not check the group %s", group.run, exc_info=True)
            return None
        seq = exit_wake.event.get("seq")
        for ev in self.store.local_events(group.run, kind_prefix="job.rank_failed"):
            if ev.data.get("stream") != st.run or ev.data.get("exit_seq") != seq:
                continue
            woken = self.store.woken(group.run)
            found = wake.judge(ev, group.policy, self.now(), woken).wake
            if found is None:
                return None
            t = self.now()
            _mark(self.store, group.run, found.key, woken, t)
            _mark(self.store, group.run, found.condition, woken, t)
            _absorb_reported_exit(self.store, found)
            return WatchResult(int(found.record(t)["exit"]), {**found.record(t), "pending": 0})
        return None

    def step(self, changed: bool) -> Optional[WatchResult]:
        """Judge what arrived since the last step (when the store changed), then what quiet
        hours held back once they are over."""
        marks = self.store.change_marks() if changed else {}
        for st in list(self.states.values()):
            held = list(st.deferred) if st.deferred and not st.policy.quiet_now(self.now()) else []
            # Of many runs, only those with something new stored are read (bench/controller_scale.py).
            moved = changed and (st.run not in self.marks or marks.get(st.run) != self.marks[st.run])
            if not moved and not held:
                continue
            st.deferred = [] if held else st.deferred
            woken = self.store.woken(st.run)
            result = self.judge(st, held, woken, noting=False)  # older than anything fresh
            if moved:
                self.marks[st.run] = marks.get(st.run, (0, 0.0, 0))
            if result is None and moved:
                result = self.judge(st, _fresh(self.store, st), woken, noting=True)
            if result is not None:
                return result
        return None

    def link_down(self) -> Optional[WatchResult]:
        """Exit 4 once a run's link stayed down past its budget (counted from the last such exit)."""
        t = self.now()
        for st in self.states.values():
            lost = st.link_lost
            if lost is None or t - lost.ts <= st.policy.link_budget_s:
                continue
            key = wake.event_key(lost)
            woken = self.store.woken(st.run)
            since = max(lost.ts, wake.last_woken(key, woken) or lost.ts)
            if t - since <= st.policy.link_budget_s:
                continue
            _mark(self.store, st.run, key, woken, t)
            return WatchResult(EXIT_LINK, link_record(st.run, lost, t, st.policy.link_budget_s))
        return None

    def drop_ended(self) -> None:
        """Runs that are over leave the watch (a group's row once all its nodes have)."""
        for run in [r for r, st in self.states.items() if st.over()]:
            del self.states[run]

    def live(self) -> bool:
        return bool(self.waiting) or any(not st.group for st in self.states.values())

    def all_ended(self, t: float, last: Optional[Ended] = None,
                  record: Optional[Dict[str, Any]] = None, before: bool = False) -> WatchResult:
        """Every covered run has ended: exit 0 when each ended well, else 10 on the one that did not."""
        doc = ended_record(self.store, self.covered, t, last or self.newest_end(), record, before)
        return WatchResult(int(doc["exit"]), doc)

    def newest_end(self) -> Optional[Ended]:
        return max(self.ended.values(), key=lambda e: e.at) if self.ended else None

    def timeout(self, timeout_s: Optional[float], again: str) -> WatchResult:
        t = self.now()
        lines = {}
        for run, st in self.states.items():
            lines[run] = (status_group.one_line(status_group.summarize(self.store, run, now=t)) if st.group
                          else status_mod.one_line(status_mod.summarize(self.store, run, now=t)))
        runs = list(self.states)
        what = "; ".join(f"{run}: {line}" for run, line in lines.items())
        if self.waiting:
            what += ("; " if what else "") + "queue cells not launched yet: " + ", ".join(
                f"{cell} ({state})" for cell, state in self.waiting.items())
        record: Dict[str, Any] = {
            "exit": EXIT_TIMEOUT, "run": runs[0] if len(runs) == 1 else None, "runs": runs, "event": None,
            "explain": cut(f"nothing material happened in {render.seconds(timeout_s)}: {what}"
                                          if timeout_s is not None else f"nothing material happened: {what}"),
            "next": again, "status": lines, "timeout_s": timeout_s, "woke_at": t}
        if self.waiting:
            record["waiting"] = dict(self.waiting)
        if self.ended:
            record["ended"] = {run: e.wake.life.to_dict() for run, e in self.ended.items() if e.wake.life}
        return WatchResult(EXIT_TIMEOUT, record)


def _ensure(ensure_watcher: Optional[Callable[[str], Any]], states: Mapping[str, _Run]) -> None:
    """(Re)start the background watcher of every watched run that has not ended."""
    if ensure_watcher is None:
        return
    for run, st in states.items():
        if st.over():
            continue
        try:
            ensure_watcher(run)
        except Exception:  # the watch goes on with what the store has; the reason is logged
            log.warning("could not start the background watcher of %s", run, exc_info=True)


def watch(store: Store, runs: Sequence[str] = (), *, all_runs: bool = False,
          timeout_s: Optional[float] = None, policy_overrides: Optional[Mapping[str, Any]] = None,
          from_now: bool = False, now: Callable[[], float] = time.time,
          sleep: Callable[[float], Any] = time.sleep, monotonic: Callable[[], float] = time.monotonic,
          ensure_watcher: Optional[Callable[[str], Any]] = None, poll_s: float = POLL_S,
          ensure_every_s: float = ENSURE_EVERY_S, check_group: Optional[CheckGroup] = None) -> WatchResult:
    """Watch `runs` (ids or unique prefixes) or, with all_runs, every run not ended yet (and the
    queue cells not launched yet).

    ValueError for a bad call or bad overrides, StoreError (RunNotFound, ...) for a
    run the store does not know; otherwise a WatchResult (see the module doc).
    `sleep` is called between polls and `ensure_watcher(run)` (the daemon's follow) every
    ensure_every_s; `check_group(group)` has a group's verdicts recorded (the daemon's; None: the
    watch only reads what is recorded).
    """
    if all_runs == bool(runs):
        raise ValueError("give a run id, or all_runs" if not runs else "give run ids or all_runs, not both")
    overrides = wake.check_layer(policy_overrides or {})
    started = monotonic()
    names = live_runs(store) if all_runs else [store.resolve_run(r) for r in runs]
    names = _expand(store, names)
    again = again_command(names if not all_runs else (), all_runs)
    w = _Watch(store, now, all_runs, check_group)
    w.waiting = waiting_cells(store) if all_runs else {}
    if not names and not w.waiting:
        return _nothing(now(), again)
    w.states = {run: _start(store, run, overrides, from_now) for run in names}
    _link_groups(store, w.states)
    w.covered = [run for run, st in w.states.items() if not st.group]
    known = set(w.states)  # ever watched here: a run that ended stays out
    next_group_check = started
    _ensure(ensure_watcher, w.states)
    next_ensure = started + ensure_every_s
    deadline = None if timeout_s is None else started + timeout_s
    version: Optional[int] = None
    first = True
    while True:
        current = store.data_version()
        if first or (current != version and monotonic() >= next_group_check):
            next_group_check = monotonic() + GROUP_CHECK_S
            _check_groups(check_group, w.states)
        result = w.step(changed=current != version)
        version = current
        if result is not None:
            return result
        if first:
            first = False
            if not any(not st.over() for st in w.states.values()) and not w.waiting:
                return (w.all_ended(now(), before=True) if w.covered else _nothing(now(), again))
        w.drop_ended()
        if not w.live():
            return w.all_ended(now())
        result = w.link_down()
        if result is not None:
            return result
        if deadline is not None and monotonic() >= deadline:
            return w.timeout(timeout_s, again)
        if monotonic() >= next_ensure:
            next_ensure = monotonic() + ensure_every_s
            if all_runs:
                w.waiting = waiting_cells(store)
            if _add_new(store, w, known, all_runs, overrides):
                version = None  # judge the new runs' stored events at the next poll
            _ensure(ensure_watcher, w.states)
        sleep(poll_s)


def _nothing(t: float, again: str) -> WatchResult:
    return WatchResult(EXIT_CLEAN, {
        "exit": EXIT_CLEAN, "run": None, "runs": [], "event": None, "woke_at": t, "ended": {},
        "explain": "nothing to watch: every run in the store has ended and no queue cell waits to launch",
        "next": "rgt runs", "status": "nothing to watch: every run in the store has ended"})


def _add_new(store: Store, w: _Watch, known: Set[str], all_runs: bool, overrides: Mapping[str, Any]) -> bool:
    """Runs that appeared since: live ones and those of queue cells (with all_runs), and node
    streams of watched groups."""
    found = live_runs(store) if all_runs else []
    if all_runs:
        found += [run for run in waiting_cells(store, runs=True) if run not in found]
    found = _expand(store, found + [run for run, st in w.states.items() if st.group])
    fresh = [run for run in found if run not in known]
    known.update(fresh)
    for run in fresh:
        w.states[run] = _start(store, run, overrides, False)
    if fresh:
        _link_groups(store, w.states)
        w.covered += [run for run in fresh if not w.states[run].group]
    return bool(fresh)


__all__ = ["EXIT_CLEAN", "EXIT_LINK", "EXIT_MATERIAL", "EXIT_TIMEOUT", "WatchResult", "live_runs",
           "policy_for", "watch"]
