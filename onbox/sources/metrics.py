"""Tail <run>/metrics.jsonl (one JSON object per line) into `Record`s; `FileTail` tails any file.

`FileTail` is the tail itself (train.log uses it too). Each poll stats the path and reads only the
bytes added since the last poll (at most `max_read_bytes`), through an unbuffered fd kept open:

- a partial last line waits for its newline; a line longer than `max_line_bytes` is dropped (and
  counted in `TailRead.overlong`) rather than held in memory;
- a file truncated in place (size under our offset) is read again from its start;
- a path that names another file (rotation, rewrite by rename) is handled by draining the old file
  to its end, its unterminated last line included, then opening the new one from its start; a path
  that vanished keeps the old fd (a writer may still append to it) until a new file appears;
- `position()` (inode, offset of the last whole line) can be saved and handed to `restore()` after a
  sidecar restart, so old lines are not read again; `history_bytes` bounds what a first open without
  a position reads of an existing file (its newest bytes, from the first whole line).

A truncation followed, within one poll, by a rewrite longer than the old offset is not noticed (the
inode stays the same); the next lines are then read from the middle of the new content.

`MetricsSource` parses the lines: an object becomes a `Record` (step, epoch and numeric scalars; the
strings "nan"/"inf"/"-inf" our protocol writes and JSON's NaN/Infinity become non-finite floats; one
level of nesting is flattened as "outer/inner"; only metric names, `protocol.metrics`: a `time` or
`timestamp` field is not a metric). Anything else (not JSON, not an object, overlong, a
lone surrogate escape such as `\\ud800`, which no event could carry) is a bad line: counted, the first
kept as a short example.
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from protocol.codec import has_lone_surrogate
from protocol.metrics import is_metric_name

MAX_NAME = 64          # characters of a scalar name kept
MAX_SCALARS = 64       # scalars kept from one line
EXAMPLE_CHARS = 120    # characters of a bad line kept as its example
STEP_KEYS = ("step", "global_step", "iteration", "iter")

_WORDS = {
    "nan": math.nan, "+nan": math.nan, "-nan": math.nan,
    "inf": math.inf, "+inf": math.inf, "infinity": math.inf, "+infinity": math.inf,
    "-inf": -math.inf, "-infinity": -math.inf,
}


@dataclasses.dataclass(frozen=True)
class Record:
    """One line's training signal: where it came from, step, epoch and numeric scalars; `total`
    is the step count the run aims at, when the line says it (a progress bar's "20/60")."""

    source: str
    step: Optional[int] = None
    epoch: Optional[float] = None
    scalars: Mapping[str, float] = dataclasses.field(default_factory=dict)
    total: Optional[int] = None


@dataclasses.dataclass
class SourceRead:
    """What one poll of a source gave: records, bytes the file grew by, new bad lines, and the
    file's mtime (unix s) when it grew: when its newest bytes were written."""

    records: List[Record] = dataclasses.field(default_factory=list)
    new_bytes: int = 0
    bad: int = 0
    mtime: Optional[float] = None


def to_number(value: Any) -> Optional[float]:
    """A float from a JSON/Python scalar: numbers, numeric strings and nan/inf words; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    if isinstance(value, float):
        return value
    if isinstance(value, str) and len(value) <= 64:
        text = value.strip().lower()
        if text in _WORDS:
            return _WORDS[text]
        try:
            return float(text)
        except ValueError:
            return None
    return None


def to_step(value: Any) -> Optional[int]:
    number = to_number(value)
    if number is None or not math.isfinite(number) or number < 0:
        return None
    return int(number)


def to_epoch(value: Any) -> Optional[float]:
    number = to_number(value)
    return number if number is not None and math.isfinite(number) and number >= 0 else None


def record_from_mapping(obj: Mapping[Any, Any], source: str, *, strict: bool = False,
                        declared: Sequence[str] = ()) -> Optional[Record]:
    """A `Record` from a parsed line; None when it carries no step, epoch or number.

    Only metric names become scalars (`protocol.metrics`): never a `time`/`timestamp` field, a file
    name or a banner word; `strict` (a dict printed in train.log) also wants a known or declared name.
    """
    step: Optional[int] = None
    epoch: Optional[float] = None
    scalars: Dict[str, float] = {}

    def add(name: str, value: Any) -> None:
        number = to_number(value)
        if (number is not None and len(scalars) < MAX_SCALARS
                and is_metric_name(name[:MAX_NAME], declared, strict)):
            scalars[name[:MAX_NAME]] = number

    for key, value in obj.items():
        name = str(key)
        low = name.lower()
        if low in STEP_KEYS:
            if step is None:
                step = to_step(value)
        elif low == "epoch":
            epoch = to_epoch(value)
        elif isinstance(value, Mapping):
            for inner, inner_value in value.items():
                if not isinstance(inner_value, Mapping):
                    add(f"{name}/{inner}", inner_value)
        else:
            add(name, value)
    if step is None and epoch is None and not scalars:
        return None
    return Record(source, step, epoch, scalars)


def example_of(line: bytes) -> str:
    """A short printable sample of a bad line."""
    text = line[:EXAMPLE_CHARS].decode("utf-8", "replace")
    return "".join(ch if ch.isprintable() else "?" for ch in text)


@dataclasses.dataclass
class TailRead:
    lines: List[bytes] = dataclasses.field(default_factory=list)
    new_bytes: int = 0
    truncated: bool = False
    rotated: bool = False
    overlong: int = 0
    mtime: Optional[float] = None  # of the file read last, when new bytes were read


StatFn = Callable[[str], os.stat_result]


class FileTail:
    """Follow one file by path; see the module doc."""

    def __init__(self, path: Path, *, newlines: bytes = b"\n", max_read_bytes: int = 1 << 20,
                 max_line_bytes: int = 64 << 10, history_bytes: Optional[int] = 8 << 20,
                 stat: StatFn = os.stat) -> None:
        self.path = Path(path)
        self.max_read_bytes = max_read_bytes
        self.max_line_bytes = max_line_bytes
        self.history_bytes = history_bytes
        self._stat = stat
        self._split = re.compile(b"[" + re.escape(newlines) + b"]").split
        self._f: Optional[io.FileIO] = None
        self._id: Optional[Tuple[int, int]] = None  # (st_dev, st_ino) of the open file
        self._offset = 0
        self._partial = b""
        self._skipping = False  # inside a dropped overlong line (or a history cut): drop to its newline
        self._restore: Optional[Tuple[int, int]] = None
        self._opened_once = False
        self.restored = False   # the first open resumed at a restored position

    # ---- position ---------------------------------------------------------------------------

    def position(self) -> Optional[Tuple[int, int]]:
        """(inode, offset just past the last whole line read), or None when nothing is open."""
        if self._id is None:
            return None
        return self._id[1], self._offset - len(self._partial)

    def restore(self, inode: int, offset: int) -> None:
        """Resume at `offset` when the first file opened is still inode `inode` and that long."""
        self._restore = (int(inode), int(offset))

    @property
    def offset(self) -> int:
        return self._offset

    # ---- polling ----------------------------------------------------------------------------

    def poll(self) -> TailRead:
        """Read what was added since the last poll (bounded); never raises for a missing file."""
        out = TailRead()
        try:
            st: Optional[os.stat_result] = self._stat(str(self.path))
        except OSError:
            st = None
        if self._f is not None:
            replaced = st is not None and (st.st_dev, st.st_ino) != self._id
            cur = st if st is not None and not replaced else os.fstat(self._f.fileno())
            size = cur.st_size
            if size < self._offset:
                self._seek(0)
                out.truncated = True
            if size > self._offset:
                self._read(size, out)
                out.mtime = cur.st_mtime
            if not replaced or self._offset < size:
                return out
            if self._partial and not self._skipping:
                out.lines.append(self._partial)
            self.close()
            out.rotated = True
        if st is None:
            return out
        self._open()
        if self._f is not None:
            cur = os.fstat(self._f.fileno())
            if cur.st_size > self._offset:
                self._read(cur.st_size, out)
                out.mtime = cur.st_mtime
        return out

    def drain(self, max_bytes: int = 64 << 20) -> TailRead:
        """Poll until the file is read to its end (or `max_bytes` were read): startup, job exit."""
        total = TailRead()
        while True:
            got = self.poll()
            total.lines += got.lines
            total.new_bytes += got.new_bytes
            total.truncated |= got.truncated
            total.rotated |= got.rotated
            total.overlong += got.overlong
            total.mtime = got.mtime if got.mtime is not None else total.mtime
            if got.new_bytes == 0 and not got.rotated or total.new_bytes >= max_bytes:
                return total

    def _open(self) -> None:
        try:
            f = io.FileIO(str(self.path), "r")
        except OSError:
            return
        st = os.fstat(f.fileno())
        self._f, self._id = f, (st.st_dev, st.st_ino)
        offset, skipping = 0, False
        restore, self._restore = self._restore, None
        first, self._opened_once = not self._opened_once, True
        if restore is not None and restore[0] == st.st_ino and 0 <= restore[1] <= st.st_size:
            offset, self.restored = restore[1], True
        elif first and self.history_bytes is not None and st.st_size > self.history_bytes:
            offset, skipping = st.st_size - self.history_bytes, True
        self._seek(offset)
        self._skipping = skipping

    def _seek(self, offset: int) -> None:
        assert self._f is not None
        self._f.seek(offset)
        self._offset = offset
        self._partial = b""
        self._skipping = False

    def _read(self, size: int, out: TailRead) -> None:
        assert self._f is not None
        data = self._f.read(min(size - self._offset, self.max_read_bytes)) or b""
        self._offset += len(data)
        out.new_bytes += len(data)
        parts = self._split(self._partial + data)
        self._partial = parts.pop()
        for part in parts:
            if self._skipping:
                self._skipping = False
            elif part.strip():
                out.lines.append(part)
        if len(self._partial) > self.max_line_bytes:
            if not self._skipping:
                out.overlong += 1
            self._partial = b""
            self._skipping = True

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        self._f, self._id = None, None
        self._offset, self._partial, self._skipping = 0, b"", False


class TailSource:
    """A tailed file -> `Record`s, counting bad lines; subclasses say how one line parses."""

    name = "?"
    count_overlong = True   # an over-long line is a bad line (metrics), or just skipped (logs)

    def __init__(self, path: Path, **tail: Any) -> None:
        self.tail = FileTail(path, **tail)
        self.bad_lines = 0
        self.bad_example: Optional[str] = None

    def parse(self, line: bytes) -> Tuple[Optional[Record], bool]:
        """(record or None, whether the line is bad)."""
        raise NotImplementedError

    def read(self, got: TailRead) -> SourceRead:
        overlong = got.overlong if self.count_overlong else 0
        out = SourceRead(new_bytes=got.new_bytes, bad=overlong, mtime=got.mtime)
        for line in got.lines:
            record, bad = self.parse(line)
            if bad:
                out.bad += 1
                if self.bad_example is None:
                    self.bad_example = example_of(line)
            elif record is not None:
                out.records.append(record)
        if overlong and self.bad_example is None:
            self.bad_example = f"(a line over {self.tail.max_line_bytes} bytes)"
        self.bad_lines += out.bad
        return out

    def poll(self) -> SourceRead:
        return self.read(self.tail.poll())

    def drain(self) -> SourceRead:
        return self.read(self.tail.drain())

    def close(self) -> None:
        self.tail.close()


class MetricsSource(TailSource):
    """metrics.jsonl -> `Record`s, counting bad lines (see the module doc)."""

    name = "metrics"

    def parse(self, line: bytes) -> Tuple[Optional[Record], bool]:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, over 4300 digits, too deep
            return None, True
        if not isinstance(obj, dict):
            return None, True
        if b"\\u" in line and has_lone_surrogate(obj):  # a `\ud800` escape: not UTF-8 text
            return None, True
        return record_from_mapping(obj, self.name), False


__all__ = ["FileTail", "MetricsSource", "Record", "SourceRead", "TailRead", "record_from_mapping",
           "to_epoch", "to_number", "to_step"]
