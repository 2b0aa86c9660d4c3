"""Xids from the kernel log: parse pasted text and /dev/kmsg records, and read /dev/kmsg.

Two halves, kept apart:

- Interpretation (pure functions): `parse_line` / `parse_text` turn kernel-log text people paste
  (plain ``dmesg``, ``dmesg -T``, ``dmesg -x``, journalctl/syslog, raw /dev/kmsg records) into
  `XidLine`s; `parse_kmsg_record` does the same for one raw record and drops records whose syslog
  facility is not the kernel's (user space can write to /dev/kmsg, and its lines always get a
  non-zero facility, so a spoofed "NVRM: Xid" line never counts).
- Raw binding: `KmsgReader` opens /dev/kmsg non-blocking, skips the backlog unless asked, reads whole
  records and hands back `KmsgRecord`s or `XidLine`s. It never raises for an unreadable /dev/kmsg
  (containers often hide it): `available` is False and `reason` says why.

Only Xid lines become `XidLine`s. The companion ``NVRM: GPU 0000:3b:00.0: GPU has fallen off the
bus.`` line is not an Xid; `parse_gpu_lost` recognizes it separately (a ``gpu.lost`` signal).
"""

from __future__ import annotations

import errno
import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from onbox.xid import normalize_pci, normalize_recovery_action

log = logging.getLogger(__name__)

KERNEL_FACILITY = 0
MIN_READ_BUFFER = 8192
MAX_READ_BUFFER = 1 << 20

# The driver prints: NVRM: Xid (PCI:%04x:%02x:%02x[ GPU-I:%02u[ GPU-CI:%02u]]): %d, pid=%s, name=%s, %s
# or, without a process context: NVRM: Xid (PCI:...): %d, %s. Older drivers leave out "PCI:".
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)"
    r"(?: GPU-I:(?P<gi>\d+))?(?: GPU-CI:(?P<ci>\d+))?\): (?P<code>\d+)(?:,\s?(?P<rest>.*))?$"
)
_PID_RE = re.compile(r"pid=(?P<pid>'[^']*'|<[^>]*>|[^,\s]*)(?:,\s?|$)")
_NAME_RE = re.compile(r"name=(?P<name>[^,]*)(?:,\s?|$)")
_CAUSED_BY_RE = re.compile(r"\s*caused by previous Xid (?P<code>\d+)\s*$")
_RECOVERY_RE = re.compile(
    r"recovery action changed from 0x[0-9A-Fa-f]+ \([^)]*\) to "
    r"(?P<num>0x[0-9A-Fa-f]+)\s*(?:\((?P<text>[^)]*)\))?"
)
_GPU_LOST_RE = re.compile(
    r"NVRM: GPU (?:at )?(?:PCI:)?(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?):?"
    r" GPU has fallen off the bus"
)

# Line prefixes, tried in this order; each may be followed by the next ones.
_KMSG_HEAD_RE = re.compile(r"^(?P<prio>\d+),(?P<seq>\d+),(?P<ts>\d+),(?P<flags>[^;]*);")
_SYSLOG_PRI_RE = re.compile(r"^<(?P<prio>\d+)>")
_DMESG_LEVEL_RE = re.compile(r"^(?P<fac>[a-z]+)\s*:\s*(?P<lvl>[a-z]+)\s*:\s?")
_DMESG_T_RE = re.compile(r"^\[(?P<wall>[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4})\]\s?")
_SYSLOG_RE = re.compile(
    r"^(?P<wall>[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?"
    r"(?:Z|[+-]\d\d:?\d\d)?) (?P<host>\S+) (?P<tag>[^\s:\[]+)(?:\[\d+\])?: "
)
_DMESG_TS_RE = re.compile(r"^\[\s*(?P<ts>\d+\.\d+)\]\s?")
_KMSG_ESCAPE_RE = re.compile(r"\\x([0-9a-fA-F]{2})")


