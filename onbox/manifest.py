"""Checkpoint custody records: <run>/rgt/manifest.jsonl.

One JSON object per line, appended by the custody worker once a committed
checkpoint has been hashed and has passed its structural check:

    {"v": 1, "path": "checkpoints/step000100.pt", "size": 2717, "sha256": "...",
     "mtime_ns": ..., "inode": ..., "step": 100, "format": "torch", "ts": 1795990000.1}

`path` is relative to the run dir. A file rewritten after it was recorded no
longer matches its record (size, mtime_ns, inode) and is not trusted until a
newer record covers it. The launcher resumes from `newest_good()`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

FILENAME = "manifest.jsonl"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class Record:
    path: str
    size: int
    sha256: str
    mtime_ns: int
    inode: int
    step: Optional[int]
    format: str
    ts: float

    @property
    def key(self) -> Tuple[int, int, int]:
        """(size, mtime_ns, inode): what pins the hashed bytes to the file."""
        return self.size, self.mtime_ns, self.inode

    def to_dict(self) -> Dict[str, Any]:
        return {"v": VERSION, **dataclasses.asdict(self)}

    def matches(self, run_dir: Path) -> bool:
        """The file is still exactly what was hashed (same size, mtime and inode)."""
        try:
            st = os.stat(Path(run_dir) / self.path)
        except OSError:
            return False
        return (st.st_size, st.st_mtime_ns, st.st_ino) == self.key


def append(run_dir: Path, record: Record) -> None:
    """Append one record as a whole line and fsync it."""
    path = Path(run_dir) / "rgt" / FILENAME
    line = (json.dumps(record.to_dict(), separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read(run_dir: Path) -> List[Record]:
    """Every well-formed record, oldest first; torn or foreign lines are skipped."""
    path = Path(run_dir) / "rgt" / FILENAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    out: List[Record] = []
    fields = {f.name for f in dataclasses.fields(Record)}
    for line in raw.splitlines():
        try:
            obj = json.loads(line)
            if obj.get("v") != VERSION:
                continue
            out.append(Record(**{k: obj[k] for k in fields}))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def newest_good(run_dir: Path) -> Optional[Path]:
    """The newest recorded checkpoint whose file still matches its record."""
    for record in sorted(read(run_dir), key=lambda r: (r.ts, r.step or -1), reverse=True):
        if record.matches(run_dir):
            return Path(run_dir) / record.path
    return None
