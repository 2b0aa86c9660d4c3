"""controller.wake.watch and `rgt watch`: every exit code, against a real store file."""
from __future__ import annotations

import json
import shlex
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence

import pytest
from click.testing import CliRunner, Result

from controller.cli import watch as cli_watch
from controller.cli.base import RgtGroup
from controller.store.db import Store
from controller.wake.watch import WatchResult, live_runs, watch
from protocol import Event

RUN = "train-7f3a"
OTHER = "train-b2c4"
WAIT_S = 10.0   # an upper bound for anything awaited; a broken feature ends a test by exit 3, not a hang
T0 = 1_700_000_000.0
NAN = dict(state="onset", name="loss", value="nan", step=350, source="metrics")


def ev(seq: int, kind: str = "heartbeat", sev: str = "info", run: str = RUN, **data: Any) -> Event:
    return Event(run=run, host="box1", seq=seq, ts=time.time() - 100 + seq, kind=kind, sev=sev, data=data)


@pytest.fixture
def store(home: Path) -> Iterator[Store]:
    with Store.open() as s:
        s.upsert_run(RUN, host="box1")
        s.apply(RUN, [ev(1, "sidecar.started"), ev(2, "job.started", pid=42), ev(3, "heartbeat")], 3)
        yield s


def run_watch(store: Store, runs: Sequence[str] = (RUN,), **kw: Any) -> WatchResult:
    kw.setdefault("timeout_s", WAIT_S)
    kw.setdefault("poll_s", 0.01)
    return watch(store, runs, **kw)


class Later:
    """Applies events from another connection once the watch is polling (its first sleep)."""

    def __init__(self, run: str, events: List[Event], cursor: int) -> None:
        self.polling = threading.Event()
        self.done = threading.Event()
        self.error: List[BaseException] = []
        self.thread = threading.Thread(target=self._apply, args=(run, events, cursor), name="later")

    def _apply(self, run: str, events: List[Event], cursor: int) -> None:
        try:
            if not self.polling.wait(WAIT_S):
                raise AssertionError("the watch never started polling")
            with Store.open() as other:
                other.apply(run, events, cursor)
        except BaseException as e:  # handed to the test thread
            self.error.append(e)
        finally:
            self.done.set()

    def sleep(self, seconds: float) -> None:
        self.polling.set()
        self.done.wait(seconds)   # the poll interval (and no longer than the apply takes)

    def __enter__(self) -> Later:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.polling.set()
        self.thread.join(WAIT_S)
        assert not self.error, self.error


# ---- 10: a material event ------------------------------------------------------------


def test_a_nan_stored_while_watching_wakes_with_exit_10(store: Store) -> None:
    calls: List[str] = []
    with Later(RUN, [ev(4, "train.nonfinite", "critical", **NAN)], 4) as later:
        result = run_watch(store, sleep=later.sleep, ensure_watcher=calls.append)
    assert result.exit_code == 10
    r = result.record
    assert set(r) >= {"exit", "run", "event", "explain", "next", "woke_at"}
    assert r["exit"] == 10 and r["run"] == RUN and r["event"]["seq"] == 4
    assert r["explain"] == "loss is NaN at step 350 (metrics)"
    assert r["next"] == f"rgt events {RUN} --kind train."
    assert calls == [RUN]
    assert "seq:4" in store.woken(RUN)
    json.dumps(r, allow_nan=False)


def test_the_same_event_does_not_end_the_next_watch(store: Store) -> None:
    store.apply(RUN, [ev(4, "train.nonfinite", "critical", **NAN)], 4)
    assert run_watch(store).exit_code == 10
    again = run_watch(store, timeout_s=0.2)
    assert again.exit_code == 3


def test_a_late_watcher_still_learns_of_an_earlier_nan(store: Store) -> None:
    store.apply(RUN, [ev(4, "train.nonfinite", "critical", **NAN), ev(5, "heartbeat")], 5)
    result = run_watch(store)
    assert result.exit_code == 10 and result.record["event"]["seq"] == 4


def test_the_worst_pending_event_is_reported_first(store: Store) -> None:
    store.apply(RUN, [ev(4, "gpu.throttle", "warn", gpu=0, state="onset"),
                      ev(5, "train.nonfinite", "critical", **NAN)], 5)
    first = run_watch(store)
    assert first.record["event"]["seq"] == 5 and first.record["pending"] == 1
    assert run_watch(store).record["event"]["seq"] == 4


