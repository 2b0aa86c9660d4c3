"""The dead-man's lease and decisions, driven by fake clocks through `Daemon.tick`.

The action is a real program: a recorder script on PATH that appends its arguments (and whether
the credential reached it) to a file, so "ran once" and "never ran" are read from that file. Runs
are real run directories; a "running" one names this test process as its job (alive, ours).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from onbox.custody import manifest
from onbox.deadman.clock import Clocks, Timebase
from onbox.deadman.daemon import Daemon, plan_action
from onbox.deadman.feed import DeadmanFeed
from onbox.deadman.lease import (
    DEFAULT_TTL_S,
    DeadmanError,
    Lease,
    LeaseRead,
    append_event,
    arm,
    authorize,
    decide,
    disarm,
    paths_for,
    read_events,
    read_lease,
    renew,
)
from onbox.runs import ProcRef
from tests.helpers import REPO, Recorder

T0 = 1_790_000_000.0
B0 = 86_400.0            # the boot clock at T0: the box has been up a day
HOUR = 3600.0


class FakeClocks(Clocks):
    """A wall clock and a boot clock the test sets (tests/onbox/test_deadman_clock.py steps the
    wall one alone), and the boot they count in."""

    def __init__(self, wall: float = T0, boot: float = B0, boot_id: Optional[str] = "boot-1") -> None:
        self.wall_s, self.boot_s, self.id = wall, boot, boot_id

    def wall(self) -> float:
        return self.wall_s

    def boot(self) -> float:
        return self.boot_s

    def boot_id(self) -> Optional[str]:
        return self.id


class Box:
    """A home, a runs root, a profiles dir and a recorder, all under tmp; fake clocks. Setting
    `now` lets time pass (both clocks move together)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.home = tmp / "home"
        self.home.mkdir()
        self.top = tmp / "disk"                      # the "container" tier: a stop wipes it
        self.root = self.top / "workspace" / "runs"  # the "volume" tier: it survives a stop
        self.root.mkdir(parents=True)
        self.bin = tmp / "bin"
        self.bin.mkdir()
        self.record = tmp / "recorded"
        recorder = self.bin / "recorder"
        line = 'echo "$* key=${LAMBDA_API_KEY:-none} other=${OTHER_VAR:-none}"'
        recorder.write_text(f"#!/bin/sh\n{line} >> {shlex.quote(str(self.record))}\n")
        recorder.chmod(0o755)
        self.pdir = tmp / "profiles"
        self.pdir.mkdir()
        self.environ: Dict[str, str] = {
            "HOME": str(self.home), "PATH": f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "LANG": "C.UTF-8", "RGT_ROOT": str(self.root), "RGT_PROFILES_DIR": str(self.pdir),
            "OTHER_VAR": "must-not-reach-the-action"}
        self.paths = paths_for(self.environ)
        self.clocks = FakeClocks()
        self.calls = 0
        self.testcloud()

    def testcloud(self, command: str = "recorder stop {instance_id}") -> None:
        (self.pdir / "testcloud.toml").write_text(f"""
name = "testcloud"
kind = "ssh-rental"
[storage.container]
path = "{self.top}"
survives_stop = false
survives_release = false
verified = "2026-06"
[storage.volume]
path = "{self.top / 'workspace'}"
survives_stop = true
survives_release = false
verified = "2026-06"
[actions.stop]
stops_meter = true
deletes = "the container disk"
still_bills = "the volume"
reversible = true
box_command = "{command}"
verified = "2026-06"
[deadman]
action = "stop"
instance_id_env = "TEST_INSTANCE_ID"
why = "stop keeps the volume"
verified = "2026-06"
""")

    def lambda_copy(self) -> None:
        """The real Lambda profile with its terminate pointed at the recorder."""
        text = (REPO / "profiles" / "lambda.toml").read_text()
        recorder = 'box_command = "recorder terminate {instance_id}"'
        text, n = re.subn(r'(?m)^box_command = ".*"$', recorder, text)
        assert n == 1
        (self.pdir / "lambda.toml").write_text(text)

    @property
    def now(self) -> float:
        return self.clocks.wall_s

    @now.setter
    def now(self, at: float) -> None:
        self.clocks.boot_s += at - self.clocks.wall_s
        self.clocks.wall_s = at

    def clock(self) -> Timebase:
        return Timebase(self.clocks)

    def daemon(self) -> Daemon:
        return Daemon(self.paths, self.environ, clock=self.clock(), tick_s=1.0)

    def arm(self, **kw: Any) -> None:
        base: Dict[str, Any] = dict(ttl_s=HOUR, idle_s=1800.0, profile="testcloud", root=str(self.root),
                                    by="cli")
        base.update(kw)
        arm(self.paths, now=self.now, environ=self.environ, clocks=self.clocks, **base)

    def renew(self) -> LeaseRead:
        return renew(self.paths, now=self.now, by="controller", environ=self.environ, clocks=self.clocks)

    def run(self, name: str, running: bool, active_at: float) -> Path:
        run_dir = self.root / "p" / "active" / name
        (run_dir / "rgt").mkdir(parents=True)
        (run_dir / "checkpoints").mkdir()
        (run_dir / "run.json").write_text(json.dumps({"id": name, "metrics": str(run_dir / "metrics.jsonl"),
                                                      "ckpt_dir": str(run_dir / "checkpoints")}))
        me = ProcRef.of(os.getpid())
        assert me is not None
        (run_dir / "rgt" / "job.json").write_text(json.dumps({"wrapper": me.to_dict(), "job": me.to_dict(),
                                                              "pgid": os.getpgid(0), "attempt": 1}))
        if not running:
            (run_dir / "rgt" / "exit.json").write_text(json.dumps({"code": 0, "signal": None}))
        for path in (run_dir / "train.log", run_dir / "metrics.jsonl"):
            path.write_text("step 1\n")
        self.touch(run_dir, active_at)
        return run_dir

    def touch(self, run_dir: Path, at: float) -> None:
        for path in (run_dir / "train.log", run_dir / "metrics.jsonl", run_dir / "checkpoints"):
            os.utime(path, (at, at))

    def recorded(self) -> List[str]:
        return self.record.read_text().splitlines() if self.record.exists() else []

    def kinds(self) -> List[str]:
        return [r["kind"] for r in read_events(self.paths)]

    def last(self, kind: str) -> Dict[str, Any]:
        return [r for r in read_events(self.paths) if r["kind"] == kind][-1]["data"]


