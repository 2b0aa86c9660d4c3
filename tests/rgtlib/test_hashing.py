"""rgtlib.hashing: the one SHA-256 reader both sides use (paced, stoppable, copying) and the unit
digest the box records and the laptop recomputes."""
from __future__ import annotations

import hashlib
import io
import threading
from typing import List, Optional

from hypothesis import given
from hypothesis import strategies as st

from rgtlib.hashing import CHUNK, RateLimit, sha256_stream, sha256_whole, unit_digest


class Waits(threading.Event):
    """A stop event whose waits return at once and are written down: the pace's debt, unslept."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: List[float] = []

    def wait(self, timeout: Optional[float] = None) -> bool:
        self.waits.append(timeout or 0.0)
        return self.is_set()


@given(st.binary(max_size=3 * 64 + 5), st.sampled_from([1, 7, 64]))
def test_a_stream_hashes_and_counts_like_hashlib_across_chunk_edges(data: bytes, chunk: int) -> None:
    seen: List[int] = []
    out = io.BytesIO()
    got = sha256_stream(io.BytesIO(data), progress=seen.append, chunk=chunk, copy_to=out)
    assert got == (hashlib.sha256(data).hexdigest(), len(data))
    assert out.getvalue() == data
    assert seen == list(range(chunk, len(data), chunk)) + ([len(data)] if data else [])
    assert sha256_whole(io.BytesIO(data), chunk) == got


def test_the_pace_waits_out_its_debt_and_a_stop_ends_the_stream() -> None:
    stop, now = Waits(), [0.0]
    pace = RateLimit(8 << 20, 1 << 20, stop, monotonic=lambda: now[0])
    assert sha256_stream(io.BytesIO(bytes(3 * CHUNK)), pace) is not None
    assert stop.waits == [0.125, 0.25]  # 1 MiB of burst, then 1 and 2 MiB of debt at 8 MiB/s, no time passing
    now[0] += 10.0  # a long pause refills the bucket to its burst only
    assert pace.take(1 << 20) and stop.waits == [0.125, 0.25]
    stop.set()
    assert sha256_stream(io.BytesIO(bytes(CHUNK)), pace) is None
    assert not RateLimit(None, 0, stop).take(1), "an unpaced limit still ends once stopped"


def test_an_unpaced_stream_never_waits() -> None:
    stop = Waits()
    assert RateLimit(0, 0, stop).take(1 << 30) and stop.waits == []


def test_the_unit_digest_is_the_sorted_lines_of_its_files() -> None:
    rows = [("b/model.safetensors", 2, "x" * 64), ("a/\udcff", 1, "y" * 64)]
    lines = "".join(f"{r}\0{n}\0{h}\n" for r, n, h in sorted(rows)).encode("utf-8", "surrogateescape")
    assert unit_digest(rows) == unit_digest(reversed(rows)) == hashlib.sha256(lines).hexdigest()
    assert unit_digest([]) == hashlib.sha256(b"").hexdigest()
