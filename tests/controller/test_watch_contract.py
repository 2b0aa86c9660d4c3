"""The wake contract of `rgt watch` on the common lives of a run, against a real store file.

Normal lives never wake: a stop by request, a clean run watched again and again, a failed
verification that then passed, late dead-man renewals, one run of several finishing. Every exit
prints one whole JSON line. Events that arrive while a watch polls are applied from another
store connection by the watch's own sleep (no threads, no timing).
"""
from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Sequence

import pytest
from click.testing import CliRunner, Result

from controller.cli import watch as cli_watch
from controller.cli.base import RgtGroup
from controller.queue import model as queue
from controller.runs import life
from controller.store.db import Store
from controller.wake.watch import WatchResult, watch
from protocol import Event

RUN = "train-7f3a"
OTHER = "train-b2c4"
WAIT_S = 10.0
KEYS = {"exit", "run", "event", "explain", "next"}


def ev(seq: int, kind: str = "heartbeat", sev: str = "info", run: str = RUN, **data: Any) -> Event:
    return Event(run=run, host="box1", seq=seq, ts=time.time() - 100 + seq, kind=kind, sev=sev, data=data)


def started(store: Store, run: str) -> None:
    store.upsert_run(run, host="box1")
    store.apply(run, [ev(1, "sidecar.started", run=run), ev(2, "job.started", run=run, pid=42),
                      ev(3, "heartbeat", run=run)], 3)


@pytest.fixture
def store(home: Path) -> Iterator[Store]:
    with Store.open() as s:
        started(s, RUN)
        yield s


class Steps:
    """A watch's sleep that applies the next batch from another connection at each poll."""

    def __init__(self, *batches: Callable[[Store], Any]) -> None:
        self.batches = list(batches)
        self.polls = 0

    def sleep(self, seconds: float) -> None:
        self.polls += 1
        if self.batches:
            with Store.open() as other:
                self.batches.pop(0)(other)


def apply(run: str, events: List[Event]) -> Callable[[Store], Any]:
    return lambda s: s.apply(run, events, max(e.seq for e in events))


def run_watch(store: Store, runs: Sequence[str] = (RUN,), **kw: Any) -> WatchResult:
    kw.setdefault("timeout_s", WAIT_S)
    kw.setdefault("poll_s", 0.01)
    return watch(store, runs, **kw)


def stop_requested(store: Store, run: str = RUN, by: str = "rgt stop") -> None:
    store.add_local_event(run, life.STOP_KIND, "info", {"by": by})


# ---- stopped by request ------------------------------------------------------------------


def test_a_stop_by_request_exits_0_with_stopped_by_and_so_does_every_later_watch(store: Store) -> None:
    stop_requested(store)
    steps = Steps(apply(RUN, [ev(4, "job.exited", "warn", code=143, signal=None)]),
                  apply(RUN, [ev(5, "sidecar.stopping")]))
    first = run_watch(store, sleep=steps.sleep)
    assert first.exit_code == 0, first.record
    r = first.record
    assert r["stopped_by"] == "rgt stop" and r["life"]["state"] == "stopped" and r["event"]["seq"] == 4
    assert r["ended"][RUN]["state"] == "stopped" and r["ended"][RUN]["ok"] is True
    assert "stopped by request (rgt stop)" in r["explain"] and "SIGTERM" in r["explain"]
    for _ in range(2):   # a second and a third watch: the same story, told as told before
        again = run_watch(store)
        assert again.exit_code == 0 and again.record["stopped_by"] == "rgt stop"
        assert again.record["already_reported"] is True and again.record["event"]["seq"] == 4


def test_the_box_own_stop_flag_counts_when_the_laptop_has_no_record(store: Store) -> None:
    store.apply(RUN, [ev(4, "job.exited", "warn", code=1, stop_requested=True)], 4)   # torchrun: code 1
    result = run_watch(store)
    assert result.exit_code == 0 and result.record["stopped_by"] == "rgt stop"


def test_a_sigterm_nobody_asked_for_is_still_a_preemption(store: Store) -> None:
    store.apply(RUN, [ev(4, "job.exited", "warn", code=143, signal=None)], 4)
    result = run_watch(store)
    assert result.exit_code == 10 and result.record["life"]["state"] == "preempted"
    assert "stopped_by" not in result.record
    assert shlex.split(result.record["next"])[3:6] == ["&&", "rgt", "resume"]
    assert run_watch(store).record["already_reported"] is True


