from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import List

import pytest

from onbox.sidecar.journal import CURRENT, Journal, read_all
from protocol import ProtocolError, decode_event
from tests.helpers import Clock


def make(tmp_path: Path, **kw: object) -> Journal:
    j = Journal(tmp_path / "rgt", "run-1", "box", **kw)  # type: ignore[arg-type]
    j.open()
    return j


def seqs(directory: Path) -> List[int]:
    return [e["seq"] for e in read_all(directory)]


def test_seq_continues_across_reopen(tmp_path: Path) -> None:
    j = make(tmp_path)
    for i in range(5):
        j.append("train.progress", {"step": i})
    j.close()
    j2 = make(tmp_path)
    (ev, _), = j2.append("heartbeat")
    assert ev.seq == 6
    j2.close()
    assert seqs(tmp_path / "rgt") == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("torn", [
    b'{"v":1,"run":"run-1","ho', b"\x00" * 37, b'{"v":1}\n', b"garbage\n\x00\x00",
])
def test_torn_tail_is_cut_kept_aside_and_not_fatal(tmp_path: Path, torn: bytes) -> None:
    j = make(tmp_path)
    for i in range(3):
        j.append("train.progress", {"step": i})
    j.close()
    with open(tmp_path / "rgt" / CURRENT, "ab") as f:
        f.write(torn)
    j2 = make(tmp_path)
    assert j2.torn_recoveries == 1 and j2.last_seq == 3
    (ev, _), = j2.append("heartbeat")
    j2.close()
    assert ev.seq == 4
    assert seqs(tmp_path / "rgt") == [1, 2, 3, 4]
    kept = list((tmp_path / "rgt").glob(f"{CURRENT}.torn.*"))
    assert len(kept) == 1 and kept[0].read_bytes() == torn


def test_read_all_skips_a_line_read_from_mid_record(tmp_path: Path) -> None:
    # What a reader sees when a restarted writer cuts a torn tail under its
    # buffer: the next read starts inside a record. CI once failed on this.
    j = make(tmp_path)
    j.append("train.progress", {"step": 0})
    j.append("heartbeat")
    j.close()
    path = tmp_path / "rgt" / CURRENT
    first, second = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(first + b'"kind":"synthetic.tick","sev":"info","data":{}}\n[1, 2]\n' + second)
    assert seqs(tmp_path / "rgt") == [1, 2]


def test_rotation_and_replay_across_files(tmp_path: Path) -> None:
    j = make(tmp_path, rotate_bytes=2048, cache_max=10)
    for i in range(100):
        j.append("train.progress", {"step": i, "pad": "x" * 50})
    rotated = sorted(p.name for p in (tmp_path / "rgt").glob("events.*.jsonl"))
    assert len(rotated) > 3 and rotated[0] == "events.000000000001.jsonl"
    assert j.oldest_seq == 1
    frames, more = j.read_since(0, 1000, 10 << 20)
    assert [decode_event(f).seq for f in frames] == list(range(1, 101)) and not more
    page, more = j.read_since(37, 10, 10 << 20)
    assert [decode_event(f).seq for f in page] == list(range(38, 48)) and more
    j.close()
    j2 = make(tmp_path, rotate_bytes=2048)
    assert j2.last_seq == 100
    frames, _ = j2.read_since(95, 100, 10 << 20)
    assert [decode_event(f).seq for f in frames] == [96, 97, 98, 99, 100]
    j2.close()


def test_read_since_respects_byte_budget(tmp_path: Path) -> None:
    j = make(tmp_path)
    for i in range(20):
        j.append("train.progress", {"step": i})
    first_three = sum(len(f) for f in j.read_since(0, 3, 1 << 20)[0])
    frames, more = j.read_since(0, 1000, first_three + 1)
    assert len(frames) == 3 and more
    j.close()


def test_fsync_on_warn_at_once_and_info_at_most_every_interval(tmp_path: Path) -> None:
    mono = Clock()
    calls: List[int] = []
    j = make(tmp_path, monotonic=mono, fsync=lambda fd: calls.append(fd), fsync_interval_s=2.0)
    calls.clear()
    for _ in range(10):
        j.append("train.progress", {})
    assert calls == []
    j.append("job.stalled", {}, "warn")
    assert len(calls) == 1
    j.append("train.progress", {})
    mono.t += 1.0
    j.tick()
    assert len(calls) == 1
    mono.t += 1.5
    j.tick()
    assert len(calls) == 2
    j.tick()
    assert len(calls) == 2  # nothing new written: no fsync
    j.close()