def test_an_event_repaired_into_a_gap_below_seen_ones_still_wakes(store: Store) -> None:
    store.apply(RUN, [ev(5, "heartbeat")], 3)   # seq 5 lands ahead of the repair of 4
    with Later(RUN, [ev(4, "train.nonfinite", "critical", **NAN)], 5) as later:
        result = run_watch(store, from_now=True, sleep=later.sleep)
    assert result.exit_code == 10 and result.record["event"]["seq"] == 4


def test_a_flapping_condition_wakes_once(store: Store) -> None:
    store.apply(RUN, [ev(4, "train.nonfinite", "critical", **NAN),
                      ev(5, "train.nonfinite", "info", **{**NAN, "state": "cleared"}),
                      ev(6, "train.nonfinite", "critical", **{**NAN, "step": 380})], 6)
    first = run_watch(store)
    assert first.exit_code == 10 and first.record["event"]["seq"] == 4
    assert run_watch(store, timeout_s=0.2).exit_code == 3
    assert "absorbed:seq:6" in store.woken(RUN)
    # outside the flap window it wakes again
    store.apply(RUN, [ev(7, "train.nonfinite", "critical", **NAN)], 7)
    later = run_watch(store, policy_overrides={"flap_window_s": 0})
    assert later.exit_code == 10 and later.record["event"]["seq"] == 7


def test_sidecar_silent_from_the_controller_wakes(store: Store) -> None:
    store.add_local_event(RUN, "sidecar.silent", "warn",
                          {"state": "onset", "silent_s": 91.0, "heartbeat_interval_s": 30.0})
    result = run_watch(store)
    assert result.exit_code == 10
    assert result.record["event"]["kind"] == "sidecar.silent" and result.record["event"]["seq"] is None
    assert "no heartbeat for 3 intervals" in result.record["explain"]


# ---- policy ---------------------------------------------------------------------------


def test_mute_add_and_min_sev_from_the_overrides_and_the_store(store: Store) -> None:
    store.apply(RUN, [ev(4, "gpu.throttle", "warn", gpu=0, state="onset")], 4)
    assert run_watch(store, timeout_s=0.2, policy_overrides={"mute": ["gpu."]}).exit_code == 3
    assert run_watch(store, timeout_s=0.2, policy_overrides={"min_sev": "critical"}).exit_code == 3
    store.set_policy("*", {"min_sev": "critical"})
    assert run_watch(store, timeout_s=0.2).exit_code == 3
    store.set_policy(RUN, {"min_sev": "warn"})   # the run's own layer is more specific
    assert run_watch(store).record["event"]["seq"] == 4
    store.apply(RUN, [ev(5, "ckpt.saved", path="checkpoints/a.pt", step=10)], 5)
    assert run_watch(store, timeout_s=0.2).exit_code == 3
    added = run_watch(store, policy_overrides={"add": ["ckpt.saved"]})
    assert added.exit_code == 10 and added.record["event"]["kind"] == "ckpt.saved"


def _window_around(t: float) -> str:
    lt = time.localtime(t)
    start = (lt.tm_hour * 60 + lt.tm_min - 30) % 1440
    end = (start + 60) % 1440
    return f"{start // 60:02d}:{start % 60:02d}-{end // 60:02d}:{end % 60:02d}"


def test_quiet_hours_hold_a_warning_until_they_end(store: Store) -> None:
    store.apply(RUN, [ev(4, "gpu.throttle", "warn", gpu=0, state="onset")], 4)
    quiet = {"quiet": [_window_around(T0)]}
    assert run_watch(store, timeout_s=0.2, now=lambda: T0, policy_overrides=quiet).exit_code == 3
    clock = {"t": T0}

    def sleep(seconds: float) -> None:
        clock["t"] = T0 + 3 * 3600   # the quiet hours end while the watch waits

    result = run_watch(store, now=lambda: clock["t"], sleep=sleep, policy_overrides=quiet)
    assert result.exit_code == 10 and result.record["event"]["seq"] == 4
    store.apply(RUN, [ev(5, "gpu.lost", "critical", gpu=0, evidence="sample")], 5)
    critical = run_watch(store, now=lambda: T0, policy_overrides=quiet)
    assert critical.exit_code == 10 and critical.record["event"]["seq"] == 5


# ---- --from-now ---------------------------------------------------------------------


def test_from_now_ignores_what_was_stored_before(store: Store) -> None:
    store.apply(RUN, [ev(4, "train.nonfinite", "critical", **NAN)], 4)
    assert run_watch(store, timeout_s=0.2, from_now=True).exit_code == 3
    with Later(RUN, [ev(5, "gpu.lost", "critical", gpu=0, evidence="sample")], 5) as later:
        result = run_watch(store, from_now=True, sleep=later.sleep)
    assert result.exit_code == 10 and result.record["event"]["seq"] == 5
    assert "seq:4" not in store.woken(RUN)  # still unreported: a later plain watch tells it
    assert run_watch(store).record["event"]["seq"] == 4


