"""`rgt-onbox launch --resume-from PATH --resume-sha256 HEX`: a checkpoint from elsewhere joins the run.

    request = requested(opts)                     # before anything starts: bad options are usage errors
    taken = take(run_dir, ckpt_dir, request)      # under the launch lock: hash, copy in, record

`rgt resume` pushes the old run's checkpoint into the new run's checkpoint dir, or names a durable
copy the new box sees (a network volume). PATH is a file unit (a `.pt`, a Lightning `.ckpt`) or a
directory unit (HF `checkpoint-N/`, a DeepSpeed or FSDP shard dir). A file must hash to the given
SHA-256; a directory's HEX is its unit digest (`rgtlib.hashing.unit_digest` over (relpath, size,
sha256) of every finished regular file under it, listed as custody lists a unit:
`onbox.custody.units.signature`, temporary names and symlinks left out). Else the launch is refused
(exit 3) and nothing starts. A unit outside the checkpoint dir is copied in first (a temporary
name, fsync of each file and directory, rename, fsync of the checkpoint dir), so the run owns its
own copy; then a custody record (rgt/manifest.jsonl; kind "dir" with its files for a directory) is
appended, so RGT_RESUME_FROM, `newest_good()` and the pull manifest all see it like a checkpoint
the job wrote. run.json keeps `record()` under "resume".

Standard library only; Python 3.9.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from rgtlib.hashing import sha256_whole, unit_digest

from onbox.custody import check, manifest, units
from onbox.custody.pullmanifest import ManifestError, sha256_state
from onbox.fsutil import fsync_dir
from onbox.launch.gates import LaunchRefused, LaunchUsageError

HASH_TRIES = 3
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
Key = Tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Request:
    source: Path
    sha256: str
    step: Optional[int]
    from_run: Optional[str]
    kind: str = manifest.FILE             # manifest.DIR when --resume-from names a directory unit


@dataclasses.dataclass(frozen=True)
class Taken:
    """The checkpoint the job resumes from, now in the run's custody."""

    path: Path
    sha256: str
    step: Optional[int]
    from_run: Optional[str]
    source: Path
    copied: bool
    kind: str = manifest.FILE
    files: int = 1

    def record(self) -> Dict[str, Any]:
        """run.json's "resume": where the unit is, what it hashes to (a directory: its unit digest),
        its step, the run it came from, whether it was copied in, and how many files it holds."""
        return {"path": str(self.path), "sha256": self.sha256, "step": self.step, "from_run": self.from_run,
                "source": str(self.source), "copied": self.copied, "kind": self.kind, "files": self.files}


def requested(resume_from: Optional[Path], sha256: Optional[str], step: Optional[int],
              resumes: Optional[str]) -> Optional[Request]:
    """The resume the options ask for, or None; LaunchUsageError (exit 2) for options that do not fit."""
    if resume_from is None:
        if sha256 is not None or step is not None:
            raise LaunchUsageError("--resume-sha256 and --resume-step describe --resume-from PATH, "
                                   "which is missing")
        return None
    if sha256 is None:
        raise LaunchUsageError("--resume-from needs --resume-sha256: a checkpoint from elsewhere is taken "
                               "only when its bytes are the ones meant",
                               f"sha256sum {resume_from} (on the machine the checkpoint came from; for a "
                               "directory, the unit digest its custody record or `rgt resume` names)")
    digest = sha256.strip().lower()
    if not _HEX64.match(digest):
        raise LaunchUsageError(f"--resume-sha256 {sha256[:80]!r} is not 64 hex digits")
    if step is not None and step < 0:
        raise LaunchUsageError(f"--resume-step {step} is below 0")
    source = Path(resume_from).expanduser().absolute()
    if source.is_dir():
        return Request(source=source, sha256=digest, step=step, from_run=resumes, kind=manifest.DIR)
    if not source.is_file():
        raise LaunchUsageError(f"--resume-from {source}: no such file or directory here",
                               "push it first (rgt resume does), or name a path this box sees")
    return Request(source=source, sha256=digest, step=step, from_run=resumes)


def _stat_key(st: os.stat_result) -> Key:
    return st.st_size, st.st_mtime_ns, st.st_ino


def _changing(path: Path) -> LaunchRefused:
    return LaunchRefused(f"{path} kept changing while it was hashed; refusing to resume from it",
                         "let whatever writes it finish, then launch again")


