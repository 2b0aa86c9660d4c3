"""The identity proof of a pulled run: the box's PULL_MANIFEST.json, the exact roster, sizes, SHA-256.

The manifest (protocol.pull) is proved first: its `sha256` must equal
protocol.pull.manifest_digest(doc); only then are its fields read. A manifest that fails proves
nothing, so every file then fails with it.

The roster is exact. Under the run directory every regular file must be listed, and every listed
file must be there, a regular file (no symlink, no symlinked parent), of the listed size and hash.
Not part of the roster: the manifest itself, rgt/PULL_VERIFIED.json and the temporary file it is
written through. rsync leftovers (a `.name.XXXXXX` temp file of a listed file, anything under a
`.rsync-partial` or `.~tmp~` directory) fail with their own reason: a transfer was interrupted or is
still running, so the directory is not a finished pull.

Hashing runs one file per thread (hashlib and readinto release the GIL), largest files first.
Each file's stat (`pin_of`: size, mtime_ns, inode, device) is taken before and after it is hashed:
one that changed meanwhile fails ("changed while hashing"), and the pin goes into the report, so
the teardown gate can tell a local copy that is still what was hashed from one it must hash again.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from protocol import pull
from rgtlib.hashing import sha256_whole

if TYPE_CHECKING:  # typing has it from 3.10; it appears only in annotations, never evaluated
    from typing_extensions import TypeGuard

MANIFEST_REL = f"rgt/{pull.FILENAME}"
VERIFIED_REL = "rgt/PULL_VERIFIED.json"
VERIFIED_TMP = re.compile(r"^rgt/\.PULL_VERIFIED\.json\.[0-9]+\.tmp$")
KINDS = frozenset(pull.KINDS)
HASHED = frozenset(pull.HASHED)
CHUNK_BYTES = 4 << 20
MAX_MANIFEST_BYTES = 64 << 20
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_RSYNC_TEMP = re.compile(r"^\.(.+)\.[A-Za-z0-9]{6}$")
_RSYNC_DIRS = frozenset({".rsync-partial", ".~tmp~"})

Progress = Callable[[str, int, int], None]  # (stage, done, total)


class ManifestError(ValueError):
    """The manifest cannot be trusted; the message says why in one line."""


@dataclasses.dataclass(frozen=True)
class Entry:
    path: str  # relative, POSIX
    size: int
    sha256: str
    kind: str  # "checkpoint" | "include"
    step: Optional[int]
    hashed: str
    unit: Optional[str] = None  # the checkpoint this file belongs to (a checkpoint-N dir), when stated


@dataclasses.dataclass(frozen=True)
class Removed:
    """A checkpoint the box recorded and then saw go: by the job's own rotation, or by something else."""

    path: str
    sha256: Optional[str]
    by: str  # "job" | "other"
    reason: str
    ts: Any
    unit: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Manifest:
    run_id: str
    created_at: Any
    host: Any
    entries: Tuple[Entry, ...]
    total_bytes: int
    sha256: str
    removed: Tuple[Removed, ...] = ()


# ---- the manifest ----------------------------------------------------------------------------------


def stated_sha256(path: Path) -> Optional[str]:
    """The "sha256" a manifest file claims, for the report even when the manifest fails."""
    try:
        doc = json.loads(Path(path).read_bytes()[:MAX_MANIFEST_BYTES])
    except (OSError, ValueError):
        return None
    value = doc.get("sha256") if isinstance(doc, dict) else None
    return value if isinstance(value, str) else None


def _reject_constant(name: str) -> Any:
    raise ManifestError(f"manifest: {name} is not JSON")


