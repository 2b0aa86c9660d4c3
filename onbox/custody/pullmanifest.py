"""What a pull must bring back: <run>/rgt/PULL_MANIFEST.json (schema in protocol.pull). The box's
current checkpoint set for the controller's teardown gate is onbox.custody.gateview, built on the
same records.

The roster is every live checkpoint unit in rgt/manifest.jsonl (its newest record per path, minus
the units the job itself rotated away: a removal line by "job", see onbox.custody.manifest), expanded to its
files (kind "checkpoint", each naming its "unit"), plus the declared includes: glob patterns
relative to the run dir (`**` spans directories, `*` and `?` stay within one; a pattern naming a
directory takes every file under it), or an explicit roster file of relative paths. A unit recorded
outside the run dir is listed under its place's link rgt/external/<name>-<8 hex> (made here when
missing; see onbox.custody.units), its files checked to resolve inside that recorded place. The
rotated units go to the optional top-level "removed" list: gone on purpose, not missing. A
checkpoint's custody sha256 is reused while its size, mtime and inode still match the record;
anything else is hashed now (4 MiB reads).

It fails closed: a recorded checkpoint file that is missing (a unit removed by anything but the
job's rotation among them), a roster entry that is missing, an explicit
include that matches nothing, or any path that leads out of the run dir (`..`, a symlink pointing
outside) raises ManifestError and nothing is written. Never listed: rgt/sock/, the manifest itself,
temporary names (*.tmp, *.partial, dotfiles: `onbox.custody.check.is_temporary`).

Standard library only, no threads: the sidecar runs it on its control thread, the CLI in-process.
"""
from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from protocol.pull import FILENAME, SCHEMA, VERSION, manifest_digest
from rgtlib.hashing import sha256_whole

from onbox.custody import manifest, units
from onbox.custody.check import is_temporary
from onbox.errors import OnboxError
from onbox.fsutil import write_atomic
from onbox.runs import read_json, utc_iso

CHUNK = 4 << 20
DEFAULT_INCLUDES: Tuple[str, ...] = ("metrics.jsonl", "run.json", "train.log", "rgt/manifest.jsonl",
                                     "rgt/exit.json", "eval/**")
MANIFEST_REL = f"rgt/{FILENAME}"
_HASH_TRIES = 3
MAX_REMOVED = 5000
_MAGIC = re.compile(r"[*?\[]")
MISSING_GRACE_S = 10.0  # how long a missing recorded checkpoint may wait for custody's removal record


class ManifestError(OnboxError):
    """The manifest could not be complete; nothing was written."""


class MissingCheckpoints(ManifestError):
    """A checkpoint custody recorded is gone and no removal of it is recorded."""


# ---- paths --------------------------------------------------------------------------------------


def _excluded(rel: str) -> bool:
    """Never listed by an include: the socket dir, this manifest, temporary names, and the links to
    places outside the run dir (their units are listed as checkpoints, from their records)."""
    return (rel == MANIFEST_REL or rel in ("rgt/sock", units.EXTERNAL) or rel.startswith("rgt/sock/")
            or rel.startswith(units.EXTERNAL + "/") or is_temporary(rel))


def _clean_rel(text: str, what: str) -> str:
    """A relative POSIX path with no `..`, or ManifestError."""
    rel = text.strip().replace("\\", "/")
    while rel.startswith("./"):
        rel = rel[2:]
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or rel.startswith("/") or ".." in parts or "\x00" in rel:
        raise ManifestError(f"{what} {text!r} is not a path inside the run dir")
    return "/".join(parts)


def _inside(root: Path, rel: str, what: str) -> Path:
    """The path of `rel` under the (resolved) run dir; ManifestError when it resolves outside."""
    path = root / rel
    real = Path(os.path.realpath(path))
    if real != root and root not in real.parents:
        raise ManifestError(f"{what} {rel} leads out of the run dir (to {real}); refusing to list it")
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise ManifestError(f"{what} {rel!r} is not a UTF-8 name; rename it") from None
    return path


def _class_end(pattern: str, i: int) -> int:
    """Index of the "]" closing the class that opens at `i` (fnmatch's rules), or -1."""
    j = i + 1
    if pattern.startswith("!", j):
        j += 1
    if pattern.startswith("]", j):
        j += 1
    return pattern.find("]", j)


