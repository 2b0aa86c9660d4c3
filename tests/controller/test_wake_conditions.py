"""controller.wake.policy: wake keys are conditions, not events (pure logic, no store).

A condition that woke wakes again only when it re-opens after a clear or escalates; one made
moot by a later, graver event never wakes; the dead-man's warnings are keyed by their lease;
a job exit is judged with controller.runs.life (a stop by request is not a failure).
"""
from __future__ import annotations

import shlex
from typing import Any, Dict, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller import kinds
from controller.runs import explain, life
from controller.store.db import LocalEvent
from controller.wake import policy as wake
from controller.wake.policy import Context, Policy, judge
from protocol import Event

RUN = "train-7f3a"
NOW = 1_700_000_000.0
P = Policy()
ODD = "x'; rm -rf ~ $(id) `id`"


def ev(seq: int, kind: str, sev: str = "warn", run: str = RUN, **data: Any) -> Event:
    return Event(run=run, host="box1", seq=seq, ts=NOW - 1000 + seq, kind=kind, sev=sev, data=data)


def local(id: int, kind: str, sev: str = "warn", **data: Any) -> LocalEvent:
    return LocalEvent(id=id, run=RUN, ts=NOW - 1000 + id, kind=kind, sev=sev, data=data)


def verdict(event: Any, woken: Any = None, history: Sequence[Any] = (), others: Sequence[Any] = (),
            lease: Any = None, policy: Policy = P) -> str:
    ctx = Context(history=tuple(history), others=tuple(others), lease=lease)
    return judge(event, policy, NOW, woken or {}, context=ctx).reason


THROTTLE: Dict[str, Any] = dict(gpu=0, reasons=["hw_slowdown"])


# ---- re-open after a clear ----------------------------------------------------------------


def test_a_woken_condition_that_never_cleared_stays_open_whatever_the_flap_window() -> None:
    first = ev(4, "gpu.throttle", state="onset", **THROTTLE)
    again = ev(9, "gpu.throttle", state="onset", **THROTTLE)
    woken = {"seq:4": NOW - 7200, "cond:gpu.throttle:0": NOW - 7200}
    assert verdict(again, woken, [first], policy=Policy(flap_window_s=0)) == "open"
    # without the history (a caller that did not read it) the flap window alone decides, as before
    assert judge(again, Policy(flap_window_s=0), NOW, woken).reason == "wake"


def test_it_wakes_again_after_a_clear_once_the_flap_window_passed() -> None:
    first = ev(4, "gpu.throttle", state="onset", **THROTTLE)
    clear = ev(6, "gpu.throttle_cleared", "info", gpu=0)
    again = ev(9, "gpu.throttle", state="onset", **THROTTLE)
    woken = {"seq:4": NOW - 60, "cond:gpu.throttle:0": NOW - 60}
    assert verdict(again, woken, [first, clear]) == "flapping"          # re-opened, inside the window
    assert verdict(again, woken, [first, clear], policy=Policy(flap_window_s=30)) == "wake"
    assert wake.reopened(again, [first, clear], woken)
    assert not wake.reopened(again, [first], woken)
    # a clear of another GPU is not a clear of this one
    other = ev(6, "gpu.throttle_cleared", "info", gpu=1)
    assert not wake.reopened(again, [first, other], woken)


def test_a_clear_before_the_wake_does_not_count() -> None:
    clear = ev(3, "gpu.throttle_cleared", "info", gpu=0)
    first = ev(4, "gpu.throttle", state="onset", **THROTTLE)
    again = ev(9, "gpu.throttle", state="onset", **THROTTLE)
    assert not wake.reopened(again, [clear, first], {"seq:4": NOW})


def test_an_escalation_wakes_even_while_its_onset_is_open() -> None:
    onset = ev(4, "mem.pressure", state="onset", used_pct=91.0)
    worse = ev(5, "mem.pressure", "critical", state="escalated", used_pct=98.0)
    oom = ev(6, "mem.pressure", "critical", state="oom_kill", oom_kill_delta=1)
    woken = {"seq:4": NOW, "cond:mem.pressure:": NOW}
    assert verdict(worse, woken, [onset]) == "wake"
    woken.update({"seq:5": NOW, "cond:mem.pressure::escalated": NOW})
    assert verdict(oom, woken, [onset, worse]) == "wake"
    assert kinds.condition_key(oom) == "cond:mem.pressure::oom_kill"


# ---- superseded by a graver event -----------------------------------------------------------


