"""`rgt deadman HOST ...` against host `local`: the box's real rgt-onbox, in a temp HOME."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

from controller.store.db import Store
from controller.teardown import deadman as ctl
from controller.teardown import gate as teardown
from onbox.deadman import daemon
from onbox.deadman import lease as deadman
from onbox.runs import wait_for
from protocol import Event
from tests.helpers import REPO, rgt_cmd


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A HOME of the test's own: the lease and any daemon an `arm` starts live there, and the
    daemon is gone at the end (disarmed, then by its pid)."""
    where = tmp_path / "boxhome"
    where.mkdir()
    monkeypatch.setenv("HOME", str(where))
    paths = deadman.paths_for({"HOME": str(where)})
    try:
        yield where
    finally:
        pid = daemon.daemon_pid(paths)
        if pid is not None:
            deadman.disarm(paths, now=0.0, environ={"HOME": str(where)})
            if not wait_for(lambda: daemon.daemon_pid(paths) is None, 15.0):
                os.kill(pid, signal.SIGTERM)
                wait_for(lambda: daemon.daemon_pid(paths) is None, 10.0)


def rgt(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(rgt_cmd(*args), env=env, cwd=REPO, capture_output=True, text=True, timeout=60)


def answer(done: subprocess.CompletedProcess[str]) -> Dict[str, Any]:
    assert done.returncode == 0, done.stderr
    doc: Dict[str, Any] = json.loads(done.stdout)
    return doc


def test_status_arm_renew_disarm_round_trip(home: Path) -> None:
    assert answer(rgt("deadman", "local", "status", "--json"))["state"] == "absent"
    armed = answer(rgt("deadman", "local", "arm", "--ttl", "2h", "--idle", "10m", "--json"))
    assert armed["lease"]["armed"] and armed["lease"]["ttl_s"] == 7200.0
    assert armed["lease"]["idle_s"] == 600.0 and armed["lease"]["profile"] == "local"
    lease = json.loads((home / ".rgt" / "deadman.json").read_text())
    assert lease["armed"] and lease["renewed_by"] == "cli"
    renewed = answer(rgt("deadman", "local", "renew", "--ttl", "3h", "--json"))
    assert renewed["lease"]["ttl_s"] == 10800.0 and renewed["lease"]["expires_at"] > lease["expires_at"]
    shown = rgt("deadman", "local", "status")
    assert shown.returncode == 0 and "dead-man on local: armed" in shown.stdout
    assert "expires in" in shown.stdout
    assert answer(rgt("deadman", "local", "disarm", "--json"))["lease"]["armed"] is False
    assert "dead-man on local: disarmed" in rgt("deadman", "local", "status").stdout


def test_a_refusal_on_the_box_is_an_error_line_not_an_install_hint(home: Path) -> None:
    done = rgt("deadman", "local", "arm", "--ttl", "soon")
    assert done.returncode == 1 and "error: local refused `deadman arm`" in done.stderr
    assert "rgt install" not in done.stderr


def test_authorize_needs_a_known_run_an_open_gate_and_the_typed_host(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Store.open() as store:
        with pytest.raises(ctl.DeadmanError, match="no run launched on local"):
            ctl.authorize(store, "local", "terminate", instance_id="i-1", typed="local")
        store.upsert_run("run-a", host="", target="local", run_dir=str(home / "runs" / "run-a"))
        # The job may still run (nothing from the box says it ended): the real gate is closed.
        with pytest.raises(ctl.DeadmanError, match="gate of run run-a is closed: the job has not ended"):
            ctl.authorize(store, "local", "terminate", instance_id="i-1", typed="local")
        store.apply("run-a", [Event(run="run-a", host="local", seq=1, ts=1.7e9, kind="job.exited", sev="info",
                                    data={"code": 0})], 1)
        # Ended but never pulled: still closed, and it names the run.
        with pytest.raises(ctl.DeadmanError, match="gate of run run-a is closed: not verified"):
            ctl.authorize(store, "local", "terminate", instance_id="i-1", typed="local")
        open_gate = [ctl.RunGate("run-a", teardown.Gate(True, "open", "covered"))]
        monkeypatch.setattr(ctl, "host_gates", lambda s, h: open_gate)
        with pytest.raises(ctl.DeadmanError, match="typed host name does not match"):
            ctl.authorize(store, "local", "terminate", instance_id="i-1", typed="loca")
        # The gate is open and the name typed: the box itself still refuses an action its
        # profile does not allow (local's dead-man allows none).
        with pytest.raises(ctl.DeadmanError, match="local refused `deadman authorize`"):
            ctl.authorize(store, "local", "terminate", instance_id="i-1", typed="local")
    assert not (home / ".rgt" / "deadman.json").exists() or \
        json.loads((home / ".rgt" / "deadman.json").read_text()).get("authorized") is None


def test_render_reads_a_status_answer() -> None:
    text = ctl.render("gpu1", {"lease": {"armed": True, "ttl_s": 7200, "renewed_by": "controller",
                                         "max_hours": 12, "fired": None, "authorized": None},
                               "seconds_left": 3725, "daemon": {"pid": 42, "alive": True},
                               "decision": {"verdict": "armed", "reason": "the lease runs 3725 s more"},
                               "would": {"action": "stop", "reason": "the profile's dead-man action",
                                         "refused": None, "still_bills": "the volume disk"}})
    assert "dead-man on gpu1: armed" in text and "1h02m" in text and "pid 42" in text
    assert "hard budget  12 h" in text and "now          armed: the lease runs 3725 s more" in text
    assert "when it fires stop: the profile's dead-man action" in text and "still bills  the volume" in text


FAKE_ONBOX = r'''
import json, sys
answer = {"lease": {"armed": True, "ttl_s": 7200, "renewed_by": "ctl\x1b[2J\x1b[H",
                    "max_hours": 12, "fired": None, "authorized": None},
          "seconds_left": 60, "daemon": {"pid": 7, "alive": True},
          "decision": {"verdict": "armed",
                       "reason": "ok\r\x1b[32mgate OPEN\x9b0m \x1b]52;c;cm0gLXJmIH4K\x07"},
          "would": {"action": "stop\u2028FAKE", "reason": "\u202etxt.exe", "refused": None}}
if sys.argv[2] == "status":
    sys.stderr.write("warming up \x1b[2J\n")
    print(json.dumps(answer, ensure_ascii=False))
else:
    sys.stderr.write("refused\x1b]0;pwned\x07\n\x1b[2J\u202eno lease\n")
    sys.exit(1)
'''
UNSAFE = ("\x1b", "\x07", "\x9b", "\r", "\u202e", "\u2028")


def test_a_hostile_box_answer_is_printed_escaped(home: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw box text never reaches the terminal: the answer's escapes show as \\x1b, its bidi
    override as \\u{202e}, and the refusal's stderr likewise."""
    monkeypatch.setenv("RGT_HOME", str(tmp_path / "state"))
    script = tmp_path / "fake_onbox.py"
    script.write_text(FAKE_ONBOX)
    with Store.open() as store:
        store.add_host("local", ssh="", onbox=shlex.join([sys.executable, str(script)]))
    shown = rgt("deadman", "local", "status")
    assert shown.returncode == 0, shown.stderr
    assert not any(c in shown.stdout for c in UNSAFE), shown.stdout
    lines = shown.stdout.splitlines()
    assert len(lines) == 6 and "renewed by ctl\\x1b[2J\\x1b[H" in lines[1]
    assert lines[4] == ("  now          armed: ok\\x0d\\x1b[32mgate OPEN\\x9b0m "
                        "\\x1b]52;c;cm0gLXJmIH4K\\x07")
    assert "stop\\u{2028}FAKE: \\u{202e}txt.exe" in lines[5]
    as_json = rgt("deadman", "local", "status", "--json")
    assert as_json.stdout.isascii() and json.loads(as_json.stdout)["decision"]["reason"].endswith("\x07")
    refused = rgt("deadman", "local", "renew")
    assert refused.returncode == 1 and not any(c in refused.stderr for c in UNSAFE)
    assert "error: local refused `deadman renew`: refused\\x1b]0;pwned\\x07 / \\x1b[2J\\u{202e}no lease" \
        in refused.stderr