# ---- 0: finished cleanly ------------------------------------------------------------


def test_a_clean_exit_ends_with_0_and_then_there_is_nothing_to_watch(store: Store) -> None:
    with Later(RUN, [ev(4, "job.exited", code=0, final_ok=True)], 4) as later:
        result = run_watch(store, sleep=later.sleep)
    assert result.exit_code == 0
    assert result.record["exit"] == 0 and result.record["event"]["kind"] == "job.exited"
    assert "finished cleanly" in result.record["explain"]
    after = run_watch(store)
    assert after.exit_code == 0 and after.record["ended"][RUN]["ok"] is True
    assert after.record["already_reported"] is True and "nothing more to watch" in after.record["status"]


def test_a_material_event_before_a_clean_exit_is_reported_first(store: Store) -> None:
    store.apply(RUN, [ev(4, "gpu.throttle", "warn", gpu=0, state="onset"), ev(5, "job.exited", code=0)], 5)
    assert run_watch(store).exit_code == 10
    assert run_watch(store).exit_code == 0


def test_a_failed_exit_wakes_with_10(store: Store) -> None:
    store.apply(RUN, [ev(4, "job.exited", "warn", code=3, final_ok=False)], 4)
    result = run_watch(store)
    assert result.exit_code == 10 and "code 3" in result.record["explain"]
    # the run is over: the next watch ends at once, and never with a 0 that reads as success
    again = run_watch(store)
    assert again.exit_code == 10 and again.record["already_reported"] is True
    assert again.record["ended"][RUN]["ok"] is False and again.record["event"]["seq"] == 4


def test_a_run_that_ended_before_a_from_now_watch_is_reported_at_once(store: Store) -> None:
    store.apply(RUN, [ev(4, "job.exited", "warn", code=3, final_ok=False)], 4)
    result = run_watch(store, from_now=True)
    assert result.exit_code == 10 and result.record["already_reported"] is False
    store.apply(RUN, [ev(5, "sidecar.stopping")], 5)
    assert run_watch(store, from_now=True).exit_code == 10


# ---- 3: timeout ---------------------------------------------------------------------


def test_timeout_with_nothing_material_is_3_with_a_short_status(store: Store) -> None:
    store.apply(RUN, [ev(4, "train.progress", step=120, scalars={"loss": 0.5})], 4)
    started = time.monotonic()
    result = run_watch(store, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - started < WAIT_S
    assert result.exit_code == 3
    r = result.record
    assert r["exit"] == 3 and r["run"] == RUN and r["runs"] == [RUN]
    assert r["status"][RUN].startswith("running, step 120, loss 0.5")


# ---- 4: link down ---------------------------------------------------------------------


def test_a_link_down_past_its_budget_is_4_and_says_nothing_about_the_job(store: Store) -> None:
    store.add_local_event(RUN, "link.lost", "warn", {"reason": "ssh: timeout"}, ts=time.time() - 10)
    result = run_watch(store, policy_overrides={"link_budget_s": 1})
    assert result.exit_code == 4
    r = result.record
    assert r["link"] == "down" and "NOTHING about the job" in r["explain"]
    assert r["next"].startswith(f"rgt status {RUN}")
    # the next watch counts the budget again from that report instead of ending at once
    assert run_watch(store, timeout_s=0.3, policy_overrides={"link_budget_s": 5}).exit_code == 3


ODD = "x'; rm -rf ~ $(id) `id`"   # an id an older rgt may have stored: any string at all


def test_the_next_command_quotes_a_run_id_the_shell_would_misread(store: Store) -> None:
    store.upsert_run(ODD, host="box1")
    store.apply(ODD, [ev(1, "sidecar.started", run=ODD), ev(2, "job.started", run=ODD, pid=7)], 2)
    store.add_local_event(ODD, "link.lost", "warn", {"reason": "eof"}, ts=time.time() - 10)
    down = run_watch(store, [ODD], policy_overrides={"link_budget_s": 1})
    assert down.exit_code == 4
    assert shlex.split(down.record["next"].split(",")[0]) == ["rgt", "status", ODD]
    store.apply(ODD, [ev(3, "job.exited", "warn", run=ODD, code=1)], 3)
    failed = run_watch(store, [ODD])
    assert failed.exit_code == 10
    first = failed.record["next"].split(",")[0]
    assert shlex.split(first)[-1] == ODD and first.startswith("rgt ")


def test_a_restored_link_is_not_down(store: Store) -> None:
    store.add_local_event(RUN, "link.lost", "warn", {}, ts=time.time() - 10)
    store.add_local_event(RUN, "link.restored", "info", {}, ts=time.time() - 5)
    assert run_watch(store, timeout_s=0.2, policy_overrides={"link_budget_s": 1}).exit_code == 3


# ---- --all ----------------------------------------------------------------------------


def test_all_watches_only_runs_that_have_not_ended(store: Store) -> None:
    store.upsert_run(OTHER, host="box2")
    store.apply(OTHER, [ev(1, "job.started", run=OTHER), ev(2, "job.exited", "warn", run=OTHER, code=1)], 2)
    assert live_runs(store) == [RUN]
    store.apply(RUN, [ev(4, "gpu.lost", "critical", gpu=0, evidence="sample")], 4)
    result = watch(store, all_runs=True, timeout_s=WAIT_S, poll_s=0.01)
    assert result.exit_code == 10 and result.record["run"] == RUN


def test_all_with_nothing_live_is_0(store: Store) -> None:
    store.apply(RUN, [ev(4, "sidecar.stopping")], 4)
    result = watch(store, all_runs=True, timeout_s=WAIT_S)
    assert result.exit_code == 0 and result.record["runs"] == []
    assert "nothing to watch" in result.record["status"]


def test_runs_and_all_together_are_refused(store: Store) -> None:
    with pytest.raises(ValueError):
        watch(store, [RUN], all_runs=True)
    with pytest.raises(ValueError):
        watch(store, [])


# ---- the command ----------------------------------------------------------------------


def invoke(args: List[str]) -> Result:
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]  # click 8.1
    except TypeError:
        runner = CliRunner()                    # click 8.2+: stderr is apart already
    return runner.invoke(cli_watch.watch_command, args, catch_exceptions=False)


