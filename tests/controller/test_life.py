"""controller.runs.life: one run's life from a real store, every state and outcome, and what decides
between them (a stop request, the attempt that counts, an exit against a sidecar's stop)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from controller.runs import life
from controller.store.db import Store
from protocol import Event

RUN = "life-run"
T0 = 1_700_000_000.0


class Journal:
    """RUN's box events, appended in seq order the way a watcher stores them."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.seq = 0
        store.upsert_run(RUN, host="box1", target="box1", run_dir="/runs/life-run")

    def add(self, kind: str, sev: str = "info", ts: Optional[float] = None, **data: Any) -> Event:
        self.seq += 1
        ev = Event(run=RUN, host="box1", seq=self.seq, ts=T0 + self.seq if ts is None else ts, kind=kind,
                   sev=sev, data=data)
        self.store.apply(RUN, [ev], self.seq)
        return ev

    def started(self) -> Event:
        return self.add("job.started", pid=42)

    def exited(self, **data: Any) -> Event:
        return self.add("job.exited", "warn", **data)

    def stop_asked(self, by: str = "rgt stop", ts: Optional[float] = None) -> None:
        self.store.add_local_event(RUN, life.STOP_KIND, "info", {"by": by, "grace": "30s"},
                                   ts=T0 + self.seq + 0.5 if ts is None else ts)

    def life(self) -> life.Life:
        return life.of_run(self.store, RUN)


@pytest.fixture
def box(home: Path) -> Iterator[Journal]:
    with Store.open() as s:
        yield Journal(s)


# ---- before the end -----------------------------------------------------------------------


def test_launched_until_the_box_says_anything_then_running(box: Journal) -> None:
    first = box.life()
    assert (first.state, first.outcome, first.ended, first.ok) == (life.LAUNCHED, "launched", False, False)
    box.add("heartbeat")
    assert box.life().state == life.RUNNING   # box events stored, no job exit
    box.started()
    now = box.life()
    assert (now.state, now.outcome, now.ended, now.ok) == (life.RUNNING, "running", False, False)
    assert now.to_dict()["ended"] is False and "stopped_by" not in now.to_dict()


# ---- the ends -------------------------------------------------------------------------------


EXITS: List[Any] = [
    ({"code": 0, "final_ok": True}, life.FINISHED, "ok"),
    ({"code": 0}, life.FINISHED, "ok"),
    ({"code": 0, "final_ok": False, "final_reasons": ["durable copy failed"]}, life.FAILED, "final"),
    ({"code": 0, "final_ok": False, "final_reasons": ["loss went non-finite"]}, life.FAILED, "nan"),
    ({"code": 137, "signal": 9, "oom_killed": True}, life.FAILED, "oom"),
    ({"code": 1}, life.FAILED, "error"),
    ({"code": None, "signal": 9}, life.FAILED, "error"),
    ({"code": 143}, life.PREEMPTED, "preempted"),
    ({"code": -15}, life.PREEMPTED, "preempted"),
    ({"code": None, "signal": 15}, life.PREEMPTED, "preempted"),
    ({"code": 1, "preempted": True}, life.PREEMPTED, "preempted"),
    ({"code": None, "vanished": True}, life.VANISHED, "vanished"),
    ({"code": None, "vanished": True, "evidence": {"rebooted": True}}, life.VANISHED, "vanished"),
    ({"code": 143, "stop_requested": True}, life.STOPPED, "stopped"),   # the box's own flag
]


@pytest.mark.parametrize("data, state, outcome", EXITS)
def test_every_exit_ends_in_its_state(box: Journal, data: Dict[str, Any], state: str, outcome: str) -> None:
    box.started()
    end = box.exited(**data)
    found = box.life()
    assert (found.state, found.outcome) == (state, outcome), found
    assert found.ended and found.ok == (state in (life.FINISHED, life.STOPPED))
    assert found.evidence == {"kind": "job.exited", "seq": end.seq, "ts": end.ts}
    assert found.reason and found.to_dict()["state"] == state
    # exit_life alone tells the same story from the exit's data
    assert life.exit_life(data).state == state


