"""Read TensorBoard event files (``events.out.tfevents.*``) into `Record`s: a small parser.

Why not the `tensorboard` package's reader: the sidecar runs in a minimal environment on the box
(pyzmq, psutil, watchdog, ...) where tensorboard is absent, and it must run on Python 3.9 with the
standard library only. Scalars are all we need, and their encoding is small and stable:

- TFRecord framing, repeated: ``u64 length`` (little-endian), ``u32 masked_crc32c(length bytes)``,
  ``data`` (length bytes), ``u32 masked_crc32c(data)``; masked(c) = ((c >> 15 | c << 17) +
  0xa282ead8) mod 2^32, with CRC-32C (Castagnoli), which zlib does not have: a table is built here.
- ``data`` is an ``Event`` protobuf: wall_time = 1 (double), step = 2 (int64), summary = 5. A
  ``Summary`` holds repeated value = 1; a ``Summary.Value`` has tag = 1 (string), simple_value = 2
  (float; what ``SummaryWriter.add_scalar`` writes) or tensor = 8 (a ``TensorProto``: dtype = 1,
  tensor_content = 4 (raw little-endian), float_val = 5, double_val = 6, int_val = 7, int64_val =
  10, half_val = 13; new-style scalars). A tensor counts only when it holds exactly one number.

Torn or garbage data never raises: a record whose length CRC fails is skipped by searching forward,
byte by byte, for the next valid header (at most `MAX_RESYNC` bytes a poll); a record whose data CRC
fails, or that does not decode, is skipped by its length. Each is counted (`bad`). A record not
yet complete waits for the next poll; a record over `MAX_RECORD` (an image, a graph) is skipped
unread. `TfEventsReader` follows one file by offset; `position()`/`restore()` as `FileTail`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import struct
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from protocol.metrics import is_metric_name

from onbox.sources.metrics import MAX_NAME, MAX_SCALARS, Record, SourceRead

MAX_RECORD = 1 << 20         # a bigger record is skipped without reading it
MAX_READ = 1 << 20           # bytes read by one poll
MAX_RESYNC = 64 << 10        # bytes searched for a valid header in one poll
_HEADER = 12
_MASK_DELTA = 0xA282EAD8
_DTYPES = {1: ("<f", 4), 2: ("<d", 8), 3: ("<i", 4), 9: ("<q", 8), 19: ("<e", 2)}


@functools.lru_cache(maxsize=1)
def _table() -> Tuple[int, ...]:
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        out.append(c)
    return tuple(out)


def crc32c(data: bytes) -> int:
    table, crc = _table(), 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One TFRecord around `data` (tests write torn files with it)."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


# ---- protobuf, the few wire types an Event uses ------------------------------------------------

def _varint(buf: bytes, pos: int) -> Tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("bad varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[Tuple[int, int, object]]:
    """(field number, wire type, int or bytes) of each field; ValueError on malformed data."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: object
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        else:
            raise ValueError(f"wire type {wire}")
        if pos > len(buf):
            raise ValueError("truncated field")
        yield number, wire, value


