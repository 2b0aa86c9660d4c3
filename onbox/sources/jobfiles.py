"""Find and follow the files training frameworks write by default under the job's working directory.

`scan(root)` is a bounded breadth-first walk (never the whole disk): directories down to
`MAX_DEPTH` below the root, at most `MAX_DIRS` directories and `MAX_ENTRIES` entries a scan, no
symlinked directories, no hidden or environment directories (``.git``, ``node_modules``,
``site-packages``, ``wandb``, ...). It finds

- ``checkpoint-N/trainer_state.json`` (Hugging Face; the checkpoint directory itself is not listed)
  and a ``trainer_state.json`` beside them (the Trainer's ``save_state``),
- ``version_N/metrics.csv`` (Lightning's CSVLogger),
- ``events.out.tfevents.*`` (TensorBoard, as Lightning's default logger and the Trainer write them).

`JobFiles` re-scans every `scan_s` and polls what it found: the CSV and event files on each poll,
the trainer_state.json files at each scan (they are written once per checkpoint). `poll()` gives one
`SourceRead` per source name ("hfstate", "csv", "tfevents"); the readers are in
`onbox.sources.hfstate`, `onbox.sources.csvlog` and `onbox.sources.tfevents`.

At start, a file with a saved position resumes there; a file older than the run (its mtime before
`since`) is counted as read without judging it (last week's run in the same directory); any other
file found then is history (`start()` marks it so, for a quiet replay). Files found later are new.
"""
from __future__ import annotations

import collections
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Tuple, Union

from onbox.sources.csvlog import CsvLogReader
from onbox.sources.hfstate import HfStateSource
from onbox.sources.metrics import SourceRead
from onbox.sources.tfevents import TfEventsReader

log = logging.getLogger(__name__)

MAX_DEPTH = 4
MAX_DIRS = 400
MAX_ENTRIES = 20_000
MAX_FILES = 64            # CSV + event files followed at once (the newest by name are kept)
SOURCES = ("hfstate", "csv", "tfevents")
SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", "dist-packages", "venv", "env", "wandb",
             "mlruns", "rgt", "export", "quarantine"}
_CKPT = re.compile(r"checkpoint-\d+$")
_VERSION = re.compile(r"version_\d+$")

Found = Dict[str, List[Path]]
Reader = Union[CsvLogReader, TfEventsReader]


def scan(root: Path, max_depth: int = MAX_DEPTH, max_dirs: int = MAX_DIRS,
         max_entries: int = MAX_ENTRIES) -> Found:
    """The framework files under `root` (see the module doc); never raises for unreadable dirs."""
    found: Found = {name: [] for name in SOURCES}
    queue: Deque[Tuple[str, int]] = collections.deque([(str(root), 0)])
    dirs = entries = 0
    while queue and dirs < max_dirs and entries < max_entries:
        path, depth = queue.popleft()
        dirs += 1
        try:
            it = os.scandir(path)
        except OSError:
            continue
        with it:
            for entry in it:
                entries += 1
                if entries > max_entries:
                    break
                _visit(entry, depth, os.path.basename(path), found, queue, max_depth)
    return found


def _visit(entry: os.DirEntry[str], depth: int, parent: str, found: Found,
           queue: Deque[Tuple[str, int]], max_depth: int) -> None:
    name = entry.name
    try:
        if entry.is_dir(follow_symlinks=False):
            if _CKPT.match(name):
                state = os.path.join(entry.path, "trainer_state.json")
                if os.path.isfile(state):
                    found["hfstate"].append(Path(state))
            elif depth + 1 < max_depth and not name.startswith(".") and name not in SKIP_DIRS:
                queue.append((entry.path, depth + 1))
        elif entry.is_file(follow_symlinks=False):
            if name.startswith("events.out.tfevents."):
                found["tfevents"].append(Path(entry.path))
            elif name == "metrics.csv" and _VERSION.match(parent):
                found["csv"].append(Path(entry.path))
            elif name == "trainer_state.json":
                found["hfstate"].append(Path(entry.path))
    except OSError:
        return


def _mtime(path: Path) -> Optional[float]:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


