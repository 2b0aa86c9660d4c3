"""Structural checks of checkpoint files (and the step they name), standard library only. Nothing is
ever unpickled here.

A check reads what locates the tensors (and, for safetensors, a sample of their raw bytes):

- safetensors: the 8-byte little-endian header length, the JSON header (measured before it is
  parsed: nesting deeper than MAX_DEPTH, more than MAX_CONTAINERS arrays/objects or MAX_ITEMS values
  is "bad", never a RecursionError or a MemoryError), every dtype known, every shape at most
  MAX_RANK dims below 2^64 whose byte size fits 64 bits, every
  tensor's byte span equal to prod(shape) x dtype size, spans contiguous (no overlap, no hole) and
  covering the data section exactly (what the safetensors loader itself demands); then the head of
  each float tensor is sampled for NaN/Inf (`onbox.ckptfinite`: raw bytes, nothing decoded).
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
import itertools
import json
import os
import re
import struct
import zipfile
from pathlib import Path
from typing import IO, Any, Dict, List, Mapping, Optional, Tuple

from protocol.pull import is_temporary  # re-exported: custody and the manifest use it from here

from onbox import ckptfinite

OK = "ok"
BAD = "bad"
UNCHECKED = "unchecked"

SAFETENSORS = "safetensors"
TORCH = "torch"
PICKLE = "pickle"
OTHER = "other"

TORCH_SUFFIXES = frozenset({".pt", ".pth", ".ckpt"})
MAX_HEADER_BYTES = 100_000_000  # the safetensors loader's own cap
MAX_DEPTH = 64                  # nesting of arrays/objects: a real header needs 3
MAX_CONTAINERS = 3_000_000      # arrays + objects: ~3 per tensor
MAX_ITEMS = 8_000_000           # values: bounds what json builds in memory
MAX_RANK = 64
MAX_U64 = (1 << 64) - 1         # the loader's usize
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}

# Bits per element of every dtype safetensors 0.8 knows (sub-byte dtypes pack).
DTYPE_BITS: Dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}


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
    if size < 8:
        raise _Bad(f"{size} bytes: shorter than the 8-byte header length")
    f.seek(0)
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER_BYTES:
        raise _Bad(f"header length {n} is over the {MAX_HEADER_BYTES}-byte cap")
    if 8 + n > size:
        raise _Bad(f"header length {n} runs past the end of the file ({size} bytes): truncated")
    raw = f.read(n)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Bad(f"header is not UTF-8 (byte {e.start})") from e
    measure(text)
    try:
        header = json.loads(text)
    except (ValueError, RecursionError, MemoryError) as e:  # ValueError: also a 4300-digit int
        raise _Bad(f"header is not JSON: {type(e).__name__}: {str(e)[:200]}") from e
    if not isinstance(header, dict):
        raise _Bad("header is not a JSON object")
    metadata = _metadata(header.pop("__metadata__", None))
    spans = [_span(key, info) for key, info in header.items()]
    _check_spans(spans, size - 8 - n)
    nonfinite, _ = ckptfinite.sample_nonfinite(f, 8 + n, header)
    return CheckResult(SAFETENSORS, OK, metadata=metadata, tensors=len(spans), nonfinite=tuple(nonfinite))


def measure(text: str) -> None:
    """Refuse (as bad) a header too deep or too large to parse safely, before json sees it:
    strings blanked out, brackets counted and their running depth taken (regexes, C speed)."""
    skeleton = _STRING.sub("0", text)
    brackets = _NOT_BRACKET.sub("", skeleton)
    containers = brackets.count("[") + brackets.count("{")
    if containers > MAX_CONTAINERS:
        raise _Bad(f"header holds {containers} arrays/objects (over {MAX_CONTAINERS}): refused unparsed")
    items = skeleton.count(",") + containers
    if items > MAX_ITEMS:
        raise _Bad(f"header holds about {items} values (over {MAX_ITEMS}): refused unparsed")
    depth = max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)
    if depth > MAX_DEPTH:
        raise _Bad(f"header nests {depth} levels deep (over {MAX_DEPTH}): refused unparsed")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _metadata(meta: Any) -> Dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _Bad("__metadata__ is not a map of strings")
    return dict(meta)


def _span(key: str, info: Any) -> Tuple[int, int, str]:
    if not isinstance(info, dict):
        raise _Bad(f"tensor {key!r}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise _Bad(f"tensor {key!r}: unknown dtype {_short(dtype)}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise _Bad(f"tensor {key!r}: bad shape {_short(shape)}")
    if len(shape) > MAX_RANK or any(d > MAX_U64 for d in shape):
        raise _Bad(f"tensor {key!r}: shape {_short(shape)} has over {MAX_RANK} dims or a dim of 2^64 or more")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise _Bad(f"tensor {key!r}: bad data_offsets {_short(offsets)}")
    begin, end = offsets
    if end > MAX_U64:
        raise _Bad(f"tensor {key!r}: data_offsets {_short(offsets)} reach 2^64 or more")
    if end < begin:
        raise _Bad(f"tensor {key!r}: data_offsets end {end} before begin {begin}")
    bits = DTYPE_BITS[str(dtype)]
    for d in shape:
        bits *= d
        if bits > MAX_U64 * 8:
            raise _Bad(f"tensor {key!r}: shape {_short(shape)} x {dtype} overflows 64 bits")
    if bits % 8 or bits // 8 != end - begin:
        raise _Bad(f"tensor {key!r}: shape {shape} x {dtype} needs {bits / 8:g} bytes, "
                   f"its span holds {end - begin}")
    return begin, end, key


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_spans(spans: List[Tuple[int, int, str]], data_len: int) -> None:
    at = 0
    for begin, end, key in sorted(spans):
        if begin < at:
            raise _Bad(f"tensor {key!r}: span {begin}..{end} overlaps the previous tensor (ends at {at})")
        if begin > at:
            raise _Bad(f"tensor {key!r}: span starts at {begin}, leaving a hole after {at}")
        if end > data_len:
            raise _Bad(f"tensor {key!r}: span {begin}..{end} ends past the data section "
                       f"({data_len} bytes): truncated")
        at = end
    if at != data_len:
        raise _Bad(f"data section is {data_len} bytes but the tensors cover {at}")


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