@dataclass(frozen=True)
class XidLine:
    """One Xid line from the kernel log.

    `pci` is normalized (``0000:3b:00``, lowercase, function dropped). `kernel_ts` is seconds since
    boot (``[123.456]`` prefixes and /dev/kmsg records); `wall_time` is the clock text of ``dmesg -T``
    and journalctl prefixes, as written. `caused_by` is set on Xid 45 lines that name their root
    Xid; `recovery_action` (canonical name, see onbox.xid) on Xid 154 lines.
    """

    code: int
    pci: str
    pid: Optional[int]
    name: Optional[str]
    message: str
    raw: str
    kernel_ts: Optional[float] = None
    wall_time: Optional[str] = None
    seq: Optional[int] = None
    gpu_instance: Optional[int] = None
    compute_instance: Optional[int] = None
    caused_by: Optional[int] = None
    recovery_action: Optional[str] = None


@dataclass(frozen=True)
class GpuLostLine:
    """``NVRM: GPU <pci>: GPU has fallen off the bus.`` (not an Xid line; Xid 79 usually precedes it)."""

    pci: str
    raw: str
    kernel_ts: Optional[float] = None
    wall_time: Optional[str] = None


@dataclass(frozen=True)
class KmsgRecord:
    """One /dev/kmsg record: ``prio,seq,ts_usec,flags[,...];message`` (continuation lines dropped)."""

    prio: int
    seq: int
    ts_usec: int
    flags: str
    message: str

    @property
    def facility(self) -> int:
        return self.prio >> 3

    @property
    def level(self) -> int:
        return self.prio & 7


@dataclass
class _Prefix:
    body: str
    kernel_ts: Optional[float] = None
    wall_time: Optional[str] = None
    seq: Optional[int] = None
    from_kernel: bool = True


def _strip_prefixes(line: str) -> _Prefix:
    """Peel known log prefixes off `line`; `from_kernel` is False when one proves user space wrote it."""
    p = _Prefix(body=line.strip().lstrip("\ufeff"))
    m = _KMSG_HEAD_RE.match(p.body)
    if m is not None:
        prio = int(m.group("prio"))
        p.from_kernel = prio >> 3 == KERNEL_FACILITY
        p.seq = int(m.group("seq"))
        p.kernel_ts = int(m.group("ts")) / 1e6
        p.body = _unescape_kmsg(p.body[m.end():])
    m = _SYSLOG_PRI_RE.match(p.body)
    if m is not None:
        p.from_kernel = p.from_kernel and int(m.group("prio")) >> 3 == KERNEL_FACILITY
        p.body = p.body[m.end():]
    m = _DMESG_LEVEL_RE.match(p.body)
    if m is not None:
        p.from_kernel = p.from_kernel and m.group("fac") == "kern"
        p.body = p.body[m.end():]
    for regex in (_DMESG_T_RE, _SYSLOG_RE):
        m = regex.match(p.body)
        if m is not None:
            p.wall_time = m.group("wall")
            if regex is _SYSLOG_RE:
                p.from_kernel = p.from_kernel and m.group("tag") == "kernel"
            p.body = p.body[m.end():]
            break
    m = _DMESG_TS_RE.match(p.body)
    if m is not None:
        p.kernel_ts = float(m.group("ts"))
        p.body = p.body[m.end():]
    return p


def _unescape_kmsg(text: str) -> str:
    """Undo /dev/kmsg's ``\\xNN`` escaping of non-printable bytes and backslashes."""
    if "\\x" not in text:
        return text
    return _KMSG_ESCAPE_RE.sub(lambda m: chr(int(m.group(1), 16)), text)


def _parse_pid(text: str) -> Optional[int]:
    text = text.strip("'\"")
    return int(text) if text.isdigit() else None


def _parse_name(text: str) -> Optional[str]:
    text = text.strip()
    if not text or text in ("<unknown>", "'<unknown>'"):
        return None
    return text


def _split_rest(rest: str) -> Tuple[Optional[int], Optional[str], str]:
    """pid, name and the driver's message from what follows ``<code>, ``."""
    pid: Optional[int] = None
    name: Optional[str] = None
    m = _PID_RE.match(rest)
    if m is not None:
        pid = _parse_pid(m.group("pid"))
        rest = rest[m.end():]
        n = _NAME_RE.match(rest)
        if n is not None:
            name = _parse_name(n.group("name"))
            rest = rest[n.end():]
    return pid, name, rest.strip()


