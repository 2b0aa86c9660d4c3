"""Kernel-log Xid parsing and the /dev/kmsg reader (onbox/sources/kmsg.py)."""

from __future__ import annotations

import errno
import os
import select
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from onbox.sources.kmsg import (
    KmsgReader,
    decode_record,
    parse_gpu_lost,
    parse_gpu_lost_text,
    parse_kmsg_record,
    parse_line,
    parse_text,
    split_records,
)

DATA = Path(__file__).parent / "data"

# (line, expected fields). Lines follow the formats the driver prints (see the module docstring);
# PCI ids, pids and hosts are made up.
XID_LINES: List[Any] = [
    (
        "[Mon Nov 24 10:02:33 2026] NVRM: Xid (PCI:0000:3b:00): 79, pid=2311, name=python3, "
        "GPU has fallen off the bus.",
        dict(code=79, pci="0000:3b:00", pid=2311, name="python3", wall_time="Mon Nov 24 10:02:33 2026",
             message="GPU has fallen off the bus."),
    ),
    (
        "[ 8123.456789] NVRM: Xid (PCI:0000:CB:00): 13, pid='<unknown>', name=<unknown>, "
        "Graphics SM Warp Exception on (GPC 7, TPC 1, SM 0): Out Of Range Address",
        dict(code=13, pci="0000:cb:00", pid=None, name=None, kernel_ts=8123.456789,
             message="Graphics SM Warp Exception on (GPC 7, TPC 1, SM 0): Out Of Range Address"),
    ),
    (
        "Nov 24 10:02:33 node-a kernel: NVRM: Xid (PCI:0000:18:00): 31, pid=4242, name=python, "
        "Ch 00000010, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f2a_3c000000",
        dict(code=31, pci="0000:18:00", pid=4242, name="python", wall_time="Nov 24 10:02:33"),
    ),
    (
        "NVRM: Xid (0000:01:00): 31, Ch 00000010, engmask 00000101, intr 10000000",
        dict(code=31, pci="0000:01:00", pid=None, name=None,
             message="Ch 00000010, engmask 00000101, intr 10000000"),
    ),
    (
        "[  812.000001] NVRM: Xid (PCI:0000:86:00): 43, pid=5120, name=torchrun, Ch 00000008",
        dict(code=43, pci="0000:86:00", pid=5120, name="torchrun", message="Ch 00000008"),
    ),
    (
        "NVRM: Xid (PCI:0000:af:00): 45, pid=6001, name=python3, Ch 00000028 caused by previous Xid 149",
        dict(code=45, pci="0000:af:00", pid=6001, caused_by=149),
    ),
    (
        "3,1541,8123456789,-;NVRM: Xid (PCI:0000:ca:00): 48, pid=7777, name=python3, "
        "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer",
        dict(code=48, pci="0000:ca:00", pid=7777, seq=1541, kernel_ts=8123.456789),
    ),
    (
        "[ 1000.100000] NVRM: Xid (PCI:0000:02:00): 61, 0cec(2d48) 00000000 00000000",
        dict(code=61, pci="0000:02:00", pid=None, message="0cec(2d48) 00000000 00000000"),
    ),
    (
        "kern  :warn  : [ 1000.200000] NVRM: Xid (PCI:0000:02:00): 62, 0cec(2d48) 00000000 00000000",
        dict(code=62, pci="0000:02:00", kernel_ts=1000.2),
    ),
    (
        "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu "
        "to activate.",
        dict(code=63, pci="0000:10:1c", pid=1896, name=None,
             message="Row Remapper: New row marked for remapping, reset gpu to activate."),
    ),
    (
        "<4>NVRM: Xid (PCI:0000:3b:00): 64, pid=1896, name=python3, Row Remapper: remapping failed",
        dict(code=64, pci="0000:3b:00", pid=1896),
    ),
    (
        "[ 2000.000000] NVRM: Xid (PCI:0000:41:00): 68, pid=3030, name=ffmpeg, NVDEC0 Exception",
        dict(code=68, pci="0000:41:00", pid=3030, name="ffmpeg"),
    ),
    (
        "NVRM: Xid (PCI:0000:41:00): 69, pid=3030, name=python, Class Error: ChId 0010, Class 0000c7c0, "
        "Offset 00000000, Data 00000000, ErrorCode 00000000",
        dict(code=69, pci="0000:41:00", name="python"),
    ),
    (
        "2026-11-24T10:02:34+0000 node-a kernel: NVRM: Xid (PCI:0000:c1:00): 74, pid=9090, name=python3, "
        "NVLink: fatal error detected on link 4(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
        dict(code=74, pci="0000:c1:00", wall_time="2026-11-24T10:02:34+0000"),
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00): 92, pid=2311, name=python3, High single-bit ECC error rate",
        dict(code=92, pci="0000:3b:00"),
    ),
    (
        "[Mon Nov 24 10:02:33 2026] NVRM: Xid (PCI:0000:4e:00 GPU-I:02 GPU-CI:00): 94, pid=1200, "
        "name=python3, Contained: SM (0x1). RST: No, D-RST: No",
        dict(code=94, pci="0000:4e:00", gpu_instance=2, compute_instance=0, pid=1200),
    ),
    (
        "NVRM: Xid (PCI:0000:4e:00 GPU-I:05): 95, pid='<unknown>', name=<unknown>, Uncontained: FBHUB. "
        "RST: Yes, D-RST: No",
        dict(code=95, pci="0000:4e:00", gpu_instance=5, compute_instance=None, pid=None),
    ),
    (
        "Nov 24 10:02:33 node-a kernel: [ 7001.250000] NVRM: Xid (PCI:0000:9a:00): 119, pid=2212, "
        "name=python, Timeout after 6s of waiting for RPC response from GPU0 GSP!",
        dict(code=119, pci="0000:9a:00", kernel_ts=7001.25, wall_time="Nov 24 10:02:33"),
    ),
    (
        "NVRM: Xid (PCI:0000:9a:00): 120, pid='<unknown>', name=<unknown>, GSP task exception",
        dict(code=120, pci="0000:9a:00", pid=None, name=None),
    ),
    (
        "NVRM: Xid (PCI:0000:9a:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 "
        "(Node Reboot Required)",
        dict(code=154, recovery_action="node_reboot", pid=None),
    ),
    (
        "NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (PF FLR)",
        dict(code=154, recovery_action="gpu_reset"),
    ),
    (
        "NVRM: Xid (PCI:0008:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)",
        dict(code=154, pci="0008:01:00", recovery_action="drain_p2p"),
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00.0): 8, pid=77, name=python",
        dict(code=8, pci="0000:3b:00", pid=77, name="python", message=""),
    ),
]

