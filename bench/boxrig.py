"""What the SSH benchmarks share: a throw-away sshd box, `rgt` against it, and a clean end.

    with BoxRig() as rig:
        run, run_dir = rig.launch(sys.executable, "-c", JOB)
        ...
The job must end once `<run_dir>/stop` exists; at the end the rig writes it, waits for the
sidecar's stop to reach the store, stops the watchers it started (by pid) and the sshd.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import List, Optional, Sequence, Tuple, Type

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.sshbox import SshBox  # noqa: E402

# `rgt hosts add --onbox` takes shell text: this checkout's sidecar CLI, its path quoted.
ONBOX = shlex.join([sys.executable, "-m", "onbox.cli"])

RESULTS = REPO / "bench" / "results"


class BoxRig:
    def __init__(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up on SIGTERM too
        self.root = Path(tempfile.mkdtemp(prefix="rgtbench-", dir="/tmp"))
        self.box = SshBox(self.root)
        self.home = self.root / "rgt-home"
        self.env = {**os.environ, "RGT_HOME": str(self.home), "PYTHONPATH": str(REPO)}
        self.rgt = [sys.executable, "-m", "controller.cli.main"]
        self.runs: List[Tuple[str, Path]] = []

    def __enter__(self) -> BoxRig:
        self.box.start()
        self.env["RGT_SSH_CONFIG"] = str(self.box.config_file)
        self.call("hosts", "add", "box", "--ssh", self.box.alias, "--onbox", ONBOX)
        return self

    def call(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.rgt, *args], env=self.env, capture_output=True, text=True, check=True,
                              timeout=1800)

    def add_hosts(self, names: Sequence[str]) -> None:
        """More host records for this box, each its own ssh alias (so each gets its own
        ControlMaster, as separate boxes would) and its own root, <box home>/NAME."""
        base = self.box.config_file.read_text()
        head = f"Host {self.box.alias}\n"
        blocks = [base, *(base.replace(head, f"Host {name}\n", 1) for name in names)]
        config = self.root / "ssh_config_hosts"
        config.write_text("\n".join(blocks))
        self.env["RGT_SSH_CONFIG"] = str(config)
        for name in names:
            self.call("hosts", "add", name, "--ssh", name, "--onbox", ONBOX,
                      "--root", str(self.box.home / name))

    def launch(self, *command: str, onbox_args: Tuple[str, ...] = (), host: str = "box",
               root: Optional[Path] = None) -> Tuple[str, Path]:
        where = root or self.box.home / "runs"
        out = self.call("launch", host, "--root", str(where), "--json",
                        "--onbox-arg=--no-preflight", "--onbox-arg=--sidecar-linger=0s",
                        "--onbox-arg=--serve-arg=--no-kmsg", *onbox_args, "--", *command)
        answer = json.loads(out.stdout.strip().splitlines()[-1])
        self.runs.append((answer["run_id"], Path(answer["run_dir"])))
        return self.runs[-1]

    def stored(self, run: str, kind: str) -> int:
        """How many events of `kind` the controller has stored so far."""
        os.environ["RGT_HOME"] = str(self.home)
        from controller.store.db import Store

        with Store.open() as store:
            return len(store.events(run, kind_prefix=kind))

    def wait_stored(self, run: str, kind: str, count: int = 1, timeout_s: float = 30) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.stored(run, kind) < count:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)  # polling another process's database
        return True

    def __exit__(self, kind: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        from controller.follow import client

        try:
            for run, run_dir in self.runs:
                (run_dir / "stop").write_text("")
                self.wait_stored(run, "sidecar.stopping")  # let the job end before the box goes
                _wait_gone(run_dir)
            os.environ["RGT_HOME"] = str(self.home)
            for run, _ in self.runs:
                client.unfollow(run)
            client.stop_daemon()
        finally:
            self.box.close()
            shutil.rmtree(self.root, ignore_errors=True)


def _wait_gone(run_dir: Path, timeout_s: float = 15.0) -> None:
    """Until no process names run_dir on its command line (the supervisor, the sidecar)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = False
        for proc in psutil.process_iter(["cmdline"]):
            if str(run_dir) in " ".join(proc.info["cmdline"] or []):
                busy = True
                break
        if not busy:
            return
        time.sleep(0.1)


def write_results(name: str, report: object) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path