def test_a_vanished_job_on_a_rebooted_box_says_so(box: Journal) -> None:
    box.started()
    box.exited(code=None, vanished=True, evidence={"rebooted": True})
    assert "rebooted" in box.life().reason


def test_a_nonfinite_onset_before_the_exit_fails_it_even_with_code_zero(box: Journal) -> None:
    box.started()
    box.add("train.nonfinite", "critical", state="onset", name="loss")
    box.exited(code=0, final_ok=True)
    assert (box.life().state, box.life().outcome) == (life.FAILED, "nan")


def test_a_cleared_nonfinite_or_a_preemption_after_the_exit_does_not_count(box: Journal) -> None:
    box.started()
    box.add("train.nonfinite", "info", state="cleared", name="loss")
    box.exited(code=0, final_ok=True)
    box.add("job.preempted", "warn")
    assert box.life().state == life.FINISHED


def test_a_job_preempted_before_an_exit_code_one_is_a_preemption(box: Journal) -> None:
    box.started()
    box.add("job.preempted", "warn", signal=15)
    box.exited(code=1)
    assert box.life().state == life.PREEMPTED


def test_the_sidecar_stopping_without_an_exit_is_lost(box: Journal) -> None:
    box.started()
    stop = box.add("sidecar.stopping")
    found = box.life()
    assert (found.state, found.outcome, found.ended, found.ok) == (life.LOST, "lost", True, False)
    assert found.evidence == {"kind": "sidecar.stopping", "seq": stop.seq, "ts": stop.ts}


def test_a_sidecar_started_again_after_its_stop_is_running_not_lost(box: Journal) -> None:
    box.started()
    box.add("sidecar.stopping")
    assert box.life().state == life.LOST
    box.add("sidecar.started")
    assert box.life().state == life.RUNNING


@pytest.mark.parametrize("stopping_first", [True, False])
def test_a_stored_exit_wins_over_the_sidecars_stop_whatever_their_order(box: Journal,
                                                                          stopping_first: bool) -> None:
    box.started()
    if stopping_first:   # the sidecar's stop arrived first, the exit after (a replay after a gap)
        box.add("sidecar.stopping")
        box.exited(code=0, final_ok=True)
    else:
        box.exited(code=0, final_ok=True)
        box.add("sidecar.stopping")
    assert box.life().state == life.FINISHED


# ---- a stop rgt was asked for ----------------------------------------------------------------------


@pytest.mark.parametrize("data", [{"code": 143}, {"code": 1}, {"code": 0, "final_ok": True},
                                  {"code": None, "signal": 15}, {"code": -15}])
def test_a_stop_request_wins_over_the_exit_code(box: Journal, data: Dict[str, Any]) -> None:
    box.started()
    box.stop_asked()
    box.exited(**data)
    found = box.life()
    assert (found.state, found.outcome, found.stopped_by) == (life.STOPPED, "stopped", "rgt stop")
    assert found.ok and found.ended and found.to_dict()["stopped_by"] == "rgt stop"
    assert "stopped by request (rgt stop)" in found.reason
    request = box.store.local_events(RUN, kind_prefix=life.STOP_KIND)[-1]
    assert found.evidence["stop_request"] == {"id": request.id, "ts": request.ts}


def test_a_stop_request_wins_over_a_preemption(box: Journal) -> None:
    box.started()
    box.stop_asked(by="rgt queue cancel")
    box.add("job.preempted", "warn", signal=15)
    box.exited(code=143, preempted=True)
    found = box.life()
    assert (found.state, found.stopped_by) == (life.STOPPED, "rgt queue cancel")


def test_an_oom_kill_during_a_stop_is_still_an_oom(box: Journal) -> None:
    box.started()
    box.stop_asked()
    box.exited(code=137, signal=9, oom_killed=True)
    assert (box.life().state, box.life().outcome) == (life.FAILED, "oom")


def test_a_sigterm_exit_with_no_stop_request_is_a_preemption(box: Journal) -> None:
    box.started()
    box.exited(code=143)
    found = box.life()
    assert found.state == life.PREEMPTED and found.stopped_by is None and not found.ok
    assert "no stop" in found.reason


