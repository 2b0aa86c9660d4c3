"""The local half of `rgt pull`: the staging dir next to the destination, what may stay in it, the
checks before it counts, and the swap into place (controller.pull.fetch has the flow and the rsync).

Staging is <dest>.partial/, marked as rgt's by its marker file and locked while a pull writes it.
Only what can help stays there: a file of the listed size that hashes to the listed SHA-256, or a
shorter file of ours alone (a prefix rsync --append-verify continues and then checks as a whole).
A hard-linked file is never left to be written in place, so an earlier pull is never changed.
Every path made of a manifest entry is checked to stay under staging first (inside(): the box
wrote the manifest, and protocol.pull's check_manifest is not the last word on a laptop path).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple

from protocol.pull import FILENAME
from rgtlib import lockfile

from controller import trust as boxtrust
from controller.verify.identity import hash_file

STAGING_SUFFIX = ".partial"
MARKER = ".rgt-staging.json"
MANIFEST_REL = f"rgt/{FILENAME}"
VERIFIED_REL = "rgt/PULL_VERIFIED.json"


class PullError(Exception):
    """The pull cannot go on; `hint` is the next step for a person. Staging is kept for a rerun."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclasses.dataclass(frozen=True)
class Entry:
    path: str
    size: int
    sha256: str



def inside(root: Path, rel: str) -> Path:
    """ROOT/REL when it stays under ROOT (boxtrust.contained: relative, no '..', no control
    characters, no symlink out); PullError naming the entry otherwise."""
    try:
        return boxtrust.contained(root, rel)
    except boxtrust.Untrusted as e:
        raise PullError(f"refused the box's manifest entry {rel[:200]!r}: {e}",
                        hint="nothing was copied") from None


def check_entries(root: Path, entries: Dict[str, Entry]) -> None:
    """Every listed path stays under ROOT (staging), or PullError before anything is written."""
    for rel in entries:
        inside(root, rel)


def sha256_of(path: Path) -> str:
    return hash_file(path)[1]


def _files_under(root: Path) -> Iterator[Tuple[str, Path]]:
    """(POSIX relative path, path) of everything but directories under root (the marker excluded)."""
    for base, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(base, d))]:
            path = Path(base, name)
            rel = path.relative_to(root).as_posix()
            if rel != MARKER:
                yield rel, path


@contextlib.contextmanager
def staging_dir(staging: Path, run: str) -> Iterator[Path]:
    """Create or reuse <dest>.partial/ (only one rgt made for this run: its marker says so) and
    hold its lock, so that two pulls never write one staging dir."""
    marker = staging / MARKER
    if os.path.lexists(staging):
        try:
            owner = json.loads(marker.read_text(encoding="utf-8")).get("run")
        except (OSError, ValueError, AttributeError):
            owner = None
        if owner != run:
            raise PullError(f"{staging} exists and is not rgt's staging dir for {run}",
                            hint="move it away, or pull somewhere else with --to DIR")
    else:
        staging.mkdir(parents=True)
        marker.write_text(json.dumps({"run": run, "created_at": time.time()}) + "\n", encoding="utf-8")
    fd = lockfile.try_lock(marker, create=False)
    if fd is None:
        raise PullError(f"another rgt pull is writing {staging}")
    try:
        yield staging
    finally:
        os.close(fd)


def _keeps(path: Path, entry: Optional[Entry]) -> bool:
    """Whether a file already in staging can only help: a prefix to append to (ours alone: a
    hard-linked file must never be written in place), or the listed file itself."""
    st = os.lstat(path)
    if entry is None or not stat.S_ISREG(st.st_mode) or st.st_size > entry.size:
        return False
    if st.st_size < entry.size:
        return st.st_nlink == 1
    return sha256_of(path) == entry.sha256


