"""PULL_MANIFEST.json's optional fields for checkpoint units: an entry's "unit", the "removed" list."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict

import pytest

from protocol.errors import ProtocolError
from protocol.pull import MAX_REMOVED, SCHEMA, VERSION, check_manifest, manifest_digest

SHA = "ab" * 32


def doc(**extra: Any) -> Dict[str, Any]:
    d: Dict[str, Any] = {
        "schema": SCHEMA, "version": VERSION, "run_id": "r", "host": "h",
        "created_at": "2024-06-01T00:00:00+00:00",
        "files": [{"path": "out/checkpoint-30/model.safetensors", "size": 3, "sha256": SHA,
                   "kind": "checkpoint",
                   "step": 30, "hashed": "custody", "unit": "out/checkpoint-30"},
                  {"path": "metrics.jsonl", "size": 2, "sha256": SHA, "kind": "include", "hashed": "now"}],
        "total_bytes": 5,
        "removed": [{"path": "out/checkpoint-10", "sha256": SHA, "by": "job", "reason": "rotated", "ts": 1.5,
                     "step": 10}],
        **extra}
    d["sha256"] = manifest_digest(d)
    return d


def test_a_manifest_with_units_and_removals_checks_and_old_ones_still_do() -> None:
    check_manifest(doc())
    old = doc()
    del old["removed"]
    for e in old["files"]:
        e.pop("unit", None)
    old["sha256"] = manifest_digest(old)
    check_manifest(old)


def _set(path: str, value: Any) -> Callable[[Dict[str, Any]], None]:
    def mutate(d: Dict[str, Any]) -> None:
        where: Any = d
        keys = path.split(".")
        for k in keys[:-1]:
            where = where[int(k)] if k.isdigit() else where[k]
        where[keys[-1]] = value
    return mutate


@pytest.mark.parametrize("mutate, needle", [
    (_set("removed", {"path": "x"}), "must be a list"),
    (_set("removed", [{"path": "x"}] * (MAX_REMOVED + 1)), "at most"),
    (_set("removed.0.path", "../escape"), "bad removed path"),
    (_set("removed.0.path", "/abs/checkpoint-10"), "bad removed path"),
    (_set("removed.0.path", "out/checkpoint-30"), "both as removed and as a file"),
    (_set("removed.0.by", "someone"), "bad 'by'"),
    (_set("removed.0.sha256", "xyz"), "bad sha256 for removed"),
    (_set("removed.0.reason", "r" * 501), "bad reason"),
    (_set("removed.0.ts", True), "bad ts"),
    (_set("removed.0.step", "10"), "bad step for removed"),
    (_set("files.0.unit", "out/checkpoint-40"), "bad unit"),
    (_set("files.0.unit", "../x"), "bad unit"),
])
def test_bad_units_and_removals_are_refused(mutate: Callable[[Dict[str, Any]], None], needle: str) -> None:
    d = copy.deepcopy(doc())
    mutate(d)
    d["sha256"] = manifest_digest(d)
    with pytest.raises(ProtocolError, match=needle):
        check_manifest(d)
