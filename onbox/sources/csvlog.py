"""Read a Lightning ``CSVLogger`` metrics.csv (``<save_dir>/<name>/version_N/metrics.csv``) into `Record`s.

The file is a header row and one row per logging call; a cell is empty when that call did not log
the column, and ``nan``/``inf`` are written as such. Lightning appends rows, except when a new
column appears: then it rewrites the whole file in place (same inode, ``open("w")``) with the new
header and every old row, and appends from there. So a poll compares the header with the one it
saw: the same header and a file no shorter than the offset read so far means new rows are appended
(read from the offset, whole lines only); otherwise the file was rewritten (or replaced) and is
read from its start, skipping the rows already judged. A rewrite with fewer rows than were judged
is either a rewrite in progress or a new file: it is taken as a new file only when the next poll
sees it unchanged.

Cells: ``step`` and ``epoch`` are the counters, other numeric cells scalars when their column is a
metric name (`protocol.metrics`: a ``time`` or ``timestamp`` column is not), anything else skipped.
`position()` / `restore()` keep (inode, offset, header, rows) across sidecar restarts.
"""
from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from onbox.sources.metrics import SourceRead, record_from_mapping

MAX_FILE = 32 << 20       # a bigger file is not re-read after a rewrite (it is followed from its end)
MAX_READ = 1 << 20        # appended bytes read by one poll
MAX_HEADER = 64 << 10


class CsvLogReader:
    """Follow one metrics.csv; see the module doc."""

    name = "csv"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.inode: Optional[int] = None
        self.offset = 0
        self.header: Optional[str] = None
        self.rows = 0
        self.bad = 0
        self.restored = False
        self._pending: Optional[Tuple[int, int, float]] = None   # a short rewrite, seen once

    def position(self) -> Dict[str, Any]:
        return {"inode": self.inode, "offset": self.offset, "header": self.header, "rows": self.rows}

    def restore(self, saved: Mapping[str, Any]) -> bool:
        inode, offset = saved.get("inode"), saved.get("offset")
        rows, header = saved.get("rows"), saved.get("header")
        if not (isinstance(inode, int) and isinstance(offset, int) and isinstance(rows, int)
                and isinstance(header, str)):
            return False
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        if st.st_ino != inode:
            return False
        self.inode, self.offset, self.rows, self.header = inode, offset, rows, header
        self.restored = True
        return True

    def skip_to_end(self) -> None:
        """Count what the file holds now as judged (an old file found at start)."""
        self.poll()

    def poll(self) -> SourceRead:
        out = SourceRead()
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino == self.inode and st.st_size == self.offset:
                    return out
                head = f.readline(MAX_HEADER)
                if not head.endswith(b"\n"):
                    return out   # the header is still being written
                header = head.rstrip(b"\r\n").decode("utf-8", "replace")
                appended = (st.st_ino == self.inode and header == self.header and st.st_size >= self.offset)
                if appended:
                    f.seek(self.offset)
                    data = f.read(min(st.st_size - self.offset, MAX_READ))
                    start = self.offset
                elif st.st_size > MAX_FILE:
                    self.inode, self.offset, self.header, self.rows = st.st_ino, st.st_size, header, 0
                    return out
                else:
                    data = f.read(st.st_size - len(head))
                    start = len(head)
        except OSError:
            return out
        end = data.rfind(b"\n") + 1
        rows = self._parse(data[:end])
        if not appended:
            if len(rows) < self.rows and self.inode is not None:
                sig = (st.st_ino, st.st_size, st.st_mtime)
                if self._pending != sig:
                    self._pending = sig
                    return out
                self.rows = 0   # unchanged since the last poll: a new, shorter file
            self._pending = None
            rows, self.rows = rows[self.rows:], self.rows
        self.inode, self.header, self.offset = st.st_ino, header, start + end
        self.rows += len(rows)
        out.new_bytes, out.mtime = max(end, 1), st.st_mtime
        names = next(csv.reader([header]), [])
        for row in rows:
            record = record_from_mapping({k: v for k, v in zip(names, row) if v != ""}, self.name)
            if record is not None:
                out.records.append(record)
        return out

    @staticmethod
    def _parse(data: bytes) -> List[List[str]]:
        if not data:
            return []
        text = data.decode("utf-8", "replace")
        return [row for row in csv.reader(io.StringIO(text)) if row]


__all__ = ["CsvLogReader"]
