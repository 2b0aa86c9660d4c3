"""The dead-man judges time on the boot clock and on changes it saw, never on the wall clock.

Most tests drive `Daemon.tick` with fake clocks (tests/onbox/test_deadman.py's Box): the wall clock
is stepped on its own, hours either way, while the boot clock runs on; a tick is 10 s of boot time.
The box's rule: never fire early, and fire at most one tick after the lease's real end. The last
tests run the real daemon (real clocks) on a lease whose unix times lie by 3 h, which is what a
step of the box's clock looks like from the daemon, and a renewal written by another process.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onbox.deadman.clock import SYSTEM, LeaseTimer, Timebase
from onbox.deadman.daemon import Daemon, ensure_daemon
from onbox.deadman.lease import arm, read_events, read_lease
from tests.helpers import REPO, wait_until
from tests.onbox.test_deadman import B0, HOUR, T0, Box
from tests.onbox.test_deadman_daemon import Daemons, daemons, env_of  # noqa: F401 (a fixture)

TICK = 10.0
STEP = 3 * HOUR


def ticks(box: Box, daemon: Daemon, until_boot: float, each: Optional[Callable[[float], None]] = None,
          tick: float = TICK) -> Optional[float]:
    """Tick every `tick` boot seconds until `until_boot`; the boot time it fired at (None: never).
    `each(boot)` runs before each tick (a wall step, a renewal, a run writing)."""
    while box.clocks.boot_s <= until_boot:
        if each is not None:
            each(box.clocks.boot_s)
        if not daemon.tick():
            return box.clocks.boot_s
        box.clocks.boot_s += tick
        box.clocks.wall_s += tick
    return None


def fired_kinds(box: Box) -> List[str]:
    return [k for k in box.kinds() if k in ("deadman.firing", "deadman.fired")]


@pytest.fixture
def box(tmp_path: Path) -> Box:
    b = Box(tmp_path)
    b.environ["TEST_INSTANCE_ID"] = "i-1"
    return b


@pytest.mark.parametrize("step", [STEP, -STEP])
def test_a_wall_step_either_way_neither_fires_early_nor_late(box: Box, step: float) -> None:
    box.run("done", running=False, active_at=T0)
    box.arm()  # a 1 h lease, at boot B0

    def stepped(boot: float) -> None:
        if boot == B0 + 600:
            box.clocks.wall_s += step  # ten minutes in, NTP steps the clock

    fired = ticks(box, box.daemon(), B0 + 2 * HOUR, stepped)
    assert fired is not None and B0 + HOUR <= fired <= B0 + HOUR + TICK
    assert box.recorded() == ["stop i-1 key=none other=none"]
    warned = [r for r in read_events(box.paths) if r["kind"] == "deadman.expiring"]
    assert [w["data"]["minutes_left"] for w in warned] == [30, 5]
    for w in warned:  # said in the person's (stepped) wall time, ending at the real end
        assert abs(w["data"]["ends_at"] - (T0 + step + HOUR)) <= TICK


@pytest.mark.parametrize("step", [STEP, -STEP])
def test_renewals_hold_it_off_across_steps_and_it_fires_on_time_after_they_stop(
        box: Box, step: float) -> None:
    box.run("done", running=False, active_at=T0)
    box.arm()
    last: List[float] = []

    def controller(boot: float) -> None:
        if boot in (B0 + 5430, B0 + 3 * HOUR + 1230):  # a step between two renewals, another after
            box.clocks.wall_s += step
        if boot < B0 + 3 * HOUR and (boot - B0) % 600 == 0:  # renews every 10 min for 3 h
            box.renew()
            last.append(boot)

    fired = ticks(box, box.daemon(), B0 + 5 * HOUR, controller, tick=30.0)
    assert fired is not None and last[-1] + HOUR <= fired <= last[-1] + HOUR + 30.0
    assert box.kinds().count("deadman.firing") == 1


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from([-STEP, -60.0, 60.0, STEP, 86400.0])),
                max_size=4))
def test_any_wall_steps_fire_it_within_one_tick_of_the_real_end(steps: List[Tuple[int, float]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        box = Box(Path(tmp))
        box.environ["TEST_INSTANCE_ID"] = "i-1"
        box.run("done", running=False, active_at=T0)
        box.arm(ttl_s=600.0)
        at = {B0 + 20.0 * i: jump for i, jump in steps}
        fired = ticks(box, box.daemon(), B0 + 1200,
                      lambda boot: setattr(box.clocks, "wall_s", box.clocks.wall_s + at.get(boot, 0.0)), 20.0)
        assert fired is not None and B0 + 600 <= fired <= B0 + 600 + 20.0


def test_a_renewal_written_by_another_process_is_read_on_the_boot_clock(box: Box) -> None:
    """The sidecar (or `rgt-onbox deadman renew`) renews in its own process: its boot stamp is exact
    to the daemon, even when that process's wall clock is 3 h behind."""
    arm(box.paths, ttl_s=HOUR, now=time.time(), root=str(box.root), environ=box.environ)
    timer = LeaseTimer(Timebase(SYSTEM))
    lease = read_lease(box.paths, box.environ).lease
    assert lease is not None
    first = timer.anchors(lease, SYSTEM.boot()).lease_start
    code = ("import sys, time; from onbox.deadman.lease import paths_for, renew; "
            "renew(paths_for(), now=time.time() - 3 * 3600, by='controller')")
    before = SYSTEM.boot()
    subprocess.run([sys.executable, "-c", code], env={**env_of(box), "PYTHONPATH": str(REPO)}, check=True,
                   timeout=60)
    after = SYSTEM.boot()
    renewed = read_lease(box.paths, box.environ).lease
    assert renewed is not None and renewed.boot_id == SYSTEM.boot_id() and renewed.boot_id
    assert renewed.renewed_at < time.time() - 2 * HOUR  # its unix times lie
    start = timer.anchors(renewed, SYSTEM.boot()).lease_start
    assert before <= start <= after and start > first