@pytest.fixture
def box(tmp_path: Path) -> Box:
    return Box(tmp_path)


def test_fires_on_expiry_when_every_run_has_exited(box: Box) -> None:
    box.environ["TEST_INSTANCE_ID"] = "i-123"
    box.run("done", running=False, active_at=T0 + 10)
    box.arm()
    daemon = box.daemon()
    box.now = T0 + HOUR - 1
    assert daemon.tick() and box.recorded() == []
    box.now = T0 + HOUR + 1
    assert daemon.tick() is False  # it acted: nothing left to do
    assert box.recorded() == ["stop i-123 key=none other=none"]
    fired = read_lease(box.paths).lease.fired  # type: ignore[union-attr]
    assert fired is not None and (fired["state"], fired["exit_code"], fired["argv"]) == \
        ("done", 0, ["recorder", "stop", "i-123"])
    firing, done = box.last("deadman.firing"), box.last("deadman.fired")
    assert box.kinds().index("deadman.firing") < box.kinds().index("deadman.fired")
    assert firing["why"] == "stop keeps the volume" and firing["argv"] == ["recorder", "stop", "i-123"]
    assert (done["action"], done["outcome"], done["exit_code"]) == ("stop", "done", 0)
    assert "fired at" in box.paths.fired_txt.read_text()
    box.now += HOUR
    assert daemon.tick() is False and box.daemon().tick() is False
    assert len(box.recorded()) == 1


def test_holds_while_a_run_progresses_and_says_so_once(box: Box) -> None:
    box.environ["TEST_INSTANCE_ID"] = "i-1"
    run_dir = box.run("busy", running=True, active_at=T0)
    box.arm()
    daemon = box.daemon()
    for step in range(1, 4):
        box.now = T0 + HOUR + step * 60
        box.touch(run_dir, box.now - 5)  # the job keeps writing
        assert daemon.tick()
    assert box.recorded() == [] and box.kinds().count("deadman.held") == 1
    assert box.last("deadman.held")["progressing"] == ["busy"]
    assert box.daemon().tick() and box.kinds().count("deadman.held") == 1  # a restart does not repeat it