def test_an_onset_is_superseded_by_its_escalation_unless_it_cleared_between() -> None:
    onset = ev(4, "disk.low", path="/data", resource="bytes", state="onset")
    worse = ev(7, "disk.low", "critical", path="/data", resource="bytes", state="escalated")
    clear = ev(5, "disk.ok", "info", path="/data", resource="bytes", state="cleared")
    assert verdict(onset, others=[onset, worse]) == "superseded"
    assert wake.superseded(onset, [onset, worse]) is worse
    assert verdict(onset, others=[onset, clear, worse]) == "wake"
    other_disk = ev(7, "disk.low", "critical", path="/scratch", resource="bytes", state="escalated")
    assert verdict(onset, others=[onset, other_disk]) == "wake"
    assert verdict(worse, others=[onset, worse]) == "wake"   # the graver one itself wakes


@pytest.mark.parametrize("pressure", [
    dict(state="onset", used_pct=92.0),
    dict(state="escalated", used_pct=98.0),
    dict(state="oom_kill", oom_kill_delta=1),
])
def test_memory_pressure_is_superseded_by_the_oom_kill_it_led_to(pressure: Any) -> None:
    mem = ev(4, "mem.pressure", "warn", **pressure)
    oom_exit = ev(6, "job.exited", code=None, signal=9, oom_killed=True)
    assert "job.exited" in wake.supersede_kinds(mem)
    assert verdict(mem, others=[mem, oom_exit]) == "superseded"
    # reported after the exit (the counter is read late) it is still the same kill
    late = ev(8, "mem.pressure", "critical", state="oom_kill", oom_kill_delta=1)
    assert verdict(late, others=[oom_exit, late]) == "superseded"
    # an exit that was not an OOM kill leaves the warning standing
    assert verdict(mem, others=[mem, ev(6, "job.exited", code=1, oom_killed=False)]) == "wake"


def test_a_failed_verification_is_superseded_by_a_later_pass_only() -> None:
    failed = local(4, "verify.done", "warn", ok=False, dest="/runs/a")
    passed_later = local(6, "verify.done", "info", ok=True, dest="/runs/a")
    passed_before = local(2, "verify.done", "info", ok=True, dest="/runs/a")
    assert wake.supersede_kinds(failed) == ("verify.done",)
    assert verdict(failed, others=[failed, passed_later]) == "superseded"
    assert verdict(failed, others=[passed_before, failed]) == "wake"
    assert verdict(failed, others=[failed, local(7, "verify.done", "warn", ok=False)]) == "wake"
    assert wake.supersede_kinds(passed_later) == ()


def test_a_nan_is_superseded_by_the_exit_of_its_attempt_which_tells_it_as_the_cause() -> None:
    nan = ev(4, "train.nonfinite", "critical", state="onset", name="loss", value="nan", step=350,
             source="metrics")
    exited = ev(6, "job.exited", code=0, final_ok=True)
    assert verdict(nan, others=[nan, exited]) == "superseded"
    lived = life.exit_life(exited.data, nonfinite=True)
    found = judge(exited, P, NOW, {}, context=Context(life=lived, cause=nan)).wake
    assert found is not None and found.clean_exit is False
    record = found.record(NOW)
    assert record["exit"] == 10 and record["cause"]["seq"] == 4 and record["life"]["outcome"] == "nan"
    assert "non-finite: loss is NaN at step 350" in found.explain


# ---- the dead-man: keyed by its lease --------------------------------------------------------


def expiring(seq: int, renewed_at: float, minutes: int, trigger: str = "lease") -> Event:
    return ev(seq, "deadman.expiring", minutes_left=minutes, seconds_left=minutes * 60.0 - 10,
              trigger=trigger, key=f"deadman.expiring:{trigger}:{renewed_at!r}:{minutes}",
              ends_at=renewed_at + 7200, deadman_seq=seq)


def test_dead_man_warnings_are_keyed_by_the_lease_not_by_each_renewal() -> None:
    first, after_renewal = expiring(10, 1000.0, 30), expiring(20, 5000.0, 30)
    assert kinds.condition_key(first, "arm:3") == kinds.condition_key(after_renewal, "arm:3")
    assert kinds.condition_key(first, "arm:3") != kinds.condition_key(first, "arm:9")
    woken = {"seq:10": NOW - 7200, kinds.condition_key(first, "arm:3"): NOW - 7200}
    assert verdict(after_renewal, woken, [first], lease="arm:3") == "open"
    # a new arm is a new lease: it warns again
    assert verdict(after_renewal, woken, [first], lease="arm:9") == "wake"
    # the budget is a lease of its own
    assert verdict(expiring(21, 5000.0, 30, "budget"), woken, [first], lease="arm:3") == "wake"


def test_the_five_minute_warning_escalates_once_per_lease_and_supersedes_the_thirty() -> None:
    t30, t5 = expiring(10, 1000.0, 30), expiring(11, 1000.0, 5)
    assert kinds.condition_key(t5, "arm:3") == kinds.condition_key(t30, "arm:3") + ":escalated"
    assert verdict(t30, others=[t30, t5], lease="arm:3") == "superseded"
    woken = {"seq:11": NOW - 9000, kinds.condition_key(t5, "arm:3"): NOW - 9000}
    late = expiring(31, 9000.0, 5)          # renewed late again: the same lease's escalation
    assert verdict(late, woken, [t30, t5], lease="arm:3") == "open"


