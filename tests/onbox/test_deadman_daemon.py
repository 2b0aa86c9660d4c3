"""The dead-man daemon as real processes: `rgt-onbox deadman ...`, a launch, a sidecar's Renew.

Daemons detach (they are not this test's children), so every test ends the ones it caused by pid
through the `daemons` fixture: it disarms the lease (a daemon then ends at its next tick, 50 ms
here) and waits, SIGTERM as a last resort. Everything lives under tmp: HOME, runs, profiles.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
from click.testing import CliRunner

from onbox.cli.main import main as onbox_main
from onbox.deadman.daemon import daemon_pid
from onbox.deadman.lease import DeadmanPaths, arm, disarm, read_events, read_lease
from onbox.launch.launcher import LaunchOptions, launch
from onbox.runs import ProcRef, read_json, run_status, wait_for
from onbox.sidecar.journal import read_all
from protocol import Renew, RenewReply, encode_request
from protocol.endpoints import Endpoints
from tests.helpers import REPO, Client, SidecarProcess, onbox_cmd, wait_until
from tests.onbox.test_deadman import Box

FAST = {"RGT_DEADMAN_TICK_S": "0.05"}


class Daemons:
    """The daemons a test caused, ended by pid at teardown."""

    def __init__(self) -> None:
        self.homes: List[DeadmanPaths] = []
        self.refs: List[ProcRef] = []

    def watch(self, paths: DeadmanPaths) -> DeadmanPaths:
        self.homes.append(paths)
        return paths

    def seen(self, pid: Any) -> ProcRef:
        ref = ProcRef.of(int(pid))
        assert ref is not None, f"daemon pid {pid} is not running"
        self.refs.append(ref)
        return ref

    def end(self) -> None:
        for paths in self.homes:
            pid = daemon_pid(paths)
            if pid is not None:
                self.seen(pid)
            if paths.lease.exists():
                disarm(paths, now=time.time())
        for ref in self.refs:
            if not wait_for(lambda r=ref: not r.alive(), 10.0) and ref.alive():
                os.kill(ref.pid, signal.SIGTERM)
                wait_for(lambda r=ref: not r.alive(), 10.0)
        left = [r.pid for r in self.refs if r.alive()]
        assert not left, f"dead-man daemons still running: {left}"


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    d = Daemons()
    try:
        yield d
    finally:
        d.end()


@pytest.fixture
def box(tmp_path: Path, daemons: Daemons) -> Box:
    b = Box(tmp_path)
    daemons.watch(b.paths)
    return b


def onbox(env: Dict[str, str], *args: str, check: bool = True) -> Dict[str, Any]:
    done = subprocess.run(onbox_cmd(*args), env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    if check:
        assert done.returncode == 0, done.stderr
    answer: Dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def env_of(box: Box, **extra: str) -> Dict[str, str]:
    return {**os.environ, **box.environ, **FAST, "PYTHONPATH": str(REPO), **extra}


def test_the_real_daemon_fires_once_on_a_compressed_clock(box: Box, daemons: Daemons) -> None:
    env = env_of(box, RGT_DEADMAN_TIMESCALE="3600", TEST_INSTANCE_ID="i-7")  # an hour is a second
    box.run("done", running=False, active_at=time.time())
    answer = onbox(env, "deadman", "arm", "--ttl", "1h", "--profile", "testcloud", "--root", str(box.root),
                   "--json")
    assert answer["daemon"]["started"] is True
    ref = daemons.seen(answer["daemon"]["pid"])
    wait_until(lambda: not ref.alive(), 30, "the daemon to fire and end")
    assert box.recorded() == ["stop i-7 key=none other=none"]
    kinds = [r["kind"] for r in read_events(box.paths)]
    assert kinds.count("deadman.firing") == 1 and kinds[-1] == "deadman.fired"
    assert read_lease(box.paths).lease.fired["state"] == "done"  # type: ignore[union-attr]
    again = onbox(env, "deadman", "renew", "--json")  # a fired lease wants no daemon
    assert again["state"] == "fired" and again["daemon"]["running"] is False
    assert box.recorded() == ["stop i-7 key=none other=none"]


def test_one_daemon_per_box_and_renew_restarts_a_killed_one(box: Box, daemons: Daemons) -> None:
    env = env_of(box)
    first = daemons.seen(onbox(env, "deadman", "arm", "--ttl", "1h", "--json")["daemon"]["pid"])
    second = onbox(env, "deadman", "run", "--foreground", "--json")
    assert (second["started"], second["pid"]) == (False, first.pid)
    os.kill(first.pid, signal.SIGKILL)
    wait_until(lambda: not first.alive(), 10, "the killed daemon to go")
    renewed = onbox(env, "deadman", "renew", "--json")
    assert renewed["state"] == "armed" and renewed["daemon"]["started"] is True
    fresh = daemons.seen(renewed["daemon"]["pid"])
    assert fresh.pid != first.pid
    status = onbox(env, "deadman", "status", "--json")
    assert status["daemon"] == {"pid": fresh.pid, "alive": True}
    assert status["decision"]["verdict"] == "armed" and status["would"]["action"] == "notify"
    assert onbox(env, "deadman", "disarm", "--json")["state"] == "disarmed"
    log = onbox(env, "deadman", "events", "--since", "1", "--json")
    assert [r["kind"] for r in log["events"]] == ["deadman.renewed", "deadman.disarmed"]
    assert log["last_seq"] == 3
    wait_until(lambda: not fresh.alive(), 10, "the daemon to end once disarmed")


def test_authorize_takes_only_an_allowed_action(box: Box) -> None:
    box.lambda_copy()
    arm(box.paths, ttl_s=3600, profile="lambda", root=str(box.root), now=time.time(), environ=box.environ)
    env = env_of(box)
    refused = subprocess.run(onbox_cmd("deadman", "authorize", "shutdown", "--instance-id", "i-1"), env=env,
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and refused.stderr.startswith("error: 'shutdown' is not an action")
    done = onbox(env, "deadman", "authorize", "terminate", "--instance-id", "i-1", "--json")
    assert done["authorized"]["action"] == "terminate" and done["authorized"]["instance_id"] == "i-1"


def _launch(box: Box, ttl: Any) -> Path:
    environ = {**os.environ, **box.environ, **FAST}
    res = launch(LaunchOptions(command=[sys.executable, "-c", "pass"], root=box.root, project="p",
                               preflight=False, probe="none", min_free_bytes=1 << 20, cwd=box.tmp,
                               sidecar=False, deadman_ttl_s=ttl, deadman_idle_s=600.0), environ=environ)
    wait_until(lambda: run_status(res.run_dir).state == "exited", 20, "the job to end")
    return res.run_dir


def test_a_launch_arms_the_lease_and_starts_the_daemon(box: Box, daemons: Daemons) -> None:
    run_dir = _launch(box, 3600.0)
    lease = read_lease(box.paths).lease
    assert lease is not None and (lease.armed, lease.ttl_s, lease.idle_s, lease.renewed_by) == \
        (True, 3600.0, 600.0, "launch")
    assert lease.roots == [str(box.root.resolve())]
    assert read_json(run_dir / "run.json")["deadman"] == {"ttl_s": 3600.0, "idle_s": 600.0, "max_hours": None}
    pid = daemon_pid(box.paths)
    assert pid is not None
    daemons.seen(pid)


def test_a_launch_with_the_deadman_off_leaves_no_lease(box: Box) -> None:
    run_dir = _launch(box, None)
    assert read_json(run_dir / "run.json")["deadman"] is None
    assert not box.paths.lease.exists() and daemon_pid(box.paths) is None


def test_the_launch_option_takes_a_duration_or_off() -> None:
    bad = CliRunner().invoke(onbox_main, ["launch", "--deadman", "soon", "--", "true"])
    assert bad.exit_code == 2 and "not a duration" in bad.output


def test_a_sidecar_renews_for_the_controller_relays_records_and_keeps_the_daemon(
        box: Box, daemons: Daemons, tmp_path: Path) -> None:
    arm(box.paths, ttl_s=3600, root=str(box.root), now=time.time(), environ=box.environ)
    run_dir = tmp_path / "active" / "run-x"
    sc = SidecarProcess(run_dir, "--heartbeat", "0.5", "--no-kmsg", env={**box.environ, **FAST}).start()
    client = Client(Endpoints.read(run_dir / "rgt"))
    try:
        pid = wait_until(lambda: daemon_pid(box.paths), 20, "the sidecar to start the daemon")
        ref = daemons.seen(pid)
        reply = client.ask(encode_request(Renew(id="r1", ttl_s=600.0)))
        assert isinstance(reply, RenewReply) and (reply.id, reply.armed, reply.ttl_s, reply.state) == \
            ("r1", True, 600.0, "armed")
        assert abs(reply.expires_at - (time.time() + 600)) < 30
        assert read_lease(box.paths).lease.renewed_by == "controller"  # type: ignore[union-attr]

        def journaled(kind: str) -> List[Dict[str, Any]]:
            return [e for e in read_all(run_dir / "rgt") if e["kind"] == kind]

        renewed = wait_until(lambda: journaled("deadman.renewed"), 20, "the renewal in the run's journal")
        assert renewed[0]["data"]["by"] == "controller" and renewed[0]["data"]["ttl_s"] == 600.0
        disarm(box.paths, now=time.time())
        wait_until(lambda: journaled("deadman.disarmed"), 20, "the disarm in the run's journal")
        wait_until(lambda: not ref.alive(), 10, "the daemon to end once disarmed")
        after = client.ask(encode_request(Renew(id="r2")))
        assert isinstance(after, RenewReply) and (after.armed, after.state, after.expires_at) == \
            (False, "disarmed", 0.0)
    finally:
        client.close()
        sc.stop()
