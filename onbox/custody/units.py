"""What a checkpoint unit is, and how a directory unit is listed, hashed and named.

A unit is what a framework saves at once and resumes from. Under a watched place, a file's unit is
its outermost ancestor directory (below the place) whose name is a save's name, else the file
itself:

- directory units: `checkpoint-N` / `checkpoint_N` (HF Trainer, accelerate), `global_stepN`
  (DeepSpeed), `step_N`, `iter_N`, `epoch_N`, `ckpt-N`, `*.ckpt/` (Lightning under DeepSpeed),
  `*_fsdp_N` (FSDP shard dirs), and any directory a `checkpoint` hint named;
- file units: everything else (`step100.pt`, `epoch=0-step=40.ckpt`, `model.safetensors`).

Temporary names (`onbox.custody.check.is_temporary`: `tmp-checkpoint-N/`, `*.tmp`, dotfiles) are never
part of a unit; a unit staged under one commits when it is renamed into place.

A directory unit is complete when its framework's last file of the save was written (HF:
`trainer_state.json`, see `final_file`) and the directory is quiet; without a known last file, when
it stayed quiet for the longer `unit_settle_s`. Its files are hashed one by one (`hash_dir`) and
summed up by `rgtlib.hashing.unit_digest` (the hashing is the custody worker's: `onbox.custody.worker`).
Standard library only: the pull manifest and the gate's view use it too.

A unit outside the run dir gets a stable place in a pull: <run>/rgt/external/<name>-<8 hex>, a
symbolic link to its watched place (`external_rel`, `ensure_link`); the pull's rsync copies links
as their targets (--copy-links), so its files arrive as
rgt/external/<name>-<8 hex>/<path under the place>.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from onbox.custody import check
from onbox.custody.check import is_temporary
from onbox.fsutil import regular_files

_UNIT_DIR = re.compile(r"^(?:checkpoint|ckpt|global_step|step|iter|iteration|epoch)[-_=]?\d+$"
                       r"|\.ckpt$|_fsdp_\d+$", re.I)
_HF_DIR = re.compile(r"^checkpoint-\d+$")
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".distcp")
EXTERNAL = "rgt/external"
MAX_STATE_BYTES = 64 << 20
Key = Tuple[int, int, int]           # (size, mtime_ns, inode)
Sig = Tuple[Tuple[str, Key], ...]   # a directory unit's (relpath, key) per file, sorted


def is_unit_dir(name: str) -> bool:
    return bool(_UNIT_DIR.search(name)) and not is_temporary(name)


def unit_of(rel: str) -> Tuple[str, str]:
    """(unit path relative to the place, "dir" | "file") of a file's path relative to its place."""
    parts = rel.split("/")
    for i in range(len(parts) - 1):
        if is_unit_dir(parts[i]):
            return "/".join(parts[: i + 1]), "dir"
    return rel, "file"


def final_file(unit_name: str) -> Optional[str]:
    """The file a framework writes last in a save of this unit, when one is known."""
    return "trainer_state.json" if _HF_DIR.match(unit_name) else None


def is_weight_name(name: str) -> bool:
    return name.lower().endswith(WEIGHT_SUFFIXES)


def framework_of(unit_name: str) -> str:
    if _HF_DIR.match(unit_name):
        return "hf"
    if unit_name.startswith("global_step"):
        return "deepspeed"
    return "dir"


# ---- listing and hashing ------------------------------------------------------------------------


def signature(unit: Path) -> Sig:
    """Every finished regular file under `unit` (no symlink followed), with its key, sorted."""
    out: List[Tuple[str, Key]] = []
    for base, dirs, files in os.walk(unit):
        dirs[:] = sorted(d for d in dirs if not is_temporary(d))
        for full, st in regular_files(base, (n for n in files if not is_temporary(n))):
            rel = os.path.relpath(full, unit).replace(os.sep, "/")
            out.append((rel, (st.st_size, st.st_mtime_ns, st.st_ino)))
    return tuple(sorted(out))


def unit_step(unit: Path, rel: str) -> Optional[int]:
    """The step a unit's name says (checkpoint-50, epoch=0-step=60.ckpt), else its
    trainer_state.json's global_step."""
    step = check.step_of(rel)
    if step is not None:
        return step
    state = unit / "trainer_state.json"
    try:
        if state.stat().st_size > MAX_STATE_BYTES:
            return None
        doc = json.loads(state.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = doc.get("global_step") if isinstance(doc, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


# ---- places outside the run dir -----------------------------------------------------------------


def external_rel(root: str) -> str:
    """The stable in-pull place of a watched place outside the run dir."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(root.rstrip("/")) or "root")[:40]
    tag = hashlib.sha256(root.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    return f"{EXTERNAL}/{name}-{tag}"


def ensure_link(run_dir: Path, root: str) -> str:
    """Create <run>/rgt/external/<name>-<tag> -> root (once); its run-relative path."""
    rel = external_rel(root)
    link = Path(run_dir) / rel
    try:
        if os.readlink(link) == root:
            return rel
        os.unlink(link)
    except OSError:
        pass
    link.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.symlink(root, link)
    except FileExistsError:
        pass
    return rel


def in_pull_path(run_dir: Path, path: str, root: Optional[str]) -> Optional[str]:
    """Where a recorded unit (its manifest `path`) lies in a pull: the path itself when it is
    run-relative, else under its place's external link; None when it cannot be placed."""
    if not os.path.isabs(path):
        return path
    if root is None:
        return None
    rel = os.path.relpath(path, root)
    if rel == "." or rel.startswith(".."):
        return None
    return f"{external_rel(root)}/{rel.replace(os.sep, '/')}"


def places_file(run_dir: Path) -> Path:
    return Path(run_dir) / "rgt" / "ckpt_locations.json"


def read_places(run_dir: Path) -> Dict[str, str]:
    """The places custody watches beyond the checkpoint dir: absolute path -> how it was found."""
    try:
        doc = json.loads(places_file(run_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    items = doc.get("places") if isinstance(doc, dict) else None
    out: Dict[str, str] = {}
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and isinstance(item.get("path"), str) and item["path"].startswith("/"):
            out[item["path"]] = str(item.get("how") or "")
    return out


__all__ = ["EXTERNAL", "Key", "Sig", "ensure_link", "external_rel", "final_file",
           "framework_of", "in_pull_path", "is_unit_dir", "is_weight_name", "places_file",
           "read_places", "signature", "unit_of", "unit_step"]
