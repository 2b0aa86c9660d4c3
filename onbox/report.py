"""Helpers for training scripts: `from onbox import report`.

    report.log(step=100, epoch=0.5, loss=loss)          # one JSON line in $RGT_METRICS
    path = report.save(state, "step{step:06d}.pt", step=100)   # atomic, into $RGT_CKPT_DIR
    resume = report.latest_checkpoint()                 # $RGT_RESUME_FROM, else the newest file
    report.seed(0, deterministic=True)                  # seeds, recorded in <run>/rgt/seed.json

Only the standard library is imported here (this module runs on Python 3.9 without the sidecar's
dependencies); torch, safetensors and numpy are imported inside the functions that need them.
Without the launcher's environment the defaults are ./metrics.jsonl and ./checkpoints.
"""
from __future__ import annotations

import json
import math
import os
import random
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

from onbox import hints
from onbox.fsutil import fsync_dir

PathLike = Union[str, "os.PathLike[str]"]
_LOG_WARNED = False


def metrics_path() -> Path:
    return Path(os.environ.get("RGT_METRICS") or "metrics.jsonl")


def checkpoint_dir() -> Path:
    return Path(os.environ.get("RGT_CKPT_DIR") or "checkpoints")


def _value(value: Any) -> Any:
    """A JSON-safe scalar: tensors/numpy scalars via .item(); NaN/Inf as "nan"/"inf"/"-inf"."""
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (str, bytes)):
        value = value.item()  # a one-element tensor or a numpy scalar; anything bigger raises
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def log(step: Optional[int] = None, epoch: Optional[float] = None, **scalars: Any) -> None:
    """Append one JSON object line to $RGT_METRICS (default ./metrics.jsonl).

    The line goes out in one write on an O_APPEND descriptor, so concurrent writers never
    interleave inside a line. A failing write (a full disk) warns once and does not stop training.
    """
    global _LOG_WARNED
    record: Dict[str, Any] = {}
    if step is not None:
        record["step"] = int(_value(step))
    if epoch is not None:
        record["epoch"] = _value(float(_value(epoch)))
    for name, value in scalars.items():
        record[name] = _value(value)
    line = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")
    path = metrics_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as e:
        if not _LOG_WARNED:
            warnings.warn(f"rgt report.log cannot write {path}: {e}", RuntimeWarning, stacklevel=2)
        _LOG_WARNED = True


def _target(name_or_path: PathLike, step: Optional[int]) -> Path:
    text = os.fspath(name_or_path)
    if step is not None and "{" in text:
        text = text.format(step=step)
    path = Path(text)
    if not path.is_absolute() and path.parent == Path("."):
        path = checkpoint_dir() / path
    return path


def _write_torch(obj: Any, tmp: Path) -> None:
    import torch  # noqa: TID251 (lazy: only a torch checkpoint needs it)

    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_safetensors(obj: Any, tmp: Path, step: Optional[int]) -> None:
    if not isinstance(obj, Mapping):
        raise TypeError("fmt='safetensors' takes a mapping of names to tensors or arrays")
    metadata = {"step": str(step)} if step is not None else None
    tensors = dict(obj)
    if any(type(v).__module__.startswith("torch") for v in tensors.values()):
        import safetensors.torch  # noqa: TID251 (lazy: only this format needs it)

        safetensors.torch.save_file(tensors, str(tmp), metadata=metadata)
    else:
        import safetensors.numpy  # noqa: TID251 (lazy: only this format needs it)

        safetensors.numpy.save_file(tensors, str(tmp), metadata=metadata)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(obj: Any, name_or_path: PathLike, *, fmt: str = "torch", step: Optional[int] = None) -> Path:
    """Save a checkpoint atomically and return its final path.

    A bare name goes into $RGT_CKPT_DIR (default ./checkpoints); a path with a directory is used as
    given. ``{step}`` in the name is filled from `step`. A `step` is recorded whatever the name says:
    safetensors keeps it in its metadata, and under rgt (RGT_RUN_DIR set) a "step" hint naming the
    final path, the temp file's inode and the step goes to <run>/rgt/hints.jsonl before the rename
    and a "checkpoint" hint after it, so custody knows the step of ``latest.pt`` too (not "step None").

    The bytes go to a temp file ending in ``.tmp`` in the same directory, are flushed and fsynced,
    renamed over the final name, and the directory is fsynced: a reader sees the old file or the
    whole new one under the final name, never a part. On error the temp file is removed.
    """
    if fmt not in ("torch", "safetensors"):
        raise ValueError(f"fmt must be 'torch' or 'safetensors', not {fmt!r}")
    final = _target(name_or_path, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        if fmt == "torch":
            _write_torch(obj, tmp)
        else:
            _write_safetensors(obj, tmp, step)
        os.chmod(tmp, 0o644)
        if step is not None:  # before the rename: custody may record the file the moment it appears
            hints.write("step", str(final), step=int(step), inode=os.stat(tmp).st_ino, framework="report")
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(final.parent)
    if step is not None:
        hints.write("checkpoint", str(final), step=int(step), framework="report")
    return final


def latest_checkpoint() -> Optional[Path]:
    """$RGT_RESUME_FROM when set and present (the launcher takes it from the custody manifest; a
    file, or a directory for a checkpoint that is one, as Hugging Face's `checkpoint-N/`), else
    the newest regular file in the checkpoint dir by mtime that is not a ``.tmp``; else None."""
    resume = os.environ.get("RGT_RESUME_FROM")
    if resume and (Path(resume).is_file() or Path(resume).is_dir()):
        return Path(resume)
    best: Optional[Path] = None
    best_mtime = -1.0
    try:
        entries = list(os.scandir(checkpoint_dir()))
    except OSError:
        return None
    for entry in entries:
        if entry.name.endswith(".tmp"):
            continue
        try:
            if not entry.is_file():
                continue
            mtime = entry.stat().st_mtime
        except OSError:
            continue
        if mtime > best_mtime:
            best, best_mtime = Path(entry.path), mtime
    return best


def _seed_torch(seed: int, deterministic: bool) -> Optional[bool]:
    """Seed torch when it is installed; returns cudnn.benchmark (None without torch)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
    import torch  # noqa: TID251 (lazy: only when the job has torch)

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return bool(torch.backends.cudnn.benchmark)


def seed(seed: int, deterministic: bool = False) -> Dict[str, Any]:
    """Seed python, numpy and torch (those importable) and record it for run.json.

    The record ``{"seed", "deterministic", "cudnn_benchmark", "seeded", "ts"}`` is written
    atomically to $RGT_RUN_DIR/rgt/seed.json when the launcher set RGT_RUN_DIR, and returned.
    """
    seeded: List[str] = ["python"]
    random.seed(seed)
    try:
        import numpy  # lazy: a job may not have numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % (1 << 32))
        seeded.append("numpy")
    benchmark = _seed_torch(seed, deterministic)
    if benchmark is not None:
        seeded.append("torch")
    record = {"seed": seed, "deterministic": bool(deterministic), "cudnn_benchmark": benchmark,
              "seeded": seeded, "ts": round(time.time(), 3)}
    run_dir = os.environ.get("RGT_RUN_DIR")
    if run_dir:
        rgt = Path(run_dir) / "rgt"
        rgt.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".seed.json.", suffix=".tmp", dir=rgt)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, rgt / "seed.json")
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        fsync_dir(rgt)
    return record


__all__ = ["checkpoint_dir", "latest_checkpoint", "log", "metrics_path", "save", "seed"]
