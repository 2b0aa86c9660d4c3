"""OOM wherever the memory limit sits: the job's own cgroup (v1 for real, v2 over a fake cgroupfs),
the container's, the box's; from the cgroup's oom_kill counter and the kernel log line.

The real test moves a leaking job into a v1 memory cgroup of its own limited to 64 MiB (what
`systemd-run --scope -p MemoryMax=` or a Slurm step does), lets the kernel kill it, and checks that the
sidecar's monitor turns the wrapper's plain SIGKILL into `oom_killed` with the limit that was hit.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set

import pytest

from onbox.monitors.health import HealthMonitor, MonitorConfig
from onbox.sources.host import CgroupReader
from onbox.sources.process import ProcInfo
from tests.helpers import Clock, Recorder, wait_until

LIMIT = 64 << 20
# The job waits on a FIFO (its read ends when the test opens and closes the other end), then leaks.
LEAK = """
import sys
with open(sys.argv[1]) as go:
    go.read()
chunks = []
while True:
    chunk = bytearray(8 << 20)
    chunk[::4096] = b"x" * len(chunk[::4096])   # touch every page: it is charged
    chunks.append(chunk)
"""


def _open_writer(fifo: Path) -> Optional[int]:
    """A write end of `fifo` once a reader has it open (ENXIO until then); closing it is the go."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            return None
        raise


def _own_v1_memory_cgroup() -> Optional[Path]:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            return Path("/sys/fs/cgroup/memory") / parts[2].lstrip("/")
    return None


