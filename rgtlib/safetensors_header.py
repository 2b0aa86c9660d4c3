"""Our own parser of the safetensors layout, standard library only: the safe-load proof of a
`.safetensors` file without trusting anybody's loader.

The layout: 8 bytes little-endian N, then N bytes of JSON header, then the data area. The header
maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
data area) plus an optional "__metadata__" map of strings. A file passes when

- N is at most MAX_HEADER_BYTES and 8 + N is at most the file size;
- the header is UTF-8 JSON, an object, with no name given twice; before it is parsed its shape is
  measured (strings blanked, brackets counted: C-speed regexes), and a header nesting deeper than
  MAX_DEPTH, or holding more than MAX_CONTAINERS arrays/objects or MAX_ITEMS values, is refused
  with a HeaderError, so a hostile header can never raise RecursionError or exhaust memory here;
- every dtype is known, every shape a list of at most MAX_RANK ints in [0, 2^64), its byte size
  within 64 bits (what the safetensors loader's checked arithmetic accepts), every span [begin,
  end] with end - begin == prod(shape) x dtype size (sub-byte dtypes must fill whole bytes);
- sorted by begin, the spans neither overlap nor leave a hole, and they cover the data area exactly
  (what the safetensors loader itself demands, so a file we pass is a file it loads).

Nothing here reads the tensor bytes; `parse_path` reads the first 8 + N bytes only.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import struct
from pathlib import Path
from typing import IO, Any, Dict, List, Sequence, Tuple

MAX_HEADER_BYTES = 100 * 1000 * 1000  # safetensors' own cap on N
MAX_DEPTH = 64  # nesting of arrays/objects: a real header needs 3
MAX_CONTAINERS = 3_000_000  # arrays + objects: ~3 per tensor, so a million tensors
MAX_ITEMS = 8_000_000  # values (separators + containers): bounds what json builds in memory
MAX_RANK = 64
MAX_U64 = (1 << 64) - 1  # the loader's usize
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}

# Bits per element of every dtype safetensors 0.8 writes.
DTYPE_BITS: Dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "U16": 16, "I16": 16, "U32": 32, "I32": 32, "U64": 64, "I64": 64,
    "F16": 16, "BF16": 16, "F32": 32, "F64": 64, "C64": 64,
    "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4,
}
FLOAT_DTYPES = frozenset(d for d in DTYPE_BITS if d.startswith(("F", "BF", "C")))


class HeaderError(ValueError):
    """The file breaks the layout; the message is one line saying where."""


@dataclasses.dataclass(frozen=True)
class TensorSpan:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    begin: int  # relative to the data area
    end: int

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclasses.dataclass(frozen=True)
class Layout:
    """A header that passed: where the data area starts and what lies in it."""

    data_start: int  # absolute file offset: 8 + N
    data_len: int
    tensors: Tuple[TensorSpan, ...]
    metadata: Dict[str, str]

    def dtypes(self) -> Dict[str, int]:
        counts: Dict[str, int] = {}
        for t in self.tensors:
            counts[t.dtype] = counts.get(t.dtype, 0) + 1
        return counts


def parse_path(path: Path) -> Layout:
    """Open `path` and parse it; HeaderError when the layout is broken, OSError when unreadable."""
    with open(path, "rb") as f:
        return parse(f, os.fstat(f.fileno()).st_size)


def parse(f: IO[bytes], size: int) -> Layout:
    """Parse the layout of a file of `size` bytes open in `f` (read from offset 0)."""
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) < 8:
        raise HeaderError(f"file is {size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > size:
        raise HeaderError(f"header length {n} runs past the end of the {size}-byte file (truncated?)")
    raw = f.read(n)
    if len(raw) != n:
        raise HeaderError(f"header cut short: read {len(raw)} of {n} bytes")
    header = _decode_header(raw)
    metadata = _metadata(header.pop("__metadata__", None))
    tensors = tuple(_tensor(name, entry) for name, entry in header.items())
    data_len = size - 8 - n
    _check_coverage(tensors, data_len)
    return Layout(data_start=8 + n, data_len=data_len, tensors=tensors, metadata=metadata)


def _no_duplicates(pairs: Sequence[Tuple[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise HeaderError(f"name {key!r} appears twice in the header")
        out[key] = value
    return out


def measure(text: str) -> None:
    """Refuse a header text too deep or too large to parse safely (HeaderError), before json sees
    it: strings blanked out, then brackets counted and their running depth taken."""
    skeleton = _STRING.sub("0", text)
    brackets = _NOT_BRACKET.sub("", skeleton)
    containers = brackets.count("[") + brackets.count("{")
    if containers > MAX_CONTAINERS:
        raise HeaderError(f"header holds {containers} arrays/objects (limit {MAX_CONTAINERS}): "
                          "refused without parsing it")
    items = skeleton.count(",") + containers
    if items > MAX_ITEMS:
        raise HeaderError(f"header holds about {items} values (limit {MAX_ITEMS}): "
                          "refused without parsing it")
    depth = max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)
    if depth > MAX_DEPTH:
        raise HeaderError(f"header nests {depth} levels deep (limit {MAX_DEPTH}): refused without parsing it")


def _decode_header(raw: bytes) -> Dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"header is not UTF-8 (byte {e.start})") from e
    measure(text)
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except HeaderError:
        raise
    except json.JSONDecodeError as e:
        raise HeaderError(f"header is not JSON: {e.msg} at offset {e.pos}") from e
    except (ValueError, RecursionError, MemoryError) as e:  # e.g. an int of over 4300 digits
        raise HeaderError(f"header does not parse: {type(e).__name__}: {str(e)[:120]}") from e
    if not isinstance(header, dict):
        raise HeaderError(f"header is a JSON {type(header).__name__}, not an object")
    return header


def _metadata(value: Any) -> Dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HeaderError("__metadata__ is not an object")
    for key, item in value.items():
        if not isinstance(item, str):
            raise HeaderError(f"__metadata__[{key!r}] is not a string")
    return dict(value)


def _natural(value: Any) -> bool:
    return type(value) is int and value >= 0


def _tensor(name: str, entry: Any) -> TensorSpan:
    if not isinstance(entry, dict):
        raise HeaderError(f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise HeaderError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_natural(d) for d in shape):
        raise HeaderError(f"tensor {name!r}: shape {_short(shape)} is not a list of non-negative ints")
    if len(shape) > MAX_RANK or any(d > MAX_U64 for d in shape):
        raise HeaderError(f"tensor {name!r}: shape {_short(shape)} has more than {MAX_RANK} dimensions "
                          "or a dimension of 2^64 or more")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_natural(o) for o in offsets):
        raise HeaderError(f"tensor {name!r}: data_offsets {_short(offsets)} is not [begin, end]")
    if any(o > MAX_U64 for o in offsets):
        raise HeaderError(f"tensor {name!r}: data_offsets {_short(offsets)} are 2^64 or more")
    span = TensorSpan(name, dtype, tuple(shape), offsets[0], offsets[1])
    if span.end < span.begin:
        raise HeaderError(f"tensor {name!r}: data_offsets end {span.end} is before begin {span.begin}")
    bits = DTYPE_BITS[dtype]
    for d in shape:
        bits *= d
        if bits > MAX_U64 * 8:
            raise HeaderError(f"tensor {name!r}: shape {_short(shape)} x {dtype} overflows 64 bits")
    if bits % 8 != 0 or bits // 8 != span.end - span.begin:
        raise HeaderError(f"tensor {name!r}: shape {list(shape)} x {dtype} is {bits / 8:g} bytes "
                          f"but its span [{span.begin}, {span.end}] holds {span.end - span.begin}")
    return span


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _check_coverage(tensors: Sequence[TensorSpan], data_len: int) -> None:
    ordered: List[TensorSpan] = sorted(tensors, key=lambda t: (t.begin, t.end))
    covered = 0
    for t in ordered:
        if t.end > data_len:
            raise HeaderError(f"tensor {t.name!r}: span [{t.begin}, {t.end}] ends beyond the "
                              f"{data_len}-byte data area (truncated or lying header)")
        if t.begin < covered:
            raise HeaderError(f"tensor {t.name!r}: span [{t.begin}, {t.end}] overlaps the tensor "
                              f"before it (which ends at {covered})")
        if t.begin > covered:
            raise HeaderError(f"tensor {t.name!r}: span starts at {t.begin}, leaving a hole "
                              f"[{covered}, {t.begin}] in the data area")
        covered = t.end
    if covered != data_len:
        raise HeaderError(f"tensors cover {covered} of the {data_len}-byte data area "
                          f"({data_len - covered} bytes unaccounted for)")


__all__ = ["DTYPE_BITS", "FLOAT_DTYPES", "MAX_DEPTH", "HeaderError", "Layout", "TensorSpan", "measure",
           "parse", "parse_path"]
