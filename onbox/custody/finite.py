"""Are a safetensors file's weights finite? A sampled answer, standard library only, no torch.

The custody worker asks this of every safetensors file it records (HF's `model.safetensors`, shards,
`report.save(..., format="safetensors")`), so a run whose weights went NaN is named when its
checkpoint is written, before anyone pulls it. The laptop's `rgt verify` does the full check.

A float is non-finite exactly when its exponent bits are all ones (IEEE 754: F64, F32, F16, and
BF16, which is F32's top half). The check reads at most `SAMPLE_BYTES` from the start of each float
tensor and at most `FILE_BUDGET_BYTES` per file, so a large checkpoint costs milliseconds; weights a
NaN step poisoned are NaN everywhere, so the head of each tensor is where to look. The test is done
on whole chunks at once with big-integer arithmetic (the "has a zero field" trick over the masked
exponents), never one element at a time in Python.

8-bit and smaller float formats are skipped (their encodings differ; E4M3 has no infinity).
"""
from __future__ import annotations

import functools
from typing import IO, Dict, Iterable, List, Tuple

from rgtlib.safetensors_header import TensorSpan

SAMPLE_BYTES = 64 * 1024
FILE_BUDGET_BYTES = 8 << 20
MAX_NAMES = 5

# dtype -> (bytes per element, exponent mask)
FLOATS: Dict[str, Tuple[int, int]] = {
    "F64": (8, 0x7FF0_0000_0000_0000),
    "F32": (4, 0x7F80_0000),
    "F16": (2, 0x7C00),
    "BF16": (2, 0x7F80),
}


@functools.lru_cache(maxsize=32)
def _masks(width: int, mask: int, n: int) -> Tuple[int, int, int]:
    """(the exponent mask, 1, and the top bit) repeated over `n` little-endian fields."""
    def rep(value: int) -> int:
        return int.from_bytes(value.to_bytes(width, "little") * n, "little")
    return rep(mask), rep(1), rep(1 << (8 * width - 1))


def chunk_has_nonfinite(chunk: bytes, dtype: str) -> bool:
    """True when any whole element of `chunk` (little-endian `dtype`) is NaN or +/-Inf."""
    width, mask = FLOATS[dtype]
    n = len(chunk) // width
    if n == 0:
        return False
    exp_mask, ones, tops = _masks(width, mask, n)
    x = int.from_bytes(chunk[:n * width], "little")
    z = (x & exp_mask) ^ exp_mask     # a field is zero exactly where the exponent is all ones
    return ((z - ones) & ~z & tops) != 0


def sample_nonfinite(f: IO[bytes], data_start: int, tensors: Iterable[TensorSpan]) -> Tuple[List[str], int]:
    """(names of float tensors whose sampled head holds NaN/Inf, at most MAX_NAMES; bytes read).
    `tensors`: a parsed header's (rgtlib.safetensors_header), its spans already checked."""
    found: List[str] = []
    read = 0
    spans = sorted((t.begin, t.end, t.name, t.dtype) for t in tensors if t.dtype in FLOATS)
    for begin, end, key, dtype in spans:
        take = min(end - begin, SAMPLE_BYTES, FILE_BUDGET_BYTES - read)
        if take <= 0:
            break
        f.seek(data_start + begin)
        chunk = f.read(take)
        read += len(chunk)
        if chunk_has_nonfinite(chunk, dtype):
            found.append(key)
            if len(found) >= MAX_NAMES:
                break
    return found, read


__all__ = ["FLOATS", "chunk_has_nonfinite", "sample_nonfinite"]
