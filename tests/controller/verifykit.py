"""Pulled-run fixtures for the verify tests: real torch.save / safetensors files and a
PULL_MANIFEST.json that follows the box's schema (rgt.pull_manifest v1)."""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from safetensors.torch import save_file

MANIFEST = "rgt/PULL_MANIFEST.json"
VERIFIED = "rgt/PULL_VERIFIED.json"

# (path, kind, step) of the files every fixture run holds
ST_FILES: List[Tuple[str, str, Optional[int]]] = [
    ("checkpoints/step000100.safetensors", "checkpoint", 100),
    ("checkpoints/step000200.safetensors", "checkpoint", 200),
    ("metrics.jsonl", "include", None),
    ("config.json", "include", None),
]
PT_FILE = ("checkpoints/step000050.pt", "checkpoint", 50)
METRICS = [{"step": 50, "loss": 1.0}, {"step": 100, "loss": 0.5}, {"step": 150, "loss": 0.4},
           {"step": 200, "loss": 0.25, "lr": 0.001}]


class Evil:
    """Unpickling this runs `touch <marker>`: the payload a hostile checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Tuple[Callable[..., Any], Tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def tensors(seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(8, 4, generator=g), "layer.bias": torch.zeros(8),
            "steps": torch.arange(3, dtype=torch.int64)}


def make_run(root: Path, with_pt: bool = False) -> Path:
    """A pulled run dir with two safetensors checkpoints (+ a torch one), metrics and a config."""
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "rgt").mkdir()
    save_file(tensors(1), str(run / ST_FILES[0][0]), metadata={"step": "100"})
    save_file(tensors(2), str(run / ST_FILES[1][0]), metadata={"step": "200"})
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in METRICS))
    (run / "config.json").write_text('{"lr": 0.001}\n')
    entries = list(ST_FILES)
    if with_pt:
        torch.save({"model": tensors(3), "step": 50, "opt": {"lr": 0.1}}, run / PT_FILE[0])
        entries.append(PT_FILE)
    write_manifest(run, entries)
    return run


def sha256_of(doc: Dict[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(run: Path, entries: List[Tuple[str, str, Optional[int]]],
                   edit: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
    """Hash the files as they are now and write rgt/PULL_MANIFEST.json; `edit` runs after the
    self-hash is computed (to make a manifest that lies about itself)."""
    files = []
    for path, kind, step in entries:
        data = (run / path).read_bytes()
        files.append({"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                      "kind": kind, "step": step, "hashed": "custody"})
    doc: Dict[str, Any] = {"schema": "rgt.pull_manifest", "version": 1, "run_id": "run-abc",
                           "created_at": "2026-05-09T12:00:00Z", "host": "box1", "files": files,
                           "total_bytes": sum(f["size"] for f in files)}
    doc["sha256"] = sha256_of(doc)
    if edit is not None:
        edit(doc)
    (run / MANIFEST).write_text(json.dumps(doc, indent=1))
    return doc


def entries_of(run: Path) -> List[Tuple[str, str, Optional[int]]]:
    doc = json.loads((run / MANIFEST).read_text())
    return [(f["path"], f["kind"], f["step"]) for f in doc["files"]]


def rewrite_safetensors(path: Path, edit: Callable[[Dict[str, Any]], None], extra_data: bytes = b"",
                        cut_data: int = 0) -> None:
    """Rewrite a real safetensors file's header with `edit` (the data area kept, optionally
    extended or cut), for files whose header lies."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    edit(header)
    blob = json.dumps(header).encode()
    data = data + extra_data
    if cut_data:
        data = data[:-cut_data]
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