def hash_file(path: Path) -> Tuple[str, Key]:
    """(SHA-256, the (size, mtime_ns, inode) it belongs to); LaunchRefused if the file kept changing."""
    try:
        digest, st = sha256_state(path)
    except ManifestError as e:
        raise _changing(path) from e
    return digest, _stat_key(st)


def hash_dir(unit: Path) -> Tuple[str, Tuple[manifest.UnitFile, ...]]:
    """(unit digest, every file with its hash and key) of a directory unit, listed as custody lists
    one; LaunchRefused when its listing or a file kept changing while it was hashed."""
    for _ in range(HASH_TRIES):
        listing = units.signature(unit)
        files: List[manifest.UnitFile] = []
        try:
            for rel, key in listing:
                digest, got = hash_file(unit / rel)
                if got != key:
                    break
                files.append(manifest.UnitFile(rel, key[0], digest, key[1], key[2]))
        except (FileNotFoundError, LaunchRefused):
            continue
        if len(files) == len(listing) and units.signature(unit) == listing:
            return unit_digest((f.path, f.size, f.sha256) for f in files), tuple(files)
    raise _changing(unit)


def _mismatch(path: Path, found: str, want: str) -> LaunchRefused:
    what = "has the unit digest" if path.is_dir() else "hashes to SHA-256"
    return LaunchRefused(f"{path} {what} {found}, not the {want} it should have: refusing to "
                         "resume from it", "the copy is damaged or not the checkpoint meant: push it again "
                         "(rgt resume), or check both ends with sha256sum")


def _copy_file(source: Path, dest: Path) -> str:
    """source -> dest (a new file), hashed while copied and fsync'd; its SHA-256."""
    with open(source, "rb") as fin, open(dest, "xb") as fout:
        digest, _ = sha256_whole(fin, copy_to=fout)
        fout.flush()
        os.fsync(fout.fileno())
    return digest


def _copy_in(source: Path, dest: Path, want: str) -> None:
    """source -> a temporary name beside dest (hashed while copied, fsync'd) -> dest, then fsync the dir.
    A copy whose bytes do not hash to `want` is removed and refused."""
    tmp = dest.with_name(f".{dest.name}.rgt-resume-{os.getpid()}.tmp")
    try:
        found = _copy_file(source, tmp)
        if found != want:
            raise _mismatch(source, found, want)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(dest.parent, strict=True)


def _copy_tree(source: Path, tmp: Path) -> str:
    """Every file of the unit at `source` into the new directory `tmp` (each fsync'd, then each
    directory); the unit digest of what was written."""
    tmp.mkdir()
    dirs = {tmp}
    rows = []
    for rel, _key in units.signature(source):
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        up = target.parent
        while up != tmp and up not in dirs:
            dirs.add(up)
            up = up.parent
        digest = _copy_file(source / rel, target)
        rows.append((rel, target.stat().st_size, digest))
    for where in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        fsync_dir(where, strict=True)
    if not rows:
        raise LaunchRefused(f"--resume-from {source} holds no finished file: nothing to resume from",
                            "name the checkpoint directory itself (HF: out/checkpoint-N)")
    return unit_digest(rows)