def glob_regex(pattern: str) -> re.Pattern[str]:
    """`**` any number of directories, `*` / `?` within one path segment, `[...]` a class."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:[^/]+/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[" and _class_end(pattern, i) > 0:
            end = _class_end(pattern, i)
            body = pattern[i + 1:end].replace("\\", "\\\\")
            body = "^" + body[1:] if body.startswith("!") else ("\\" + body if body.startswith("^") else body)
            out.append("(?!/)[" + body + "]")
            i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z")


def _walk(root: Path, base_rel: str, regex: re.Pattern[str], max_depth: Optional[int]) -> Iterator[str]:
    """Run-relative paths of files under `base_rel` that `regex` matches; refuses a symlinked
    directory the pattern reaches into when it points outside the run dir (it is never entered)."""
    top = root / base_rel if base_rel else root
    for base, dirs, files in os.walk(top):
        rel_base = os.path.relpath(base, root).replace(os.sep, "/")
        rel_base = "" if rel_base == "." else rel_base + "/"
        depth = rel_base.count("/")
        for d in list(dirs):
            rel = rel_base + d
            if _excluded(rel) or (max_depth is not None and depth + 1 >= max_depth):
                dirs.remove(d)
            elif os.path.islink(os.path.join(base, d)) and regex.match(rel + "/\x01"):
                _inside(root, rel, "directory")  # inside: skipped (its target is listed as itself)
        for name in files:
            rel = rel_base + name
            if not _excluded(rel) and regex.match(rel):
                yield rel


def match_include(root: Path, pattern: str) -> List[str]:
    """The files (run-relative, sorted) that one include pattern names."""
    pat = _clean_rel(pattern, "include pattern")
    segments = pat.split("/")
    literal = next((i for i, s in enumerate(segments) if _MAGIC.search(s)), None)
    if literal is None:
        if _excluded(pat) or not os.path.lexists(root / pat):
            return []
        path = _inside(root, pat, "include")
        if path.is_dir():
            return sorted(_walk(root, pat, glob_regex(pat + "/**"), None))
        return [pat]
    base_rel = "/".join(segments[:literal])
    if base_rel and not os.path.isdir(root / base_rel):
        return []
    if base_rel:
        _inside(root, base_rel, "include")
    max_depth = None if "**" in pat else len(segments)
    return sorted(_walk(root, base_rel, glob_regex(pat), max_depth))


def read_roster(path: Path) -> List[str]:
    """A roster file: one relative path per line; blank and # lines ignored, a BOM tolerated."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"cannot read the roster {path}: {e}") from e
    out: List[str] = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            rel = _clean_rel(line, "roster entry")
            if rel not in out:
                out.append(rel)
    return out


# ---- hashing ------------------------------------------------------------------------------------


def sha256_file(path: Path, chunk: int = CHUNK) -> Tuple[str, int]:
    """(sha256 hex, size) of one consistent state of a file: re-read when it changes underneath."""
    digest, st = sha256_state(path, chunk)
    return digest, st.st_size


def sha256_state(path: Path, chunk: int = CHUNK) -> Tuple[str, os.stat_result]:
    """(sha256 hex, the stat of the state it hashed): re-read when the file changes underneath,
    ManifestError when it keeps changing."""
    for _ in range(_HASH_TRIES):
        with open(path, "rb") as f:
            before = os.fstat(f.fileno())
            digest, n = sha256_whole(f, chunk)
            after = os.fstat(f.fileno())
        if (before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns) and n == after.st_size:
            return digest, after
    raise ManifestError(f"{path} kept changing while it was hashed; try again when nothing writes it")


# ---- the manifest -------------------------------------------------------------------------------


def run_meta(run_dir: Path) -> Dict[str, Any]:
    return read_json(run_dir / "run.json") or {}


def newest_records(run_dir: Path) -> Dict[str, manifest.Record]:
    """The newest custody record per path (a later line wins a tie)."""
    out: Dict[str, manifest.Record] = {}
    for rec in manifest.read(run_dir):
        old = out.get(rec.path)
        if old is None or rec.ts >= old.ts:
            out[rec.path] = rec
    return out


def live_records(run_dir: Path) -> Tuple[Dict[str, manifest.Record], List[manifest.Removal]]:
    """The newest record per unit minus the units the job removed (rotation), and those removals."""
    rems = manifest.removals(run_dir)
    live: Dict[str, manifest.Record] = {}
    gone: List[manifest.Removal] = []
    for path, rec in newest_records(run_dir).items():
        rem = manifest.removal_of(rec, rems)
        if rem is not None and rem.by == "job":
            gone.append(rem)
        else:
            live[path] = rec
    return live, gone