NOT_XID_NVRM = [
    "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
    "[    4.398127] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
    "NVRM: GPU at PCI:0000:3b:00: GPU-7f3c1a2b-0000-1111-2222-333344445555",
    "NVRM: GPU Board Serial Number: 0000000000000",
    "NVRM: A GPU crash dump has been created. If possible, please run",
    "NVRM: nvGpuOpsReportFatalError: uvm encountered global fatal error 0x60, requiring os reboot",
    "NVRM: The NVIDIA GPU 0000:3b:00.0 (PCI ID: 10de:2330) installed in this system is not supported",
    "NVRM: Xid logging is enabled",
]

GARBAGE = [
    "",
    "   ",
    "\x00\xff\xfe garbage",
    "random text with Xid 79 in it",
    "NVRM: Xid (",
    "NVRM: Xid (PCI:0000:3b:00): abc, pid=1",
    "NVRM: Xid (PCI:zzzz:3b:00): 79, pid=1",
    "NVRM: Xid (PCI:0000:3b:00) 79 no colon",
    "NVRM: Xid (PCI:0000:3b:00): 79x, pid=1",
    "x" * 100000,
]

# Lines that look like Xids but were provably written by user space.
SPOOFED = [
    "Nov 24 10:02:33 node-a python3[1234]: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, spoof",
    "user  :notice: [  12.000000] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, spoof",
    "14,1542,8123456800,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, spoof",
    "<14>NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, spoof",
]


@pytest.mark.parametrize("line,expected", XID_LINES, ids=[str(e[1]["code"]) for e in XID_LINES])
def test_parse_line_xid_shapes(line: str, expected: Dict[str, Any]) -> None:
    xid = parse_line(line)
    assert xid is not None
    for field, value in expected.items():
        got = getattr(xid, field)
        if isinstance(value, float):
            assert got == pytest.approx(value), field
        else:
            assert got == value, field
    assert xid.raw == line


def test_at_least_fifteen_shapes_and_the_issue_codes_are_covered() -> None:
    codes = {e[1]["code"] for e in XID_LINES}
    assert len(XID_LINES) >= 15
    assert {13, 31, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 119, 120, 154} <= codes