def load_manifest(path: Path) -> Manifest:
    """Read, self-hash, then validate the manifest at `path`; ManifestError when it fails."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise ManifestError(f"manifest unreadable: {e.strerror or e}") from e
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"manifest is not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise ManifestError("manifest is not a JSON object")
    stated = doc.get("sha256")
    if not isinstance(stated, str) or not _HEX64.match(stated):
        raise ManifestError("manifest has no sha256 of itself (64 lowercase hex)")
    actual = pull.manifest_digest(doc)
    if actual != stated:
        raise ManifestError(f"manifest does not hash to its own sha256 (states {stated[:12]}..., "
                            f"hashes to {actual[:12]}...): edited or corrupt")
    return _validate(doc, stated)


def _validate(doc: Dict[str, Any], digest: str) -> Manifest:
    if doc.get("schema") != pull.SCHEMA:
        raise ManifestError(f"manifest schema is {doc.get('schema')!r}, not {pull.SCHEMA!r}")
    if doc.get("version") != pull.VERSION:
        raise ManifestError(f"manifest version {doc.get('version')!r} is not {pull.VERSION}")
    run_id = doc.get("run_id")
    if not isinstance(run_id, str) or not run_id.strip():
        raise ManifestError("manifest has no run_id")
    files = doc.get("files")
    if not isinstance(files, list):
        raise ManifestError("manifest files is not a list")
    entries = tuple(_entry(i, item) for i, item in enumerate(files))
    seen: Dict[str, int] = {}
    for i, e in enumerate(entries):
        if e.path in seen:
            raise ManifestError(f"manifest lists {e.path!r} twice (entries {seen[e.path]} and {i})")
        seen[e.path] = i
    total = doc.get("total_bytes")
    if total != sum(e.size for e in entries):
        raise ManifestError(f"manifest total_bytes {total!r} is not the sum of its sizes "
                            f"({sum(e.size for e in entries)})")
    return Manifest(run_id=run_id, created_at=doc.get("created_at"), host=doc.get("host"),
                    entries=entries, total_bytes=total, sha256=digest, removed=_removed(doc.get("removed")))


def _removed(value: Any) -> Tuple[Removed, ...]:
    """The manifest's optional "removed" list (see protocol.pull and the box's custody)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ManifestError("manifest removed is not a list")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ManifestError(f"manifest removed[{i}] is not an object")
        path, sha, by = item.get("path"), item.get("sha256"), item.get("by")
        problem = path_problem(path)
        if problem:
            raise ManifestError(f"manifest removed[{i}] path {path!r}: {problem}")
        if sha is not None and (not isinstance(sha, str) or not _HEX64.match(sha)):
            raise ManifestError(f"manifest removed[{i}] ({path}): sha256 is not 64 lowercase hex")
        if by not in ("job", "other"):
            raise ManifestError(f"manifest removed[{i}] ({path}): by {by!r} is not 'job' or 'other'")
        reason, unit = item.get("reason"), item.get("unit")
        out.append(Removed(path=str(path), sha256=sha, by=str(by),
                           reason=str(reason)[:300] if reason is not None else "", ts=item.get("ts"),
                           unit=unit if isinstance(unit, str) and not path_problem(unit) else None))
    return tuple(out)


def _natural(v: Any) -> TypeGuard[int]:
    return type(v) is int and v >= 0


def _entry(i: int, item: Any) -> Entry:
    if not isinstance(item, dict):
        raise ManifestError(f"manifest files[{i}] is not an object")
    path, size, sha, kind = item.get("path"), item.get("size"), item.get("sha256"), item.get("kind")
    step, hashed = item.get("step"), item.get("hashed")
    problem = path_problem(path)
    if problem:
        raise ManifestError(f"manifest files[{i}] path {path!r}: {problem}")
    if not _natural(size):
        raise ManifestError(f"manifest files[{i}] ({path}): size {size!r} is not a non-negative int")
    if not isinstance(sha, str) or not _HEX64.match(sha):
        raise ManifestError(f"manifest files[{i}] ({path}): sha256 is not 64 lowercase hex")
    if kind not in KINDS:
        raise ManifestError(f"manifest files[{i}] ({path}): kind {kind!r} is not one of {sorted(KINDS)}")
    if step is not None and not _natural(step):
        raise ManifestError(f"manifest files[{i}] ({path}): step {step!r} is not a non-negative int")
    if hashed not in HASHED:
        raise ManifestError(f"manifest files[{i}] ({path}): hashed {hashed!r} is not one of {sorted(HASHED)}")
    unit = item.get("unit")
    if unit is not None and path_problem(unit):
        raise ManifestError(f"manifest files[{i}] ({path}): unit {unit!r}: {path_problem(unit)}")
    return Entry(path=str(path), size=size, sha256=sha, kind=str(kind), step=step, hashed=str(hashed),
                 unit=None if unit is None else str(unit))


