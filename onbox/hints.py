"""Hints from inside the job: <run>/rgt/hints.jsonl, one JSON object per line.

The framework integrations (`onbox.integrations`) know things the sidecar can only guess: where a
checkpoint was just saved (and that its save is complete), where the framework writes its output.
They append one line per fact; the sidecar's custody and training monitors tail the file.

    {"v": 1, "kind": "checkpoint", "path": "/abs/out/checkpoint-50", "step": 50, "framework": "hf",
     "ts": 1795990000.1}
    {"v": 1, "kind": "output_dir", "path": "/abs/out", "framework": "hf", "ts": ...}

Kinds: "checkpoint" (a save finished: `path` is the file or directory the framework resumes from),
"step" (the file about to be renamed to `path`, inode `inode`, holds step `step`: written before the
rename by `rgt.report.save`, so custody knows the step of a ``latest.pt`` the moment it appears),
"output_dir" (a directory the framework writes checkpoints under), "removed" (the framework's own
rotation deleted the checkpoint at `path`: HF `save_total_limit`, Lightning `save_top_k`), and
"faulthandler" (the process `pid` dumps the Python stacks of all its threads into `path` when it
receives signal number `signal`; `path` is always <run>/rgt/stacks/<pid>.txt, `stacks_path()`):

    {"v": 1, "kind": "faulthandler", "pid": 4242, "signal": 12, "path": "/run/rgt/stacks/4242.txt",
     "framework": "hf", "ts": ...}

Each dump is appended to that file: a reader notes its size before sending the signal and reads
from there. Send the signal only to a pid that hinted it: the default action of SIGUSR2 ends a
process. `path` is absolute or relative to the job's cwd.

The job is on the same box as the sidecar but is still input: the reader drops lines that are not
objects of a known kind with a string path, caps line length and count, drops a "faulthandler"
hint whose path is not its pid's stack file, and never follows a path it was not asked to check.

Standard library only: the writer runs inside the job's own Python (3.9+), without the sidecar's
dependencies; it is a no-op when the job was not started by rgt (no RGT_RUN_DIR).
"""
from __future__ import annotations

import json
import os
import signal as _signal
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

FILENAME = "hints.jsonl"
VERSION = 1
KINDS = ("checkpoint", "step", "output_dir", "removed", "faulthandler")
STACKS_DIR = "stacks"
MAX_LINE_BYTES = 8192
MAX_READ_BYTES = 1 << 20


def hints_path(run_dir: Optional[str] = None) -> Optional[Path]:
    """<run>/rgt/hints.jsonl of this job (from RGT_RUN_DIR), or None outside an rgt launch."""
    base = run_dir if run_dir is not None else os.environ.get("RGT_RUN_DIR")
    return Path(base) / "rgt" / FILENAME if base else None


def stacks_path(run_dir: str, pid: int) -> Path:
    """<run>/rgt/stacks/<pid>.txt: where process `pid` dumps its stacks (the "faulthandler" hint)."""
    return Path(run_dir) / "rgt" / STACKS_DIR / f"{int(pid)}.txt"


def _valid_pid(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 31


def _valid_signal(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < _signal.NSIG


def write(kind: str, path: str, *, step: Optional[int] = None, framework: Optional[str] = None,
          run_dir: Optional[str] = None, pid: Optional[int] = None, signal: Optional[int] = None,
          inode: Optional[int] = None) -> bool:
    """Append one hint line (one write(2) of a whole line, O_APPEND); False when there is no run,
    the hint is malformed (a "faulthandler" hint needs `pid` and `signal`) or the write failed.
    Never raises: a hint must not break the training job."""
    target = hints_path(run_dir)
    if target is None or kind not in KINDS:
        return False
    doc: Dict[str, Any] = {"v": VERSION, "kind": kind, "path": os.path.abspath(str(path)), "ts": time.time()}
    if kind == "faulthandler":
        if not (_valid_pid(pid) and _valid_signal(signal)):
            return False
        doc["pid"], doc["signal"] = pid, signal
    if step is not None:
        doc["step"] = int(step)
    if inode is not None:
        doc["inode"] = int(inode)
    if framework:
        doc["framework"] = str(framework)
    line = (json.dumps(doc, separators=(",", ":")) + "\n").encode("utf-8", "replace")
    if len(line) > MAX_LINE_BYTES:
        return False
    try:
        fd = os.open(str(target), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def parse(line: bytes) -> Optional[Dict[str, Any]]:
    """One validated hint, or None for anything else."""
    if len(line) > MAX_LINE_BYTES:
        return None
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("v") != VERSION or doc.get("kind") not in KINDS:
        return None
    path = doc.get("path")
    if not isinstance(path, str) or not path or "\x00" in path or len(path) > 4096:
        return None
    out: Dict[str, Any] = {"kind": doc["kind"], "path": path}
    if doc["kind"] == "faulthandler":
        if not (_valid_pid(doc.get("pid")) and _valid_signal(doc.get("signal"))):
            return None
        out["pid"], out["signal"] = doc["pid"], doc["signal"]
    step = doc.get("step")
    if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 1 << 62:
        out["step"] = step
    inode = doc.get("inode")
    if isinstance(inode, int) and not isinstance(inode, bool) and 0 <= inode < 1 << 64:
        out["inode"] = inode
    if isinstance(doc.get("framework"), str):
        out["framework"] = doc["framework"][:32]
    ts = doc.get("ts")
    if isinstance(ts, (int, float)) and not isinstance(ts, bool) and 0 <= ts < 1e11:
        out["ts"] = float(ts)
    return out


class HintReader:
    """Tails <run>/rgt/hints.jsonl: `poll()` returns the hints appended since the last call."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "rgt" / FILENAME
        self._offset = 0
        self._inode: Optional[int] = None

    def poll(self) -> List[Dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._inode or st.st_size < self._offset:
                    self._inode, self._offset = st.st_ino, 0
                f.seek(self._offset)
                raw = f.read(MAX_READ_BYTES)
        except OSError:
            return []
        end = raw.rfind(b"\n")
        if end < 0:
            if len(raw) >= MAX_READ_BYTES:  # one line longer than a read: skip its bytes
                self._offset += len(raw)
            return []
        self._offset += end + 1
        out = []
        for line in raw[:end].split(b"\n"):
            hint = parse(line)
            if hint is None:
                continue
            if hint["kind"] == "faulthandler" and hint["path"] != os.path.abspath(
                    stacks_path(str(self.run_dir), hint["pid"])):
                continue  # a stack file is only ever <run>/rgt/stacks/<pid>.txt: nothing else is read
            out.append(hint)
        return out


__all__ = ["FILENAME", "KINDS", "STACKS_DIR", "HintReader", "hints_path", "parse", "stacks_path", "write"]