@pytest.mark.parametrize("line", NOT_XID_NVRM)
def test_nvrm_lines_that_are_not_xids(line: str) -> None:
    assert parse_line(line) is None


@pytest.mark.parametrize("line", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_is_not_an_xid(line: str) -> None:
    assert parse_line(line) is None


@pytest.mark.parametrize("line", SPOOFED, ids=["journal-tag", "dmesg-x-user", "kmsg-prio14", "syslog-pri"])
def test_lines_written_by_user_space_are_dropped(line: str) -> None:
    assert parse_line(line) is None
    # The same text with the kernel as its source is accepted, so the prefix is what decides.
    kernel = (line.replace("python3[1234]", "kernel").replace("user  :notice:", "kern  :err   :")
              .replace("14,1542", "3,1542").replace("<14>", "<3>"))
    assert parse_line(kernel) is not None


def test_gpu_lost_line_is_reported_separately() -> None:
    lost = parse_gpu_lost("[ 9001.000120] NVRM: GPU 0000:CB:00.0: GPU has fallen off the bus.")
    assert lost is not None
    assert lost.pci == "0000:cb:00"
    assert lost.kernel_ts == pytest.approx(9001.00012)
    # The Xid 79 line is an Xid, not a gpu-lost line; user-space copies do not count.
    xid_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."
    assert parse_gpu_lost(xid_79) is None
    user_space = "Nov 24 10:02:33 h app[1]: NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."
    assert parse_gpu_lost(user_space) is None
    assert parse_gpu_lost("NVRM: loading NVIDIA UNIX x86_64 Kernel Module") is None


def test_parse_text_plain_dmesg_fixture() -> None:
    text = (DATA / "dmesg_plain.log").read_text()
    xids = parse_text(text)
    assert [x.code for x in xids] == [13, 13, 43, 79, 154]
    assert {x.pci for x in xids} == {"0000:3b:00", "0000:cb:00"}
    assert xids[-1].recovery_action == "node_reboot"
    assert [g.pci for g in parse_gpu_lost_text(text)] == ["0000:cb:00"]


def test_parse_text_ctime_and_journal_fixtures() -> None:
    ctime = parse_text((DATA / "dmesg_ctime.log").read_text())
    assert [x.code for x in ctime] == [94, 63, 45, 95]
    assert all(x.wall_time and x.wall_time.startswith("Mon Nov 23") for x in ctime)
    assert ctime[2].caused_by == 94
    journal = parse_text((DATA / "journal.log").read_text())
    # The python3[4242] line is user space and is dropped.
    assert [x.code for x in journal] == [119, 154, 74, 120]
    assert journal[1].recovery_action == "gpu_reset"


def test_parse_text_on_a_kmsg_dump_drops_the_spoof() -> None:
    xids = parse_text((DATA / "kmsg_records.txt").read_text())
    assert [(x.code, x.seq) for x in xids] == [(48, 1541), (64, 1543)]


# ---- raw /dev/kmsg records ----------------------------------------------------------------------------


def test_parse_kmsg_record_kernel_facility() -> None:
    rec = b"3,1541,8123456789,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=2311, name=python3, DBE\n"
    xid = parse_kmsg_record(rec)
    assert xid is not None
    assert (xid.code, xid.pci, xid.pid, xid.seq) == (48, "0000:3b:00", 2311, 1541)
    assert xid.kernel_ts == pytest.approx(8123.456789)


@pytest.mark.parametrize("prio", [8, 11, 14, 15, 30, 190])
def test_parse_kmsg_record_ignores_non_kernel_facilities(prio: int) -> None:
    rec = b"%d,9,100,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus." % prio
    assert parse_kmsg_record(rec) is None
    assert decode_record(rec) is not None  # it is a well-formed record, just not the kernel's


def test_parse_kmsg_record_continuation_caller_and_escapes() -> None:
    rec = (b"4,77,5000000,-,caller=T812;NVRM: Xid (PCI:0000:3b:00): 31, pid=9, name=a\\x5cb, Ch 1\n"
           b" SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n")
    xid = parse_kmsg_record(rec)
    assert xid is not None
    assert (xid.code, xid.seq, xid.name, xid.message) == (31, 77, "a\\b", "Ch 1")
    assert "SUBSYSTEM" not in xid.raw


@pytest.mark.parametrize("rec", [b"", b"garbage", b"3,x,1,-;NVRM: Xid (PCI:0000:3b:00): 79, a", b"3,1,1;msg",
                                 b"6,5,10,-;usb 1-1: new high-speed USB device", b"\xff\xfe;\x00"])
def test_parse_kmsg_record_rejects_malformed_and_other_records(rec: bytes) -> None:
    assert parse_kmsg_record(rec) is None


def test_split_records_keeps_continuation_lines_with_their_record() -> None:
    chunks = split_records((DATA / "kmsg_records.txt").read_bytes())
    assert len(chunks) == 4
    assert chunks[1].count(b"\n") == 2 and chunks[1].endswith(b"DEVICE=+pci:0000:3b:00.0")


# ---- KmsgReader ---------------------------------------------------------------------------------------


def test_reader_reports_unavailable_instead_of_raising(tmp_path: Path) -> None:
    r = KmsgReader(path=str(tmp_path / "no-such-kmsg"))
    assert not r.available
    assert "No such file" in r.reason
    assert r.read_available() == []
    with pytest.raises(ValueError):
        r.fileno()
    r.close()

    def deny(path: str, flags: int) -> int:
        raise PermissionError(errno.EACCES, "Permission denied", path)

    r = KmsgReader(opener=deny)
    assert not r.available and "Permission denied" in r.reason


def test_reader_opens_nonblocking_and_skips_backlog_by_default(tmp_path: Path) -> None:
    dump = tmp_path / "kmsg"
    dump.write_bytes((DATA / "kmsg_records.txt").read_bytes())
    seen_flags: List[int] = []

    def opener(path: str, flags: int) -> int:
        seen_flags.append(flags)
        return os.open(path, flags)

    with KmsgReader(path=str(dump), opener=opener) as r:
        assert r.available
        assert r.read_available() == []  # seeked past the backlog
    assert seen_flags and seen_flags[0] & os.O_NONBLOCK and seen_flags[0] & os.O_ACCMODE == os.O_RDONLY
    with KmsgReader(path=str(dump), backlog=True) as r:
        assert [x.code for x in r.read_available()] == [48, 64]  # the prio-14 spoof is dropped


def test_reader_on_a_fifo_with_select(tmp_path: Path) -> None:
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)
    r = KmsgReader(path=str(fifo))
    assert r.available, r.reason
    wfd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(wfd, b"14,1,100,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=spoof, GPU is gone.\n")
        os.write(wfd, b"6,2,200,-;e1000e: eth0 NIC Link is Up\n")
        os.write(wfd, b"3,3,300,-;NVRM: Xid (PCI:0000:3b:00): 119, pid=5, name=python, GSP timeout\n")
        ready, _, _ = select.select([r], [], [], 5.0)
        assert ready == [r]
        xids = r.read_available()
    finally:
        os.close(wfd)
        r.close()
    assert [(x.code, x.seq, x.pid) for x in xids] == [(119, 3, 5)]