def test_a_stop_request_of_an_earlier_attempt_does_not_cover_a_later_sigterm(store: Store) -> None:
    stop_requested(store)
    later = time.time() + 50   # the resumed attempt starts after the request
    store.apply(RUN, [ev(4, "job.exited", code=143),
                      Event(run=RUN, host="box1", seq=5, ts=later, kind="job.started", sev="info", data={}),
                      Event(run=RUN, host="box1", seq=6, ts=later + 1, kind="job.exited", sev="warn",
                            data={"code": 143})], 6)
    result = run_watch(store)
    assert result.exit_code == 10 and result.record["event"]["seq"] == 6
    assert result.record["life"]["state"] == "preempted"


# ---- clean and failed runs watched again ------------------------------------------------------


@pytest.mark.parametrize("from_now", [False, True])
def test_a_clean_run_whose_sidecar_stopped_after_the_exit_stays_0_on_every_watch(
        store: Store, from_now: bool) -> None:
    store.apply(RUN, [ev(4, "job.exited", code=0, final_ok=True), ev(5, "sidecar.stopping")], 5)
    results = [run_watch(store, from_now=from_now) for _ in range(3)]
    assert [r.exit_code for r in results] == [0, 0, 0]
    for r in results:
        assert "finished cleanly" in r.record["explain"] and "sidecar stopped" not in r.record["explain"]
        assert r.record["event"]["kind"] == "job.exited" and r.record["ended"][RUN]["state"] == "finished"
    assert results[2].record["already_reported"] is True


def test_a_failed_run_watched_again_is_10_and_already_reported(store: Store) -> None:
    store.apply(RUN, [ev(4, "job.exited", "warn", code=3), ev(5, "sidecar.stopping")], 5)
    first, second, third = (run_watch(store) for _ in range(3))
    assert first.exit_code == 10 and "already_reported" not in first.record
    for again in (second, third):
        assert again.exit_code == 10 and again.record["already_reported"] is True
        assert again.record["event"]["seq"] == 4 and "code 3" in again.record["explain"]


def test_a_nan_then_an_exit_wakes_once_on_the_exit_with_the_nan_as_its_cause(store: Store) -> None:
    nan: Dict[str, Any] = dict(state="onset", name="loss", value="nan", step=350, source="metrics")
    store.apply(RUN, [ev(4, "train.nonfinite", "critical", **nan), ev(5, "job.exited", code=0)], 5)
    first = run_watch(store)
    assert first.exit_code == 10 and first.record["event"]["seq"] == 5
    assert first.record["cause"]["seq"] == 4 and first.record["life"]["outcome"] == "nan"
    second = run_watch(store)
    assert second.exit_code == 10 and second.record["already_reported"] is True
    assert second.record["event"]["seq"] == 5   # not the NaN again


# ---- conditions, not events -------------------------------------------------------------------


def test_memory_pressure_never_wakes_after_the_oom_kill_it_led_to(store: Store) -> None:
    mem: Dict[str, Any] = dict(scope="cgroup", used_pct=95.0, used_bytes=95, limit_bytes=100)
    store.apply(RUN, [ev(4, "mem.pressure", "warn", state="onset", **mem)], 4)
    assert run_watch(store).record["event"]["seq"] == 4            # the warning, while the job runs
    store.apply(RUN, [ev(5, "job.exited", "warn", code=None, signal=9, oom_killed=True),
                      ev(6, "mem.pressure", "critical", state="oom_kill", oom_kill_delta=1, **mem)], 6)
    killed = run_watch(store)
    assert killed.exit_code == 10 and killed.record["event"]["seq"] == 5 and killed.record["pending"] == 0
    assert "absorbed:seq:6" in store.woken(RUN)
    later = run_watch(store)
    assert later.exit_code == 10 and later.record["event"]["seq"] == 5 and later.record["already_reported"]


def test_a_backlog_of_a_warning_and_its_oom_kill_wakes_once(store: Store) -> None:
    store.apply(RUN, [ev(4, "mem.pressure", "warn", state="onset", used_pct=95.0),
                      ev(5, "job.exited", "warn", code=137, oom_killed=True)], 5)
    assert run_watch(store).record["event"]["seq"] == 5
    assert run_watch(store).record["already_reported"] is True


def test_a_failed_verification_that_then_passed_wakes_nobody(store: Store) -> None:
    store.add_local_event(RUN, "verify.done", "warn", {"ok": False, "dest": "/runs/a"})
    store.add_local_event(RUN, "verify.done", "info", {"ok": True, "dest": "/runs/a"})
    assert run_watch(store, timeout_s=0.3).exit_code == 3


def test_a_failed_verification_alone_wakes_with_the_whole_line(store: Store) -> None:
    store.add_local_event(RUN, "verify.done", "warn", {"ok": False, "dest": "/runs/a"})
    result = invoke([RUN, "--json", "--timeout", "10s"])
    assert result.exit_code == 10
    line = one_json_line(result)
    assert KEYS | {"entry"} <= set(line) and line["event"]["kind"] == "verify.done"