class JobFiles:
    """The framework files of one job (see the module doc)."""

    def __init__(self, root: Optional[Path], *, scan_s: float = 5.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.root = Path(root) if root is not None else None
        self.scan_s = scan_s
        self._mono = monotonic
        self.hf = HfStateSource()
        self.readers: Dict[str, Reader] = {}
        self._saved: Dict[str, Any] = {}
        self._hf_paths: List[Path] = []
        self._scanned_at: Optional[float] = None
        self._failed = False

    # ---- state --------------------------------------------------------------------------------

    def state(self) -> Dict[str, Any]:
        files = {p: {"kind": r.name, **r.position()} for p, r in self.readers.items()}
        return {"hfstate": self.hf.state(), "files": files}

    def bad(self) -> Dict[str, Tuple[int, Optional[str]]]:
        """Bad records per source: (count, a path that had one)."""
        out = {"hfstate": (self.hf.bad, self.hf.bad_path)}
        for name in ("csv", "tfevents"):
            readers = [r for r in self.readers.values() if r.name == name and r.bad]
            out[name] = (sum(r.bad for r in readers), str(readers[0].path) if readers else None)
        return out

    # ---- reading ------------------------------------------------------------------------------

    def start(self, saved: Mapping[str, Any], since: float) -> Dict[str, Tuple[SourceRead, SourceRead]]:
        """The first scan: per source, (history to replay quietly, restored new data to judge)."""
        hf_saved = _dict(saved.get("hfstate"))
        self.hf.restore(hf_saved)
        files = saved.get("files")
        self._saved = dict(files) if isinstance(files, dict) else {}
        found = self._scan(self._mono())
        out = {name: (SourceRead(), SourceRead()) for name in SOURCES}
        old = [p for p in found["hfstate"] if str(p) not in self.hf.seen and (_mtime(p) or 0) < since]
        self.hf.mark_seen(old)
        replay = not hf_saved
        self._merge(out["hfstate"][0 if replay else 1], self.hf.read(self._hf_paths))
        for path, reader in self.readers.items():
            saved_pos = _dict(self._saved.get(path))
            if self._restore(reader, saved_pos):
                self._merge(out[reader.name][1], reader.poll())
            elif (_mtime(reader.path) or 0) < since:
                reader.skip_to_end()
            else:
                self._merge(out[reader.name][0], reader.poll())
        return out

    def poll(self, force: bool = False) -> Dict[str, SourceRead]:
        """New records per source; `force` re-scans now (the job exited: read its last files)."""
        now = self._mono()
        out = {name: SourceRead() for name in SOURCES}
        if force or self._scanned_at is None or now - self._scanned_at >= self.scan_s:
            self._scan(now)
            self._merge(out["hfstate"], self.hf.read(self._hf_paths))
        for reader in list(self.readers.values()):
            self._merge(out[reader.name], reader.poll())
        return out

    def _scan(self, now: float) -> Found:
        self._scanned_at = now
        if self.root is None:
            return {name: [] for name in SOURCES}
        try:
            found = scan(self.root)
        except Exception:  # a seam boundary: an odd filesystem must not stop the tail
            if not self._failed:
                log.exception("scanning %s for framework files failed", self.root)
            self._failed = True
            return {name: [] for name in SOURCES}
        self._hf_paths = found["hfstate"]
        wanted = sorted(found["csv"] + found["tfevents"], key=_natural)[-MAX_FILES:]
        keep = {str(p) for p in wanted}
        for gone in [p for p in self.readers if p not in keep]:
            del self.readers[gone]
        for path in wanted:
            if str(path) not in self.readers:
                reader: Reader = CsvLogReader(path) if path.name == "metrics.csv" else TfEventsReader(path)
                self.readers[str(path)] = reader
        return found

    @staticmethod
    def _restore(reader: Reader, saved: Mapping[str, Any]) -> bool:
        if not saved or saved.get("kind") != reader.name:
            return False
        if isinstance(reader, CsvLogReader):
            return reader.restore(saved)
        inode, offset = saved.get("inode"), saved.get("offset")
        return isinstance(inode, int) and isinstance(offset, int) and reader.restore(inode, offset)

    @staticmethod
    def _merge(into: SourceRead, got: SourceRead) -> None:
        into.records += got.records
        into.new_bytes += got.new_bytes
        into.bad += got.bad
        if got.mtime is not None:
            into.mtime = max(into.mtime or 0.0, got.mtime)


def _natural(path: Path) -> List[Union[int, str]]:
    """version_2 before version_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def _dict(value: Any) -> Dict[str, Any]:
    return value if isinstance(value, dict) else {}


__all__ = ["JobFiles", "SOURCES", "scan"]
