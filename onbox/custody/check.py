"""Structural checks of checkpoint files (and the step they name), standard library only. Nothing is
ever unpickled here.

A check reads what locates the tensors (and, for safetensors, a sample of their raw bytes):

- safetensors: the header and every tensor's span, by the parser the controller's proof uses too
  (`rgtlib.safetensors_header`: a hostile header is "bad", never a RecursionError or a MemoryError;
  spans contiguous and covering the data section exactly, as the safetensors loader demands); then
  the head of each float tensor is sampled for NaN/Inf (`onbox.custody.finite`: raw bytes, nothing
  decoded).
- torch zip (`torch.save` since 1.6): the zip central directory parses, a `data.pkl` member exists,
  and every member's recorded span lies inside the file. No member is decompressed or read.
- legacy torch / raw pickle: recognized by its magic and reported "unchecked" (judging a pickle
  means running it, which the custody worker never does).

The format comes from the bytes first and the name second: a `.safetensors` or `.pt` name that holds
something else is "bad"; an unrecognized name with unrecognized bytes (config.json, a tokenizer) is
"other", unchecked. The controller's pull verification does the real (weights_only) load.
`check_file` never raises for what a file holds: anything a check raises is "bad" with its reason.
"""
from __future__ import annotations

import dataclasses
import os
import re
import struct
import zipfile
from pathlib import Path
from typing import IO, Any, Dict, Mapping, Optional, Tuple

from protocol.pull import is_temporary  # re-exported: custody and the manifest use it from here
from rgtlib import safetensors_header

from onbox.custody import finite

OK = "ok"
BAD = "bad"
UNCHECKED = "unchecked"

SAFETENSORS = "safetensors"
TORCH = "torch"
PICKLE = "pickle"
OTHER = "other"

TORCH_SUFFIXES = frozenset({".pt", ".pth", ".ckpt"})

@dataclasses.dataclass(frozen=True)
class CheckResult:
    """`status` is OK, BAD (with `reason`) or UNCHECKED; `metadata` is a safetensors header's."""

    format: str
    status: str
    reason: Optional[str] = None
    metadata: Dict[str, str] = dataclasses.field(default_factory=dict)
    tensors: Optional[int] = None
    nonfinite: Tuple[str, ...] = ()    # safetensors: float tensors whose sampled head is NaN/Inf


class _Bad(Exception):
    """A structural defect; the message is the reason shown to the user."""


def check_path(path: Path) -> CheckResult:
    """Open `path` read-only and check it (see `check_file`)."""
    with open(path, "rb") as f:
        return check_file(f, os.fstat(f.fileno()).st_size, Path(path).name)


def check_file(f: IO[bytes], size: int, name: str) -> CheckResult:
    """Check an open binary file of `size` bytes called `name`; never raises for bad content."""
    f.seek(0)
    head = f.read(16)
    suffix = Path(name).suffix.lower()
    if suffix == ".safetensors" or _looks_like_safetensors(head, size):
        return _run(SAFETENSORS, lambda: _check_safetensors(f, size))
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return _run(TORCH, lambda: _check_torch_zip(f, size, suffix))
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return CheckResult(PICKLE, UNCHECKED, "legacy pickle: not unpickled here")
    if suffix in TORCH_SUFFIXES:
        return CheckResult(TORCH, BAD, "neither a torch zip nor a pickle (unknown leading bytes)")
    return CheckResult(OTHER, UNCHECKED)


def _run(fmt: str, fn: Any) -> CheckResult:
    try:
        result: CheckResult = fn()
    except _Bad as e:
        return CheckResult(fmt, BAD, f"{fmt}: {e}")
    except Exception as e:  # a check that raised is a verdict too: never a checkpoint left out
        return CheckResult(fmt, BAD, f"{fmt}: checking it raised {type(e).__name__}: {str(e)[:200]}")
    return result


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= size - 8 and head[8:9] == b"{"


_STEP = re.compile(r"(?<![a-z])(?:global_step|step|iteration|iter|checkpoint|ckpt)[-_=]?(\d+)", re.I)
_EPOCH = re.compile(r"(?<![a-z])epoch[-_=]?(\d+)", re.I)


def step_of(rel: str, metadata: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The step a path names (step000100, checkpoint-500/x, global_step7, epoch=3-step=90), else the
    epoch it names (epoch_3), else a safetensors header's "step" / "global_step", else None."""
    parts = list(reversed(Path(rel).parts))
    for pattern in (_STEP, _EPOCH):
        for part in parts:
            found = pattern.findall(part)
            if found:
                return int(found[-1])
    meta = metadata or {}
    value = meta.get("step") or meta.get("global_step")
    return int(value) if value is not None and value.strip().isdigit() else None


# ---- safetensors --------------------------------------------------------------------------------


def _check_safetensors(f: IO[bytes], size: int) -> CheckResult:
    try:
        layout = safetensors_header.parse(f, size)
    except safetensors_header.HeaderError as e:
        raise _Bad(str(e)) from e
    nonfinite, _ = finite.sample_nonfinite(f, layout.data_start, layout.tensors)
    return CheckResult(SAFETENSORS, OK, metadata=layout.metadata, tensors=len(layout.tensors),
                       nonfinite=tuple(nonfinite))


# ---- torch zip ----------------------------------------------------------------------------------


def _check_torch_zip(f: IO[bytes], size: int, suffix: str) -> CheckResult:
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as zf:  # parses the central directory only
            infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as e:
        raise _Bad(f"zip central directory unreadable ({e}): truncated or corrupt") from e
    names = [i.filename for i in infos]
    if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
        if suffix in TORCH_SUFFIXES:
            raise _Bad(f"zip has no data.pkl member ({len(names)} members): not a torch checkpoint")
        return CheckResult(OTHER, UNCHECKED, "a zip archive that is not a torch checkpoint")
    for info in infos:
        # A 30-byte local header and the name precede the data (extra fields add more, never less;
        # the name's length in characters is a lower bound on its length in bytes).
        end = info.header_offset + 30 + len(info.orig_filename) + info.compress_size
        if end > size:
            raise _Bad(f"member {info.filename!r} ends at {end}, past the end of the file ({size} bytes)")
    return CheckResult(TORCH, OK, tensors=sum(1 for n in names if "/data/" in n))


__all__ = ["BAD", "OK", "UNCHECKED", "CheckResult", "check_file", "check_path", "is_temporary", "step_of"]
