"""Finding the places a job really writes its checkpoints, beyond $RGT_CKPT_DIR.

Each `Locator.tick()` (custody runs it every few seconds) returns the places found since the last
one, each once, as (absolute directory, how):

- "hint": a `output_dir` hint, or the parent of a `checkpoint` hint's path (rgt/hints.jsonl, written
  by the framework integrations: `onbox.hints`);
- "trainer_state": a `checkpoint-N/trainer_state.json` under the job's cwd: its output_dir (HF);
- "lightning": a `.../version_N/checkpoints` directory under the job's cwd (Lightning's dirpath);
- "open_for_write": a file of >= `min_open_bytes` that the job or one of its descendants holds
  open for writing (/proc/PID/fd plus the access mode in /proc/PID/fdinfo): its unit's parent.

The cwd walk is bounded (depth `max_depth`, at most `max_entries` entries per tick, never into
hidden, virtualenv or cache directories, nor a directory of more than `max_dir_entries`), so a
dataset next to the code costs a capped number of stat calls. A place that is `/`, the home
directory or an ancestor of the run dir is refused (it would watch far too much): it is returned
once in `refused`, and the gate's scan still names the files found there.

Checkpoint hints are handed on as they come (`hinted`): custody commits the named unit at once.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

from onbox.custody.units import is_unit_dir
from onbox.hints import HintReader

_SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", "venv", ".venv", "env", "wandb",
                        "rgt", ".git", "dist-packages"})
_LIGHTNING = re.compile(r"^version_\d+$")
_HF = re.compile(r"^checkpoint-\d+$")
_TMP_HF = re.compile(r"^tmp-checkpoint-\d+$")
_LOGGISH = (".log", ".txt", ".jsonl", ".csv", ".out", ".err")
Place = Tuple[Path, str]


class Locator:
    def __init__(self, run_dir: Path, job_cwd: Optional[Path], job_pid: Optional[int], *,
                 proc: str = "/proc", min_open_bytes: int = 1 << 20, max_depth: int = 4,
                 max_entries: int = 5000, max_dir_entries: int = 1000) -> None:
        self.run_dir = Path(os.path.realpath(run_dir))
        self.job_cwd = Path(os.path.realpath(job_cwd)) if job_cwd else None
        self.job_pid = job_pid
        self.proc = proc
        self.min_open_bytes = min_open_bytes
        self.max_depth = max_depth
        self.max_entries = max_entries
        self.max_dir_entries = max_dir_entries
        self.hints = HintReader(run_dir)
        self.hinted: List[Dict[str, Any]] = []
        self.refused: List[Place] = []
        self.open_files: Set[str] = set()   # every large file seen open for writing
        self._seen: Set[str] = set()
        self._waiting: List[Place] = []

    # ---- the tick -----------------------------------------------------------------------------

    def tick(self, watched: List[Path]) -> List[Place]:
        """New places (each once); checkpoint hints pile up in `hinted` for the caller to take."""
        found: List[Place] = []
        for hint in self.hints.poll():
            path = self._abs(hint["path"])
            if hint["kind"] == "checkpoint":
                self.hinted.append({**hint, "path": str(path)})
                found.append((path.parent, "hint"))
            elif hint["kind"] == "step":
                found.append((path.parent, "hint"))  # custody reads the step itself (CustodyCore)
            else:
                found.append((path, "hint"))
        if self.job_cwd is not None:
            found += [(p, how) for p, how in self._scan_cwd()]
        found += [(p, "open_for_write") for p in self._open_places()]
        return self._fresh(found, watched)

    def _abs(self, path: str) -> Path:
        p = Path(path)
        if not p.is_absolute():
            p = (self.job_cwd or self.run_dir) / p
        return Path(os.path.realpath(p))

    def _fresh(self, found: List[Place], watched: List[Path]) -> List[Place]:
        out: List[Place] = []
        waiting, self._waiting = self._waiting, []
        for path, how in waiting + found:
            path = Path(os.path.realpath(path))
            key = str(path)
            if key in self._seen or any(_under(path, w) for w in watched):
                continue
            if not path.is_dir():
                if len(self._waiting) < 64 and (path, how) not in self._waiting:
                    self._waiting.append((path, how))  # a hinted place not made yet
                continue
            self._seen.add(key)
            if self._too_broad(path):
                self.refused.append((path, how))
                continue
            out.append((path, how))
        return out

    def _too_broad(self, path: Path) -> bool:
        home = os.path.realpath(os.path.expanduser("~"))
        return str(path) in ("/", home) or _under(self.run_dir, path) or str(path).startswith(
            str(self.run_dir / "rgt"))

    # ---- the job's cwd ------------------------------------------------------------------------

    def _scan_cwd(self) -> Iterator[Place]:
        assert self.job_cwd is not None
        budget = [self.max_entries]
        yield from self._walk(self.job_cwd, 0, budget)

    def _walk(self, top: Path, depth: int, budget: List[int]) -> Iterator[Place]:
        if depth > self.max_depth or budget[0] <= 0:
            return
        try:
            with os.scandir(top) as it:
                entries = []
                for e in it:
                    entries.append(e)
                    if len(entries) > self.max_dir_entries:
                        return
        except OSError:
            return
        budget[0] -= len(entries)
        for e in entries:
            try:
                if not e.is_dir(follow_symlinks=False):
                    continue
            except OSError:
                continue
            name = e.name
            if name.startswith(".") or name in _SKIP_DIRS:
                continue
            here = Path(e.path)
            if _HF.match(name) and (here / "trainer_state.json").is_file():
                yield top, "trainer_state"
                continue
            if name == "checkpoints" and _LIGHTNING.match(top.name):
                yield here, "lightning"
                continue
            if is_unit_dir(name):
                continue
            yield from self._walk(here, depth + 1, budget)

    # ---- /proc --------------------------------------------------------------------------------

    def _pids(self) -> List[int]:
        """The job and its descendants (by ppid, from /proc/*/stat)."""
        if not self.job_pid:
            return []
        children: Dict[int, List[int]] = {}
        try:
            names = os.listdir(self.proc)
        except OSError:
            return []
        for name in names:
            if not name.isdigit():
                continue
            try:
                with open(f"{self.proc}/{name}/stat", "rb") as f:
                    raw = f.read(4096)
                ppid = int(raw[raw.rindex(b")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
        out: List[int] = []
        todo = [self.job_pid]
        while todo and len(out) < 4096:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    def open_for_write(self) -> List[Path]:
        """Large regular files the job's processes hold open for writing."""
        out: Dict[str, Path] = {}
        for pid in self._pids():
            fd_dir = f"{self.proc}/{pid}/fd"
            try:
                fds = os.listdir(fd_dir)
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(f"{fd_dir}/{fd}")
                    if not target.startswith("/") or target.startswith(("/dev/", "/proc/", "/sys/")):
                        continue
                    if not _writable(f"{self.proc}/{pid}/fdinfo/{fd}"):
                        continue
                    st = os.stat(target)
                except (OSError, ValueError):
                    continue
                if st.st_size >= self.min_open_bytes and os.path.isfile(target):
                    out[target] = Path(target)
        return sorted(out.values())

    def _open_places(self) -> List[Path]:
        places = []
        for path in self.open_for_write():
            if path.name.lower().endswith(_LOGGISH) or "tfevents" in path.name:
                continue
            if path.parent == self.run_dir or _under(path, self.run_dir / "rgt"):
                continue  # the run's own logs and files
            self.open_files.add(str(path))
            place = path.parent
            for anc in [path.parent, *path.parent.parents][:3]:
                if is_unit_dir(anc.name) or _TMP_HF.match(anc.name):
                    place = anc.parent
                    break
            places.append(place)
        return places


def _writable(fdinfo: str) -> bool:
    with open(fdinfo, encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("flags:"):
                return int(line.split()[1], 8) & 3 in (os.O_WRONLY, os.O_RDWR)
    return False


def _under(path: Path, top: Path) -> bool:
    return path == top or top in path.parents


__all__ = ["Locator", "Place"]
