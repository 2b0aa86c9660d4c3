"""The host seams: cgroup v2/v1 memory from fake cgroup trees, statvfs, boot id; psutil's process view."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Dict

import pytest

from onbox.sources import host, process
from onbox.sources.host import CgroupReader, disk_usage
from onbox.sources.process import ProcessView
from tests.helpers import wait_until


def write_tree(root: Path, files: Dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_v2_binding_limit_is_the_tightest_ancestor(tmp_path: Path) -> None:
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    write_tree(proc, {"123/cgroup": "0::/box.slice/job\n"})
    write_tree(cg, {
        "cgroup.controllers": "memory\n",
        "box.slice/memory.current": "900\n", "box.slice/memory.max": "1000\n",
        "box.slice/memory.stat": "anon 700\nfile 200\nactive_file 50\ninactive_file 150\n",
        "box.slice/job/memory.current": "700\n", "box.slice/job/memory.max": "max\n",
        "box.slice/job/memory.events": "low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\noom_group_kill 0\n",
    })
    reader = CgroupReader(root=cg, proc=proc)
    where = reader.locate(123)
    assert where is not None and where.version == 2 and where.leaf == cg / "box.slice" / "job"
    mem = reader.memory(where)
    assert mem is not None
    assert (mem.current_bytes, mem.max_bytes, mem.oom_kill) == (900, 1000, 2)
    # Page cache the kernel can drop is not pressure: the working set is 900 - 150.
    assert mem.working_set_bytes == 750 and mem.used_pct == 75.0
    assert mem.path == str(cg / "box.slice")


def test_cgroup_v2_without_any_limit_and_namespaced_paths(tmp_path: Path) -> None:
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    # A cgroup namespace shows "/" (or a path that does not exist here): the mount is the container's.
    write_tree(proc, {"self/cgroup": "0::/../outside\n"})
    write_tree(cg, {"memory.current": "5\n", "memory.max": "max\n", "memory.events": "oom_kill 0\n"})
    reader = CgroupReader(root=cg, proc=proc)
    where = reader.locate(None)
    assert where is not None and where.leaf == cg
    mem = reader.memory(where)
    assert mem is not None and mem.max_bytes is None and mem.used_pct is None and mem.oom_kill == 0


def test_cgroup_v1_memory_line_wins_in_a_hybrid_hierarchy(tmp_path: Path) -> None:
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    write_tree(proc, {"9/cgroup": "12:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n"})
    write_tree(cg, {
        "memory/docker/abc/memory.usage_in_bytes": "600\n",
        "memory/docker/abc/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/docker/abc/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
        "memory/docker/memory.usage_in_bytes": "650\n",
        "memory/docker/memory.limit_in_bytes": "800\n",
        "memory/docker/memory.stat": "cache 100\ninactive_file 1\ntotal_inactive_file 50\n",
        "memory/memory.usage_in_bytes": "5000\n",
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
    })
    reader = CgroupReader(root=cg, proc=proc)
    where = reader.locate(9)
    assert where is not None and where.version == 1
    mem = reader.memory(where)
    assert mem is not None and (mem.current_bytes, mem.max_bytes, mem.oom_kill) == (650, 800, 3)
    assert mem.working_set_bytes == 600 and mem.used_pct == 75.0


def test_a_container_without_a_cgroup_namespace_finds_the_job_cgroup_below_its_root(tmp_path: Path) -> None:
    # Docker on cgroup v1: /proc names the host's path, the mount is the container's cgroup, and the
    # job sits in a cgroup of its own below it. The kernel log names the whole path.
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    write_tree(proc, {"77/cgroup": "4:memory:/docker/abc/job\n", "78/cgroup": "4:memory:/docker/abc/job\n"})
    write_tree(cg, {
        "memory/memory.usage_in_bytes": "5000\n", "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/job/memory.usage_in_bytes": "700\n", "memory/job/memory.limit_in_bytes": "1000\n",
        "memory/job/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
        "memory/job/cgroup.procs": "77\n",
    })
    reader = CgroupReader(root=cg, proc=proc)
    where = reader.locate(77)
    assert where is not None and where.leaf == cg / "memory" / "job" and where.hidden == "/docker/abc"
    assert host.kernel_path(where) == "/docker/abc/job"
    assert host.kernel_path(where, where.mount) == "/docker/abc"
    mem = reader.memory(where)
    assert mem is not None and (mem.current_bytes, mem.max_bytes, mem.oom_kill) == (700, 1000, 2)
    # A cgroup of the same name that does not hold the process is not its cgroup: the mount is.
    other = reader.locate(78)
    assert other is not None and other.leaf == cg / "memory" and other.hidden == ""
    assert host.kernel_path(other) == "/"


def test_a_path_with_dot_dot_never_leaves_the_mount(tmp_path: Path) -> None:
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    write_tree(proc, {"5/cgroup": "0::/../outside\n"})
    write_tree(tmp_path, {"outside/memory.current": "1\n", "outside/cgroup.procs": "5\n"})
    write_tree(cg, {"cgroup.controllers": "memory\n", "memory.current": "9\n"})
    where = CgroupReader(root=cg, proc=proc).locate(5)
    assert where is not None and where.leaf == cg


def test_no_readable_cgroup_is_none_not_an_error(tmp_path: Path) -> None:
    reader = CgroupReader(root=tmp_path / "cg", proc=tmp_path / "proc")
    assert reader.locate(1) is None
    write_tree(tmp_path / "proc", {"1/cgroup": "0::/a\n"})
    assert reader.locate(1) is None  # no memory.current anywhere: the host root


def test_disk_usage_matches_df_and_tolerates_missing_inode_tables() -> None:
    fake = SimpleNamespace(f_frsize=4096, f_bsize=8192, f_blocks=1000, f_bfree=300, f_bavail=200,
                           f_files=0, f_ffree=0, f_favail=0)
    u = disk_usage(Path("/x"), stat=lambda p: fake, device_of=lambda p: 7)
    assert (u.total_bytes, u.used_bytes, u.avail_bytes, u.device) == (4096000, 2867200, 819200, 7)
    assert u.bytes_used_pct == pytest.approx(100 * 700 / 900)  # df: used / (used + avail)
    assert u.inodes_used_pct is None and u.inodes_total is None
    real = disk_usage(Path("/"))
    assert real.total_bytes > 0 and real.bytes_used_pct is not None


def test_boot_id_and_boot_time(tmp_path: Path) -> None:
    write_tree(tmp_path, {"sys/kernel/random/boot_id": "abc-123\n", "stat": "cpu 1 2\nbtime 1700000000\n"})
    assert host.boot_id(tmp_path) == "abc-123"
    assert host.boot_time(tmp_path) == 1_700_000_000.0
    assert host.boot_id(tmp_path / "nope") is None and host.boot_time(tmp_path / "nope") is None
    total, avail = host.host_memory()
    assert total > 0 and 0 <= avail <= total


def test_process_view_sees_a_job_tree_and_tells_a_gone_pid() -> None:
    code = ("import subprocess, sys; "
            "c = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], "
            "stdin=subprocess.PIPE); "
            "print(c.pid, flush=True); sys.stdin.read(); c.stdin.close(); c.wait()")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        view = ProcessView()
        info = view.info(parent.pid)
        assert info is not None and info.create_time > 0 and info.rss_bytes and info.name
        assert wait_until(lambda: view.tree(parent.pid) == {parent.pid, child}, what="the job tree")
        assert view.visible(child) and view.holds_gpu(os.getpid()) is False
        assert process.pid_alive(parent.pid)
    finally:
        assert parent.stdin is not None
        parent.stdin.close()
        parent.wait(10)
    assert view.info(parent.pid) is None and view.tree(parent.pid) == set()
    assert not process.pid_alive(parent.pid) and view.holds_gpu(parent.pid) is False
    usage = process.own_usage()
    assert usage["rss_bytes"] > 0 and usage["cpu_s"] >= 0
