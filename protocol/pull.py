"""PULL_MANIFEST.json: the box's list of what a pull must bring back, shared by box and controller.

    {"schema": "rgt.pull_manifest", "version": 1, "run_id": "run-1", "host": "box",
     "created_at": "2024-06-01T12:00:00+00:00",
     "files": [{"path": "checkpoints/step000100.pt", "size": 2717, "sha256": "<64 hex>",
                "kind": "checkpoint", "step": 100, "hashed": "custody"},
               {"path": "metrics.jsonl", "size": 812, "sha256": "<64 hex>",
                "kind": "include", "hashed": "now"}],
     "total_bytes": 3529, "sha256": "<64 hex>"}

`path` is POSIX and relative to the run dir; `hashed` says whether the sha256 came from the custody
record ("custody": the file's size, mtime and inode still match it) or was computed while the
manifest was built ("now"). A checkpoint entry may name its `unit` (the directory or file a
framework saved at once; a file of a directory unit lies under it); a unit recorded outside the run
dir is listed under rgt/external/ (see onbox.custody.units). The optional top-level `removed` lists
units the job itself rotated away after they were recorded (HF save_total_limit, Lightning
save_top_k), at most MAX_REMOVED: {"path": <unit, checked like a file path>, "sha256": <the
unit's>, "by": "job" | "other", "reason": <at most 500 chars>, "ts": <unix seconds>, "step": <int
or null>}; they are gone on purpose, not missing, and never also listed as files. `sha256` (top
level) is the SHA-256 of the canonical JSON of every other
field (`canonical_bytes`), so a manifest proves its own integrity whatever its on-disk formatting.

Standard library only: `onbox` writes it, `controller` verifies against it.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import PurePosixPath
from typing import Any, Mapping, Set

from .errors import ProtocolError

SCHEMA = "rgt.pull_manifest"
VERSION = 1
FILENAME = "PULL_MANIFEST.json"
KINDS = ("checkpoint", "include")
HASHED = ("custody", "now")
REMOVED_BY = ("job", "other")
MAX_REMOVED = 10_000

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def canonical_bytes(doc: Mapping[str, Any]) -> bytes:
    """The bytes the manifest's own sha256 covers: sorted, compact JSON of all fields but "sha256"."""
    body = {k: v for k, v in doc.items() if k != "sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def manifest_digest(doc: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_bytes(doc)).hexdigest()


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad_path(path: str) -> bool:
    parts = path.split("/")
    return (not path or path.startswith("/") or "\\" in path or "\x00" in path
            or any(p in ("", ".", "..") for p in parts))


def check_manifest(doc: Any) -> None:
    """Raise ProtocolError unless `doc` is a well-formed manifest whose sha256 matches its content."""
    if not isinstance(doc, dict):
        raise ProtocolError("a pull manifest is a JSON object")
    if doc.get("schema") != SCHEMA or doc.get("version") != VERSION:
        raise ProtocolError(f"not a {SCHEMA} version {VERSION} manifest: "
                            f"{doc.get('schema')!r:.60} {doc.get('version')!r:.20}")
    for name in ("run_id", "host", "created_at"):
        if not isinstance(doc.get(name), str):
            raise ProtocolError(f"manifest field {name!r} must be a string")
    files = doc.get("files")
    if not isinstance(files, list):
        raise ProtocolError("manifest field 'files' must be a list")
    seen = set()
    total = 0
    for entry in files:
        if not isinstance(entry, dict):
            raise ProtocolError("a manifest entry is an object")
        path, size, sha = entry.get("path"), entry.get("size"), entry.get("sha256")
        if not isinstance(path, str) or _bad_path(path):
            raise ProtocolError(f"bad manifest path {path!r:.200}")
        if path in seen:
            raise ProtocolError(f"manifest lists {path!r:.200} twice")
        seen.add(path)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ProtocolError(f"bad size for {path!r:.200}")
        if not isinstance(sha, str) or not _HEX64.match(sha):
            raise ProtocolError(f"bad sha256 for {path!r:.200}")
        if entry.get("kind") not in KINDS or entry.get("hashed") not in HASHED:
            raise ProtocolError(f"bad kind or hashed for {path!r:.200}")
        step = entry.get("step")
        if step is not None and not _int(step):
            raise ProtocolError(f"bad step for {path!r:.200}")
        unit = entry.get("unit")
        if unit is not None and (not isinstance(unit, str) or _bad_path(unit)
                                 or not (path == unit or path.startswith(unit + "/"))):
            raise ProtocolError(f"bad unit for {path!r:.200}")
        total += size
    _check_removed(doc.get("removed"), seen)
    if doc.get("total_bytes") != total or not _int(doc.get("total_bytes")):
        raise ProtocolError(f"manifest total_bytes {doc.get('total_bytes')!r:.30} is not the sum {total}")
    sha = doc.get("sha256")
    if not isinstance(sha, str) or sha != manifest_digest(doc):
        raise ProtocolError("manifest sha256 does not match its content")


def _check_removed(removed: Any, listed: Set[str]) -> None:
    """The optional "removed" list: units the job rotated away (gone on purpose, not missing)."""
    if removed is None:
        return
    above = {"/".join(p.split("/")[:i]) for p in listed for i in range(1, p.count("/") + 2)}
    if not isinstance(removed, list) or len(removed) > MAX_REMOVED:
        raise ProtocolError(f"manifest field 'removed' must be a list of at most {MAX_REMOVED} entries")
    for item in removed:
        if not isinstance(item, dict):
            raise ProtocolError("a removed entry is an object")
        path = item.get("path")
        if not isinstance(path, str) or _bad_path(path):
            raise ProtocolError(f"bad removed path {path!r:.200}")
        if path in above:
            raise ProtocolError(f"{path!r:.200} is listed both as removed and as a file")
        if not isinstance(item.get("sha256"), str) or not _HEX64.match(item["sha256"]):
            raise ProtocolError(f"bad sha256 for removed {path!r:.200}")
        if item.get("by") not in REMOVED_BY:
            raise ProtocolError(f"bad 'by' for removed {path!r:.200}")
        reason, ts, step = item.get("reason"), item.get("ts"), item.get("step")
        if not isinstance(reason, str) or len(reason) > 500:
            raise ProtocolError(f"bad reason for removed {path!r:.200}")
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not 0 <= ts < 1e11:
            raise ProtocolError(f"bad ts for removed {path!r:.200}")
        if step is not None and not _int(step):
            raise ProtocolError(f"bad step for removed {path!r:.200}")


def is_temporary(rel: str) -> bool:
    """A name (any component of a path under a checkpoint dir) that is not a finished file: a
    dotfile, *.tmp, *.partial, *.tmp.*, tmp-* or tmp_*. The sidecar's custody, the pull manifest
    and the controller's checks all apply this one rule."""
    for part in PurePosixPath(rel).parts:
        low = part.lower()
        if (part.startswith(".") or low.endswith((".tmp", ".partial")) or ".tmp." in low
                or low.startswith(("tmp-", "tmp_"))):
            return True
    return False


__all__ = ["FILENAME", "HASHED", "KINDS", "SCHEMA", "VERSION", "canonical_bytes", "check_manifest",
           "is_temporary", "manifest_digest"]