def _recovery_action_of(message: str) -> Optional[str]:
    m = _RECOVERY_RE.search(message)
    if m is None:
        return None
    text = m.group("text")
    action = normalize_recovery_action(text) if text else None
    return action or normalize_recovery_action(int(m.group("num"), 16))


def parse_line(line: str) -> Optional[XidLine]:
    """The Xid in one kernel-log line, or None (not an Xid, garbage, or written by user space).

    Accepts plain dmesg, ``dmesg -T``, ``dmesg -x``, journalctl/syslog (only lines tagged
    ``kernel``) and raw /dev/kmsg records (only kernel facility). A prefix it does not recognize is
    skipped, not rejected: pasted text is trusted unless a prefix proves user space wrote the line.
    """
    if "NVRM: Xid" not in line:
        return None
    p = _strip_prefixes(line)
    if not p.from_kernel:
        return None
    start = p.body.find("NVRM: Xid")
    m = _XID_RE.match(p.body[start:].rstrip())
    if m is None:
        return None
    pci = normalize_pci(m.group("pci"))
    if pci is None:
        return None
    pid, name, message = _split_rest(m.group("rest") or "")
    code = int(m.group("code"))
    caused = _CAUSED_BY_RE.search(message)
    return XidLine(
        code=code,
        pci=pci,
        pid=pid,
        name=name,
        message=message,
        raw=line.rstrip("\r\n"),
        kernel_ts=p.kernel_ts,
        wall_time=p.wall_time,
        seq=p.seq,
        gpu_instance=int(m.group("gi")) if m.group("gi") else None,
        compute_instance=int(m.group("ci")) if m.group("ci") else None,
        caused_by=int(caused.group("code")) if caused else None,
        recovery_action=_recovery_action_of(message) if code == 154 else None,
    )


def parse_gpu_lost(line: str) -> Optional[GpuLostLine]:
    """The ``GPU has fallen off the bus`` companion line (not an Xid), or None."""
    if "fallen off the bus" not in line or "NVRM: Xid" in line:
        return None
    p = _strip_prefixes(line)
    if not p.from_kernel:
        return None
    m = _GPU_LOST_RE.search(p.body)
    if m is None:
        return None
    pci = normalize_pci(m.group("pci"))
    if pci is None:
        return None
    return GpuLostLine(pci=pci, raw=line.rstrip("\r\n"), kernel_ts=p.kernel_ts, wall_time=p.wall_time)


def parse_text(text: str) -> List[XidLine]:
    """Every Xid line in a block of kernel-log text, in order."""
    out: List[XidLine] = []
    for line in text.splitlines():
        xid = parse_line(line)
        if xid is not None:
            out.append(xid)
    return out


def parse_gpu_lost_text(text: str) -> List[GpuLostLine]:
    """Every ``GPU has fallen off the bus`` line in a block of kernel-log text, in order."""
    out: List[GpuLostLine] = []
    for line in text.splitlines():
        lost = parse_gpu_lost(line)
        if lost is not None:
            out.append(lost)
    return out


# The OOM killer prints (mm/oom_kill.c), newest kernels first:
#   oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/a/b,
#       task_memcg=/a/b,task=python3,pid=1234,uid=0
#   Memory cgroup out of memory: Killed process 1234 (python3) total-vm:82132kB, anon-rss:...
#   Out of memory: Killed process 1234 (python3) total-vm:...          (the whole box: global OOM)
# and before 5.x: "Memory cgroup out of memory: Kill process 1234 (python3) score 1000 or sacrifice
# child", then "Killed process 1234 (python3) total-vm:..."; v1 kernels add "Task in /a/b killed as a
# result of limit of /a".
_OOM_KILLED_RE = re.compile(
    r"(?P<scope>Memory cgroup out of memory|Out of memory(?: \([^)]*\))?)?:?\s*"
    r"Kill(?:ed)? process (?P<pid>\d+) \((?P<name>[^)]*)\)")