class FlakyDisk:
    """A write() that fails with ENOSPC until told otherwise, or writes half."""

    def __init__(self) -> None:
        self.full = False
        self.short = False

    def __call__(self, fd: int, data: bytes) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        if self.short:
            return os.write(fd, data[: len(data) // 2])
        return os.write(fd, data)


def test_disk_full_buffers_in_ring_publishes_degraded_and_flushes_later(tmp_path: Path) -> None:
    mono = Clock()
    disk = FlakyDisk()
    j = make(tmp_path, write=disk, monotonic=mono, retry_interval_s=1.0)
    j.append("train.progress", {"step": 0})
    disk.full = True
    out = j.append("train.progress", {"step": 1})
    assert [e.kind for e, _ in out] == ["train.progress", "sidecar.degraded"]
    assert "ENOSPC" in out[1][0].data["error"] and j.degraded
    for i in range(2, 5):
        j.append("train.progress", {"step": i})
    # Buffered events are replayable while the disk is full.
    frames, _ = j.read_since(1, 100, 1 << 20)
    assert [decode_event(f).seq for f in frames] == [2, 3, 4, 5, 6]
    mono.t += 1.5
    assert j.tick() == []  # still full
    disk.full = False
    mono.t += 1.5
    recovered = j.tick()
    assert [e.kind for e, _ in recovered] == ["sidecar.recovered"]
    assert recovered[0][0].data["events_buffered"] == 5 and not j.degraded
    j.close()
    assert seqs(tmp_path / "rgt") == list(range(1, 8))


def test_ring_overflow_keeps_newest_and_names_the_lost_range(tmp_path: Path) -> None:
    mono = Clock()
    disk = FlakyDisk()
    j = make(tmp_path, write=disk, monotonic=mono, ring_max=5)
    disk.full = True
    for i in range(12):
        j.append("train.progress", {"step": i})
    # seq 1 event, seq 2 degraded notice, then 11 more: 13 total, newest 5 kept.
    disk.full = False
    mono.t += 5
    (rec, _), = j.tick()
    assert (rec.data["lost_first_seq"], rec.data["lost_last_seq"]) == (1, 8) and rec.sev == "warn"
    j.close()
    assert seqs(tmp_path / "rgt") == [9, 10, 11, 12, 13, 14]


def test_short_write_is_cut_back_never_a_torn_line(tmp_path: Path) -> None:
    disk = FlakyDisk()
    j = make(tmp_path, write=disk)
    j.append("train.progress", {"step": 0})
    disk.short = True
    j.append("train.progress", {"step": 1})
    raw = (tmp_path / "rgt" / CURRENT).read_bytes()
    assert raw.endswith(b"\n") and len(raw.splitlines()) == 1
    disk.short = False
    j.close()  # flushes the ring, then says so
    kinds = [e["kind"] for e in read_all(tmp_path / "rgt")]
    assert kinds == ["train.progress", "train.progress", "sidecar.degraded", "sidecar.recovered"]
    assert all(json.loads(line) for line in (tmp_path / "rgt" / CURRENT).read_bytes().splitlines())


def test_a_lone_surrogate_in_box_text_is_journaled_as_u_fffd_not_lost(tmp_path: Path) -> None:
    # os.fsdecode keeps a non-UTF-8 file name as lone surrogates; a JSON "\ud800" escape in a file
    # the job wrote decodes to one. Neither may cost the event, nor stop its detector for good.
    j = make(tmp_path)
    published = j.append("ckpt.saved", {"path": "ckpt-\udcff.pt", "tags": ["a\ud800"], "lo\udfffss": 1})
    (ev, frame), = published
    assert ev.seq == 1 and j.repaired_strings == 1
    assert ev.data == {"path": "ckpt-\ufffd.pt", "tags": ["a\ufffd"], "lo\ufffdss": 1}
    assert decode_event(frame) == ev
    (ev2, _), = j.append("heartbeat", {"ok": True})
    j.close()
    assert ev2.seq == 2 and seqs(tmp_path / "rgt") == [1, 2]


def test_an_event_the_codec_refuses_leaves_no_gap(tmp_path: Path) -> None:
    j = make(tmp_path)
    j.append("heartbeat")
    with pytest.raises(ProtocolError, match="integer out of range"):
        j.append("train.progress", {"step": 1 << 64})
    (ev, _), = j.append("heartbeat")
    j.close()
    assert ev.seq == 2 and seqs(tmp_path / "rgt") == [1, 2]