class ScriptedRead:
    """An os.read stand-in that plays a script of results (bytes or an errno to raise)."""

    def __init__(self, script: List[Any]) -> None:
        self.script = list(script)
        self.sizes: List[int] = []

    def __call__(self, fd: int, size: int) -> bytes:
        self.sizes.append(size)
        step = self.script.pop(0) if self.script else errno.EAGAIN
        if isinstance(step, int):
            raise OSError(step, os.strerror(step))
        if callable(step):
            return bytes(step(size))
        return bytes(step)


def _dummy_opener(path: str, flags: int) -> int:
    return os.open(os.devnull, os.O_RDONLY)


REC_79 = b"3,10,100,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.\n"
REC_13 = b"3,12,120,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=python, Graphics Exception\n"


def test_reader_skips_overwritten_records_on_epipe() -> None:
    read = ScriptedRead([REC_79, errno.EPIPE, REC_13, errno.EAGAIN])
    with KmsgReader(opener=_dummy_opener, read=read) as r:
        xids = r.read_available()
        assert [x.code for x in xids] == [79, 13]
        assert r.overwritten == 1 and r.errors == 0
    assert all(size >= 8192 for size in read.sizes)


def test_reader_grows_its_buffer_on_einval() -> None:
    big = REC_13.rstrip(b"\n") + b" " + b"y" * 20000 + b"\n"

    def fits(size: int) -> bytes:
        if size < len(big):
            raise OSError(errno.EINVAL, "Invalid argument")
        return big

    read = ScriptedRead([fits, fits, fits, errno.EAGAIN])
    with KmsgReader(opener=_dummy_opener, read=read, buffer_size=8192) as r:
        xids = r.read_available()
    assert [x.code for x in xids] == [13]
    assert read.sizes[:3] == [8192, 16384, 32768]


