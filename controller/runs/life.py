"""A run's life, one state machine that `rgt watch`, `rgt status`, `rgt runs`, the queue and the
group verdict all read, so they never tell one run's ending two ways.

    launched -> running -> closing -> finished | failed | stopped | preempted | vanished | lost

    launched   the laptop launched (or tracks) it; nothing from the box is stored yet
    running    box events are stored and no job exit is
    closing    the job exited and the sidecar is closing the run (onbox/sidecar/closing.py: every
               source read, every checkpoint committed or named incomplete, the final manifest);
               `outcome` is what the exit alone says, and the run ends on its `run.closed`. An
               exit from a sidecar without a close-out, or whose sidecar stopped before closing
               (and was not started again), ends the run itself
    finished   the job exited 0 and the sidecar's final verdict held
    failed     it ended badly; `outcome` says how: nan, oom, final, error
    stopped    it ended after a stop rgt was asked for (`rgt stop`, a queue cancel): by request,
               whatever the exit code (143, the SIGTERM itself, or 0 after saving)
    preempted  a SIGTERM nobody asked rgt for: job.preempted, job.exited preempted, or a 143 /
               SIGTERM exit with no stop request; under Slurm the sidecar says why (the event's
               `reason`, the exit's `preempt_reason`), and `outcome` is then time_limit, requeued,
               cancelled or preempted, each told in its own words
    vanished   the job disappeared without an exit record (the box rebooted under it, ...)
    lost       the sidecar said it stopped and no job exit is stored: nothing more will arrive

Each state comes with its evidence (the event kind and seq or local id that moved it), so a
reader can show why. A run resumed in place shares its journal with the attempts before it:
only events after the newest job.started count.

`ended` and `ok` are what most readers want: a finished or stopped run is not a failure, and
`rgt watch` ends 0 on both (with "stopped_by" for a stop).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import protocol

from controller.store.db import LocalEvent, Store

LAUNCHED, RUNNING, CLOSING = "launched", "running", "closing"
FINISHED, FAILED, STOPPED, PREEMPTED, VANISHED, LOST = (
    "finished", "failed", "stopped", "preempted", "vanished", "lost")
ENDED = (FINISHED, FAILED, STOPPED, PREEMPTED, VANISHED, LOST)
STATES = (LAUNCHED, RUNNING, CLOSING, *ENDED)
EXIT_KIND, CLOSED_KIND, CLOSING_KIND = "job.exited", "run.closed", "run.closing"
END_KINDS = (EXIT_KIND, CLOSED_KIND)
SIGTERM = 15
SIGTERM_CODES = (143, -SIGTERM)   # a shell's 128+15, and Python's returncode for the signal
STOP_KIND = "run.stop_requested"  # the laptop's own record of a stop it asked the box for
STOP_ANSWER_KIND = "run.stop_answered"   # the box's answer to it: "not_running" voids the request


# Why a scheduler ended the job (onbox/sources/slurm.py's reasons): the outcome and its line.
SCHEDULER_ENDS: Dict[str, Tuple[str, str]] = {
    "time_limit": ("time_limit", "Slurm's time limit: the job was told to stop as its --time ran out, "
                                 "not a crash; resume it in a new job with more --time"),
    "requeued": ("requeued", "requeued by Slurm (scontrol requeue or a requeueing preemption): the job "
                             "runs again and resumes from its newest checkpoint"),
    "cancelled": ("cancelled", "cancelled through Slurm (scancel), not by rgt"),
    "preempted": ("preempted", "preempted by Slurm for another job"),
}


@dataclasses.dataclass(frozen=True)
class Life:
    """Where a run is in its life, with the evidence."""

    state: str
    outcome: str                      # finer than state: ok, stopped, preempted, nan, oom, final,
    #                                   error, vanished, lost, running, launched
    reason: str                       # one line, safe to print once box strings are printable()
    evidence: Dict[str, Any] = dataclasses.field(default_factory=dict)
    stopped_by: Optional[str] = None  # who asked for the stop ("rgt stop", "rgt queue cancel", ...)

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def ok(self) -> bool:
        """Not a failure: finished cleanly or stopped by request (a live run is not judged)."""
        return self.state in (FINISHED, STOPPED)

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"state": self.state, "outcome": self.outcome, "reason": self.reason,
                               "ended": self.ended, "ok": self.ok, "evidence": dict(self.evidence)}
        if self.stopped_by:
            out["stopped_by"] = self.stopped_by
        return out


def _is_sigterm(data: Mapping[str, Any]) -> bool:
    code, sig = data.get("code"), data.get("signal")
    return code in SIGTERM_CODES or sig == SIGTERM


def exit_life(data: Mapping[str, Any], *, evidence: Optional[Mapping[str, Any]] = None,
              stopped_by: Optional[str] = None, preempted: bool = False, nonfinite: bool = False,
              preempt_reason: Optional[str] = None) -> Life:
    """How a job.exited (its data) ends the run.

    stopped_by: the laptop recorded a stop request before this exit (the box's own
    stop_requested flag counts as "rgt stop" when the laptop has no record). preempted:
    a job.preempted came before it. nonfinite: a train.nonfinite onset came before it.
    preempt_reason: that job.preempted's `reason` (the exit's own `preempt_reason` counts too).
    """
    ev = dict(evidence or {})
    reasons = [str(r) for r in data.get("final_reasons") or [] if isinstance(r, str)]
    code, sig = data.get("code"), data.get("signal")
    by = stopped_by or ("rgt stop" if data.get("stop_requested") is True else None)
    if by is not None and not data.get("oom_killed"):
        how = "exit code 0" if code == 0 else (f"exit code {code}" if code is not None else
                                              f"signal {sig}" if sig is not None else "no exit code")
        return Life(STOPPED, "stopped", f"stopped by request ({by}); the job ended with {how}", ev, by)
    if nonfinite or any("non-finite" in r for r in reasons):
        return Life(FAILED, "nan", "training went non-finite (train.nonfinite)", ev)
    if data.get("oom_killed"):
        return Life(FAILED, "oom", "the job was killed for memory (OOM)", ev)
    if preempted or data.get("preempted") is True:
        why = preempt_reason or data.get("preempt_reason")
        if isinstance(why, str) and why in SCHEDULER_ENDS:
            outcome, line = SCHEDULER_ENDS[why]
            return Life(PREEMPTED, outcome, line, ev)
        return Life(PREEMPTED, "preempted", "preempted: a SIGTERM nobody asked rgt for (job.preempted)", ev)
    if code == 0 and data.get("final_ok") is not False:
        return Life(FINISHED, "ok", "the job exited 0 and the final checks held", ev)
    if code == 0:
        return Life(FAILED, "final", "exited 0 but failed the final check: " + "; ".join(reasons), ev)
    if data.get("vanished"):
        rebooted = (data.get("evidence") or {}).get("rebooted")
        return Life(VANISHED, "vanished", "the box rebooted under the job" if rebooted
                    else "the job vanished without an exit record", ev)
    if _is_sigterm(data):
        return Life(PREEMPTED, "preempted", "preempted: the job ended by a SIGTERM (exit 143) and no stop "
                    "was asked for", ev)
    return Life(FAILED, "error", f"exit code {code}" if code is not None else f"killed by signal {sig}", ev)


def stop_request(local: Sequence[LocalEvent], after_ts: float = 0.0) -> Optional[LocalEvent]:
    """The laptop's newest stop request at or after after_ts that the box did not answer with
    "not_running" (the job had ended on its own: its exit, even a crash, is not a stop), or None."""
    void = {ev.data.get("request_id") for ev in local
            if ev.kind == STOP_ANSWER_KIND and ev.data.get("outcome") == "not_running"}
    found = None
    for ev in local:
        if ev.kind == STOP_KIND and ev.ts >= after_ts and ev.id not in void:
            found = ev
    return found


def stop_events(store: Store, run: str, since_id: int = 0) -> List[LocalEvent]:
    """The laptop's stop requests of a run and the box's answers to them, for stop_request."""
    return store.local_events(run, since_id=since_id, kind_prefix="run.stop_")


def stopped_by(request: Optional[LocalEvent]) -> Optional[str]:
    """Who asked for a stop request ("rgt stop" when it does not say), or None for no request."""
    if request is None:
        return None
    by = request.data.get("by")
    return by if isinstance(by, str) and by else "rgt stop"


def of_exit(store: Store, run: str, end: protocol.Event) -> Life:
    """How this stored job.exited ends its attempt: the laptop's stop request since the attempt's
    job.started, and the job.preempted / train.nonfinite onset of the attempt before the exit."""
    starts = [e for e in store.events(run, kind_prefix="job.started") if e.seq < end.seq]
    since = starts[-1].seq if starts else 0
    since_ts = starts[-1].ts if starts else 0.0
    before = [e for e in store.events(run, since=since, kind_prefix="job.preempted") if e.seq < end.seq]
    nan = [e for e in store.events(run, since=since, kind_prefix="train.nonfinite")
           if e.seq < end.seq and e.data.get("state", "onset") == "onset"]
    request = stop_request(stop_events(store, run), since_ts)
    evidence: Dict[str, Any] = {"kind": end.kind, "seq": end.seq, "ts": end.ts}
    if request is not None:
        evidence["stop_request"] = {"id": request.id, "ts": request.ts}
    reason = before[-1].data.get("reason") if before else None
    return exit_life(end.data, evidence=evidence, stopped_by=stopped_by(request),
                     preempted=bool(before), nonfinite=bool(nan),
                     preempt_reason=reason if isinstance(reason, str) else None)


def closes(exit_event: Any) -> bool:
    """This job.exited says a close-out follows (a sidecar with onbox/sidecar/closing.py)."""
    return exit_event.kind == EXIT_KIND and exit_event.data.get("closing") is True


def close_cut(store: Store, run: str, exit_event: protocol.Event) -> bool:
    """The sidecar stopped after this exit, before any run.closed, and no sidecar started after
    that stop: no run.closed will come (one stopped mid close-out that nothing restarted)."""
    if store.events(run, since=exit_event.seq, kind_prefix=CLOSED_KIND, limit=1):
        return False
    stops = store.events(run, since=exit_event.seq, kind_prefix="sidecar.stopping")
    return bool(stops) and not store.events(run, since=stops[-1].seq, kind_prefix="sidecar.started")


def end_of(store: Store, run: str) -> Tuple[Optional[protocol.Event], Optional[protocol.Event]]:
    """The newest attempt's end event (its run.closed; else its job.exited when no close follows
    it) and the job.exited whose close-out is still running, at most one of them set."""
    started = store.events(run, kind_prefix="job.started")
    since = started[-1].seq - 1 if started else 0
    closed = store.events(run, since=since, kind_prefix=CLOSED_KIND, limit=1)
    if closed:
        return closed[0], None
    exited = store.events(run, since=since, kind_prefix=EXIT_KIND, limit=1)
    if not exited:
        return None, None
    if closes(exited[0]) and not close_cut(store, run, exited[0]):
        return None, exited[0]
    return exited[0], None


def of_run(store: Store, run: str) -> Life:
    """The life of a stored run, from its job.*, run.closed, sidecar.stopping, train.nonfinite
    and the laptop's stop requests, counting only the newest attempt."""
    started = store.events(run, kind_prefix="job.started")
    since = started[-1].seq - 1 if started else 0
    end, closing = end_of(store, run)
    if end is not None:
        return of_exit(store, run, end)
    if closing is not None:
        now = of_exit(store, run, closing)
        return Life(CLOSING, now.outcome, f"closing: {now.reason}; the sidecar is finishing custody and "
                    "the final manifest (run.closed ends it)", now.evidence, now.stopped_by)
    stopping = store.events(run, since=since, kind_prefix="sidecar.stopping")
    restarted = store.events(run, since=stopping[-1].seq, kind_prefix="sidecar.started") if stopping else []
    if stopping and not restarted:   # a sidecar started again after it (a reboot, a restart) still runs
        last = stopping[-1]
        return Life(LOST, "lost", "the sidecar stopped and no job exit is stored: nothing more will "
                    "arrive; check the box", {"kind": last.kind, "seq": last.seq, "ts": last.ts})
    if store.cursor(run) or started:
        return Life(RUNNING, "running", "no job exit stored", {"cursor": store.cursor(run)})
    return Life(LAUNCHED, "launched", "nothing from the box is stored yet", {})


__all__ = ["CLOSED_KIND", "CLOSING", "CLOSING_KIND", "END_KINDS", "ENDED", "EXIT_KIND", "FAILED",
           "FINISHED", "LAUNCHED", "LOST", "Life", "PREEMPTED", "RUNNING", "SCHEDULER_ENDS", "STATES",
           "STOPPED", "STOP_ANSWER_KIND", "STOP_KIND", "VANISHED", "close_cut", "closes", "end_of",
           "exit_life", "of_exit", "of_run", "stop_events", "stop_request", "stopped_by"]