def prepare(staging: Path, entries: Dict[str, Entry], earlier: Optional[Path]) -> int:
    """Drop from staging what cannot help, link in what an earlier pull holds right; the bytes
    staging holds for the listed files afterwards."""
    check_entries(staging, entries)
    for rel, path in list(_files_under(staging)):
        if not _keeps(path, entries.get(rel)):
            os.unlink(path)
    for base, dirs, _ in os.walk(staging, topdown=False):
        for d in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(base, d))  # only empty ones go
    if earlier is not None:
        for rel, entry in entries.items():
            target, old = inside(staging, rel), earlier / rel
            try:
                boxtrust.contained(earlier, rel)  # a symlink in an earlier pull never leads out of it
            except boxtrust.Untrusted:
                continue
            if os.path.lexists(target) or not old.is_file() or old.is_symlink():
                continue
            if old.stat().st_size == entry.size and sha256_of(old) == entry.sha256:
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(old, target)
                except OSError:
                    shutil.copy2(old, target)
    return sum(os.lstat(staging / rel).st_size for rel in entries if os.path.lexists(staging / rel))


def check_staging(staging: Path, entries: Dict[str, Entry], manifest_raw: bytes) -> None:
    """Every listed file there with its listed size, the manifest byte for byte, nothing else."""
    problems = []
    check_entries(staging, entries)
    for rel, entry in entries.items():
        path = staging / rel
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            problems.append(f"{rel}: missing")
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
            problems.append(f"{rel}: {st.st_size} bytes, the manifest says {entry.size}")
    if not problems and (staging / MANIFEST_REL).read_bytes() != manifest_raw:
        problems.append(f"{MANIFEST_REL}: differs from the manifest the box answered with")
    problems += [f"{rel}: not in the manifest" for rel, _ in _files_under(staging) if rel not in entries]
    if problems:
        shown = "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")
        raise PullError(f"the pull is incomplete: {shown}",
                        hint="did the box's files change during the pull? Run `rgt pull` again: "
                             "what is right is kept and nothing complete is sent twice")


def _covered(old: Path, new: Path) -> bool:
    """Every file of the earlier pull is in the new one as the same inode (its manifest and
    verification record are superseded by the new pull)."""
    for rel, path in _files_under(old):
        if rel in (MANIFEST_REL, VERIFIED_REL):
            continue
        try:
            a, b = os.lstat(path), os.lstat(new / rel)
        except FileNotFoundError:
            return False
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            return False
    return True


def swap_in(staging: Path, dest: Path, clock: Callable[[], float] = time.time) -> Optional[Path]:
    """Move the finished staging dir to `dest`; returns where an earlier pull was kept, if it was."""
    os.unlink(staging / MARKER)
    if not os.path.lexists(dest):
        os.replace(staging, dest)
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(clock()))
    prev = dest.with_name(f"{dest.name}.prev-{stamp}")
    os.replace(dest, prev)
    try:
        os.replace(staging, dest)
    except BaseException:
        os.replace(prev, dest)
        raise
    if _covered(prev, dest):
        shutil.rmtree(prev)
        return None
    return prev


def earlier_pull(dest: Path, run_id: str) -> Optional[Path]:
    """`dest` when it holds an earlier pull of this run, None when it does not exist (or is an
    empty dir); PullError for anything else there."""
    if not os.path.lexists(dest):
        return None
    if not dest.is_dir() or dest.is_symlink():
        raise PullError(f"{dest} exists and is not a directory", hint="pull somewhere else with --to DIR")
    if not any(dest.iterdir()):
        return dest
    try:
        found = json.loads((dest / MANIFEST_REL).read_text(encoding="utf-8")).get("run_id")
    except (OSError, ValueError, AttributeError):
        found = None
    if found != run_id:
        raise PullError(f"{dest} exists and is not an earlier pull of {run_id}",
                        hint="pull somewhere else with --to DIR")
    return dest

__all__ = ["MANIFEST_REL", "MARKER", "STAGING_SUFFIX", "VERIFIED_REL", "Entry", "PullError", "check_entries",
           "check_staging", "earlier_pull", "inside", "prepare", "sha256_of", "staging_dir", "swap_in"]