def test_a_request_the_box_answered_not_running_is_not_a_stop(box: Journal) -> None:
    box.started()
    asked = box.store.add_local_event(RUN, life.STOP_KIND, "info", {"by": "rgt stop"}, ts=T0 + 10)
    box.store.add_local_event(RUN, life.STOP_ANSWER_KIND, "info",
                              {"request_id": asked.id, "outcome": "not_running"}, ts=T0 + 11)
    box.exited(code=1, ts=T0 + 20)   # the crash that ended it before the stop reached the box
    found = box.life()
    assert (found.state, found.outcome, found.stopped_by) == (life.FAILED, "error", None)
    box.store.add_local_event(RUN, life.STOP_ANSWER_KIND, "info",
                              {"request_id": asked.id + 99, "outcome": "not_running"}, ts=T0 + 12)
    assert box.life().state == life.FAILED   # an answer to another request voids nothing else


def test_a_request_without_a_by_counts_as_rgt_stop(box: Journal) -> None:
    box.started()
    box.store.add_local_event(RUN, life.STOP_KIND, "info", {}, ts=T0 + 10)
    box.exited(code=143, ts=T0 + 20)
    assert box.life().stopped_by == "rgt stop"


def test_the_newest_of_several_requests_is_the_evidence(box: Journal) -> None:
    box.started()
    box.stop_asked(by="rgt stop", ts=T0 + 5)
    box.stop_asked(by="rgt queue cancel", ts=T0 + 6)
    box.exited(code=143, ts=T0 + 7)
    assert box.life().stopped_by == "rgt queue cancel"


# ---- only the newest attempt counts --------------------------------------------------------------


def test_only_the_newest_attempt_after_the_newest_job_started_counts(box: Journal) -> None:
    box.started()
    box.exited(code=1)
    box.add("sidecar.stopping")
    assert box.life().state == life.FAILED
    box.add("sidecar.started")
    box.started()   # resumed in place: the old exit and the old sidecar stop are the past
    assert box.life().state == life.RUNNING
    box.exited(code=0, final_ok=True)
    assert box.life().state == life.FINISHED


def test_a_stop_asked_for_an_earlier_attempt_does_not_stop_the_next_one(box: Journal) -> None:
    box.started()
    box.stop_asked()
    box.exited(code=143)
    assert box.life().state == life.STOPPED
    box.started()   # relaunched after the stop request
    assert box.life().state == life.RUNNING
    box.exited(code=143)   # a SIGTERM nobody asked for this time
    assert box.life().state == life.PREEMPTED


def test_a_preemption_or_nan_of_an_earlier_attempt_does_not_judge_the_next(box: Journal) -> None:
    box.started()
    box.add("train.nonfinite", "critical", state="onset", name="loss")
    box.add("job.preempted", "warn")
    box.exited(code=143)
    box.started()
    box.exited(code=0, final_ok=True)
    assert box.life().state == life.FINISHED


# ---- the helpers -------------------------------------------------------------------------------------


def test_stop_request_is_the_newest_at_or_after_the_start(box: Journal) -> None:
    box.stop_asked(ts=T0 - 10)
    box.stop_asked(ts=T0 + 10)
    local = box.store.local_events(RUN)
    assert life.stop_request(local) == local[-1]
    assert life.stop_request(local, after_ts=T0 + 10) == local[-1]
    assert life.stop_request(local, after_ts=T0 + 11) is None
    assert life.stop_request([]) is None


def test_states_and_what_ended_means() -> None:
    assert set(life.ENDED) == {life.FINISHED, life.FAILED, life.STOPPED, life.PREEMPTED, life.VANISHED,
                               life.LOST}
    assert life.STATES[:2] == (life.LAUNCHED, life.RUNNING)
    assert life.STOP_KIND == "run.stop_requested"
    stopped = life.exit_life({"code": 143}, stopped_by="rgt stop", evidence={"seq": 9})
    assert stopped.to_dict() == {"state": "stopped", "outcome": "stopped", "reason": stopped.reason,
                                 "ended": True, "ok": True, "evidence": {"seq": 9}, "stopped_by": "rgt stop"}
    assert life.exit_life({"code": 143}, preempted=True).state == life.PREEMPTED
    assert life.exit_life({"code": 0}, nonfinite=True).outcome == "nan"