def test_a_condition_wakes_again_only_after_it_cleared(store: Store) -> None:
    throttle: Dict[str, Any] = dict(gpu=0, reasons=["hw_slowdown"])
    flap0 = {"flap_window_s": 0}
    store.apply(RUN, [ev(4, "gpu.throttle", "warn", state="onset", **throttle)], 4)
    assert run_watch(store).record["event"]["seq"] == 4
    store.apply(RUN, [ev(5, "gpu.throttle", "warn", state="onset", **throttle)], 5)
    assert run_watch(store, timeout_s=0.3, policy_overrides=flap0).exit_code == 3
    assert "absorbed:seq:5" in store.woken(RUN)
    store.apply(RUN, [ev(6, "gpu.throttle_cleared", "info", gpu=0),
                      ev(7, "gpu.throttle", "warn", state="onset", **throttle)], 7)
    again = run_watch(store, policy_overrides=flap0)
    assert again.exit_code == 10 and again.record["event"]["seq"] == 7


def expiring(seq: int, renewed_at: float, minutes: int) -> Event:
    return ev(seq, "deadman.expiring", "warn", minutes_left=minutes, seconds_left=minutes * 60.0 - 5,
              trigger="lease", key=f"deadman.expiring:lease:{renewed_at!r}:{minutes}", deadman_seq=seq)


def test_late_dead_man_renewals_wake_once_per_warning_and_the_expiry_still_wakes(store: Store) -> None:
    store.apply(RUN, [ev(4, "deadman.armed", ttl_s=7200, deadman_seq=1), expiring(5, 1000.0, 30)], 5)
    assert run_watch(store).record["event"]["seq"] == 5
    renewed = ev(6, "deadman.renewed", late=True, deadman_seq=6)
    store.apply(RUN, [renewed, expiring(7, 3000.0, 30)], 7)     # renewed late: a new period, same lease
    assert run_watch(store, timeout_s=0.3, policy_overrides={"flap_window_s": 0}).exit_code == 3
    store.apply(RUN, [expiring(8, 3000.0, 5)], 8)               # the 5-minute warning escalates once
    assert run_watch(store).record["event"]["seq"] == 8
    store.apply(RUN, [ev(9, "deadman.renewed", late=True), expiring(10, 5000.0, 30),
                      expiring(11, 5000.0, 5)], 11)
    assert run_watch(store, timeout_s=0.3, policy_overrides={"flap_window_s": 0}).exit_code == 3
    store.apply(RUN, [ev(12, "deadman.fired", "critical", action="notify", outcome="notified")], 12)
    fired = run_watch(store)
    assert fired.exit_code == 10 and fired.record["event"]["kind"] == "deadman.fired"
    store.apply(RUN, [ev(13, "deadman.armed", ttl_s=7200, deadman_seq=13), expiring(14, 9000.0, 30)], 14)
    assert run_watch(store).record["event"]["seq"] == 14       # a new arm is a new lease


# ---- several runs, --all ------------------------------------------------------------------------


def test_all_ends_0_only_when_every_run_has_ended_and_says_how_each_did(store: Store) -> None:
    started(store, OTHER)
    stop_requested(store, OTHER, by="rgt queue cancel")
    steps = Steps(apply(RUN, [ev(4, "job.exited", code=0)]), lambda s: None,
                  apply(OTHER, [ev(4, "job.exited", "warn", run=OTHER, code=143)]))
    result = watch(store, all_runs=True, timeout_s=WAIT_S, poll_s=0.01, sleep=steps.sleep)
    assert result.exit_code == 0, result.record
    r = result.record
    assert steps.polls >= 3 and r["run"] == OTHER and r["stopped_by"] == "rgt queue cancel"
    assert {run: d["state"] for run, d in r["ended"].items()} == {RUN: "finished", OTHER: "stopped"}
    assert r["explain"].startswith("every watched run has ended well")
    assert run_watch(store).record["already_reported"] is True   # RUN's finish was recorded


def test_one_run_of_several_finishing_is_recorded_and_the_watch_goes_on(store: Store) -> None:
    started(store, OTHER)
    steps = Steps(apply(RUN, [ev(4, "job.exited", code=0)]))
    result = run_watch(store, [RUN, OTHER], timeout_s=0.5, sleep=steps.sleep)
    assert result.exit_code == 3 and result.record["runs"] == [OTHER]
    assert result.record["ended"][RUN]["state"] == "finished"
    assert "seq:4" in store.woken(RUN)
    assert run_watch(store).record["already_reported"] is True