def pull_rel(root: Path, rec: manifest.Record) -> str:
    """A recorded unit's path in the pull (see onbox.custody.units: outside units under rgt/external/)."""
    if not os.path.isabs(rec.path):
        return _clean_rel(rec.path, "recorded checkpoint")
    rel = units.in_pull_path(root, rec.path, rec.root)
    if rel is None:
        raise ManifestError(f"recorded checkpoint {rec.path} lies outside the run dir and outside "
                            f"its recorded place {rec.root!r}")
    try:
        units.ensure_link(root, str(rec.root))
    except OSError:
        pass  # a sealed run: the link made when it was recorded is checked below
    return _clean_rel(rel, "recorded checkpoint")


def _resolve(root: Path, rel: str, rec: manifest.Record) -> Path:
    """The path of a recorded unit's file: inside the run dir, or inside the unit's own place."""
    if rec.root is None or not os.path.isabs(rec.path):
        return _inside(root, rel, "recorded checkpoint")
    path = root / rel
    real, place = os.path.realpath(path), os.path.realpath(rec.root)
    if not (real == place or real.startswith(place.rstrip("/") + "/")):
        raise ManifestError(f"recorded checkpoint {rel} leads out of its place {place}; refusing to list it")
    return path


def unit_files(rec: manifest.Record, rel: str) -> List[Tuple[str, Optional[Tuple[int, int, int]], str]]:
    """(pull path, recorded key, recorded sha256) of every file of a unit."""
    if rec.kind != manifest.DIR:
        return [(rel, rec.key, rec.sha256)]
    return [(_clean_rel(f"{rel}/{f.path}", "recorded file"), f.key, f.sha256) for f in rec.files]


def _checkpoint_entries(root: Path) -> List[Dict[str, Any]]:
    entries, missing = [], []
    live, _ = live_records(root)
    for _, rec in sorted(live.items()):
        unit = pull_rel(root, rec)
        for rel, key, digest in unit_files(rec, unit):
            path = root / rel
            if not os.path.lexists(path):
                missing.append(rel)
                continue
            path = _resolve(root, rel, rec)
            try:
                st = os.stat(path)
            except OSError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode):
                raise ManifestError(f"recorded checkpoint {rel} is not a regular file")
            entry: Dict[str, Any] = {"path": rel, "kind": "checkpoint", "step": rec.step, "unit": unit}
            if (st.st_size, st.st_mtime_ns, st.st_ino) == key:
                entry.update(size=st.st_size, sha256=digest, hashed="custody")
            else:
                sha, size = sha256_file(path)
                entry.update(size=size, sha256=sha, hashed="now")
            entries.append(entry)
    if missing:
        shown = ", ".join(missing[:20]) + (f" (+{len(missing) - 20} more)" if len(missing) > 20 else "")
        raise MissingCheckpoints(f"{len(missing)} checkpoint(s) in rgt/manifest.jsonl are missing: {shown}")
    return entries


def _checkpoints_settled(root: Path, grace_s: float,
                         judge_missing: Optional[Callable[[], object]]) -> List[Dict[str, Any]]:
    """The checkpoint entries; a recorded checkpoint found missing waits for custody to record its
    removal (the job's rotation deletes a save at any moment, and custody judges a deletion a moment
    later) before the manifest fails closed on it. In the sidecar `judge_missing` asks custody and
    waits for its answer; elsewhere (custody in another process) the manifest looks again for
    `grace_s`."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            return _checkpoint_entries(root)
        except MissingCheckpoints:
            if time.monotonic() >= deadline:
                raise
            if judge_missing is not None:
                judge_missing()
            threading.Event().wait(0.05 if judge_missing is not None else 0.2)


def removed_entries(root: Path, only_job: bool = True) -> List[Dict[str, Any]]:
    """The removals that apply to the newest records (by the job only, unless `only_job` is off),
    newest first, at most MAX_REMOVED, with their units' pull paths."""
    rems = manifest.removals(root)
    out: List[Dict[str, Any]] = []
    for rec in newest_records(root).values():
        rem = manifest.removal_of(rec, rems)
        if rem is None or (only_job and rem.by != "job"):
            continue
        try:
            unit = pull_rel(root, rec)
        except ManifestError:
            continue
        out.append({"path": unit, "sha256": rem.sha256, "by": rem.by, "reason": rem.reason[:500],
                    "ts": rem.ts, "step": rec.step})
    out.sort(key=lambda e: (-e["ts"], e["path"]))
    return out[:MAX_REMOVED]


def _include_paths(root: Path, includes: Sequence[str], extra: Sequence[str],
                   roster: Optional[Path]) -> List[str]:
    found: List[str] = []
    if roster is not None:
        for rel in read_roster(roster):
            if _excluded(rel):
                raise ManifestError(f"roster entry {rel} is never pulled (temporary, socket or the manifest)")
            if not os.path.lexists(root / rel):
                raise ManifestError(f"roster entry {rel} does not exist in {root}")
            if not _inside(root, rel, "roster entry").is_file():
                raise ManifestError(f"roster entry {rel} is not a regular file (list the files in it)")
            found.append(rel)
        return found
    for pattern in includes:
        found += match_include(root, pattern)
    for pattern in extra:
        matched = match_include(root, pattern)
        if not matched:
            raise ManifestError(f"--include {pattern!r} matches no file in {root}")
        found += matched
    return found


