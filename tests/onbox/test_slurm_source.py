"""onbox/sources/slurm.py: the job's ids from the environment, and why Slurm ends a job, read from
what `scontrol show job -o` said at the signal in each case (measured on Slurm 22.05, tests/slurm)."""
from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import pytest

from onbox.custody.preempt import PreemptWatch, record_preemption
from onbox.sources import slurm

T0 = time.mktime(time.strptime("2026-12-04T04:20:39", "%Y-%m-%dT%H:%M:%S"))


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def show(state: str, restarts: int, start: float, end: float, limit: str) -> Dict[str, str]:
    text = (f"JobId=7 JobName=train UserId=root(0) JobState={state} Reason=None Dependency=(null) "
            f"Requeue=1 Restarts={restarts} BatchFlag=1 RunTime=00:00:29 TimeLimit={limit} "
            f"StartTime={stamp(start)} EndTime={stamp(end)} Partition=debug Command=/x/train.sbatch")
    return slurm.fields(text)


@pytest.mark.parametrize("case,fields,reason,grace", [
    # scontrol requeue: COMPLETING at once, Restarts already 1 -> KillWait
    ("requeue", show("COMPLETING", 1, T0, T0 + 86400, "1-00:00:00"), "requeued", 10.0),
    # scancel: COMPLETING, no restart
    ("scancel", show("COMPLETING", 0, T0, T0 + 86400, "1-00:00:00"), "cancelled", 10.0),
    ("cancelled", show("CANCELLED", 0, T0, T0 + 86400, "1-00:00:00"), "cancelled", 10.0),
    # --time=1 --signal=TERM@30: RUNNING, EndTime = StartTime + 1 min, 30 s left -> 30 + KillWait
    ("warning", show("RUNNING", 0, T0, T0 + 60, "00:01:00"), "time_limit", 40.0),
    # ... read while slurmctld still delivers it (a loaded machine): RUNNING with a flag
    ("signaling", show("SIGNALING", 0, T0, T0 + 60, "00:01:00"), "time_limit", 40.0),
    ("timeout", show("TIMEOUT", 0, T0, T0 + 60, "00:01:00"), "time_limit", 10.0),
    # partition preemption, GraceTime: RUNNING, EndTime pulled in to 11 s from now
    ("grace", show("RUNNING", 0, T0, T0 + 41, "1-00:00:00"), "preempted", 21.0),
    ("preempted", show("PREEMPTED", 0, T0, T0 + 41, "1-00:00:00"), "preempted", 10.0),
    # scancel --signal=TERM with a day left: nobody can say why
    ("signal", show("RUNNING", 0, T0, T0 + 86400, "1-00:00:00"), "signalled", None),
    ("unlimited", show("RUNNING", 0, T0, T0 + 86400, "UNLIMITED"), "signalled", None),
])
def test_each_way_slurm_ends_a_job_is_told_apart(case: str, fields: Dict[str, str], reason: str,
                                                 grace: Optional[float]) -> None:
    got = slurm.classify(fields, 0, T0 + 30, 10.0)
    assert got is not None, case
    assert (got["reason"], got["grace_s"]) == (reason, grace), case
    assert got["by"] and got["state"] == fields["JobState"]


def test_a_requeued_job_counts_restarts_from_its_own_attempt() -> None:
    again = show("RUNNING", 1, T0, T0 + 86400, "1-00:00:00")
    assert slurm.classify(again, 1, T0 + 30, 10.0)["reason"] == "signalled"   # attempt 2, no new requeue
    assert slurm.classify(again, 0, T0 + 30, 10.0)["reason"] == "requeued"


@pytest.mark.parametrize("text", ["", "JobState=running", "JobState=RUNNING;rm Restarts=x",
                                  "JobId=1 JobState=" + "A" * 40])
def test_odd_scontrol_output_gives_nothing_or_an_unknown_reason(text: str) -> None:
    got = slurm.classify(slurm.fields(text), 0, T0, None)
    assert got is None or (got["reason"] == "signalled" and got["grace_s"] is None)


@pytest.mark.parametrize("value,seconds", [
    ("1-00:00:00", 86400.0), ("00:01:00", 60.0), ("02:00:00", 7200.0), ("30:00", 1800.0), ("5", 300.0),
    ("2-12", 216000.0), ("1-02:03", 93780.0), ("UNLIMITED", None), ("Partition_Limit", None), ("", None),
    ("1:2:3:4", None)])
def test_time_limits_in_every_form_scontrol_prints(value: str, seconds: Optional[float]) -> None:
    assert slurm.parse_limit(value) == seconds