@pytest.fixture
def v1_cgroup() -> Iterator[Path]:
    parent = _own_v1_memory_cgroup()
    if parent is None or not (parent / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory hierarchy here (/proc/self/cgroup names no memory controller)")
    leaf = parent / f"rgt-oom-{uuid.uuid4().hex[:8]}"
    try:
        leaf.mkdir()
        (leaf / "memory.limit_in_bytes").write_text(str(LIMIT))
    except OSError as e:
        pytest.skip(f"the cgroup v1 memory hierarchy at {parent} is not writable: {e}")
    try:
        yield leaf
    finally:
        for pid in (leaf / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        wait_until(lambda: not (leaf / "cgroup.procs").read_text().split(), 30, "the cgroup to empty")
        leaf.rmdir()


def test_a_job_oom_killed_in_its_own_v1_cgroup_is_reported_with_the_limit(tmp_path: Path,
                                                                         v1_cgroup: Path) -> None:
    run_dir, go = tmp_path / "run", tmp_path / "go"
    (run_dir / "rgt").mkdir(parents=True)
    os.mkfifo(go)
    (tmp_path / "leak.py").write_text(LEAK)
    spec = {"argv": [sys.executable, str(tmp_path / "leak.py"), str(go)], "cwd": str(tmp_path),
            "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, "run_id": "oom", "attempt": 1}
    wrapper = subprocess.Popen([sys.executable, "-m", "onbox.launch.supervise", "job",
                                "--run-dir", str(run_dir)],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rec = Recorder()
    mon = HealthMonitor(MonitorConfig(run_dir=run_dir, job_pid=wrapper.pid, gpu="none", kmsg=True), rec)
    try:
        assert wrapper.stdin is not None
        wrapper.stdin.write(json.dumps(spec).encode())
        wrapper.stdin.close()
        job = wait_until(lambda: (json.loads((run_dir / "rgt" / "job.json").read_text()) or {}).get("job")
                         if (run_dir / "rgt" / "job.json").exists() else None, 30, "job.json")
        mon.start()
        mon.job_tick()
        (v1_cgroup / "cgroup.procs").write_text(str(job["pid"]))   # the job moves into its own cgroup
        rel = "/" + str(v1_cgroup.relative_to("/sys/fs/cgroup/memory"))

        def seen() -> bool:
            mon.job_tick()
            return rel in mon.status()["job"].get("cgroups", [])
        wait_until(seen, 30, "the monitor to see the job's new cgroup")
        os.close(wait_until(lambda: _open_writer(go), 30, "the job to wait on its go FIFO"))

        def exited() -> List[Dict[str, Any]]:
            mon.kmsg_tick()
            mon.job_tick()
            return rec.of("job.exited")
        ev = wait_until(exited, 60, "job.exited")[0]
        exit_doc = json.loads((run_dir / "rgt" / "exit.json").read_text())
    finally:
        mon.close()
        if wrapper.poll() is None:
            wrapper.kill()
        wrapper.wait(30)
    assert exit_doc["signal"] == signal.SIGKILL
    assert ev["signal"] == signal.SIGKILL and ev["oom_killed"] is True, ev
    assert ev["oom_limit"] == f"job cgroup {rel} (memory.limit_in_bytes {LIMIT} bytes)", ev
    if not exit_doc["oom_killed"]:   # the wrapper's own cgroup saw nothing: the sidecar upgraded it
        assert ev["oom_upgraded"] is True
    assert {"cgroup": rel, "oom_kill_delta": 1, "limit": ev["oom_limit"]} in ev["oom_evidence"]["cgroups"]
    if mon.status()["kmsg"]:
        assert any(k["pid"] == job["pid"] and k.get("scope") == "cgroup"
                   for k in ev["oom_evidence"]["kernel"]), ev


# ---- v2 and the kernel log, over a fake cgroupfs and a fake /dev/kmsg -------------------------------

JOB, CHILD = 7001, 7002


class FakeProcesses:
    def __init__(self) -> None:
        self.alive: Set[int] = {JOB, CHILD}

    def info(self, pid: int) -> Optional[ProcInfo]:
        return ProcInfo(pid, 1.7e9, "python", 1 << 20) if pid in self.alive else None

    def tree(self, pid: int) -> Set[int]:
        return set(self.alive) if pid in self.alive else set()

    def visible(self, pid: int) -> bool:
        return pid in self.alive

    def holds_gpu(self, pid: int) -> Optional[bool]:
        return False

    def name(self, pid: int) -> Optional[str]:
        return "python"


class FakeBox:
    """A cgroup v2 tree, a /proc with two job processes, a kernel log file; a monitor over them."""

    def __init__(self, tmp_path: Path, kmsg: bool = False) -> None:
        self.cg, self.proc, self.run_dir = tmp_path / "cg", tmp_path / "proc", tmp_path / "run"
        self.kmsg = tmp_path / "kmsg"
        self.kmsg.write_bytes(b"")
        (self.run_dir / "rgt").mkdir(parents=True)
        self.processes = FakeProcesses()
        self.mono = Clock(1000.0)
        self.rec = Recorder()
        self.place(JOB, "/user.slice")
        self.place(CHILD, "/user.slice")
        self.cgroup("/user.slice", current=100, limit=None, oom_kill=5)
        config = MonitorConfig(run_dir=self.run_dir, job_pid=JOB, gpu="none", kmsg=kmsg,
                               kmsg_path=str(self.kmsg), exit_grace_s=3.0)
        self.mon = HealthMonitor(config, self.rec, monotonic=self.mono, processes=self.processes,
                                 cgroups=CgroupReader(root=self.cg, proc=self.proc),
                                 host_memory=lambda: (1 << 30, 1 << 29), boot_id=lambda: "b",
                                 state=lambda pid: "S")

    def place(self, pid: int, path: str) -> None:
        (self.proc / str(pid)).mkdir(parents=True, exist_ok=True)
        (self.proc / str(pid) / "cgroup").write_text(f"0::{path}\n")

    def cgroup(self, path: str, current: int, limit: Optional[int], oom_kill: int) -> None:
        d = self.cg / path.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.current").write_text(f"{current}\n")
        (d / "memory.max").write_text(f"{limit}\n" if limit is not None else "max\n")
        (d / "memory.events").write_text(f"low 0\nhigh 0\nmax 0\noom 0\noom_kill {oom_kill}\n")

    def kernel(self, *messages: str) -> None:
        with open(self.kmsg, "ab") as f:
            for i, m in enumerate(messages):
                f.write(f"3,{100 + i},646622374,-;{m}\n".encode())

    def tick(self) -> None:
        self.mon.kmsg_tick()
        self.mon.job_tick()
        self.mono.t += 1.0

    def die(self, signal_no: int = 9, code: Optional[int] = None, oom: bool = False) -> Dict[str, Any]:
        self.processes.alive.clear()
        (self.run_dir / "rgt" / "exit.json").write_text(json.dumps(
            {"code": code, "signal": signal_no if code is None else None, "oom_killed": oom}))
        self.tick()
        found = self.rec.of("job.exited")
        assert len(found) == 1, self.rec.events
        return found[0]


@pytest.fixture
def box(tmp_path: Path) -> Iterator[FakeBox]:
    made = FakeBox(tmp_path)
    made.mon.start()
    yield made
    made.mon.close()


def test_v2_a_job_that_moves_into_its_own_cgroup_and_is_oom_killed_there(box: FakeBox) -> None:
    box.tick()
    box.cgroup("/user.slice/job.scope", current=900, limit=1000, oom_kill=0)
    box.place(CHILD, "/user.slice/job.scope")          # systemd-run --scope: the job moves itself
    box.tick()
    assert "/user.slice/job.scope" in box.mon.status()["job"]["cgroups"]
    box.cgroup("/user.slice/job.scope", current=990, limit=1000, oom_kill=1)
    box.tick()
    ev = box.die()
    assert ev["oom_killed"] is True and ev["oom_upgraded"] is True and ev["signal"] == 9
    assert ev["oom_limit"] == "job cgroup /user.slice/job.scope (memory.max 1000 bytes)"
    assert box.rec.events[-1][2] == "critical"


def test_v2_a_plain_sigkill_with_no_counter_rise_stays_a_sigkill(box: FakeBox) -> None:
    box.tick()
    box.cgroup("/user.slice", current=100, limit=None, oom_kill=5)   # unchanged
    ev = box.die()
    assert ev["oom_killed"] is False and "oom_limit" not in ev and ev["signal"] == 9


def test_v2_a_limit_on_the_container_root_is_the_container_cgroup(box: FakeBox) -> None:
    box.place(JOB, "/")
    box.place(CHILD, "/")
    box.cgroup("/", current=1900, limit=2000, oom_kill=0)
    box.tick()
    box.cgroup("/", current=1900, limit=2000, oom_kill=1)
    box.tick()
    ev = box.die()
    assert ev["oom_killed"] and ev["oom_limit"] == "container cgroup / (memory.max 2000 bytes)"


def test_a_rank_killed_with_no_limit_anywhere_is_the_box_global_oom(box: FakeBox) -> None:
    box.tick()
    box.cgroup("/user.slice", current=100, limit=None, oom_kill=6)
    box.tick()
    ev = box.die(code=1)                                # torchrun exits 1 after a rank was killed
    assert ev["oom_killed"] and ev["code"] == 1 and ev["oom_limit"] == "box (global OOM)"


@pytest.fixture
def kbox(tmp_path: Path) -> Iterator[FakeBox]:
    made = FakeBox(tmp_path, kmsg=True)
    made.mon.start()
    yield made
    made.mon.close()


def test_the_kernel_line_naming_a_job_pid_is_enough_and_names_the_memcg(kbox: FakeBox) -> None:
    kbox.cgroup("/user.slice/job.scope", current=1, limit=1 << 26, oom_kill=0)
    kbox.tick()
    kbox.kernel(
        "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
        f"oom_memcg=/user.slice/job.scope,task_memcg=/user.slice/job.scope,task=python3,pid={CHILD},uid=0",
        f"Memory cgroup out of memory: Killed process {CHILD} (python3) total-vm:82132kB, "
        "anon-rss:65152kB, file-rss:6580kB, shmem-rss:0kB, UID:0 pgtables:192kB oom_score_adj:0")
    ev = kbox.die()                                     # the scope was removed: no counter to read
    assert ev["oom_killed"]
    assert ev["oom_limit"] == f"job cgroup /user.slice/job.scope (memory.max {1 << 26} bytes)"
    assert ev["oom_evidence"]["kernel"] == [{"pid": CHILD, "name": "python3", "scope": "cgroup",
                                             "limit": ev["oom_limit"]}]


def test_a_global_oom_line_is_the_box_and_another_pid_is_ignored(kbox: FakeBox) -> None:
    kbox.tick()
    kbox.kernel("Out of memory: Killed process 999 (other) total-vm:1kB, anon-rss:1kB",
                f"Out of memory: Killed process {JOB} (python3) total-vm:1kB, anon-rss:1kB")
    ev = kbox.die()
    assert ev["oom_killed"] and ev["oom_limit"] == "box (global OOM)"
    assert [k["pid"] for k in ev["oom_evidence"]["kernel"]] == [JOB]


def test_user_space_cannot_fake_an_oom_line(kbox: FakeBox) -> None:
    kbox.tick()
    with open(kbox.kmsg, "ab") as f:   # facility 1 (user): written by a process, not the kernel
        f.write(f"14,200,1,-;Memory cgroup out of memory: Killed process {JOB} (python3)\n".encode())
    ev = kbox.die()
    assert ev["oom_killed"] is False