def _copy_dir_in(source: Path, dest: Path, want: str) -> None:
    """The directory-unit `_copy_in`: a temporary directory (a dotted name custody never takes) ->
    dest by one rename, then fsync the checkpoint dir."""
    tmp = dest.with_name(f".{dest.name}.rgt-resume-{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a launch killed here before left it: this pid's own name
    try:
        found = _copy_tree(source, tmp)
        if found != want:
            raise _mismatch(source, found, want)
        os.rename(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(dest.parent, strict=True)


def _where(ckpt_dir: Path, req: Request) -> Tuple[bool, Path]:
    """(whether the unit already lies under the checkpoint dir, where it lives in the run)."""
    real_ckpt, real_source = Path(os.path.realpath(ckpt_dir)), Path(os.path.realpath(req.source))
    if real_source == real_ckpt or real_source in real_ckpt.parents:
        raise LaunchUsageError(f"--resume-from {req.source} is the run's checkpoint dir or holds it",
                               "name one checkpoint (a file, or a directory such as checkpoint-N)")
    inside = real_ckpt in real_source.parents
    return inside, real_source if inside else ckpt_dir / req.source.name


def _place(ckpt_dir: Path, req: Request) -> Tuple[Path, bool, Key]:
    """Where the file lives in the run, whether it was copied there, and the (size, mtime_ns,
    inode) its hash belongs to; refused on a mismatch."""
    inside, dest = _where(ckpt_dir, req)
    if inside or dest.exists():
        found, key = hash_file(dest) if dest.is_file() else ("", (0, 0, 0))
        if found == req.sha256:
            return dest, False, key
        if inside:
            raise _mismatch(req.source, found, req.sha256)
        raise _taken(dest, req.source)
    _copy_in(req.source, dest, req.sha256)
    return dest, True, _stat_key(os.stat(dest))  # nothing else writes here before the job starts


def _place_dir(ckpt_dir: Path, req: Request) -> Tuple[Path, bool, Tuple[manifest.UnitFile, ...]]:
    """`_place` for a directory unit: where it lives, whether it was copied, its hashed files."""
    inside, dest = _where(ckpt_dir, req)
    if inside or dest.exists():
        found, files = hash_dir(dest) if dest.is_dir() else ("", ())
        if files and found == req.sha256:
            return dest, False, files
        if inside and not files:
            raise LaunchRefused(f"--resume-from {req.source} holds no finished file: nothing to resume "
                                "from", "name the checkpoint directory itself (HF: out/checkpoint-N)")
        if inside:
            raise _mismatch(req.source, found, req.sha256)
        raise _taken(dest, req.source)
    _copy_dir_in(req.source, dest, req.sha256)
    found, files = hash_dir(dest)  # the keys the record pins; nothing else writes here before the job
    if found != req.sha256:
        raise _mismatch(dest, found, req.sha256)
    return dest, True, files


def _taken(dest: Path, source: Path) -> LaunchRefused:
    return LaunchRefused(f"{dest} exists and holds other bytes than {source}; refusing to replace it",
                         "resume into a new run id, or move that one away first")


def _format(path: Path) -> str:
    try:
        return check.check_path(path).format
    except OSError:
        return "unknown"


def _file_record(run_dir: Path, ckpt_dir: Path, req: Request, clock: Callable[[], float]
                 ) -> Tuple[manifest.Record, Path, bool]:
    path, copied, key = _place(ckpt_dir, req)
    step = req.step if req.step is not None else check.step_of(path.name)
    return manifest.Record(path=os.path.relpath(path, run_dir), size=key[0], sha256=req.sha256,
                           mtime_ns=key[1], inode=key[2], step=step, format=_format(path), ts=clock()), \
        path, copied


def _dir_record(run_dir: Path, ckpt_dir: Path, req: Request, clock: Callable[[], float]
                ) -> Tuple[manifest.Record, Path, bool]:
    path, copied, files = _place_dir(ckpt_dir, req)
    step = req.step if req.step is not None else units.unit_step(path, path.name)
    record = manifest.Record(path=os.path.relpath(path, run_dir).replace(os.sep, "/"),
                             size=sum(f.size for f in files), sha256=req.sha256,
                             mtime_ns=max(f.mtime_ns for f in files), inode=os.stat(path).st_ino, step=step,
                             format=units.framework_of(path.name), ts=clock(), kind=manifest.DIR,
                             files=files)
    return record, path, copied


def _same(a: manifest.Record, b: manifest.Record) -> bool:
    if (a.path, a.sha256, a.kind) != (b.path, b.sha256, b.kind):
        return False
    return a.key == b.key if a.kind != manifest.DIR else \
        sorted((f.path, f.key) for f in a.files) == sorted((f.path, f.key) for f in b.files)


def take(run_dir: Path, ckpt_dir: Path, req: Request, clock: Callable[[], float] = time.time) -> Taken:
    """Verify the checkpoint (a file, or a directory unit by its unit digest), copy it into
    `ckpt_dir` when it is elsewhere, and record it in the run's custody manifest (once: a record
    with the same bytes and files is not appended twice)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    make = _dir_record if req.kind == manifest.DIR else _file_record
    record, path, copied = make(Path(run_dir), ckpt_dir, req, clock)
    if not any(_same(r, record) for r in manifest.read(run_dir)):
        (Path(run_dir) / "rgt").mkdir(parents=True, exist_ok=True)
        manifest.append(run_dir, record)
    files = len(record.files) if record.kind == manifest.DIR else 1
    return Taken(path=path, sha256=req.sha256, step=record.step, from_run=req.from_run, source=req.source,
                 copied=copied, kind=record.kind, files=files)


__all__ = ["Request", "Taken", "hash_dir", "hash_file", "requested", "take"]