def test_fires_for_a_stalled_run_after_the_idle_window(box: Box) -> None:
    box.environ["TEST_INSTANCE_ID"] = "i-1"
    run_dir = box.run("hung", running=True, active_at=T0)
    box.arm(idle_s=1800.0)
    daemon = box.daemon()
    assert daemon.tick()         # the daemon sees the run's files
    box.now = T0 + 3000
    box.touch(run_dir, box.now)  # its last write: alive after it, but its files stopped changing
    assert daemon.tick()
    box.now = T0 + HOUR + 1      # 601 s after its last write: still within the idle window
    assert daemon.tick() and box.kinds()[-1] == "deadman.held" and box.recorded() == []
    box.now = T0 + 4801          # 1801 s: stalled
    assert daemon.tick() is False
    assert box.recorded() == ["stop i-1 key=none other=none"]
    assert "no run makes progress" in box.last("deadman.firing")["reason"]


def test_warnings_at_30_and_5_minutes_once_each_and_a_renewal_starts_over(box: Box) -> None:
    box.arm()
    daemon = box.daemon()
    for left in (1900, 1700, 1600, 299, 200):
        box.now = T0 + HOUR - left
        assert daemon.tick()
    box.renew()
    box.now += HOUR - 1000
    assert daemon.tick()
    warnings = [r["data"] for r in read_events(box.paths) if r["kind"] == "deadman.expiring"]
    assert [(w["minutes_left"], w["trigger"]) for w in warnings] == \
        [(30, "lease"), (5, "lease"), (30, "lease")]
    assert box.recorded() == []


def test_the_budget_fires_even_while_renewed_and_progressing(box: Box) -> None:
    box.environ["TEST_INSTANCE_ID"] = "i-9"
    run_dir = box.run("busy", running=True, active_at=T0)
    box.arm(max_hours=1.0)
    daemon = box.daemon()
    for at in (600, 1200, 1800, 2400, 3000, 3400):
        box.now = T0 + at
        box.renew()
        box.touch(run_dir, box.now)
        assert daemon.tick()
    assert box.recorded() == [] and [r["data"]["trigger"] for r in read_events(box.paths)
                                     if r["kind"] == "deadman.expiring"] == ["budget", "budget"]
    box.now = T0 + HOUR + 1
    box.renew()
    box.touch(run_dir, box.now)
    assert daemon.tick() is False
    assert box.recorded() == ["stop i-9 key=none other=none"]
    assert box.last("deadman.firing")["trigger"] == "budget"


def test_the_lambda_profile_never_terminates_by_default(box: Box) -> None:
    box.lambda_copy()
    box.run("done", running=False, active_at=T0)
    box.arm(profile="lambda")
    box.now = T0 + HOUR + 1
    assert box.daemon().tick() is False
    assert box.recorded() == [] and "deadman.firing" not in box.kinds()
    fired = box.last("deadman.fired")
    assert (fired["action"], fired["outcome"]) == ("notify", "notified")
    assert "Alert" in fired["why"] and read_lease(box.paths).lease.fired["action"] == "notify"  # type: ignore[union-attr]


def _secret(box: Box, name: str, value: str) -> None:
    where = box.home / ".rgt" / "secrets"
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(where, 0o700)
    (where / name).write_text(value)
    os.chmod(where / name, 0o600)


def _checkpoint(run_dir: Path, ts: float) -> None:
    manifest.append(run_dir, manifest.Record(path="checkpoints/step1.pt", size=1, sha256="0" * 64, mtime_ns=1,
                                             inode=1, step=1, format="torch", ts=ts))


def test_lambda_terminates_only_when_authorized_and_the_gate_holds(box: Box) -> None:
    box.lambda_copy()
    run_dir = box.run("done", running=False, active_at=T0)
    _checkpoint(run_dir, T0 + 5)  # pulled and verified before the authorization
    _secret(box, "LAMBDA_API_KEY", "secret-lambda-key-123")
    box.arm(profile="lambda")
    with pytest.raises(DeadmanError, match="not an action"):
        authorize(box.paths, action="shutdown", instance_id="i-abc", allowed=("terminate",), now=T0 + 10)
    authorize(box.paths, action="terminate", instance_id="i-abc", allowed=("terminate",), now=T0 + 10)
    box.now = T0 + HOUR + 1
    assert box.daemon().tick() is False
    assert box.recorded() == ["terminate i-abc key=secret-lambda-key-123 other=none"]
    fired = box.last("deadman.fired")
    assert (fired["action"], fired["outcome"]) == ("terminate", "done")
    assert "secret-lambda-key" not in box.paths.events.read_text()