def path_problem(path: Any) -> Optional[str]:
    """Why `path` is not a safe relative POSIX path inside the run directory; None when it is."""
    if not isinstance(path, str) or not path:
        return "not a non-empty string"
    if "\\" in path or "\x00" in path:
        return "contains a backslash or NUL"
    if path.startswith("/"):
        return "is absolute"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "has an empty, '.' or '..' component"
    if path in (MANIFEST_REL, VERIFIED_REL):
        return "names a file verification itself owns"
    return None


# ---- the local roster ------------------------------------------------------------------------------


@dataclasses.dataclass
class Roster:
    """What lies under the run directory (relative POSIX paths)."""

    files: List[str] = dataclasses.field(default_factory=list)  # regular files
    odd: Dict[str, str] = dataclasses.field(default_factory=dict)  # path -> what it is instead


def _kind_of(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def scan(run_dir: Path) -> Roster:
    """Every entry under run_dir, without following symlinks."""
    roster = Roster()
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(os.path.join(run_dir, rel_dir) if rel_dir else run_dir) as it:
            for de in it:
                rel = f"{rel_dir}/{de.name}" if rel_dir else de.name
                if de.is_dir(follow_symlinks=False):
                    stack.append(rel)
                elif de.is_file(follow_symlinks=False):
                    roster.files.append(rel)
                else:
                    roster.odd[rel] = _kind_of(de.stat(follow_symlinks=False).st_mode)
    roster.files.sort()
    return roster


def is_own_file(rel: str, manifest_rel: Optional[str]) -> bool:
    """Files verification itself reads or writes: never part of the roster."""
    return rel in (MANIFEST_REL, VERIFIED_REL, manifest_rel) or bool(VERIFIED_TMP.match(rel))


def leftover_reason(rel: str, listed: Iterable[str]) -> Optional[str]:
    """Why `rel` is an rsync leftover (an interrupted or running transfer); None when it is not."""
    parts = rel.split("/")
    if any(p in _RSYNC_DIRS for p in parts[:-1]):
        return "rsync partial-transfer leftover: the pull was interrupted or is still running"
    m = _RSYNC_TEMP.match(parts[-1])
    if m and "/".join([*parts[:-1], m.group(1)]) in set(listed):
        return "rsync temporary file: the pull was interrupted or is still running"
    return None


# ---- hashing -----------------------------------------------------------------------------------


def hash_file(path: Path) -> Tuple[int, str]:
    """(bytes read, SHA-256 hex) of a regular file; OSError for anything else (symlink, FIFO)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with open(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        digest, size = sha256_whole(f, CHUNK_BYTES)
    return size, digest


HashResult = Union[Tuple[int, str], OSError]


def hash_many(paths: Iterable[Path], workers: Optional[int] = None,
              progress: Optional[Progress] = None) -> Dict[Path, HashResult]:
    """Hash every path, `workers` files at a time (default os.cpu_count()), largest first.
    A file that cannot be read maps to its OSError."""
    todo = list(dict.fromkeys(Path(p) for p in paths))
    sizes = {p: _size_or_zero(p) for p in todo}
    todo.sort(key=lambda p: -sizes[p])
    n = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    out: Dict[Path, HashResult] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="rgt-hash") as pool:
        futures = {pool.submit(hash_file, p): p for p in todo}
        try:
            for fut in concurrent.futures.as_completed(futures):
                try:
                    out[futures[fut]] = fut.result()
                except OSError as e:
                    out[futures[fut]] = e
                if progress is not None:
                    progress("hash", len(out), len(todo))
        except BaseException:  # Ctrl-C, a raising progress: do not hash the rest first
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return out


def hash_files(paths: Iterable[Path], workers: Optional[int] = None) -> Dict[Path, Tuple[int, str]]:
    """{path: (size, sha256 hex)} for every path, hashed in parallel; raises the first OSError."""
    results = hash_many(paths, workers)
    out: Dict[Path, Tuple[int, str]] = {}
    for p, r in results.items():
        if isinstance(r, OSError):
            raise r
        out[p] = r
    return out


def _size_or_zero(p: Path) -> int:
    try:
        return os.lstat(p).st_size
    except OSError:
        return 0


# ---- the proof ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Identity:
    """One listed file: what was found (None where nothing could be read) and why it fails."""

    size: Optional[int] = None
    sha256: Optional[str] = None
    reason: Optional[str] = None  # None: size and hash match the manifest
    pin: Optional[Dict[str, int]] = None  # pin_of() of the file the hash was taken of


def pin_of(st: os.stat_result) -> Dict[str, int]:
    """What ties a hash to the file it was taken of: any write changes size or mtime_ns, any
    replacement the inode or device (the teardown gate hashes a file again on any change)."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino, "dev": st.st_dev}


def _size_reason(local: int, listed: int) -> str:
    how = "truncated" if local < listed else "larger than listed"
    return f"size {local} bytes, manifest says {listed} ({how})"


def prove_identity(run_dir: Path, manifest: Manifest, manifest_rel: Optional[str] = None,
                   workers: Optional[int] = None,
                   progress: Optional[Progress] = None) -> Tuple[Dict[str, Identity], Dict[str, str]]:
    """({listed path: Identity}, {unlisted path: why it fails}) for the pulled run_dir."""
    roster = scan(run_dir)
    listed = {e.path for e in manifest.entries}
    extras: Dict[str, str] = {}
    for rel in roster.files:
        if rel not in listed and not is_own_file(rel, manifest_rel):
            extras[rel] = leftover_reason(rel, listed) or "extra file: not in the manifest"
    for rel, what in roster.odd.items():
        if rel not in listed:
            extras[rel] = leftover_reason(rel, listed) or f"extra: {what}, not in the manifest"
    real_root = os.path.realpath(run_dir)
    results: Dict[str, Identity] = {}
    to_hash: Dict[Path, Entry] = {}
    before: Dict[Path, Dict[str, int]] = {}
    for e in manifest.entries:
        full = Path(run_dir, *e.path.split("/"))
        try:
            st = os.lstat(full)
        except (FileNotFoundError, NotADirectoryError):
            results[e.path] = Identity(reason="missing: listed in the manifest, not in the pull")
            continue
        if not stat.S_ISREG(st.st_mode):
            results[e.path] = Identity(reason=f"{_kind_of(st.st_mode)}, not a regular file")
        elif os.path.realpath(full) != os.path.join(real_root, *e.path.split("/")):
            results[e.path] = Identity(size=st.st_size, reason="reached through a symlinked directory")
        elif st.st_size != e.size:
            results[e.path] = Identity(size=st.st_size, reason=_size_reason(st.st_size, e.size))
        else:
            to_hash[full] = e
            before[full] = pin_of(st)
    for full, got in hash_many(to_hash, workers, progress).items():
        e = to_hash[full]
        if isinstance(got, OSError):
            results[e.path] = Identity(reason=f"unreadable: {got.strerror or got}")
            continue
        size, sha = got
        try:
            after: Optional[Dict[str, int]] = pin_of(os.lstat(full))
        except OSError:
            after = None
        if size != e.size:
            reason: Optional[str] = f"changed while hashing: {_size_reason(size, e.size)}"
        elif after != before[full]:
            reason = "changed while hashing: its size, mtime or inode moved (is something writing to it?)"
        elif sha != e.sha256:
            reason = f"sha256 differs: local {sha[:16]}..., manifest {e.sha256[:16]}..."
        else:
            reason = None
        results[e.path] = Identity(size=size, sha256=sha, reason=reason,
                                   pin=after if reason is None else None)
    return results, extras
