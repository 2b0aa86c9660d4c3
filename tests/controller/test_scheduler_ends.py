"""A job Slurm ended is told by why: a time limit, a requeue, a cancel, a preemption; each has its
own life outcome, its own line in `rgt watch` and `rgt status`, and its own catalog entry."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from controller.insight.explain import entry_for_event
from controller.runs import life
from controller.runs.explain import explain
from controller.store.db import Store
from protocol import Event

RUN = "train-81"


def ev(seq: int, kind: str, sev: str = "info", **data: Any) -> Event:
    return Event(run=RUN, host="n1", seq=seq, ts=time.time() - 100 + seq, kind=kind, sev=sev, data=data)


@pytest.mark.parametrize("reason,outcome,words", [
    ("time_limit", "time_limit", "time limit"), ("requeued", "requeued", "requeued by Slurm"),
    ("cancelled", "cancelled", "scancel"), ("preempted", "preempted", "preempted by Slurm"),
])
def test_each_reason_is_its_own_ending_and_never_a_crash(reason: str, outcome: str, words: str) -> None:
    exit_data = {"code": 143, "signal": None, "preempted": True, "preempt_reason": reason, "final_ok": False}
    lf = life.exit_life(exit_data)
    assert (lf.state, lf.outcome) == (life.PREEMPTED, outcome) and words in lf.reason
    assert life.exit_life({**exit_data, "preempt_reason": None}, preempted=True,
                          preempt_reason=reason).outcome == outcome   # from the job.preempted before it
    text = explain(ev(9, "job.exited", "warn", **exit_data), life=lf)
    assert words in text and "exit code 143" in text, text


def test_an_unknown_reason_is_a_plain_preemption() -> None:
    lf = life.exit_life({"code": 143, "preempted": True, "preempt_reason": "$(reboot)"})
    assert lf.outcome == "preempted" and "$(" not in lf.reason


def test_the_preemption_line_says_whose_grace_it_is() -> None:
    slurms = explain(ev(5, "job.preempted", "warn", reason="time_limit", grace_s=40.0, grace_from="slurm"))
    assert slurms.startswith("Slurm's time limit") and "grace 40 s before SIGKILL (Slurm's)" in slurms
    plain = explain(ev(5, "job.preempted", "warn", grace_s=30.0, grace_from="profile"))
    assert "someone else than rgt" in plain and "(Slurm's)" not in plain
    assert "grace unknown" in explain(ev(5, "job.preempted", "warn", reason="requeued"))


def test_the_catalog_entry_follows_the_reason() -> None:
    assert entry_for_event("job.preempted", {"reason": "time_limit"}) == "slurm-time-limit"
    assert entry_for_event("job.exited", {"signal": 15, "preempted": True,
                                          "preempt_reason": "time_limit"}) == "slurm-time-limit"
    assert entry_for_event("job.preempted", {"reason": "requeued"}) == "slurm-requeued"
    assert entry_for_event("job.preempted", {"grace_s": 5}) == "sigterm-preempted"


@pytest.fixture
def store(home: Path) -> Iterator[Store]:
    with Store.open() as s:
        s.upsert_run(RUN, host="n1")
        yield s


def test_the_stored_run_takes_the_reason_of_its_attempts_preemption(store: Store) -> None:
    store.apply(RUN, [ev(1, "job.started", pid=4), ev(2, "job.preempted", "warn", reason="requeued"),
                      ev(3, "job.exited", "warn", code=143, preempted=True),
                      ev(4, "job.started", pid=5), ev(5, "job.exited", code=143, preempted=True)], 5)
    assert life.of_run(store, RUN).outcome == "preempted"   # attempt 2: no reason of its own
    first = store.events(RUN, kind_prefix="job.exited")[0]
    assert life.of_exit(store, RUN, first).outcome == "requeued"


def test_a_requeue_says_to_track_the_next_attempt_not_to_resume_elsewhere() -> None:
    from controller.runs.explain import next_command

    requeued = ev(5, "job.preempted", "warn", reason="requeued", group="train-81")
    assert next_command(requeued, host="login") == "rgt track login train-81"
    assert next_command(ev(5, "job.preempted", "warn", reason="requeued", group="$(x)"), host="login") == \
        f"rgt track login {RUN}"
    plain = ev(5, "job.preempted", "warn", reason="time_limit")
    assert next_command(plain, host="login").startswith(f"rgt pull {RUN}")
