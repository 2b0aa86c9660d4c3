"""What a pull must bring back: <run>/rgt/PULL_MANIFEST.json (schema in protocol.pull), and the
box's current checkpoint set for the controller's teardown gate.

The roster is every checkpoint in rgt/manifest.jsonl (its newest record per path) plus the declared
includes: glob patterns relative to the run dir (`**` spans directories, `*` and `?` stay within
one; a pattern naming a directory takes every file under it), or an explicit roster file of
relative paths. A checkpoint's custody sha256 is reused while its size, mtime and inode still match
the record; anything else is hashed now (4 MiB reads).

It fails closed: a recorded checkpoint that is missing, a roster entry that is missing, an explicit
include that matches nothing, or any path that leads out of the run dir (`..`, a symlink pointing
outside) raises ManifestError and nothing is written. Never listed: rgt/sock/, the manifest itself,
temporary names (*.tmp, *.partial, dotfiles: `onbox.ckptcheck.is_temporary`).

Standard library only, no threads: the sidecar runs it on its control thread, the CLI in-process.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from protocol.pull import FILENAME, SCHEMA, VERSION, manifest_digest

from . import manifest
from .ckptcheck import is_temporary
from .errors import OnboxError
from .fsutil import write_atomic
from .runs import read_json, utc_iso

CHUNK = 4 << 20
DEFAULT_INCLUDES: Tuple[str, ...] = ("metrics.jsonl", "run.json", "train.log", "rgt/manifest.jsonl",
                                     "rgt/exit.json", "eval/**")
MANIFEST_REL = f"rgt/{FILENAME}"
GATE_SCHEMA = "rgt.gate_view"
_HASH_TRIES = 3
_MAGIC = re.compile(r"[*?\[]")


class ManifestError(OnboxError):
    """The manifest could not be complete; nothing was written."""


# ---- paths --------------------------------------------------------------------------------------


def _excluded(rel: str) -> bool:
    return rel == MANIFEST_REL or rel == "rgt/sock" or rel.startswith("rgt/sock/") or is_temporary(rel)


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
            h, n = hashlib.sha256(), 0
            buf = bytearray(chunk)
            view = memoryview(buf)
            while True:
                got = f.readinto(buf)
                if not got:
                    break
                h.update(view[:got])
                n += got
            after = os.fstat(f.fileno())
        if (before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns) and n == after.st_size:
            return h.hexdigest(), after
    raise ManifestError(f"{path} kept changing while it was hashed; try again when nothing writes it")


# ---- the manifest -------------------------------------------------------------------------------


def _meta(run_dir: Path) -> Dict[str, Any]:
    return read_json(run_dir / "run.json") or {}


def newest_records(run_dir: Path) -> Dict[str, manifest.Record]:
    """The newest custody record per path (a later line wins a tie)."""
    out: Dict[str, manifest.Record] = {}
    for rec in manifest.read(run_dir):
        old = out.get(rec.path)
        if old is None or rec.ts >= old.ts:
            out[rec.path] = rec
    return out


def _checkpoint_entries(root: Path) -> List[Dict[str, Any]]:
    entries, missing = [], []
    for rel, rec in sorted(newest_records(root).items()):
        clean = _clean_rel(rel, "recorded checkpoint")
        if not os.path.lexists(root / clean):
            missing.append(clean)
            continue
        path = _inside(root, clean, "recorded checkpoint")
        if not path.is_file():
            raise ManifestError(f"recorded checkpoint {clean} is not a regular file")
        entry: Dict[str, Any] = {"path": clean, "kind": "checkpoint", "step": rec.step}
        if rec.matches(root):
            entry.update(size=rec.size, sha256=rec.sha256, hashed="custody")
        else:
            sha, size = sha256_file(path)
            entry.update(size=size, sha256=sha, hashed="now")
        entries.append(entry)
    if missing:
        shown = ", ".join(missing[:20]) + (f" (+{len(missing) - 20} more)" if len(missing) > 20 else "")
        raise ManifestError(f"{len(missing)} checkpoint(s) in rgt/manifest.jsonl are missing: {shown}")
    return entries


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
                   host: Optional[str] = None, *, extra_includes: Sequence[str] = ()) -> Dict[str, Any]:
    """The manifest doc (see protocol.pull). `includes` may match nothing; each of
    `extra_includes` must match a file. A `roster` replaces both. Raises ManifestError."""
    root = Path(os.path.realpath(run_dir))
    if not root.is_dir():
        raise ManifestError(f"no run directory at {run_dir}")
    files = _checkpoint_entries(root)  # checkpoints first, then the includes, each sorted by path
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
    meta = _meta(root)
    doc: Dict[str, Any] = {
        "schema": SCHEMA, "version": VERSION, "run_id": str(meta.get("id") or root.name),
        "created_at": utc_iso(), "host": host or str(meta.get("host") or os.uname().nodename.split(".")[0]),
        "files": files, "total_bytes": sum(e["size"] for e in files),
    }
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


def check_files(run_dir: Path, doc: Dict[str, Any]) -> List[str]:
    """Hash every listed file again; one line per file that is missing or differs (empty: all match)."""
    root = Path(os.path.realpath(run_dir))
    problems: List[str] = []
    for entry in doc.get("files", []):
        rel = entry["path"]
        try:
            sha, size = sha256_file(_inside(root, _clean_rel(rel, "listed file"), "listed file"))
        except (OSError, ManifestError) as e:
            problems.append(f"{rel}: {e}")
            continue
        if (size, sha) != (entry["size"], entry["sha256"]):
            problems.append(f"{rel}: listed {entry['size']} bytes sha256 {entry['sha256'][:16]}..., "
                            f"is {size} bytes sha256 {sha[:16]}...")
    return problems


# ---- the teardown gate's view ---------------------------------------------------------------------


def ckpt_dir_of(run_dir: Path) -> Path:
    """The run's checkpoint dir from run.json; an absolute path recorded under .../active/<run-id>/
    is taken relative to `run_dir`, so a sealed run (moved to export/) still finds its own."""
    meta = _meta(run_dir)
    value = (meta.get("watch") or {}).get("ckpt_dir") if isinstance(meta.get("watch"), dict) else None
    value = value or meta.get("ckpt_dir")
    if not isinstance(value, str) or not value:
        return Path(run_dir) / "checkpoints"
    p = Path(value)
    if not p.is_absolute():
        return Path(run_dir) / p
    parts = p.parts
    for i in range(len(parts) - 1):
        if parts[i] == "active" and parts[i + 1] == Path(run_dir).name:
            return Path(run_dir).joinpath(*parts[i + 2:])
    return p


def gate_view(run_dir: Path) -> Dict[str, Any]:
    """What the box holds now: every recorded checkpoint (newest record per path), plus checkpoint
    files no record covers ("unrecorded": no record, or changed since its record), recorded ones
    that are gone ("missing"), and temporary files in the checkpoint dir ("partials")."""
    root = Path(os.path.realpath(run_dir))
    records = newest_records(root)
    ckpt_dir = Path(os.path.realpath(ckpt_dir_of(root)))
    checkpoints = {rel: {"sha256": r.sha256, "size": r.size, "step": r.step} for rel, r in records.items()}
    missing = sorted(rel for rel in records if not os.path.lexists(root / rel))
    unrecorded: List[Dict[str, Any]] = []
    partials: List[str] = []
    for base, dirs, files in os.walk(ckpt_dir):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(base, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if is_temporary(os.path.relpath(full, ckpt_dir)):
                partials.append(rel)
                continue
            try:
                st = os.stat(full)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            rec = records.get(rel)
            if rec is None or rec.key != (st.st_size, st.st_mtime_ns, st.st_ino):
                unrecorded.append({"path": rel, "size": st.st_size,
                                   "reason": "no_record" if rec is None else "changed"})
    meta = _meta(root)
    return {"schema": GATE_SCHEMA, "version": 1, "run_id": str(meta.get("id") or root.name),
            "run_dir": str(root), "at": utc_iso(),
            "ckpt_dir": os.path.relpath(ckpt_dir, root).replace(os.sep, "/"),
            "checkpoints": checkpoints, "unrecorded": unrecorded, "missing": missing, "partials": partials}


__all__ = ["CHUNK", "DEFAULT_INCLUDES", "MANIFEST_REL", "ManifestError", "build_manifest", "check_files",
           "ckpt_dir_of", "gate_view", "glob_regex", "match_include", "newest_records", "read_roster",
           "save_manifest", "sha256_file", "write_manifest"]
