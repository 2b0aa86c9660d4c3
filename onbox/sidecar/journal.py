"""The append-only event journal: rgt/events.jsonl, the run's source of truth.

One JSON event per line. seq continues across sidecar restarts (the tail is
read back on open). A torn last line from a crash mid-write is cut off and
kept aside in a `.torn` file, never fatal. Files rotate by size: the full file
is renamed to `events.<first seq>.jsonl` and replay reads across all of them.

When the disk is full (ENOSPC, EFBIG from RLIMIT_FSIZE, any OSError) new
events wait in a bounded memory ring, in order, and are still published and
replayable; the journal reports `sidecar.degraded` once and `sidecar.recovered`
when the ring is flushed. When the ring overflows, its oldest events are lost
and the recovery event names the lost seq range.

fsync: at once for warn/critical events, otherwise at most every
`fsync_interval_s` (on append or on `tick()`).
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Tuple

from protocol import Event, ProtocolError, decode_event, default_sev, encode_event
from protocol.codec import has_lone_surrogate, without_surrogates

from onbox.fsutil import fsync_dir

log = logging.getLogger(__name__)

CURRENT = "events.jsonl"
_ROTATED = re.compile(r"^events\.(\d{12})\.jsonl$")
_TAIL_SCAN_BYTES = 1 << 20

Published = List[Tuple[Event, bytes]]


class JournalError(Exception):
    """The journal cannot be opened at all (not a full disk: that degrades)."""


class Journal:
    def __init__(
        self,
        directory: Path,
        run: str,
        host: str,
        *,
        rotate_bytes: int = 16 << 20,
        ring_max: int = 10_000,
        cache_max: int = 20_000,
        fsync_interval_s: float = 2.0,
        retry_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        fsync: Callable[[int], None] = os.fsync,
        write: Callable[[int, bytes], int] = os.write,
    ) -> None:
        self.directory = Path(directory)
        self.run = run
        self.host = host
        self.rotate_bytes = rotate_bytes
        self.ring_max = ring_max
        self.fsync_interval_s = fsync_interval_s
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        self._mono = monotonic
        self._fsync = fsync
        self._write = write
        self._lock = threading.RLock()
        self._fd = -1
        self._size = 0
        self._first_seq_current = 0   # first seq in events.jsonl (0: empty)
        self._last_seq = 0
        self._cache: Deque[Tuple[int, bytes]] = collections.deque(maxlen=cache_max)
        self._ring: Deque[Tuple[int, bytes]] = collections.deque()
        self._dirty = False
        self._last_fsync = 0.0
        self._last_retry = 0.0
        self._degraded_error: Optional[str] = None
        self._lost: Optional[Tuple[int, int]] = None
        self.torn_recoveries = 0
        self.bad_lines = 0
        self.repaired_strings = 0   # events journaled with U+FFFD for a lone surrogate

    # ---- opening ----------------------------------------------------------

    def open(self) -> None:
        with self._lock:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.directory / CURRENT, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
                self._recover_tail()
            except OSError as e:
                raise JournalError(f"cannot open the journal in {self.directory}: {e}") from e
            self._last_fsync = self._mono()

    def _recover_tail(self) -> None:
        """Cut a torn or undecodable tail off events.jsonl; learn the last seq."""
        size = os.fstat(self._fd).st_size
        start = max(0, size - _TAIL_SCAN_BYTES)
        tail = os.pread(self._fd, size - start, start)
        keep = len(tail)
        while keep > 0:
            end = keep if tail[keep - 1:keep] == b"\n" else None
            if end is None:  # no newline at the end: a torn write
                cut = tail.rfind(b"\n", 0, keep) + 1
            else:
                cut = tail.rfind(b"\n", 0, keep - 1) + 1
                if self._seq_of(tail[cut:keep - 1]) is not None:
                    break
            if cut == 0 and start > 0:
                break  # the bad part is longer than the scan window; keep what we cannot see
            keep = cut
        if keep < len(tail):
            self._set_aside(tail[keep:])
            os.ftruncate(self._fd, start + keep)
            self._fsync(self._fd)
        self._size = start + keep
        lines = tail[:keep].splitlines()
        if lines:
            self._last_seq = self._seq_of(lines[-1]) or 0
            self._first_seq_current = self._first_seq_of_current()
        else:
            self._last_seq = self._last_seq_of_rotated()

    def _set_aside(self, torn: bytes) -> None:
        self.torn_recoveries += 1
        name = self.directory / f"{CURRENT}.torn.{int(self._clock())}.{os.getpid()}"
        log.warning("journal: cut a torn tail of %d bytes; kept in %s", len(torn), name)
        try:
            with open(name, "wb") as f:
                f.write(torn)
        except OSError as e:  # a full disk is why it tore; keeping the bytes is best effort
            log.warning("journal: could not keep the torn tail: %s", e)

    @staticmethod
    def _seq_of(line: bytes) -> Optional[int]:
        try:
            return decode_event(line).seq
        except ProtocolError:
            return None

    def _first_seq_of_current(self) -> int:
        with open(self.directory / CURRENT, "rb") as f:
            for line in f:
                seq = self._seq_of(line.rstrip(b"\n"))
                if seq is not None:
                    return seq
        return 0

    def _rotated(self) -> List[Tuple[int, Path]]:
        found = []
        for p in self.directory.iterdir():
            m = _ROTATED.match(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return sorted(found)

    def _last_seq_of_rotated(self) -> int:
        rotated = self._rotated()
        if not rotated:
            return 0
        path = rotated[-1][1]
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _TAIL_SCAN_BYTES))
            for line in reversed(f.read().splitlines()):
                seq = self._seq_of(line)
                if seq is not None:
                    return seq
        return rotated[-1][0] - 1

    # ---- appending --------------------------------------------------------

    @property
    def last_seq(self) -> int:
        return self._last_seq

    @property
    def degraded(self) -> bool:
        return self._degraded_error is not None

    def stats(self) -> Dict[str, Any]:
        with self._lock:
            return {
                "last_seq": self._last_seq,
                "journal_bytes": self._size,
                "degraded": self.degraded,
                "ring_events": len(self._ring),
                "lost_seqs": list(self._lost) if self._lost else None,
                "torn_recoveries": self.torn_recoveries,
            }

    def append(self, kind: str, data: Optional[Mapping[str, Any]] = None,
               sev: Optional[str] = None, ts: Optional[float] = None) -> Published:
        """Journal one event; returns every (event, frame) to publish, in seq order.

        Usually one pair; two when this append is the one that found the disk
        full (the event, then sidecar.degraded) or the one that flushed the ring
        (sidecar.recovered follows).
        """
        with self._lock:
            out: Published = []
            if self._ring and self._mono() - self._last_retry >= self.retry_interval_s:
                out.extend(self._flush_ring())
            out.extend(self._append_one(kind, data, sev, ts))
            return out

    def _append_one(self, kind: str, data: Optional[Mapping[str, Any]],
                    sev: Optional[str], ts: Optional[float]) -> Published:
        event = Event(run=self.run, host=self.host, seq=self._last_seq + 1,
                      ts=self._clock() if ts is None else ts, kind=kind,
                      sev=sev or default_sev(kind), data=dict(data or {}))
        try:
            frame = encode_event(event)  # ProtocolError leaves the seq unused
        except ProtocolError:
            # Box text UTF-8 cannot carry (a lone surrogate: a file name os.fsdecode kept, a JSON
            # escape in a file the job wrote) is journaled with U+FFFD, not lost with its event.
            if not has_lone_surrogate(event.data):
                raise
            self.repaired_strings += 1
            event = dataclasses.replace(event, data=without_surrogates(event.data))
            frame = encode_event(event)
        self._last_seq = event.seq
        if self._ring:
            self._ring_push(event.seq, frame)
            return [(event, frame)]
        error = self._write_lines([frame])
        if error is None:
            self._first_seq_current = self._first_seq_current or event.seq
            self._cache.append((event.seq, frame))
            self._after_write(event.sev)
            return [(event, frame)]
        self._ring_push(event.seq, frame)
        self._degraded_error = error
        self._last_retry = self._mono()
        log.error("journal: write failed (%s); buffering events in memory", error)
        notice = self._append_one("sidecar.degraded", {
            "part": "journal", "error": error, "ring_max": self.ring_max,
        }, "warn", None)
        return [(event, frame), *notice]

    def _ring_push(self, seq: int, frame: bytes) -> None:
        self._ring.append((seq, frame))
        while len(self._ring) > self.ring_max:
            lost_seq, _ = self._ring.popleft()
            first = self._lost[0] if self._lost else lost_seq
            self._lost = (first, lost_seq)

    def _write_lines(self, frames: List[bytes]) -> Optional[str]:
        """Write whole lines or nothing; the error text on failure."""
        blob = b"\n".join(frames) + b"\n"
        before = self._size
        try:
            written = self._write(self._fd, blob)
            if written != len(blob):
                error = (f"short write ({written} of {len(blob)} bytes): "
                         "the disk is full or a file-size limit was hit")
                self._cut_back(before)
                return error
        except OSError as e:
            self._cut_back(before)
            return f"{errno.errorcode.get(e.errno or 0, 'OSError')}: {e.strerror or e}"
        self._size += len(blob)
        return None

    def _cut_back(self, size: int) -> None:
        """Remove a partial write so the file never holds half a line."""
        try:
            os.ftruncate(self._fd, size)
        except OSError as e:
            log.error("journal: cannot cut a partial write back: %s", e)

    def _after_write(self, sev: str) -> None:
        self._dirty = True
        now = self._mono()
        if sev != "info" or now - self._last_fsync >= self.fsync_interval_s:
            self._sync(now)
        if self._size >= self.rotate_bytes:
            self._rotate()

    def _sync(self, now: float) -> None:
        try:
            self._fsync(self._fd)
        except OSError as e:
            log.warning("journal: fsync failed: %s", e)
        self._dirty = False
        self._last_fsync = now

    def _rotate(self) -> None:
        first = self._first_seq_current
        target = self.directory / f"events.{first:012d}.jsonl"
        try:
            self._sync(self._mono())
            os.rename(self.directory / CURRENT, target)
            new_fd = os.open(self.directory / CURRENT, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as e:
            log.warning("journal: rotation failed, still appending to %s: %s", CURRENT, e)
            return
        os.close(self._fd)
        self._fd = new_fd
        self._size = 0
        self._first_seq_current = self._last_seq + 1
        fsync_dir(self.directory)

    # ---- degraded mode ----------------------------------------------------

    def tick(self) -> Published:
        """Periodic: a due fsync, and a retry of the ring flush."""
        with self._lock:
            now = self._mono()
            if self._ring:
                if now - self._last_retry >= self.retry_interval_s:
                    return self._flush_ring()
                return []
            if self._dirty and now - self._last_fsync >= self.fsync_interval_s:
                self._sync(now)
            return []

    def _flush_ring(self) -> Published:
        self._last_retry = self._mono()
        frames = [frame for _, frame in self._ring]
        error = self._write_lines(frames)
        if error is not None:
            self._degraded_error = error
            return []
        buffered = len(self._ring)
        self._first_seq_current = self._first_seq_current or self._ring[0][0]
        self._cache.extend(self._ring)
        self._ring.clear()
        self._sync(self._mono())
        data: Dict[str, Any] = {"part": "journal", "events_buffered": buffered,
                                "was": self._degraded_error}
        if self._lost:
            data["lost_first_seq"], data["lost_last_seq"] = self._lost
        self._degraded_error = None
        self._lost = None
        log.warning("journal: writes work again; flushed %d buffered events", buffered)
        return self._append_one("sidecar.recovered", data,
                                "warn" if "lost_first_seq" in data else "info", None)

    # ---- replay -----------------------------------------------------------

    @property
    def oldest_seq(self) -> int:
        with self._lock:
            rotated = self._rotated()
            if rotated:
                return rotated[0][0]
            if self._first_seq_current:
                return self._first_seq_current
            if self._cache:
                return self._cache[0][0]
            return self._ring[0][0] if self._ring else 0

    def read_since(self, seq: int, limit: int, max_bytes: int) -> Tuple[List[bytes], bool]:
        """Frames with seq > `seq`, oldest first; `more` when cut by limit or bytes."""
        with self._lock:
            out: List[bytes] = []
            budget = [max_bytes]
            mem_first = self._cache[0][0] if self._cache else (self._ring[0][0] if self._ring else None)
            if mem_first is None or seq + 1 < mem_first:
                seq = self._read_files(seq, limit, budget, out)
            if len(out) < limit and budget[0] > 0:
                for s, frame in list(self._cache) + list(self._ring):
                    if s <= seq:
                        continue
                    if len(out) >= limit or len(frame) > budget[0]:
                        break
                    out.append(frame)
                    budget[0] -= len(frame)
                    seq = s
            return out, bool(out) and seq < self._last_seq

    def _read_files(self, seq: int, limit: int, budget: List[int], out: List[bytes]) -> int:
        files = self._rotated() + [(self._first_seq_current or self._last_seq + 1, self.directory / CURRENT)]
        seq, bad, _ = _scan(files, seq, limit, budget, out)
        self.bad_lines += bad
        return seq

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                if self._ring:
                    self._flush_ring()
                self._sync(self._mono())
                os.close(self._fd)
                self._fd = -1


_SEQ_FIELD = re.compile(rb'"seq":(\d+),')


def _fast_seq(line: bytes) -> Optional[int]:
    """The seq of a line we wrote, without a full decode.

    Our encoder writes v, run, host, seq in that order and run/host ids are
    restricted to safe characters, so the first "seq": is the field. Lines
    that do not look like ours get the full decode.
    """
    m = _SEQ_FIELD.search(line, 0, 400)
    if m and line.startswith(b'{"v":'):
        return int(m.group(1))
    return Journal._seq_of(line)


def _scan(files: List[Tuple[int, Path]], seq: int, limit: int, budget: List[int],
          out: List[bytes]) -> Tuple[int, int, bool]:
    """Append to `out` the whole lines with seq > `seq` of `files` ((first seq, path), oldest
    first), up to `limit` lines and `budget[0]` bytes; (the last seq taken, lines that were not
    events, whether it stopped short)."""
    start, bad = 0, 0
    for i, (first, _) in enumerate(files):
        if first <= seq + 1:
            start = i
    for _, path in files[start:]:
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            continue
        with f:
            for line in f:
                if not line.endswith(b"\n"):
                    break  # being written right now, or torn: memory has it
                line = line[:-1]
                s = _fast_seq(line)
                if s is None:
                    bad += 1
                    continue
                if s <= seq:
                    continue
                if len(out) >= limit or len(line) > budget[0]:
                    return seq, bad, True
                out.append(line)
                budget[0] -= len(line)
                seq = s
    return seq, bad, False


@dataclasses.dataclass
class Page:
    """What `read_page` found: journal lines as written, oldest first."""
    lines: List[bytes]
    last_seq: int         # the seq of the last line in `lines`, else the `since` asked for
    more: bool            # cut by the limit or the byte budget: ask again from last_seq
    bad_lines: int        # lines that are not events (skipped)


def _first_seq_in(path: Path) -> Optional[int]:
    """The seq of the first event line of `path`; None when it has none (or is missing)."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.endswith(b"\n"):
                    seq = _fast_seq(line[:-1])
                    if seq is not None:
                        return seq
    except FileNotFoundError:
        pass
    return None