@pytest.mark.parametrize("old_boot, new_boot", [(100.0, 50_000.0), (86_400.0, 30.0)])
def test_after_a_reboot_the_lease_counts_from_when_the_daemon_first_saw_it(
        box: Box, old_boot: float, new_boot: float) -> None:
    """An old boot's stamp read in the new boot would be far in the past (fire at once) or the
    future (never): neither is trusted; the lease and its budget count from the daemon's first look."""
    box.run("done", running=False, active_at=T0)
    box.clocks.boot_s = old_boot
    box.arm(max_hours=2.0)
    box.clocks.id, box.clocks.boot_s = "boot-2", new_boot  # rebooted; the wall clock runs on
    box.clocks.wall_s += 1800
    daemon = box.daemon()
    assert daemon.tick() and box.kinds() == ["deadman.armed"]
    box.clocks.boot_s += 1800
    box.renew()  # a renewal in the new boot stamps the lease and re-stamps the budget (later)
    lease = read_lease(box.paths).lease
    assert lease is not None and (lease.boot_id, lease.renewed_boottime, lease.budget_boottime) == \
        ("boot-2", new_boot + 1800, new_boot + 1800)
    renewed_at = box.clocks.boot_s
    fired = ticks(box, daemon, new_boot + 4 * HOUR)
    assert fired is not None and renewed_at + HOUR <= fired <= renewed_at + HOUR + TICK
    assert box.last("deadman.firing")["trigger"] == "lease"


def test_a_budget_from_before_a_reboot_never_fires_sooner(box: Box) -> None:
    box.run("done", running=False, active_at=T0)
    box.clocks.boot_s = 100.0
    box.arm(max_hours=1.0)
    box.clocks.id, box.clocks.boot_s = "boot-2", 90_000.0  # read in boot 2: 25 h spent, if trusted
    daemon = box.daemon()

    def controller(boot: float) -> None:
        if (boot - 90_000.0) % 600 == 0:
            box.renew()

    fired = ticks(box, daemon, 90_000.0 + 2 * HOUR, controller)
    assert fired is not None and 90_000.0 + HOUR <= fired <= 90_000.0 + HOUR + TICK
    assert box.last("deadman.firing")["trigger"] == "budget"


def test_without_a_boot_id_a_renewal_is_seen_at_the_next_tick(box: Box) -> None:
    box.clocks.id = None  # a kernel that gives none: no stamp is trusted
    box.run("done", running=False, active_at=T0)
    box.arm()
    daemon = box.daemon()
    assert daemon.tick()
    box.now += 3000
    box.renew()
    box.now += 5  # the daemon's next tick
    seen = box.clocks.boot_s
    assert daemon.tick()
    lease = read_lease(box.paths).lease
    assert lease is not None and daemon.timer.anchors(lease, seen).lease_start == seen
    fired = ticks(box, daemon, seen + 2 * HOUR)
    assert fired is not None and seen + HOUR <= fired <= seen + HOUR + TICK


