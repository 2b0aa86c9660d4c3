"""How an `rgt watch` ends when runs end, apart from the loop (controller.wake.watch).

The life a job exit gives its run as the watch judges it (controller.runs.life, with the run's stop
request), the record of runs that ended (exit 0 only when every one ended well, with `ended`:
run -> life.to_dict()), the link-down record, the queue cells a --all watch still waits for,
and the command that watches again. Every record has the contract's keys: exit, run, event,
explain, next.
"""
from __future__ import annotations

import dataclasses
import shlex
from typing import Any, Dict, Mapping, Optional, Sequence

from controller.queue import model as queue
from controller.render import printable, seconds
from controller.runs import explain, life
from controller.runs.explain import AnyEvent, cut, quoted
from controller.store.db import LocalEvent, Store
from controller.wake import policy as wake


@dataclasses.dataclass(frozen=True)
class Ended:
    """A run that ended while watched, and when the watch recorded it."""

    wake: wake.Wake
    at: float


def again_command(runs: Sequence[str], all_runs: bool) -> str:
    """The watch as a command to run again (every run name quoted: it may hold anything)."""
    return "rgt watch --all" if all_runs else " ".join(["rgt", "watch", *(shlex.quote(r) for r in runs)])


def exit_life(store: Store, run: str, ev: AnyEvent) -> life.Life:
    """How this job.exited ends its attempt: controller.runs.life.exit_life with the laptop's stop
    request since the attempt's job.started, and the job.preempted / train.nonfinite onset of
    the attempt before it (the same inputs as life.of_run, for this exit rather than the newest)."""
    if isinstance(ev, LocalEvent):
        return life.exit_life(ev.data, evidence={"kind": ev.kind, "id": ev.id, "ts": ev.ts})
    return life.of_exit(store, run, ev)


def exit_cause(store: Store, run: str, ev: AnyEvent, lf: life.Life) -> Optional[AnyEvent]:
    """For an exit life fails for a non-finite loss: the attempt's newest train.nonfinite onset."""
    if lf.outcome != "nan" or isinstance(ev, LocalEvent):
        return None
    starts = [e.seq for e in store.events(run, kind_prefix="job.started") if e.seq < ev.seq]
    onsets = [e for e in store.events(run, since=starts[-1] if starts else 0, kind_prefix="train.nonfinite")
              if e.seq < ev.seq and e.data.get("state", "onset") == "onset"]
    return onsets[-1] if onsets else None


def waiting_cells(store: Store, runs: bool = False) -> Dict[str, str]:
    """Queue cells that have not ended ("queue#idx" -> state): pending, launching, running or
    retrying. runs=True: instead, the stored runs of such cells (run -> cell), for the watch to
    cover. A queue that cannot be read is left out (the reason is logged by the caller's store)."""
    known = {str(r["run"]) for r in store.runs()} if runs else set()
    out: Dict[str, str] = {}
    for name in queue.names(store):
        for cell in queue.cells(store, name):
            if cell.state in queue.TERMINAL:
                continue
            label = f"{name}#{cell.idx}"
            if not runs:
                out[label] = cell.state
            elif cell.run and cell.run in known:
                out[cell.run] = label
    return out


def link_record(run: str, lost: LocalEvent, t: float, budget_s: float) -> Dict[str, Any]:
    return {
        "exit": 4, "run": run, "event": wake.envelope(lost), "woke_at": t,
        "link": "down", "down_s": round(t - lost.ts, 1), "link_budget_s": budget_s,
        "explain": (f"the link to the box has been down for {seconds(t - lost.ts)} (budget "
                    f"{seconds(budget_s)}): the transport is down; this says NOTHING about the job: check "
                    "the box itself (ssh, the provider's console) before concluding anything"),
        "next": f"rgt status {quoted(run)}"}


def _evidence(store: Store, run: str, lf: life.Life) -> Optional[AnyEvent]:
    seq = lf.evidence.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool):
        return None
    found = store.events(run, since=seq - 1, limit=1)
    return found[0] if found and found[0].seq == seq else None


def _started_at(store: Store, run: str, ev: AnyEvent) -> Optional[float]:
    if isinstance(ev, LocalEvent):
        return None
    starts = [e for e in store.events(run, kind_prefix="job.started") if e.seq < ev.seq]
    return starts[-1].ts if starts else None


def _said(lf: life.Life) -> str:
    return f"stopped by request ({lf.stopped_by})" if lf.state == life.STOPPED else lf.state


def _from_life(store: Store, run: str, lf: life.Life, t: float, host: Optional[str]) -> Dict[str, Any]:
    """The record of a run found ended: its end's event, how it ended, whether a watch told it."""
    ev = _evidence(store, run, lf)
    reported = False
    if ev is not None:
        key = wake.event_key(ev)
        woken = store.woken(run)
        reported = wake.last_woken(key, woken) is not None or wake.absorbed_key(key) in woken
        store.mark_woken(run, wake.mark_key(key, woken))
    if ev is not None and ev.kind in life.END_KINDS:
        said = explain.explain(ev, _started_at(store, run, ev), lf, exit_cause(store, run, ev, lf))
        next_step = explain.next_command(ev, lf, host)
    else:
        said, next_step = cut(lf.reason), f"rgt status {quoted(run)}"
    out: Dict[str, Any] = {
        "exit": 0 if lf.ok else 10, "run": run, "event": wake.envelope(ev) if ev is not None else None,
        "explain": said, "next": next_step, "woke_at": t, "already_reported": reported,
        "life": lf.to_dict()}
    if lf.stopped_by:
        out["stopped_by"] = lf.stopped_by
    return out


def _host(store: Store, run: str) -> Optional[str]:
    host = store.run(run).get("host")
    return host if isinstance(host, str) and host else None


def ended_record(store: Store, runs: Sequence[str], t: float, last: Optional[Ended],
                 record: Optional[Mapping[str, Any]], before: bool) -> Dict[str, Any]:
    """The line of a watch that ends on runs' ends: `record` (the wake of the exit that ended it)
    or the newest recorded end, with `ended` for every covered run; exit 10 instead when one of
    them ended badly (found ended, told before: already_reported), 0 never stands for a failure."""
    lives = {run: life.of_run(store, run) for run in runs}
    ended = {run: lf.to_dict() for run, lf in lives.items()}
    bad = next((run for run, lf in lives.items() if lf.ended and not lf.ok), None)
    base = dict(record) if record is not None else (last.wake.record(last.at) if last is not None else None)
    if base is not None and (bad is None or int(base.get("exit", 0)) != 0):
        out = dict(base)
    else:
        pick = bad or runs[-1]
        out = _from_life(store, pick, lives[pick], t, _host(store, pick))
    out["ended"] = ended
    out["runs"] = list(runs)
    if len(runs) > 1 and int(out["exit"]) == 0:
        how = ", ".join(f"{run}: {_said(lf)}" for run, lf in lives.items())
        out["explain"] = cut(f"every watched run has ended well ({how}); the last: {out['explain']}")
    if before:
        names = ", ".join(printable(r) for r in runs)
        out["status"] = f"nothing more to watch: {names} ended before this watch began"
    return out


__all__ = ["Ended", "again_command", "ended_record", "exit_cause", "exit_life", "link_record",
           "waiting_cells"]