def read_page(directory: Path, since: int, limit: int = 1000, max_bytes: int = 4 << 20) -> Page:
    """The journal's lines with seq > `since`, read from its files without opening it for writing
    (the sidecar may be gone, or serving): `rgt-onbox journal`, which a controller asks when the
    sidecar's sockets do not answer. A torn or half-written last line is left out."""
    directory = Path(directory)
    files: List[Tuple[int, Path]] = []
    for p in directory.iterdir():
        m = _ROTATED.match(p.name)
        if m:
            files.append((int(m.group(1)), p))
    files.sort()
    # the current file's own first seq; one with no event yet never decides where reading starts
    files.append((_first_seq_in(directory / CURRENT) or 1 << 62, directory / CURRENT))
    out: List[bytes] = []
    last, bad, more = _scan(files, since, limit, [max_bytes], out)
    return Page(out, last, more, bad)


def read_all(directory: Path) -> List[Dict[str, Any]]:
    """Every event in a journal directory, oldest first (tools and tests).

    A reader can race a restarted writer's tail repair: the file shrinks
    under the reader's buffer and the next read starts mid-line. Such a line,
    like any line that is not a JSON object, is skipped rather than fatal.
    """
    paths = sorted(p for p in Path(directory).iterdir() if _ROTATED.match(p.name))
    paths.append(Path(directory) / CURRENT)
    events: List[Dict[str, Any]] = []
    for path in paths:
        if path.exists():
            with open(path, "rb") as f:
                for line in f:
                    event = _decode_line(line) if line.endswith(b"\n") else None
                    if event is not None:
                        events.append(event)
    return events


def _decode_line(line: bytes) -> Optional[Dict[str, Any]]:
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None
