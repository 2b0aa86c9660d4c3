"""SHA-256 of file bytes, the one way both sides read them: fixed-size reads into one reused buffer,
optionally paced by a `RateLimit` (a token bucket over bytes, so hashing a 100 GB checkpoint never
starves the job's own I/O) and stoppable (every wait ends at once when its stop event is set).

Also the directory unit's digest, which the box records and the laptop recomputes: it must be the
same function on both sides, so there is one.
"""
from __future__ import annotations

import hashlib
import threading
import time
from typing import IO, Callable, Iterable, Optional, Protocol, Tuple

CHUNK = 1 << 20


class Readable(Protocol):
    """An open binary file: what `open(path, "rb")` returns, buffered or not."""

    def readinto(self, buffer: bytearray, /) -> Optional[int]: ...


class RateLimit:
    """A token bucket over bytes; `take` waits on `stop`, so closing never waits for a slow pace.
    `rate` None or 0: unpaced (only the stop is looked at)."""

    def __init__(self, rate: Optional[int], burst: int, stop: threading.Event,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self._stop = stop
        self._mono = monotonic
        self._tokens = float(burst)
        self._at = monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Spend `n` bytes, waiting while the bucket is in debt; False once stopped."""
        if self.rate:
            with self._lock:
                now = self._mono()
                self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate) - n
                self._at = now
                debt = -self._tokens
            if debt > 0 and self._stop.wait(debt / self.rate):
                return False
        return not self._stop.is_set()


def sha256_stream(f: Readable, pace: Optional[RateLimit] = None,
                  progress: Optional[Callable[[int], None]] = None, chunk: int = CHUNK,
                  copy_to: Optional[IO[bytes]] = None) -> Optional[Tuple[str, int]]:
    """(SHA-256 hex, bytes read) of the rest of the open binary file `f`; None once `pace` is
    stopped. `progress(bytes so far)` after every read; `copy_to`: every byte read is written
    there too (the caller flushes and fsyncs it)."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    done = 0
    while True:
        n = f.readinto(buf)
        if not n:
            return h.hexdigest(), done
        h.update(view[:n])
        if copy_to is not None:
            copy_to.write(view[:n])
        done += n
        if progress is not None:
            progress(done)
        if pace is not None and not pace.take(n):
            return None


def sha256_whole(f: Readable, chunk: int = CHUNK, copy_to: Optional[IO[bytes]] = None) -> Tuple[str, int]:
    """(SHA-256 hex, bytes read) of the rest of `f`, unpaced (see sha256_stream)."""
    hashed = sha256_stream(f, chunk=chunk, copy_to=copy_to)
    if hashed is None:  # only a pace stops a stream, and this one has none
        raise RuntimeError("an unpaced hash stopped")
    return hashed


def unit_digest(files: Iterable[Tuple[str, int, str]]) -> str:
    """A directory unit's digest: SHA-256 over the sorted lines "relpath\\0size\\0sha256\\n"
    (UTF-8, undecodable bytes of a name kept by surrogateescape) of the unit's files."""
    h = hashlib.sha256()
    for rel, size, sha in sorted(files):
        h.update(f"{rel}\0{size}\0{sha}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


__all__ = ["CHUNK", "RateLimit", "Readable", "sha256_stream", "sha256_whole", "unit_digest"]