def test_all_waits_for_queue_cells_that_have_not_launched(store: Store) -> None:
    queue.create(store, "sweep", ["box1"], [["python", "train.py"]], queue.Options(), time.time())
    store.apply(RUN, [ev(4, "job.exited", code=0)], 4)
    result = watch(store, all_runs=True, timeout_s=0.5, poll_s=0.01)
    assert result.exit_code == 3 and result.record["waiting"] == {"sweep#0": "pending"}
    assert "sweep#0 (pending)" in result.record["explain"]


# ---- the one JSON line ---------------------------------------------------------------------------


def invoke(args: List[str]) -> Result:
    rgt = RgtGroup("rgt")   # how controller/cli/main.py serves the command
    rgt.add_command(cli_watch.watch_command)
    rgt.add_command(cli_watch.status_command)
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]  # click 8.1
    except TypeError:
        runner = CliRunner()                    # click 8.2+: stderr is apart already
    return runner.invoke(rgt, ["watch", *args] if args[:1] != ["status"] else args)


def one_json_line(result: Result) -> Dict[str, Any]:
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    obj: Dict[str, Any] = json.loads(lines[0])
    assert KEYS | {"entry"} <= set(obj), obj
    assert obj["exit"] == result.exit_code
    return obj


def test_no_argument_is_a_plain_usage_line(store: Store) -> None:
    result = invoke([])
    assert result.exit_code == 2
    line = one_json_line(result)
    assert line["error"] == "give a run id, or --all" and "not both" not in result.stderr
    assert line["event"] is None and line["next"] == "rgt watch --help"


def test_the_timeout_line_is_whole_and_its_next_watches_again(store: Store) -> None:
    odd = "x'; rm -rf ~ $(id)"
    started(store, odd)
    result = invoke([odd, "--json", "--timeout", "0.3s"])
    assert result.exit_code == 3
    line = one_json_line(result)
    assert line["run"] == odd and line["event"] is None and line["entry"] is None
    assert line["explain"].startswith("nothing material happened in ")
    assert shlex.split(line["next"]) == ["rgt", "watch", odd]


@pytest.mark.parametrize("events, code, entry", [
    ([ev(4, "job.exited", code=0)], 0, "job-finished"),
    ([ev(4, "train.nonfinite", "critical", state="onset", name="loss", value="nan", step=3)], 10, "nan-loss"),
])
def test_wakes_carry_the_whole_line_with_the_entry(store: Store, events: List[Event], code: int,
                                                    entry: str) -> None:
    store.apply(RUN, events, 4)
    result = invoke([RUN, "--json"])
    assert result.exit_code == code
    assert one_json_line(result)["entry"] == entry


@pytest.mark.parametrize("error, code", [(RuntimeError("boom"), 1), (KeyboardInterrupt(), 130)])
def test_an_internal_error_and_an_interrupt_have_their_own_codes_and_a_whole_line(
        store: Store, monkeypatch: pytest.MonkeyPatch, error: BaseException, code: int) -> None:
    def broken(*args: Any, **kw: Any) -> WatchResult:
        raise error

    monkeypatch.setattr(cli_watch, "watch", broken)
    result = invoke([RUN, "--json"])
    assert result.exit_code == code, result.output
    line = one_json_line(result)
    assert line["event"] is None and line["run"] == RUN and "nothing was judged" in line["explain"]


def test_help_documents_every_exit_code() -> None:
    text = CliRunner().invoke(cli_watch.watch_command, ["--help"]).output
    for code in ("10", " 0", " 3", " 4", " 2", " 5", " 1", "130"):
        assert f"{code}  " in text
    assert "stopped_by" in text and '"entry"' in text


# ---- watchers end --------------------------------------------------------------------------------


def test_status_and_watch_start_watchers_only_for_runs_that_have_not_ended(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    started(store, OTHER)
    store.apply(OTHER, [ev(4, "job.exited", run=OTHER, code=0), ev(5, "sidecar.stopping", run=OTHER)], 5)
    calls: List[str] = []
    monkeypatch.setattr(cli_watch, "_watcher_starter", lambda s: calls.append)
    assert invoke(["status", OTHER, "--json"]).exit_code == 0
    assert calls == []
    assert invoke(["status", RUN, "--json"]).exit_code == 0
    assert calls == [RUN]
    calls.clear()
    run_watch(store, [RUN, OTHER], timeout_s=0.2, ensure_watcher=calls.append)
    assert calls == [RUN]
    assert cli_watch.needs_watcher(store, RUN) and not cli_watch.needs_watcher(store, OTHER)