def test_the_expiry_itself_still_wakes_and_supersedes_its_warnings() -> None:
    t5 = expiring(11, 1000.0, 5)
    fired = ev(12, "deadman.fired", "critical", action="notify", outcome="notified", deadman_seq=12)
    assert verdict(t5, others=[t5, fired], lease="arm:3") == "superseded"
    woken = {"seq:11": NOW, kinds.condition_key(t5, "arm:3"): NOW}
    assert verdict(fired, woken, [], lease="arm:3") == "wake"


# ---- job exits judged with the run's life ----------------------------------------------------


def exit_wake(data: Any, stopped_by: Any = None) -> wake.Wake:
    exited = ev(9, "job.exited", **data)
    lived = life.exit_life(exited.data, stopped_by=stopped_by)
    found = judge(exited, P, NOW, {}, NOW - 1000 + 3, Context(life=lived, host="gpu 2")).wake
    assert found is not None
    return found


@pytest.mark.parametrize("data, by", [
    ({"code": 143}, "rgt stop"),                                   # the laptop's request
    ({"code": None, "signal": 15}, "rgt queue cancel"),
    ({"code": 0, "final_ok": True}, "rgt stop"),                   # saved, then exited 0
    ({"code": 143, "stop_requested": True}, None),                 # the box's own flag
    ({"code": 1, "stop_requested": True}, None),                   # torchrun's code 1 after the stop
])
def test_a_stop_by_request_ends_the_watch_with_0_and_stopped_by(data: Any, by: Any) -> None:
    found = exit_wake(data, by)
    record = found.record(NOW)
    assert found.clean_exit is True and record["exit"] == 0
    assert record["stopped_by"] == (by or "rgt stop") and record["life"]["state"] == "stopped"
    assert found.explain.startswith(f"the job was stopped by request ({by or 'rgt stop'}) and ended with ")
    assert "after 6 s" in found.explain
    assert "preempt" not in found.explain and "crash" not in found.explain


@pytest.mark.parametrize("data", [{"code": 143}, {"code": None, "signal": 15}, {"code": -15}])
def test_a_sigterm_nobody_asked_for_stays_a_preemption(data: Any) -> None:
    found = exit_wake(data)
    assert found.clean_exit is False and found.record(NOW)["exit"] == 10
    assert "stopped_by" not in found.record(NOW) and found.life is not None
    assert found.life.state == "preempted" and "no stop was asked for" in found.explain
    words = shlex.split(found.next)
    assert words[:3] == ["rgt", "pull", RUN] and words[3:] == ["&&", "rgt", "resume", RUN, "--on", "gpu 2",
                                                              "--dry-run"]


def test_without_a_life_an_exit_is_judged_as_before() -> None:
    found = judge(ev(9, "job.exited", code=3), P, NOW, {}).wake
    assert found is not None and found.clean_exit is False and found.life is None
    assert "life" not in found.record(NOW)


# ---- next is one shell line -----------------------------------------------------------------


@settings(max_examples=120, deadline=None, derandomize=True)
@given(run=st.text(min_size=1, max_size=30).filter(lambda s: "\x00" not in s and s.isprintable()),
       kind=st.sampled_from(["job.exited", "job.preempted", "train.nonfinite", "gpu.xid", "disk.low",
                             "deadman.expiring", "verify.done", "sidecar.degraded"]))
def test_every_next_command_is_one_line_a_shell_splits_back_to_the_run_id(run: str, kind: str) -> None:
    event = ev(5, kind, run=run, code=1)
    text = explain.next_command(event, host="box 1")
    assert "\n" not in text and ", then" not in text
    words = shlex.split(text)
    assert words[0] == "rgt" and run in words


def test_next_commands_quote_an_id_the_shell_would_misread() -> None:
    assert shlex.split(explain.next_command(ev(5, "job.exited", run=ODD, code=1))) == [
        "rgt", "status", ODD, "&&", "rgt", "pull", ODD]


def test_a_job_that_vanished_in_a_reboot_says_so() -> None:
    gone = ev(9, "job.exited", code=None, vanished=True, evidence={"rebooted": True, "exit_record": False})
    lived = life.exit_life(gone.data)
    found = judge(gone, P, NOW, {}, context=Context(life=lived)).wake
    assert found is not None and found.clean_exit is False and lived.state == "vanished"
    assert "the box rebooted under it" in found.explain
    plain = ev(9, "job.exited", code=None, vanished=True, evidence={"rebooted": False})
    assert "rebooted" not in explain.explain(plain)
