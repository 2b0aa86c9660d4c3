"""The box around the job: cgroup memory (v2 and v1), filesystem usage, boot identity, host memory.

Reads only; every reader takes its OS callables and paths as parameters with real defaults, so tests
point it at a tmp dir of fake cgroup files instead of patching globals. Nothing raises for a
missing file: a value that cannot be read is None. The only onbox module besides process.py that
may import psutil (for host memory).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import psutil  # noqa: TID251 (the psutil seam)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc")
# cgroup v1 reports "no limit" as a page-rounded LLONG_MAX; anything this large is no limit.
V1_UNLIMITED = 1 << 62

ReadText = Callable[[Path], str]


def read_text(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


@dataclasses.dataclass(frozen=True)
class CgroupMemory:
    """Memory of one cgroup and its ancestors.

    The figures are those of the level whose limit binds hardest (highest working set / max);
    `max_bytes` None means no level up the tree has a limit. `working_set_bytes` is the charge less
    the inactive page cache (what the kernel cannot simply drop; the kubelet's measure), so a job
    that streams a big dataset through the page cache does not look like it is about to be killed.
    `oom_kill` is the leaf's counter (v2 memory.events, v1 memory.oom_control), None if absent.
    """

    version: int
    leaf: str
    path: str
    current_bytes: Optional[int]
    max_bytes: Optional[int]
    oom_kill: Optional[int]
    working_set_bytes: Optional[int] = None

    @property
    def used_pct(self) -> Optional[float]:
        used = self.working_set_bytes if self.working_set_bytes is not None else self.current_bytes
        if used is None or not self.max_bytes:
            return None
        return 100.0 * used / self.max_bytes


@dataclasses.dataclass(frozen=True)
class CgroupLocation:
    """Where a process's memory cgroup lies in this mount. `hidden` is the leading part of the path
    that /proc names and the mount does not show: a container that has its own cgroup mounted as the
    root without a cgroup namespace (Docker on cgroup v1) reads "/docker/ID/job" in /proc and finds
    the job at <mount>/job; the kernel log names the whole path."""

    version: int
    leaf: Path
    mount: Path
    hidden: str = ""


def _int_or_none(text: str) -> Optional[int]:
    text = text.strip()
    return int(text) if text.isdigit() else None


def _counter(text: str, key: str) -> Optional[int]:
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _int_or_none(value)
    return None


class CgroupReader:
    """Finds a process's memory cgroup and reads it; `root` and `proc` are injectable for tests."""

    def __init__(self, root: Path = CGROUP_ROOT, proc: Path = PROC, read: ReadText = read_text) -> None:
        self.root = Path(root)
        self.proc = Path(proc)
        self._read = read

    def _text(self, path: Path) -> Optional[str]:
        try:
            return self._read(path)
        except (OSError, ValueError):
            return None

    def locate(self, pid: Optional[int] = None) -> Optional[CgroupLocation]:
        """The memory cgroup of `pid` (default: this process), or None when there is none to read."""
        text = self._text(self.proc / (str(pid) if pid else "self") / "cgroup")
        if text is None:
            return None
        v1: Optional[str] = None
        v2: Optional[str] = None
        for line in text.splitlines():
            parts = line.strip().split(":", 2)
            if len(parts) != 3:
                continue
            if parts[0] == "0" and parts[1] == "":
                v2 = parts[2]
            elif "memory" in parts[1].split(","):
                v1 = parts[2]
        member = pid or os.getpid()
        if v1 is not None:
            found = self._pick(self.root / "memory", v1, "memory.usage_in_bytes", 1, member)
            if found is not None:
                return found
        if v2 is not None:
            return self._pick(self.root, v2, "memory.current", 2, member)
        return None

    def describe(self, memcg: str) -> str:
        """The cgroup the kernel log names (``oom_memcg=/a/b``), with its limit when it can be read."""
        rel = memcg.strip("/")
        for version, mount in ((2, self.root), (1, self.root / "memory")):
            limit = _int_or_none(self._text(mount / rel / limit_file(version)) or "")
            if limit is not None and limit < V1_UNLIMITED:
                what = "container cgroup" if not rel else "job cgroup"
                return f"{what} /{rel} ({limit_file(version)} {limit} bytes)"
        return f"job cgroup /{rel}"

    def _pick(self, mount: Path, rel: str, probe: str, version: int, pid: int) -> Optional[CgroupLocation]:
        """The path as /proc names it; else, within a container that mounts its own cgroup as the
        root (no cgroup namespace), the same path less leading parts, taken only where its
        cgroup.procs lists `pid`; else the mount itself, which a cgroup namespace shows as its own
        root. A path with ".." (a namespace's view of a cgroup outside it) never leaves the mount."""
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        if ".." not in parts:
            if self._text(mount.joinpath(*parts) / probe) is not None:
                return CgroupLocation(version, mount.joinpath(*parts), mount)
            for cut in range(1, len(parts)):
                inner = mount.joinpath(*parts[cut:])
                if self._text(inner / probe) is not None and self._lists(inner, pid):
                    return CgroupLocation(version, inner, mount, "/" + "/".join(parts[:cut]))
        if self._text(mount / probe) is not None:
            return CgroupLocation(version, mount, mount)
        return None

    def _lists(self, cgroup: Path, pid: int) -> bool:
        return str(pid) in (self._text(cgroup / "cgroup.procs") or "").split()

    def memory(self, where: CgroupLocation) -> Optional[CgroupMemory]:
        """Current use, the binding limit, and the oom_kill counter; None when nothing is readable."""
        names = (("memory.current", "memory.max") if where.version == 2
                 else ("memory.usage_in_bytes", "memory.limit_in_bytes"))
        levels: List[Tuple[Path, Optional[int], Optional[int]]] = []
        node = where.leaf
        while True:
            current_text = self._text(node / names[0])
            if current_text is not None:
                limit = _int_or_none(self._text(node / names[1]) or "")
                if limit is not None and limit >= V1_UNLIMITED:
                    limit = None
                levels.append((node, _int_or_none(current_text), limit))
            if node == where.mount or where.mount not in node.parents:
                break
            node = node.parent
        if not levels:
            return None
        limited: List[Tuple[Path, Optional[int], Optional[int], Optional[int]]] = [
            (node, cur, self._working_set(node, cur, where.version), lim)
            for node, cur, lim in levels if lim and cur is not None]
        working: Optional[int]
        if limited:
            node, current, working, limit = max(limited, key=lambda lv: (lv[2] or 0) / (lv[3] or 1))
        else:
            node, current, limit = levels[0]
            working = self._working_set(node, current, where.version)
        events = self._text(where.leaf / ("memory.events" if where.version == 2 else "memory.oom_control"))
        oom = _counter(events, "oom_kill") if events is not None else None
        return CgroupMemory(where.version, str(where.leaf), str(node), current, limit, oom, working)

    def _working_set(self, node: Path, current: Optional[int], version: int) -> Optional[int]:
        """The charge less inactive page cache; the charge itself when memory.stat says nothing."""
        if current is None:
            return None
        stat = self._text(node / "memory.stat")
        key = "inactive_file" if version == 2 else "total_inactive_file"
        inactive = _counter(stat, key) if stat else None
        return current if inactive is None else max(0, current - inactive)


def kernel_path(where: CgroupLocation, node: Optional[Path] = None) -> str:
    """A cgroup as the kernel log names it: its path under the mount ("/" for the mount itself),
    after the part of the path the mount does not show (`where.hidden`)."""
    node = where.leaf if node is None else node
    try:
        rel = node.relative_to(where.mount)
    except ValueError:
        return str(node)
    inside = "/" + str(rel) if str(rel) not in ("", ".") else ""
    return where.hidden + inside or "/"


def limit_file(version: int) -> str:
    return "memory.max" if version == 2 else "memory.limit_in_bytes"


def describe_limit(where: CgroupLocation, mem: CgroupMemory) -> Optional[str]:
    """The limit that binds `mem`, for a person: "job cgroup /a/b (memory.max 67108864 bytes)", or
    "container cgroup / (...)" when it sits at the root we see (a container's cgroup namespace);
    None when no level up the tree has a limit."""
    if not mem.max_bytes:
        return None
    node = Path(mem.path)
    what = "container cgroup" if node == where.mount else "job cgroup"
    return f"{what} {kernel_path(where, node)} ({limit_file(mem.version)} {mem.max_bytes} bytes)"


@dataclasses.dataclass(frozen=True)
class DiskUsage:
    """One filesystem as `df` and `df -i` see it (bytes for an unprivileged user)."""

    path: str
    device: Optional[int]
    total_bytes: int
    used_bytes: int
    avail_bytes: int
    inodes_total: Optional[int]
    inodes_used: Optional[int]
    inodes_free: Optional[int]

    @property
    def bytes_used_pct(self) -> Optional[float]:
        room = self.used_bytes + self.avail_bytes
        return 100.0 * self.used_bytes / room if room > 0 else None

    @property
    def inodes_used_pct(self) -> Optional[float]:
        if not self.inodes_total or self.inodes_used is None:
            return None  # btrfs and many FUSE mounts report no inode table
        return 100.0 * self.inodes_used / self.inodes_total


def _device_of(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


def disk_usage(path: Path, stat: Callable[[str], Any] = os.statvfs,
               device_of: Callable[[str], Optional[int]] = _device_of) -> DiskUsage:
    """statvfs of `path`'s filesystem; raises OSError when the path cannot be read."""
    st = stat(str(path))
    frsize = st.f_frsize or st.f_bsize
    used = (st.f_blocks - st.f_bfree) * frsize
    files = st.f_files or None
    inodes_used = files - st.f_ffree if files else None
    return DiskUsage(str(path), device_of(str(path)), st.f_blocks * frsize, used, st.f_bavail * frsize,
                     files, inodes_used, st.f_favail if files else None)


def boot_id(proc: Path = PROC, read: ReadText = read_text) -> Optional[str]:
    """The kernel's per-boot UUID: it changes exactly when the box reboots."""
    try:
        return read(proc / "sys" / "kernel" / "random" / "boot_id").strip() or None
    except OSError:
        return None


def boot_time(proc: Path = PROC, read: ReadText = read_text) -> Optional[float]:
    """Unix time of the last boot (`btime` of /proc/stat)."""
    try:
        return float(_counter(read(proc / "stat"), "btime") or 0) or None
    except (OSError, ValueError):
        return None


def host_memory() -> Tuple[int, int]:
    """(total, available) bytes of the whole box, for when no cgroup limit applies."""
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)