def test_an_authorization_is_void_once_a_newer_checkpoint_exists(box: Box) -> None:
    box.lambda_copy()
    run_dir = box.run("done", running=False, active_at=T0)
    box.arm(profile="lambda")
    authorize(box.paths, action="terminate", instance_id="i-abc", allowed=("terminate",), now=T0 + 10)
    _checkpoint(run_dir, T0 + 20)  # written after the person said yes: not covered by their pull
    box.now = T0 + HOUR + 1
    assert box.daemon().tick() is False
    assert box.recorded() == [] and box.last("deadman.fired")["action"] == "notify"
    assert "gate no longer holds" in box.last("deadman.fired")["choice"]


def test_the_action_runs_exactly_once_across_a_daemon_restart(
        box: Box, caplog: pytest.LogCaptureFixture) -> None:
    box.environ["TEST_INSTANCE_ID"] = "i-1"
    box.run("done", running=False, active_at=T0)
    box.arm()
    calls: List[List[str]] = []

    class Died(BaseException):
        pass

    def dies_while_running(argv: List[str], **_kw: Any) -> Any:
        calls.append(argv)
        raise Died  # the daemon is killed while the action runs

    box.now = T0 + HOUR + 1
    first = Daemon(box.paths, box.environ, clock=box.clock(), runner=dies_while_running)
    with pytest.raises(Died):
        first.tick()
    assert read_lease(box.paths).lease.fired["state"] == "firing"  # type: ignore[union-attr]
    assert box.kinds()[-1] == "deadman.firing"
    for _ in range(2):  # restarted daemons
        assert box.daemon().tick() is False
    assert len(calls) == 1 and box.recorded() == []
    assert box.kinds().count("deadman.fired") == 1 and box.last("deadman.fired")["outcome"] == "interrupted"
    assert read_lease(box.paths).lease.fired["state"] == "failed"  # type: ignore[union-attr]
    box.paths.lease.write_text("{ torn")  # even a garbled lease does not bring it back
    daemon = box.daemon()
    assert daemon.tick()  # read as armed: its default TTL counts from now
    box.now += DEFAULT_TTL_S + 1
    assert daemon.tick() is False and box.recorded() == [] and len(calls) == 1
    assert box.kinds()[-1] == "deadman.fired" and "not again" in caplog.text  # the log stopped it


@pytest.mark.parametrize("command, instance, root_under, needle", [
    ("no-such-program-rgt stop {instance_id}", "i-1", "workspace", "not on PATH"),
    ("recorder stop {instance_id}", None, "workspace", "needs the instance id"),
    ("recorder stop {instance_id}", "i-1", "scratch", "which a stop wipes"),
    ("recorder stop {instance_id}", "i-1", "elsewhere", "storage the testcloud profile does not describe"),
])
def test_a_command_that_cannot_be_taken_safely_becomes_notify_with_the_reason(
        box: Box, command: str, instance: Optional[str], root_under: str, needle: str) -> None:
    box.testcloud(command=command)
    if instance:
        box.environ["TEST_INSTANCE_ID"] = instance
    if root_under != "workspace":
        box.root = (box.top / "scratch" if root_under == "scratch" else box.tmp / "elsewhere") / "runs"
        box.root.mkdir(parents=True)
    box.run("done", running=False, active_at=T0)
    box.arm()
    box.now = T0 + HOUR + 1
    assert box.daemon().tick() is False
    fired = box.last("deadman.fired")
    assert (fired["action"], fired["wanted"], box.recorded()) == ("notify", "stop", [])
    assert needle in fired["refused"] and needle in box.paths.fired_txt.read_text()


