"""The dead-man end to end: a run on the sshd box, renewed by the controller's watcher over the
tunnel, and the box's safe action once nobody renews and nothing progresses.

The box's dead-man runs on a compressed clock (RGT_DEADMAN_TIMESCALE=600 through sshd's SetEnv:
one real second is ten box minutes), so the 1 h lease lasts 6 s and the 30 min idle window 3 s.
The profile's action is a recorder script, never a real provider command.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import stat
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from controller.follow.client import unfollow
from onbox.deadman import daemon
from onbox.deadman import lease as deadman
from onbox.runs import wait_for
from tests.e2e.rgtbox import ONBOX, TEST_ONBOX_ARGS, TRAIN, Rgt
from tests.helpers import wait_until
from tests.sshbox import SshBox

SCALE = 600.0
LEASE_REAL_S = 3600.0 / SCALE       # the lease (1 h on the box) in real seconds


def write_profile(where: Path, recorder: Path, home: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    (where / "testcloud.toml").write_text(f'''name = "testcloud"
kind = "ssh-rental"
meter_stop_action = "stop"

[storage.home]
path = "{home}"
survives_stop = true
survives_release = false
verified = "2026-11"
source = "the test's box"

[actions.stop]
stops_meter = true
deletes = "nothing"
reversible = true
box_command = "{shlex.quote(str(recorder))} stop {{host}}"
verified = "2026-11"
source = "a recorder, never a provider"

[deadman]
action = "stop"
why = "the test cloud's stop keeps the disk"
verified = "2026-11"
source = "the test"
''')


@pytest.fixture
def box(sshbox: SshBox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Dict[str, Any]]:
    """The sshd box with a compressed dead-man clock, a recorder action and a controller that
    renews every second; the dead-man is disarmed and its daemon gone at the end."""
    profiles_dir = sshbox.root / "profiles"
    recorder, record = sshbox.root / "recorder.sh", sshbox.root / "recorded.txt"
    recorder.write_text(f'#!/bin/sh\necho "$@" >> {shlex.quote(str(record))}\n')
    recorder.chmod(recorder.stat().st_mode | stat.S_IXUSR)
    write_profile(profiles_dir, recorder, sshbox.home)
    sshbox.env.update({"RGT_DEADMAN_TIMESCALE": f"{SCALE:g}", "RGT_DEADMAN_TICK_S": "0.2",
                       "RGT_PROFILES_DIR": str(profiles_dir)})
    sshbox.restart()
    monkeypatch.setenv("RGT_PROFILES_DIR", str(profiles_dir))
    r = Rgt(tmp_path, sshbox, monkeypatch)
    r.env.update({"RGT_DEADMAN_RENEW_S": "1", "RGT_PROFILES_DIR": str(profiles_dir)})
    r("hosts", "add", "box", "--ssh", sshbox.alias, "--onbox", ONBOX, "--profile", "testcloud")
    paths = deadman.paths_for({"HOME": str(sshbox.home)})
    try:
        yield {"rgt": r, "paths": paths, "record": record}
    finally:
        try:
            r("deadman", "box", "disarm", "--json", check=False)
            pid = daemon.daemon_pid(paths)
            if pid is not None and not wait_for(lambda: daemon.daemon_pid(paths) is None, 15.0):
                os.kill(pid, signal.SIGTERM)  # the daemon this test's launch started, by its pid
                wait_for(lambda: daemon.daemon_pid(paths) is None, 10.0)
        finally:
            r.end()


def box_records(paths: deadman.DeadmanPaths) -> List[Dict[str, Any]]:
    try:
        lines = paths.events.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def lease(paths: deadman.DeadmanPaths) -> Dict[str, Any]:
    doc: Dict[str, Any] = json.loads(paths.lease.read_text())
    return doc


def test_renewals_through_the_tunnel_hold_it_off_then_it_fires_once_when_they_stop(
        box: Dict[str, Any]) -> None:
    r: Rgt = box["rgt"]
    paths: deadman.DeadmanPaths = box["paths"]
    record: Path = box["record"]
    # The job hangs (SIGSTOP) at step 30: after the idle window nothing on the box progresses.
    out = r("launch", "box", "--root", str(r.root), "--json", *TEST_ONBOX_ARGS, "--onbox-arg=--deadman=1h",
            "--", *TRAIN, "--steps", "100000", "--step-seconds", "0.05", "--hang-at", "30",
            "--ckpt-every", "100000")
    run = json.loads(out.stdout.strip().splitlines()[-1])["run_id"]
    r.runs.append(run)
    armed_at = lease(paths)["renewed_at"]
    assert lease(paths)["armed"] and lease(paths)["profile"] == "testcloud"

    # The watcher renews each second over ZeroMQ: one and a half lease lengths later the lease
    # has been carried past its first expiry by the controller, and nothing fired.
    wait_until(lambda: lease(paths)["renewed_at"] - armed_at >= 1.5 * LEASE_REAL_S
               and lease(paths)["renewed_by"] == "controller", 60, "the controller to keep renewing")
    assert daemon.daemon_pid(paths) is not None
    assert not record.exists()
    assert not [x for x in box_records(paths) if x["kind"] in ("deadman.firing", "deadman.fired")]

    # Nobody renews any more, the job is hung: the box takes its profile's action, exactly once.
    assert unfollow(run)
    wait_until(lambda: any(x["kind"] == "deadman.fired" for x in box_records(paths)), 60,
               "the dead-man to fire")
    kinds = [x["kind"] for x in box_records(paths)]
    assert kinds.count("deadman.firing") == 1 and kinds.count("deadman.fired") == 1
    assert kinds.index("deadman.firing") < kinds.index("deadman.fired")
    assert record.read_text().splitlines() == [record.read_text().splitlines()[0]]
    assert record.read_text().startswith("stop ")
    fired = [x for x in box_records(paths) if x["kind"] == "deadman.fired"][0]["data"]
    assert fired["action"] == "stop" and fired["exit_code"] == 0

    # The controller learns it through the run's sidecar, and `rgt deadman` shows it.
    status = json.loads(r("deadman", "box", "status", "--json").stdout)
    assert status["lease"]["fired"]["state"] == "done"
    r("status", run)  # starts the watcher again
    wait_until(lambda: "deadman.fired" in [e.kind for e in r.store().events(run, kind_prefix="deadman.")],
               60, "the relayed deadman.fired in the store")
    assert record.read_text().count("\n") == 1
