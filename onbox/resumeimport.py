"""`rgt-onbox launch --resume-from FILE --resume-sha256 HEX`: a checkpoint from elsewhere joins the run.

    request = requested(opts)                     # before anything starts: bad options are usage errors
    taken = take(run_dir, ckpt_dir, request)      # under the launch lock: hash, copy in, record

`rgt resume` pushes the old run's checkpoint into the new run's checkpoint dir, or names a durable
copy the new box sees (a network volume). Either way the file must hash to the given SHA-256, else
the launch is refused (exit 3) and nothing starts. A file outside the checkpoint dir is copied in
first (a temporary name, fsync, rename, fsync of the dir), so the run owns its own copy; then a
custody record (rgt/manifest.jsonl) is appended, so RGT_RESUME_FROM, `newest_good()` and the pull
manifest all see it like a checkpoint the job wrote. run.json keeps `record()` under "resume".

Standard library only; Python 3.9.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from onbox import ckptcheck, manifest
from onbox.fsutil import fsync_dir
from onbox.launchgates import LaunchRefused, LaunchUsageError
from onbox.pullmanifest import ManifestError, sha256_state

CHUNK = 1 << 20
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
Key = Tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Request:
    source: Path
    sha256: str
    step: Optional[int]
    from_run: Optional[str]


@dataclasses.dataclass(frozen=True)
class Taken:
    """The checkpoint the job resumes from, now in the run's custody."""

    path: Path
    sha256: str
    step: Optional[int]
    from_run: Optional[str]
    source: Path
    copied: bool

    def record(self) -> Dict[str, Any]:
        """run.json's "resume": where the file is, what it hashes to, its step, the run it came from."""
        return {"path": str(self.path), "sha256": self.sha256, "step": self.step, "from_run": self.from_run,
                "source": str(self.source), "copied": self.copied}


def requested(resume_from: Optional[Path], sha256: Optional[str], step: Optional[int],
              resumes: Optional[str]) -> Optional[Request]:
    """The resume the options ask for, or None; LaunchUsageError (exit 2) for options that do not fit."""
    if resume_from is None:
        if sha256 is not None or step is not None:
            raise LaunchUsageError("--resume-sha256 and --resume-step describe --resume-from FILE, "
                                   "which is missing")
        return None
    if sha256 is None:
        raise LaunchUsageError("--resume-from needs --resume-sha256: a checkpoint from elsewhere is taken "
                               "only when its bytes are the ones meant",
                               f"sha256sum {resume_from} (on the machine the checkpoint came from)")
    digest = sha256.strip().lower()
    if not _HEX64.match(digest):
        raise LaunchUsageError(f"--resume-sha256 {sha256[:80]!r} is not 64 hex digits")
    if step is not None and step < 0:
        raise LaunchUsageError(f"--resume-step {step} is below 0")
    source = Path(resume_from).expanduser().absolute()
    if not source.is_file():
        raise LaunchUsageError(f"--resume-from {source}: no such file here",
                               "push it first (rgt resume does), or name a path this box sees")
    return Request(source=source, sha256=digest, step=step, from_run=resumes)


def _stat_key(st: os.stat_result) -> Key:
    return st.st_size, st.st_mtime_ns, st.st_ino


def hash_file(path: Path) -> Tuple[str, Key]:
    """(SHA-256, the (size, mtime_ns, inode) it belongs to); LaunchRefused if the file kept changing."""
    try:
        digest, st = sha256_state(path)
    except ManifestError as e:
        raise LaunchRefused(f"{path} kept changing while it was hashed; refusing to resume from it",
                            "let whatever writes it finish, then launch again") from e
    return digest, _stat_key(st)


def _mismatch(path: Path, found: str, want: str) -> LaunchRefused:
    return LaunchRefused(f"{path} hashes to SHA-256 {found}, not the {want} it should have: refusing to "
                         "resume from it", "the copy is damaged or not the checkpoint meant: push it again "
                         "(rgt resume), or check both ends with sha256sum")


def _copy_in(source: Path, dest: Path, want: str) -> None:
    """source -> a temporary name beside dest (hashed while copied, fsync'd) -> dest, then fsync the dir.
    A copy whose bytes do not hash to `want` is removed and refused."""
    tmp = dest.with_name(f".{dest.name}.rgt-resume-{os.getpid()}.tmp")
    h = hashlib.sha256()
    try:
        with open(source, "rb") as fin, open(tmp, "wb") as fout:
            for chunk in iter(lambda: fin.read(CHUNK), b""):
                h.update(chunk)
                fout.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())
        if h.hexdigest() != want:
            raise _mismatch(source, h.hexdigest(), want)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(dest.parent, strict=True)


def _place(ckpt_dir: Path, req: Request) -> Tuple[Path, bool, Key]:
    """Where the checkpoint lives in the run, whether it was copied there, and the (size, mtime_ns,
    inode) its hash belongs to; refused on a mismatch."""
    source = req.source
    inside = Path(os.path.realpath(ckpt_dir)) in Path(os.path.realpath(source)).parents
    dest = Path(os.path.realpath(source)) if inside else ckpt_dir / source.name
    if inside or dest.exists():
        found, key = hash_file(dest)
        if found == req.sha256:
            return dest, False, key
        if inside:
            raise _mismatch(source, found, req.sha256)
        raise LaunchRefused(f"{dest} exists and holds other bytes than {source}; refusing to replace it",
                            "resume into a new run id, or move that file away first")
    _copy_in(source, dest, req.sha256)
    return dest, True, _stat_key(os.stat(dest))  # nothing else writes here before the job starts


def _format(path: Path) -> str:
    try:
        return ckptcheck.check_path(path).format
    except OSError:
        return "unknown"


def take(run_dir: Path, ckpt_dir: Path, req: Request, clock: Callable[[], float] = time.time) -> Taken:
    """Verify the checkpoint, copy it into `ckpt_dir` when it is elsewhere, and record it in the run's
    custody manifest (once: a record with the same bytes and file is not appended twice)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path, copied, key = _place(ckpt_dir, req)
    rel = os.path.relpath(path, run_dir)
    step = req.step if req.step is not None else ckptcheck.step_of(path.name)
    if not any(r.path == rel and r.sha256 == req.sha256 and r.key == key for r in manifest.read(run_dir)):
        (Path(run_dir) / "rgt").mkdir(parents=True, exist_ok=True)
        manifest.append(run_dir, manifest.Record(path=rel, size=key[0], sha256=req.sha256, mtime_ns=key[1],
                                                 inode=key[2], step=step, format=_format(path),
                                                 ts=clock()))
    return Taken(path=path, sha256=req.sha256, step=step, from_run=req.from_run, source=req.source,
                 copied=copied)


__all__ = ["Request", "Taken", "hash_file", "requested", "take"]