def one_json_line(result: Result) -> Dict[str, Any]:
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    obj: Dict[str, Any] = json.loads(lines[0])
    return obj


@pytest.mark.parametrize("args, message", [
    ([], "give a run id, or --all"),
    ([RUN, "--all"], "give run ids or --all, not both"),
    ([RUN, "--timeout", "5x"], "not a duration"),
    ([RUN, "--min-sev", "loud"], "min_sev must be one of"),
    ([RUN, "--link-budget", "soon"], "not a duration"),
    ([RUN, "--mute", "job.exited"], "cannot be muted"),
    (["no-such-run"], "no run 'no-such-run'"),
])
def test_usage_errors_exit_2_with_one_json_line(store: Store, args: List[str], message: str) -> None:
    result = invoke(args)
    assert result.exit_code == 2, result.output
    obj = one_json_line(result)
    assert obj["exit"] == 2 and message in obj["error"]


def test_the_command_prints_one_json_line_and_a_sentence(store: Store) -> None:
    store.apply(RUN, [ev(4, "train.nonfinite", "critical", **NAN)], 4)
    result = invoke([RUN[:8]])   # a unique prefix names the run
    assert result.exit_code == 10
    obj = one_json_line(result)
    assert obj["event"]["seq"] == 4 and obj["run"] == RUN
    assert "woke: loss is NaN at step 350 (metrics)" in result.stderr


def test_the_command_with_json_and_a_timeout(store: Store) -> None:
    result = invoke([RUN, "--timeout", "0.3s", "--json"])
    assert result.exit_code == 3
    assert one_json_line(result)["exit"] == 3
    assert result.stderr == ""


def test_help_states_the_exit_codes() -> None:
    text = CliRunner().invoke(cli_watch.watch_command, ["--help"]).output
    for code in ("10", " 0", " 3", " 4", " 2", " 1"):
        assert f"{code}  " in text
    assert "--from-now" in text



def test_exit_codes_pass_through_the_rgt_group(store: Store) -> None:
    rgt = RgtGroup("rgt")   # how controller/cli/main.py serves the command
    rgt.add_command(cli_watch.watch_command)
    store.apply(RUN, [ev(4, "train.nonfinite", "critical", **NAN)], 4)
    woke = CliRunner().invoke(rgt, ["watch", RUN, "--json"])
    assert woke.exit_code == 10 and json.loads(woke.stdout)["event"]["seq"] == 4
    usage = CliRunner().invoke(rgt, ["watch", RUN, "--timeout", "soon"])
    assert usage.exit_code == 2 and "error: 'soon' is not a duration" in usage.output
    timeout = CliRunner().invoke(rgt, ["watch", RUN, "--timeout", "0.2", "--json"])
    assert timeout.exit_code == 3