def test_reader_other_read_errors_are_recorded_not_raised() -> None:
    read = ScriptedRead([errno.EIO])
    with KmsgReader(opener=_dummy_opener, read=read) as r:
        assert r.read_available() == []
        assert r.errors == 1 and r.last_error and "Input/output error" in r.last_error


def test_close_is_idempotent() -> None:
    r = KmsgReader(opener=_dummy_opener, read=ScriptedRead([]))
    fd = r.fileno()
    r.close()
    r.close()
    assert not r.available
    with pytest.raises(ValueError):
        r.fileno()
    with pytest.raises(OSError):
        os.fstat(fd)


def _kmsg_readable() -> Optional[str]:
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        return str(e)
    os.close(fd)
    return None


@pytest.mark.skipif(_kmsg_readable() is not None, reason="/dev/kmsg is not readable here")
def test_real_dev_kmsg_read_only() -> None:
    with KmsgReader() as r:  # skips the backlog
        assert r.available, r.reason
        assert isinstance(r.read_available(), list)
    with KmsgReader(backlog=True, max_records_per_call=5000) as r:
        records = r.read_records()
    assert records, "the ring buffer should hold at least one record"
    assert any(rec.facility == 0 for rec in records)
    seqs = [rec.seq for rec in records]
    assert seqs == sorted(seqs)


# ---- OOM-killer lines (captured from a 6.18 kernel's cgroup v1 OOM, and the older/global wordings) ----

from onbox.sources.kmsg import oom_from_record, parse_oom_line  # noqa: E402


def test_oom_lines_of_every_wording_name_the_pid_the_scope_and_the_memcg() -> None:
    memcg = ("[  646.622374] oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
             "oom_memcg=/process_api/f/rgt-oom,task_memcg=/process_api/f/rgt-oom,task=python3,pid=11625,uid=0")
    got = parse_oom_line(memcg)
    assert got is not None and (got.pid, got.name, got.scope, got.memcg, got.kernel_ts) == (
        11625, "python3", "cgroup", "/process_api/f/rgt-oom", 646.622374)
    cases = {
        "[  646.622414] Memory cgroup out of memory: Killed process 11625 (python3) total-vm:82132kB, "
        "anon-rss:65152kB, file-rss:6580kB, shmem-rss:0kB, UID:0 pgtables:192kB oom_score_adj:0":
            (11625, "python3", "cgroup"),
        "Out of memory: Killed process 1234 (python3) total-vm:1kB, anon-rss:1kB":
            (1234, "python3", "global"),
        "Out of memory (oom_kill_allocating_task): Killed process 77 (pt_main_thread)":
            (77, "pt_main_thread", "global"),
        "Memory cgroup out of memory: Kill process 1234 (python) score 1000 or sacrifice child":
            (1234, "python", "cgroup"),
        "Killed process 1234 (python) total-vm:1kB, anon-rss:1kB, file-rss:0kB": (1234, "python", None),
    }
    for line, want in cases.items():
        got = parse_oom_line(line)
        assert got is not None and (got.pid, got.name, got.scope) == want, line
    old = parse_oom_line("Task in /slurm/uid_0/job_7/step_0 killed as a result of limit of "
                         "/slurm/uid_0/job_7")
    assert old is not None and (old.pid, old.scope, old.memcg) == (None, "cgroup", "/slurm/uid_0/job_7")
    assert parse_oom_line("oom_reaper: reaped process 11625 (python3), now anon-rss:0kB") is None


def test_an_oom_record_from_user_space_is_refused() -> None:
    kernel = decode_record(b"3,9,646622414,-;Out of memory: Killed process 5 (python3) total-vm:1kB")
    user = decode_record(b"12,10,646622415,-;Out of memory: Killed process 5 (python3) total-vm:1kB")
    assert kernel is not None and user is not None
    got = oom_from_record(kernel)
    assert got is not None and got.pid == 5 and got.kernel_ts == 646.622414
    assert oom_from_record(user) is None
    assert parse_oom_line("<12>Out of memory: Killed process 5 (python3)") is None