def test_a_torn_lease_is_reported_and_read_as_armed_with_notify(box: Box) -> None:
    box.arm()
    box.paths.lease.write_text('{"v": 1, "armed": tr')
    mtime = box.paths.lease.stat().st_mtime
    read = read_lease(box.paths, box.environ)
    assert read.problem and "not valid JSON" in read.problem and read.state == "unreadable"
    lease = read.lease
    assert lease is not None and lease.armed and lease.profile is None and lease.authorized is None
    assert decide(lease, [], mtime + DEFAULT_TTL_S - 10).verdict == "armed"  # a person's reading
    assert plan_action(lease, [], box.environ).action == "notify"
    daemon = box.daemon()
    assert daemon.tick()  # the daemon trusts no stamp of it: the TTL counts from its first look
    box.now += DEFAULT_TTL_S - 10
    assert daemon.tick() and box.kinds()[-1] == "deadman.expiring"
    box.now += 11
    assert daemon.tick() is False
    assert box.last("deadman.fired")["action"] == "notify" and box.recorded() == []


def test_malformed_fields_fall_back_to_their_safest_values(box: Box) -> None:
    box.paths.ensure_dir()
    box.paths.lease.write_text(json.dumps({"v": 1, "armed": "yes", "ttl_s": "soon", "renewed_at": T0,
                                           "profile": "testcloud", "fired": "maybe",
                                           "authorized": {"action": "terminate"}}))
    read = read_lease(box.paths, box.environ)
    lease = read.lease
    assert lease is not None and read.problem and "'ttl_s'" in read.problem
    assert lease.armed and lease.ttl_s == DEFAULT_TTL_S and lease.authorized is None
    assert lease.fired is not None and read.state == "fired"  # unknown: it may have fired already


def test_renew_never_arms_and_a_steady_controller_writes_one_record(box: Box) -> None:
    assert renew(box.paths, now=T0, by="controller", environ=box.environ).state == "absent"
    box.arm()
    for minute in range(1, 6):
        box.now = T0 + 60 * minute
        assert box.renew().lease.expires_at == box.now + HOUR  # type: ignore[union-attr]
    assert box.kinds() == ["deadman.armed", "deadman.renewed"]
    disarm(box.paths, now=box.now, environ=box.environ)
    after = renew(box.paths, now=box.now + 1, by="controller", environ=box.environ)
    assert after.state == "disarmed" and after.lease is not None and not after.lease.armed
    assert box.daemon().tick() is False


def test_the_lease_file_and_its_directory_are_private(box: Box) -> None:
    box.arm()
    assert (box.paths.dir.stat().st_mode & 0o777, box.paths.lease.stat().st_mode & 0o777) == (0o700, 0o600)
    doc = json.loads(box.paths.lease.read_text())
    assert set(doc) == {"v", "armed", "ttl_s", "idle_s", "renewed_at", "expires_at", "renewed_by",
                        "max_hours", "budget_started_at", "roots", "profile", "authorized", "fired",
                        "renewed_boottime", "budget_boottime", "boot_id"}
    assert (doc["renewed_boottime"], doc["boot_id"], doc["budget_boottime"]) == (B0, "boot-1", None)


def test_the_feed_relays_each_new_record_once_and_resumes_after_a_restart(box: Box) -> None:
    rgt = box.tmp / "run" / "rgt"
    rgt.mkdir(parents=True)
    append_event(box.paths, "deadman.armed", {"ttl_s": HOUR}, now=T0)  # before this sidecar: not its news
    first = Recorder()
    feed = DeadmanFeed(rgt, first, environ=box.environ)
    feed.start()
    append_event(box.paths, "deadman.expiring", {"minutes_left": 30}, now=T0 + 1)
    feed.tick()
    feed.tick()
    assert [(k, d["minutes_left"], d["deadman_seq"], sev) for k, d, sev in first.events] == \
        [("deadman.expiring", 30, 2, "warn")]
    append_event(box.paths, "deadman.held", {"progressing": ["r"]}, now=T0 + 2)  # while no sidecar ran
    second = Recorder()
    again = DeadmanFeed(rgt, second, environ=box.environ)
    again.start()
    again.tick()
    assert [(k, d["deadman_seq"]) for k, d, _ in second.events] == [("deadman.held", 3)]


def test_the_shipped_lambda_terminate_runs_our_provider_under_the_daemons_interpreter() -> None:
    lease = Lease(profile="lambda", authorized={"action": "terminate", "instance_id": "i-9", "at": T0,
                                                "by": "cli"})
    plan = plan_action(lease, [], {"PATH": "/usr/bin", "LAMBDA_API_KEY": "k"},
                       which=lambda program, path=None: program)
    assert plan.action == "terminate" and plan.refused is None
    assert plan.argv == [sys.executable, "-m", "onbox.deadman.provider", "lambda-terminate", "i-9"]