_OOM_KILL_RE = re.compile(r"oom-kill:(?P<fields>\S+)")
_OOM_LIMIT_RE = re.compile(r"Task in (?P<task>\S+) killed as a result of limit of (?P<limit>\S+)")


@dataclass(frozen=True)
class OomLine:
    """One OOM-killer line naming the killed process.

    `scope` is "cgroup" (a memory cgroup's limit was hit), "global" (the box ran out) or None (the
    line does not say: the old second line). `memcg` is the cgroup whose limit was hit (``oom_memcg=``
    or v1's "limit of"), as the kernel names it (relative to the cgroup mount), when the line says.
    """

    pid: Optional[int]
    name: Optional[str]
    scope: Optional[str]
    memcg: Optional[str]
    raw: str
    kernel_ts: Optional[float] = None


def parse_oom_line(line: str) -> Optional[OomLine]:
    """An OOM-killer line (kernel facility only), or None."""
    if "process" not in line and "oom-kill:" not in line and "killed as a result" not in line:
        return None
    p = _strip_prefixes(line)
    if not p.from_kernel:
        return None
    body = p.body.strip()
    m = _OOM_KILL_RE.search(body)
    if m is not None:
        fields = dict(f.partition("=")[::2] for f in m.group("fields").split(","))
        pid = fields.get("pid", "")
        constraint = fields.get("constraint", "")
        scope = {"CONSTRAINT_MEMCG": "cgroup", "CONSTRAINT_NONE": "global"}.get(constraint)
        return OomLine(int(pid) if pid.isdigit() else None, fields.get("task") or None, scope,
                       fields.get("oom_memcg") or None, body[:500], p.kernel_ts)
    m = _OOM_LIMIT_RE.search(body)
    if m is not None:
        return OomLine(None, None, "cgroup", m.group("limit"), body[:500], p.kernel_ts)
    m = _OOM_KILLED_RE.search(body)
    if m is None:
        return None
    head = m.group("scope") or ""
    scope = "cgroup" if head.startswith("Memory cgroup") else "global" if head else None
    return OomLine(int(m.group("pid")), m.group("name") or None, scope, None, body[:500], p.kernel_ts)


def oom_from_record(record: KmsgRecord) -> Optional[OomLine]:
    """The OOM line in a decoded record; None unless it came from the kernel facility."""
    if record.facility != KERNEL_FACILITY:
        return None
    line = parse_oom_line(record.message)
    if line is None:
        return None
    return OomLine(line.pid, line.name, line.scope, line.memcg, line.raw, record.ts_usec / 1e6)


def decode_record(data: bytes) -> Optional[KmsgRecord]:
    """One raw /dev/kmsg record, or None when it does not follow the record format."""
    text = data.decode("utf-8", errors="replace")
    first = text.split("\n", 1)[0]
    head, sep, message = first.partition(";")
    if not sep:
        return None
    fields = head.split(",")
    if len(fields) < 4 or not all(f.isdigit() for f in fields[:3]):
        return None
    return KmsgRecord(int(fields[0]), int(fields[1]), int(fields[2]), fields[3], _unescape_kmsg(message))


def split_records(data: bytes) -> List[bytes]:
    """Cut a chunk holding one or more records into records.

    /dev/kmsg returns one record per read, but a FIFO or a saved dump holds several. A record's
    continuation lines (`` KEY=value``) start with a space and stay with their record.
    """
    records: List[bytes] = []
    current: List[bytes] = []
    for line in data.split(b"\n"):
        if line.startswith(b" ") and current:
            current.append(line)
            continue
        if current:
            records.append(b"\n".join(current))
        current = [line] if line else []
    if current:
        records.append(b"\n".join(current))
    return records


