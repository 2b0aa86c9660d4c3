"""Checkpoint custody records: <run>/rgt/manifest.jsonl.

One JSON object per line, appended by the custody worker once a committed checkpoint unit has been
hashed and has passed its structural check. A file unit (a `.pt`, a Lightning `.ckpt`, a
`.safetensors`):

    {"v": 1, "path": "checkpoints/step000100.pt", "size": 2717, "sha256": "...",
     "mtime_ns": ..., "inode": ..., "step": 100, "format": "torch", "ts": 1795990000.1}

A directory unit (HF `checkpoint-N/`, DeepSpeed `global_stepN/`, FSDP shard dirs) adds
`"kind": "dir"` and `files`, one entry per file (path relative to the unit):

    {"v": 1, "kind": "dir", "path": "out/checkpoint-50", "size": <total>, "sha256": <unit digest>,
     "mtime_ns": <newest file's>, "inode": <the directory's>, "step": 50, "format": "hf", "ts": ...,
     "files": [{"path": "model.safetensors", "size": .., "sha256": .., "mtime_ns": .., "inode": ..}]}

The unit digest is the SHA-256 of the sorted lines "relpath\\0size\\0sha256\\n" (UTF-8), one per
file (`rgtlib.hashing.unit_digest`). `path` is relative to the run dir; a unit outside the run
dir (the job wrote it where its framework writes, e.g. HF's output_dir under the job's cwd) has an
absolute `path` and `root`, the watched place it was found under. Every field added after the
first format has a default, so old files read the same and old readers (which take the first
format's fields) still read new lines.

Removals are lines of their own, never a rewrite:

    {"v": 1, "op": "removed", "path": "out/checkpoint-10", "sha256": "...", "by": "job",
     "reason": "...", "ts": ...}

`by` is "job" (the job's own rotation: HF save_total_limit, Lightning save_top_k) or "other"
(anything else: it stays suspect). A removal covers the records of its path written before it.

A committed unit that failed its check (or whose check raised) is never left out: it gets a suspect
line, with what was hashed (`files` for a directory unit) so a restarted custody does not judge it
again:

    {"v": 1, "op": "suspect", "path": "checkpoints/step5.safetensors", "code": "bad_structure",
     "reason": "...", "ts": ..., "kind": "file", "size": .., "sha256": .., "mtime_ns": .., "inode": ..}

A suspect line is live (`live_suspects`: the run's verdict fails, the pull's verification names it)
until a record of the same path written at or after it (the unit was saved again and passed).
Readers of records (`read`) skip it like a removal line.

A record no longer matches once any of its files changed (size, mtime_ns, inode) and is not trusted
until a newer record covers it. The launcher resumes from `newest_good()`: the unit itself (the
directory for HF, the `.ckpt` file for Lightning).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

FILENAME = "manifest.jsonl"
VERSION = 1
FILE = "file"
DIR = "dir"
BY = ("job", "other")
MAX_REASON = 1000
_BASE = ("path", "size", "sha256", "mtime_ns", "inode", "step", "format", "ts")


@dataclasses.dataclass(frozen=True)
class UnitFile:
    """One file of a directory unit; `path` is relative to the unit."""

    path: str
    size: int
    sha256: str
    mtime_ns: int
    inode: int

    @property
    def key(self) -> Tuple[int, int, int]:
        return self.size, self.mtime_ns, self.inode


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
    kind: str = FILE
    files: Tuple[UnitFile, ...] = ()
    root: Optional[str] = None

    @property
    def key(self) -> Tuple[int, int, int]:
        """(size, mtime_ns, inode): what pins the hashed bytes to a file unit."""
        return self.size, self.mtime_ns, self.inode

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"v": VERSION, **{k: getattr(self, k) for k in _BASE}}
        if self.kind != FILE:
            out["kind"] = self.kind
            out["files"] = [dataclasses.asdict(f) for f in self.files]
        if self.root is not None:
            out["root"] = self.root
        return out

    def location(self, run_dir: Path) -> Path:
        """Where the unit is on this box (an absolute `path` stays as it is)."""
        return Path(run_dir) / self.path

    def matches(self, run_dir: Path) -> bool:
        """Every file is still exactly what was hashed (same size, mtime and inode)."""
        where = self.location(run_dir)
        if self.kind != DIR:
            return _key_of(where) == self.key
        return bool(self.files) and all(_key_of(where / f.path) == f.key for f in self.files)


@dataclasses.dataclass(frozen=True)
class Suspect:
    """A committed unit custody judged bad (or could not judge): recorded, never left out."""

    path: str
    code: str
    reason: str
    ts: float
    kind: str = FILE
    size: Optional[int] = None
    sha256: Optional[str] = None
    mtime_ns: Optional[int] = None
    inode: Optional[int] = None
    files: Tuple[UnitFile, ...] = ()
    root: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"v": VERSION, "op": "suspect", "path": self.path, "code": self.code,
                               "reason": self.reason[:MAX_REASON], "ts": self.ts, "kind": self.kind,
                               "size": self.size, "sha256": self.sha256, "mtime_ns": self.mtime_ns,
                               "inode": self.inode}
        if self.kind == DIR:
            out["files"] = [dataclasses.asdict(f) for f in self.files]
        if self.root is not None:
            out["root"] = self.root
        return out

    def signature(self) -> Any:
        """What custody compares a unit with (its key, or a directory's sorted (path, key))."""
        if self.kind == DIR:
            return tuple(sorted((f.path, f.key) for f in self.files)) or None
        if self.size is None or self.mtime_ns is None or self.inode is None:
            return None
        return self.size, self.mtime_ns, self.inode


@dataclasses.dataclass(frozen=True)
class Removal:
    path: str
    sha256: str
    by: str
    reason: str
    ts: float

    def to_dict(self) -> Dict[str, Any]:
        return {"v": VERSION, "op": "removed", **dataclasses.asdict(self)}


def _key_of(path: Path) -> Optional[Tuple[int, int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def _append_line(run_dir: Path, doc: Dict[str, Any]) -> None:
    path = Path(run_dir) / "rgt" / FILENAME
    line = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def append(run_dir: Path, record: Record) -> None:
    """Append one record as a whole line and fsync it."""
    _append_line(run_dir, record.to_dict())


def append_removal(run_dir: Path, removal: Removal) -> None:
    """Append one removal line and fsync it."""
    _append_line(run_dir, removal.to_dict())


def append_suspect(run_dir: Path, suspect: Suspect) -> None:
    """Append one suspect line and fsync it."""
    _append_line(run_dir, suspect.to_dict())


def _lines(run_dir: Path) -> List[Dict[str, Any]]:
    try:
        raw = (Path(run_dir) / "rgt" / FILENAME).read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in raw.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("v") == VERSION:
            out.append(obj)
    return out


def _files(value: Any) -> Tuple[UnitFile, ...]:
    if not isinstance(value, list):
        raise TypeError("files must be a list")
    names = [f.name for f in dataclasses.fields(UnitFile)]
    return tuple(UnitFile(**{k: item[k] for k in names}) for item in value)


def _record(obj: Dict[str, Any]) -> Record:
    kind = obj.get("kind", FILE)
    if kind not in (FILE, DIR):
        raise TypeError(f"unknown record kind {kind!r}")
    root = obj.get("root")
    if root is not None and not isinstance(root, str):
        raise TypeError("root must be a string")
    files = _files(obj.get("files")) if kind == DIR else ()
    if not isinstance(obj["path"], str):
        raise TypeError("path must be a string")
    return Record(**{k: obj[k] for k in _BASE}, kind=kind, files=files, root=root)


def read(run_dir: Path) -> List[Record]:
    """Every well-formed record, oldest first; removals, torn and foreign lines are skipped."""
    out: List[Record] = []
    for obj in _lines(run_dir):
        if "op" in obj:
            continue
        try:
            out.append(_record(obj))
        except (KeyError, TypeError):
            continue
    return out


def removals(run_dir: Path) -> List[Removal]:
    """Every well-formed removal line, oldest first."""
    out: List[Removal] = []
    for obj in _lines(run_dir):
        if obj.get("op") != "removed":
            continue
        try:
            rem = Removal(path=obj["path"], sha256=obj["sha256"], by=obj["by"],
                          reason=str(obj.get("reason", "")), ts=float(obj["ts"]))
        except (KeyError, TypeError, ValueError):
            continue
        if isinstance(rem.path, str) and isinstance(rem.sha256, str) and rem.by in BY:
            out.append(rem)
    return out


def _opt_int(value: Any) -> Optional[int]:
    return value if type(value) is int else None


def suspects(run_dir: Path) -> List[Suspect]:
    """Every well-formed suspect line, oldest first."""
    out: List[Suspect] = []
    for obj in _lines(run_dir):
        if obj.get("op") != "suspect":
            continue
        try:
            kind = obj.get("kind", FILE)
            files = _files(obj.get("files")) if kind == DIR else ()
            item = Suspect(path=obj["path"], code=str(obj.get("code") or "suspect"),
                           reason=str(obj.get("reason") or "")[:MAX_REASON], ts=float(obj["ts"]), kind=kind,
                           size=_opt_int(obj.get("size")), mtime_ns=_opt_int(obj.get("mtime_ns")),
                           inode=_opt_int(obj.get("inode")), files=files,
                           sha256=obj["sha256"] if isinstance(obj.get("sha256"), str) else None,
                           root=obj["root"] if isinstance(obj.get("root"), str) else None)
        except (KeyError, TypeError, ValueError):
            continue
        if isinstance(item.path, str) and kind in (FILE, DIR):
            out.append(item)
    return out


def live_suspects(run_dir: Path) -> List[Suspect]:
    """The newest suspect line per path that no record of that path written at or after it covers."""
    newest: Dict[str, float] = {}
    for record in read(run_dir):
        newest[record.path] = max(record.ts, newest.get(record.path, record.ts))
    latest: Dict[str, Suspect] = {}
    for item in suspects(run_dir):
        latest[item.path] = item
    return [s for s in latest.values() if newest.get(s.path, float("-inf")) < s.ts]


def removal_of(record: Record, rems: Sequence[Removal]) -> Optional[Removal]:
    """The removal that covers `record` (same path, written at or after it), or None."""
    found = None
    for rem in rems:
        if rem.path == record.path and rem.ts >= record.ts:
            found = rem
    return found


def newest_good(run_dir: Path) -> Optional[Path]:
    """The newest recorded unit, not removed, whose files all still match their record: the
    directory of a directory unit (what HF's resume_from_checkpoint wants), else the file."""
    rems = removals(run_dir)
    for record in sorted(read(run_dir), key=lambda r: (r.ts, r.step or -1), reverse=True):
        if removal_of(record, rems) is None and record.matches(run_dir):
            return record.location(run_dir)
    return None


__all__ = ["BY", "DIR", "FILE", "Record", "Removal", "Suspect", "UnitFile", "append", "append_removal",
           "append_suspect", "live_suspects", "newest_good", "read", "removal_of", "removals", "suspects"]
