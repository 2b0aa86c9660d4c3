"""A compromised box on the real test sshd: the host's `--onbox` is evil/onbox.py reading a scenario."""
from __future__ import annotations

import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import psutil

from onbox.runs import wait_for

HERE = Path(__file__).resolve().parent


class EvilBox:
    """One scenario directory on the box; `rgt hosts add NAME --onbox` points at it."""

    def __init__(self, root: Path, name: str = "evil") -> None:
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.scenario = self.dir / "scenario.json"
        self.write({})

    @property
    def onbox(self) -> str:
        return shlex.join([sys.executable, str(HERE / 'onbox.py'), str(self.scenario)])

    @property
    def runs_root(self) -> Path:
        return self.dir / "runs"

    def write(self, scenario: Dict[str, Any]) -> None:
        self.scenario.write_text(json.dumps(scenario, ensure_ascii=True))

    def calls(self) -> List[List[str]]:
        path = self.dir / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def requests(self) -> List[Dict[str, Any]]:
        path = self.dir / "requests.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def sidecar_pid(self) -> Optional[int]:
        path = self.dir / "sidecar.pid"
        return int(path.read_text()) if path.exists() else None

    def end(self) -> None:
        """End the fake sidecar this scenario started, by its pid."""
        pid = self.sidecar_pid()
        if pid is None:
            return
        try:
            proc = psutil.Process(pid)
            if any(str(HERE / "sidecar.py") == part for part in proc.cmdline()):
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda: not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE, 10.0)
        except psutil.NoSuchProcess:
            pass
        (self.dir / "sidecar.pid").unlink()


def good_launch(pid: int = 4242) -> Dict[str, Any]:
    """What an honest rgt-onbox answers: the run id it was asked for, its run dir named after it."""
    return {"run_id": "{run_id}", "run_dir": "{root}/proj/active/{run_id}", "pid": pid,
            "sidecar_supervisor_pid": None, "project": "proj", "job_pid": pid, "attempt": 1,
            "train_log": "{root}/proj/active/{run_id}/train.log", "resume_from": None, "preflight": "skipped",
            "warnings": [], "secrets": [], "group": None, "node": None}


def event(seq: int, run: str = "{run_id}", kind: str = "sidecar.heartbeat", **data: Any) -> Dict[str, Any]:
    """An event frame as a sidecar journals it."""
    return {"v": 1, "run": run, "host": "evilbox", "seq": seq, "ts": 1767225600.0 + seq, "kind": kind,
            "sev": "info", "data": data}