def build_manifest(run_dir: Path, includes: Sequence[str] = DEFAULT_INCLUDES, roster: Optional[Path] = None,
                   host: Optional[str] = None, *, extra_includes: Sequence[str] = (),
                   judge_missing: Optional[Callable[[], object]] = None) -> Dict[str, Any]:
    """The manifest doc (see protocol.pull). `includes` may match nothing; each of
    `extra_includes` must match a file. A `roster` replaces both. `judge_missing` is custody's, when
    it runs in this process (see _checkpoints_settled). Raises ManifestError."""
    root = Path(os.path.realpath(run_dir))
    if not root.is_dir():
        raise ManifestError(f"no run directory at {run_dir}")
    files = _checkpoints_settled(root, MISSING_GRACE_S, judge_missing)  # checkpoints, then includes
    listed = {e["path"] for e in files}
    for rel in sorted(set(_include_paths(root, includes, extra_includes, roster))):
        if rel in listed:
            continue
        path = _inside(root, rel, "include")
        if not path.is_file():
            continue  # a socket, fifo or device that a glob reached
        sha, size = sha256_file(path)
        files.append({"path": rel, "size": size, "sha256": sha, "kind": "include", "hashed": "now"})
        listed.add(rel)
    meta = run_meta(root)
    doc: Dict[str, Any] = {
        "schema": SCHEMA, "version": VERSION, "run_id": str(meta.get("id") or root.name),
        "created_at": utc_iso(), "host": host or str(meta.get("host") or os.uname().nodename.split(".")[0]),
        "files": files, "total_bytes": sum(e["size"] for e in files),
    }
    removed = removed_entries(root)
    if removed:
        doc["removed"] = removed
    doc["sha256"] = manifest_digest(doc)
    return doc


def save_manifest(run_dir: Path, doc: Dict[str, Any]) -> Path:
    """Write `doc` to <run>/rgt/PULL_MANIFEST.json: temp file, fsync, rename, fsync the directory."""
    path = Path(run_dir) / MANIFEST_REL
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


def write_manifest(run_dir: Path, includes: Sequence[str] = DEFAULT_INCLUDES, roster: Optional[Path] = None,
                   host: Optional[str] = None, *, extra_includes: Sequence[str] = ()) -> Path:
    """Build and write the manifest; nothing is written when building fails."""
    return save_manifest(run_dir, build_manifest(run_dir, includes, roster, host,
                                                 extra_includes=extra_includes))


def _listed(root: Path, rel: str) -> Path:
    """A listed file's path: inside the run dir, or (rgt/external/<place>/...) inside that place."""
    parts = rel.split("/")
    if rel.startswith(units.EXTERNAL + "/") and len(parts) > 3:
        link = root.joinpath(*parts[:3])
        try:
            place = os.path.realpath(os.readlink(link))
        except OSError as e:
            raise ManifestError(f"{rel}: no link to its place at {link}: {e}") from e
        real = os.path.realpath(root / rel)
        if not real.startswith(place.rstrip("/") + "/"):
            raise ManifestError(f"listed file {rel} leads out of its place {place}; refusing it")
        return root / rel
    return _inside(root, rel, "listed file")


def check_files(run_dir: Path, doc: Dict[str, Any]) -> List[str]:
    """Hash every listed file again; one line per file that is missing or differs (empty: all match)."""
    root = Path(os.path.realpath(run_dir))
    problems: List[str] = []
    for entry in doc.get("files", []):
        rel = entry["path"]
        try:
            sha, size = sha256_file(_listed(root, _clean_rel(rel, "listed file")))
        except (OSError, ManifestError) as e:
            problems.append(f"{rel}: {e}")
            continue
        if (size, sha) != (entry["size"], entry["sha256"]):
            problems.append(f"{rel}: listed {entry['size']} bytes sha256 {entry['sha256'][:16]}..., "
                            f"is {size} bytes sha256 {sha[:16]}...")
    return problems


__all__ = ["CHUNK", "DEFAULT_INCLUDES", "MANIFEST_REL", "ManifestError", "build_manifest", "check_files",
           "glob_regex", "live_records", "match_include", "newest_records",
           "pull_rel", "read_roster", "removed_entries", "run_meta",
           "save_manifest", "sha256_file", "unit_files", "write_manifest"]