def _tensor_value(buf: bytes) -> Optional[float]:
    dtype, content, values = 1, b"", []   # dtype defaults to DT_FLOAT (an unset enum is 0: invalid)
    for number, wire, value in _fields(buf):
        if number == 1 and isinstance(value, int):
            dtype = value
        elif number == 4 and isinstance(value, bytes):
            content = value
        elif number in (5, 6) and isinstance(value, bytes):
            fmt = "<f" if number == 5 else "<d"
            size = struct.calcsize(fmt)
            if wire == 2:  # packed
                values += [v for (v,) in struct.iter_unpack(fmt, value[: len(value) // size * size])]
            else:
                values.append(struct.unpack(fmt, value)[0])
        elif number in (7, 10, 13):
            if isinstance(value, int):
                values.append(float(value))
            elif isinstance(value, bytes):  # packed varints
                pos = 0
                while pos < len(value):
                    raw, pos = _varint(value, pos)
                    values.append(float(raw - (1 << 64) if raw >= 1 << 63 else raw))
    if content and dtype in _DTYPES:
        fmt, size = _DTYPES[dtype]
        if len(content) == size:
            return float(struct.unpack(fmt, content)[0])
        return None
    return float(values[0]) if len(values) == 1 else None


def _summary_values(buf: bytes) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for number, _, value in _fields(buf):
        if number != 1 or not isinstance(value, bytes):
            continue
        tag, number_value = "", None
        for f, wire, v in _fields(value):
            if f == 1 and isinstance(v, bytes):
                tag = v.decode("utf-8", "replace")
            elif f == 2 and wire == 5 and isinstance(v, bytes):
                number_value = float(struct.unpack("<f", v)[0])
            elif f == 8 and isinstance(v, bytes):
                number_value = _tensor_value(v)
        if tag and number_value is not None and len(out) < MAX_SCALARS:
            out[tag[:MAX_NAME]] = number_value
    return out


@dataclasses.dataclass(frozen=True)
class Event:
    step: Optional[int]
    wall_time: Optional[float]
    values: Dict[str, float]


def parse_event(data: bytes) -> Event:
    """An Event's step, wall time and scalar values; ValueError when it does not decode."""
    step: Optional[int] = 0   # proto3: a step of 0 is not written
    wall: Optional[float] = None
    values: Dict[str, float] = {}
    for number, wire, value in _fields(data):
        if number == 1 and wire == 1 and isinstance(value, bytes):
            wall = struct.unpack("<d", value)[0]
        elif number == 2 and isinstance(value, int):
            step = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 5 and isinstance(value, bytes):
            values.update(_summary_values(value))
    return Event(step if step is not None and step >= 0 else None, wall, values)


def split_records(buf: bytes) -> Tuple[List[bytes], int, int, int]:
    """(complete records' data, bytes consumed, bad records, bytes to skip past `buf` unread)."""
    out: List[bytes] = []
    pos = bad = 0
    resync_from: Optional[int] = None
    while len(buf) - pos >= _HEADER:
        head = buf[pos:pos + 8]
        (length,) = struct.unpack("<Q", head)
        if struct.unpack("<I", buf[pos + 8:pos + 12])[0] != masked_crc(head):
            if resync_from is None:
                bad, resync_from = bad + 1, pos
            elif pos - resync_from >= MAX_RESYNC:
                break  # the search goes on at the next poll
            pos += 1
            continue
        resync_from = None
        end = pos + _HEADER + length + 4
        if length > MAX_RECORD:
            bad += 1
            if end > len(buf):
                return out, len(buf), bad, end - len(buf)
            pos = end
            continue
        if end > len(buf):
            break
        data = buf[pos + _HEADER:pos + _HEADER + length]
        if struct.unpack("<I", buf[end - 4:end])[0] == masked_crc(data):
            out.append(data)
        else:
            bad += 1
        pos = end
    return out, pos, bad, 0


def _records(events: List[Event], source: str) -> List[Record]:
    """Consecutive events of one step become one record; a tag "epoch" (or ".../epoch") is the epoch;
    tags that are no metric name (`protocol.metrics`: a wall-clock or "time" tag) are left out."""
    out: List[Record] = []
    group: Dict[str, float] = {}
    step: Optional[int] = None

    def flush() -> None:
        if not group:
            return
        epoch = next((v for k, v in group.items() if k.lower().rsplit("/", 1)[-1] == "epoch"), None)
        scalars = {k: v for k, v in group.items()
                   if k.lower().rsplit("/", 1)[-1] != "epoch" and is_metric_name(k)}
        ok_epoch = epoch if epoch is not None and math.isfinite(epoch) and epoch >= 0 else None
        out.append(Record(source, step, ok_epoch, scalars))
        group.clear()

    for event in events:
        if not event.values:
            continue
        if event.step != step:
            flush()
            step = event.step
        group.update(event.values)
    flush()
    return out


class TfEventsReader:
    """Follow one event file by offset; `poll()` gives the new complete records (see the doc)."""

    name = "tfevents"

    def __init__(self, path: Path, max_read: int = MAX_READ) -> None:
        self.path = Path(path)
        self.max_read = max_read
        self.inode: Optional[int] = None
        self.offset = 0
        self.bad = 0
        self.restored = False

    def position(self) -> Dict[str, Optional[int]]:
        return {"inode": self.inode, "offset": self.offset}

    def restore(self, inode: int, offset: int) -> bool:
        """Resume at `offset` when the file is still inode `inode` and that long."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        if st.st_ino != inode or not 0 <= offset <= st.st_size:
            return False
        self.inode, self.offset, self.restored = inode, offset, True
        return True

    def skip_to_end(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return
        self.inode, self.offset = st.st_ino, st.st_size

    def poll(self) -> SourceRead:
        out = SourceRead()
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self.inode or st.st_size < self.offset:
                    self.inode, self.offset = st.st_ino, 0
                if st.st_size <= self.offset:
                    return out
                f.seek(self.offset)
                buf = f.read(min(st.st_size - self.offset, self.max_read))
        except OSError:
            return out
        datas, used, bad, skip = split_records(buf)
        self.offset += used + skip
        out.new_bytes, out.mtime = used + skip, st.st_mtime
        events: List[Event] = []
        for data in datas:
            try:
                events.append(parse_event(data))
            except (ValueError, struct.error):
                bad += 1
        self.bad += bad
        out.bad = bad
        out.records = _records(events, self.name)
        return out


__all__ = ["Event", "TfEventsReader", "crc32c", "frame", "masked_crc", "parse_event", "split_records"]