def test_times_and_ids_are_checked_before_use() -> None:
    assert slurm.parse_time("Unknown") is None and slurm.parse_time("2026-13-40T99:00:00") is None
    assert slurm.parse_time(stamp(T0)) == T0
    assert slurm.from_env({}) is None
    assert slurm.from_env({"SLURM_JOB_ID": "12; rm -rf /"}) is None
    job = slurm.from_env({"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "2"})
    assert job == slurm.SlurmJob("12", "0", 2)
    assert slurm.from_env({"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "$(x)", "SLURM_RESTART_COUNT": "-1"}) == \
        slurm.SlurmJob("12", None, 0)
    assert slurm.from_record(job.to_dict()) == job
    for evil in (None, [], {"name": "slurm", "job_id": "1 2"}, {"name": "pbs", "job_id": "1"},
                 {"name": "slurm", "job_id": 12}):
        assert slurm.from_record(evil) is None


class FakeScontrol:
    """`run` for the module: answers scontrol and scancel as a cluster would, and keeps the calls."""

    def __init__(self, job_text: str = "", config: str = "KillWait                = 10 sec\n",
                 rc: int = 0, fail: Optional[BaseException] = None) -> None:
        self.job_text, self.config, self.rc, self.fail = job_text, config, rc, fail
        self.calls: List[List[str]] = []

    def __call__(self, argv: List[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert kwargs.get("timeout") and not kwargs.get("shell")
        self.calls.append(list(argv))
        if self.fail is not None:
            raise self.fail
        out = self.config if argv[1:3] == ["show", "config"] else self.job_text
        return subprocess.CompletedProcess(argv, self.rc, out, "")


def test_why_stopped_asks_scontrol_and_survives_its_failures() -> None:
    now = time.time()
    text = f"JobId=7 JobState=COMPLETING Restarts=1 StartTime={stamp(now - 5)} EndTime={stamp(now)} " \
           "TimeLimit=1-00:00:00"
    fake = FakeScontrol(text)
    got = slurm.why_stopped(slurm.SlurmJob("7", "0", 0), run=fake)
    assert got is not None and (got["reason"], got["grace_s"]) == ("requeued", 10.0)
    assert fake.calls == [["scontrol", "show", "job", "-o", "7"], ["scontrol", "show", "config"]]
    assert slurm.why_stopped(slurm.SlurmJob("7", "0", 0), run=FakeScontrol(text, rc=1)) is None
    assert slurm.why_stopped(slurm.SlurmJob("7", "0", 0),
                             run=FakeScontrol(fail=subprocess.TimeoutExpired("scontrol", 5))) is None
    assert slurm.why_stopped(slurm.SlurmJob("7", "0", 0), run=FakeScontrol(fail=FileNotFoundError())) is None
    assert slurm.kill_wait(FakeScontrol(config="KillWait = many\n")) is None


def test_scancel_ends_only_the_step() -> None:
    fake = FakeScontrol()
    assert slurm.scancel_step(slurm.SlurmJob("7", "0", 0), run=fake)
    assert fake.calls == [["scancel", "--signal=TERM", "7.0"]]
    assert not slurm.scancel_step(slurm.SlurmJob("7", None, 0), run=fake)   # never the whole job
    assert not slurm.scancel_step(slurm.SlurmJob("7", "0", 0), run=FakeScontrol(rc=1))


def test_the_watch_reports_slurms_reason_and_grace_and_keeps_the_reason(tmp_path: Path) -> None:
    calls: List[Tuple[str, Dict[str, Any]]] = []

    def emit(kind: str, data: Optional[Mapping[str, Any]], sev: Optional[str]) -> None:
        calls.append((kind, dict(data or {})))

    seen = {"reason": "time_limit", "by": "Slurm's time limit", "grace_s": 40.0, "state": "RUNNING",
            "restarts": 0, "end_time": "2026-12-04T04:21:39"}
    job = slurm.SlurmJob("7", "0", 0)
    watch = PreemptWatch(tmp_path, emit, lambda _t: None, scheduler=job, group="train-7",
                         ask_slurm=lambda _j: seen)
    record_preemption(tmp_path, signal.SIGTERM, 30.0, 77)   # 30: the profile's default grace
    watch.run()
    (kind, data), = calls
    assert kind == "job.preempted"
    assert (data["reason"], data["grace_s"], data["grace_from"], data["group"]) == (
        "time_limit", 40.0, "slurm", "train-7")
    assert data["scheduler"] == {**job.to_dict(), "state": "RUNNING", "restarts": 0,
                                 "end_time": "2026-12-04T04:21:39"}
    assert watch.reason() == "time_limit"
    again = PreemptWatch(tmp_path, emit, lambda _t: None, scheduler=job, ask_slurm=lambda _j: None)
    assert again.reason() == "time_limit"   # a restarted sidecar still knows it for job.exited


def test_without_an_answer_the_profiles_grace_stands(tmp_path: Path) -> None:
    calls: List[Dict[str, Any]] = []

    def broken(_job: slurm.SlurmJob) -> Optional[Dict[str, Any]]:
        raise RuntimeError("scontrol exploded")

    watch = PreemptWatch(tmp_path, lambda _k, d, _s: calls.append(dict(d or {})), lambda _t: None,
                         scheduler=slurm.SlurmJob("7", "0", 0), ask_slurm=broken)
    record_preemption(tmp_path, signal.SIGTERM, 30.0, 77)
    watch.run()
    assert (calls[0]["grace_s"], calls[0]["grace_from"], calls[0].get("reason")) == (30.0, "profile", None)
    assert watch.reason() is None