def xid_from_record(record: KmsgRecord) -> Optional[XidLine]:
    """The Xid in a decoded record; None unless it came from the kernel facility."""
    if record.facility != KERNEL_FACILITY or "NVRM: Xid" not in record.message:
        return None
    xid = parse_line(record.message)
    if xid is None:
        return None
    raw = f"{record.prio},{record.seq},{record.ts_usec},{record.flags};{record.message}"
    return XidLine(
        code=xid.code, pci=xid.pci, pid=xid.pid, name=xid.name, message=xid.message, raw=raw,
        kernel_ts=record.ts_usec / 1e6, wall_time=None, seq=record.seq,
        gpu_instance=xid.gpu_instance, compute_instance=xid.compute_instance,
        caused_by=xid.caused_by, recovery_action=xid.recovery_action,
    )


def parse_kmsg_record(data: bytes) -> Optional[XidLine]:
    """The Xid in one raw /dev/kmsg record; None for other records and for user-space ones."""
    record = decode_record(data)
    return None if record is None else xid_from_record(record)


class KmsgReader:
    """Non-blocking reader of /dev/kmsg records.

    Opens at construction; never raises for an unreadable device: check `available` / `reason`.
    By default it seeks to the end so only new records are read; `backlog=True` reads the ring
    buffer from its oldest record. Use `fileno()` with select/poll, then `read_available()`.
    EPIPE (records overwritten before we read them) is counted in `overwritten` and skipped; EINVAL
    (a record larger than the buffer) grows the buffer up to 1 MiB.
    """

    def __init__(
        self,
        path: str = "/dev/kmsg",
        opener: Callable[[str, int], int] = os.open,
        backlog: bool = False,
        buffer_size: int = 16384,
        read: Callable[[int, int], bytes] = os.read,
        max_records_per_call: int = 10000,
    ) -> None:
        self.path = path
        self.available = False
        self.reason = "not opened"
        self.overwritten = 0
        self.errors = 0
        self.last_error: Optional[str] = None
        self._read = read
        self._bufsize = max(buffer_size, MIN_READ_BUFFER)
        self._max_records = max_records_per_call
        self._fd: Optional[int] = None
        try:
            self._fd = opener(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            self.reason = f"cannot open {path}: {e.strerror or e}"
            return
        self.available = True
        self.reason = "ok"
        if not backlog:
            self._seek_end()

    def _seek_end(self) -> None:
        assert self._fd is not None
        try:
            os.lseek(self._fd, 0, os.SEEK_END)
        except OSError as e:
            if e.errno != errno.ESPIPE:  # a FIFO cannot seek; it has no backlog anyway
                log.debug("kmsg: seek to end of %s failed: %s", self.path, e)

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"kmsg reader for {self.path} is not available: {self.reason}")
        return self._fd

    def _read_one(self) -> Optional[bytes]:
        """One read(); None when nothing is waiting (or on an error, recorded in last_error)."""
        assert self._fd is not None
        for _ in range(64):  # bounded: EPIPE/EINVAL retries never spin forever
            try:
                return self._read(self._fd, self._bufsize)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return None
                if e.errno == errno.EPIPE:
                    self.overwritten += 1
                    continue
                if e.errno == errno.EINVAL and self._bufsize < MAX_READ_BUFFER:
                    self._bufsize = min(self._bufsize * 2, MAX_READ_BUFFER)
                    continue
                self.errors += 1
                self.last_error = f"read {self.path}: {e.strerror or e}"
                log.warning("kmsg: %s", self.last_error)
                return None
        return None

    def read_records(self) -> List[KmsgRecord]:
        """Every record waiting now (without blocking), in order."""
        if self._fd is None:
            return []
        out: List[KmsgRecord] = []
        while len(out) < self._max_records:
            data = self._read_one()
            if not data:  # nothing waiting, an error, or EOF on a FIFO with no writer
                break
            for chunk in split_records(data):
                record = decode_record(chunk)
                if record is not None:
                    out.append(record)
        return out

    def read_available(self) -> List[XidLine]:
        """The Xids among the records waiting now (kernel facility only)."""
        out: List[XidLine] = []
        for record in self.read_records():
            xid = xid_from_record(record)
            if xid is not None:
                out.append(xid)
        return out

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            self.available = False
            self.reason = "closed"
            try:
                os.close(fd)
            except OSError as e:
                log.debug("kmsg: close %s failed: %s", self.path, e)

    def __enter__(self) -> KmsgReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