def test_a_boot_stamp_in_this_boots_future_is_not_trusted(box: Box) -> None:
    box.run("done", running=False, active_at=T0)
    box.arm()
    doc = json.loads(box.paths.lease.read_text())
    doc["renewed_boottime"] = B0 + 10 * HOUR  # written wrong: it would hold the lease 10 h
    box.paths.lease.write_text(json.dumps(doc))
    fired = ticks(box, box.daemon(), B0 + 3 * HOUR)
    assert fired is not None and B0 + HOUR <= fired <= B0 + HOUR + TICK


@pytest.mark.parametrize("offset", [STEP, -STEP])
def test_a_run_writing_files_with_wrong_mtimes_holds_and_its_stall_fires(box: Box, offset: float) -> None:
    """Mtimes 3 h off either way mean nothing: a run whose files change holds the lease, one whose
    files stopped changing for idle_s lets it fire, whatever their mtimes say."""
    run_dir = box.run("busy", running=True, active_at=T0 + offset)
    box.arm(idle_s=600.0)
    log = run_dir / "train.log"

    def job(boot: float) -> None:
        if boot <= B0 + 2 * HOUR:  # it trains for two hours, then hangs
            with log.open("a") as f:
                f.write("step\n")
            box.touch(run_dir, T0 + offset)  # the same wrong mtime every time

    fired = ticks(box, box.daemon(), B0 + 4 * HOUR, job)
    assert fired is not None and B0 + 2 * HOUR + 600 <= fired <= B0 + 2 * HOUR + 600 + 2 * TICK
    assert box.kinds().count("deadman.held") == 1 and box.last("deadman.firing")["trigger"] == "lease"


def test_a_run_first_seen_counts_as_active_now(box: Box) -> None:
    box.run("busy", running=True, active_at=T0 - 10 * HOUR)  # its files last changed long ago
    box.arm(idle_s=600.0)
    box.now = T0 + HOUR + 1  # the daemon starts after the lease's end
    daemon = box.daemon()
    assert daemon.tick() and box.kinds()[-1] == "deadman.held"  # a whole idle window first
    fired = ticks(box, daemon, box.clocks.boot_s + HOUR)
    start = B0 + HOUR + 1
    assert fired is not None and start + 600 <= fired <= start + 600 + TICK


def test_an_authorization_is_void_for_a_checkpoint_recorded_after_it_whatever_its_time(box: Box) -> None:
    from onbox.deadman.lease import authorize
    from tests.onbox.test_deadman import _checkpoint

    box.lambda_copy()
    run_dir = box.run("done", running=False, active_at=T0)
    _checkpoint(run_dir, T0 + 5)
    box.arm(profile="lambda")
    authorize(box.paths, action="terminate", instance_id="i-abc", allowed=("terminate",), now=T0 + 10)
    _checkpoint(run_dir, T0 - STEP)  # recorded after the yes, by a clock stepped 3 h back
    box.now = T0 + HOUR + 1
    assert box.daemon().tick() is False
    assert box.recorded() == [] and box.last("deadman.fired")["action"] == "notify"
    assert "gate no longer holds" in box.last("deadman.fired")["choice"]


@pytest.mark.parametrize("lie", [STEP, -STEP])
def test_the_real_daemon_fires_by_the_boot_clock_when_the_unix_times_lie(
        box: Box, daemons: Daemons, lie: float) -> None:  # noqa: F811 (the fixture)
    """The lease's unix times and the run's mtimes are 3 h off the daemon's wall clock (as after a
    step of the box's clock): the real daemon fires when the boot clock says, not before."""
    daemons.watch(box.paths)
    box.run("done", running=False, active_at=time.time() + lie)
    ttl = 2.0
    arm(box.paths, ttl_s=ttl, now=time.time() + lie, profile="testcloud", root=str(box.root),
        environ=box.environ)
    started = ensure_daemon(box.paths, env_of(box))
    assert started["started"] is True
    ref = daemons.seen(started["pid"])
    wait_until(lambda: not ref.alive(), 30, "the daemon to fire and end")
    lease = read_lease(box.paths).lease
    assert lease is not None and lease.fired is not None and lease.renewed_boottime is not None
    took = lease.fired["boottime"] - lease.renewed_boottime
    # not before the boot clock's ttl, and long before the lie's 3 h (within the wait above): how
    # late past the ttl depends on how busy the machine is, so it is not bounded closer
    assert ttl <= took < 30.0, took
    assert box.recorded() == ["stop i-1 key=none other=none"]
