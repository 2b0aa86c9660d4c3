"""rgtlib.lockfile against real lock files and a real second process holding them (or probing them)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

from rgtlib import lockfile

# Takes argv[1]'s lock (plain fcntl, not the code under test), writes argv[2] into it when given,
# says "locked" and holds it until its stdin closes.
HOLDER = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
if len(sys.argv) > 2:
    os.ftruncate(fd, 0)
    os.write(fd, sys.argv[2].encode())
print("locked", flush=True)
sys.stdin.read()
"""

# Exits 0 when it could take argv[1]'s lock, 3 when another process holds it.
PROBE = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    sys.exit(3)
"""


@contextlib.contextmanager
def held_elsewhere(path: Path, text: Optional[str] = None) -> Iterator[subprocess.Popen[str]]:
    """A second process holding `path`'s lock for the block (it has taken it when the block starts)."""
    argv = [sys.executable, "-c", HOLDER, str(path), *([] if text is None else [text])]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
        yield proc
    finally:
        release(proc)


def release(proc: subprocess.Popen[str]) -> None:
    """Have the holder let go, and wait until it has (its lock goes with it)."""
    assert proc.stdin is not None
    if not proc.stdin.closed:
        proc.stdin.close()
    assert proc.wait(10) == 0


def free_elsewhere(path: Path) -> bool:
    """Whether another process could take `path`'s lock now."""
    rc = subprocess.run([sys.executable, "-c", PROBE, str(path)], timeout=10, check=False).returncode
    assert rc in (0, 3)
    return rc == 0


def closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


# ---- try_lock / take ------------------------------------------------------------------------------


def test_try_lock_takes_a_free_lock_and_creates_the_file_0600(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    old = os.umask(0o022)
    try:
        fd = lockfile.try_lock(path)
    finally:
        os.umask(old)
    assert fd is not None
    try:
        assert path.stat().st_mode & 0o777 == 0o600
        assert not free_elsewhere(path)
    finally:
        os.close(fd)
    assert free_elsewhere(path)


def test_try_lock_is_none_while_another_process_holds_it(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    with held_elsewhere(path) as proc:
        assert lockfile.try_lock(path) is None
        release(proc)
        fd = lockfile.try_lock(path)
    assert fd is not None
    os.close(fd)


def test_try_lock_without_create_never_makes_the_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.lock"
    with pytest.raises(FileNotFoundError):
        lockfile.try_lock(path, create=False)
    assert not path.exists()
    path.write_text("")
    fd = lockfile.try_lock(path, create=False)
    assert fd is not None
    os.close(fd)


def test_the_lock_fd_is_not_inherited_by_a_child(tmp_path: Path) -> None:
    fd = lockfile.try_lock(tmp_path / "x.lock")
    assert fd is not None
    try:
        assert not os.get_inheritable(fd)
        check = f"import os, sys\ntry:\n    os.fstat({fd})\nexcept OSError:\n    sys.exit(0)\nsys.exit(1)"
        assert subprocess.run([sys.executable, "-c", check], close_fds=False, timeout=10).returncode == 0
    finally:
        os.close(fd)


def test_take_says_what_the_holder_wrote_into_the_lock_file(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    with held_elsewhere(path, " 4242\n"):
        with pytest.raises(lockfile.Held) as e:
            lockfile.take(path)
    assert e.value.holder == "4242" and "4242" in str(e.value)
    with held_elsewhere(tmp_path / "y.lock"):
        with pytest.raises(lockfile.Held) as e:
            lockfile.take(tmp_path / "y.lock")
    assert e.value.holder == ""
    fd = lockfile.take(path)
    assert not free_elsewhere(path)
    os.close(fd)


def test_take_without_create_raises_for_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        lockfile.take(tmp_path / "absent.lock", create=False)


# ---- wait_lock ----------------------------------------------------------------------------------


def test_wait_lock_gives_up_at_its_deadline(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    with held_elsewhere(path):
        started = time.monotonic()
        assert lockfile.wait_lock(path, 0.3, interval_s=0.02) is None
        assert time.monotonic() - started >= 0.3


def test_wait_lock_takes_the_lock_once_its_holder_lets_go(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    got: List[Optional[int]] = []
    with held_elsewhere(path) as proc:
        waiter = threading.Thread(target=lambda: got.append(lockfile.wait_lock(path, 60, interval_s=0.01)))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()  # still waiting while it is held
        release(proc)
        waiter.join(30)
    assert not waiter.is_alive() and got[0] is not None
    try:
        assert not free_elsewhere(path)
    finally:
        os.close(got[0])


def test_wait_lock_takes_a_free_lock_even_with_no_time_left(tmp_path: Path) -> None:
    fd = lockfile.wait_lock(tmp_path / "x.lock", 0)
    assert fd is not None
    os.close(fd)


# ---- hold ---------------------------------------------------------------------------------------


def test_hold_blocks_until_the_other_holder_lets_go(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    inside = threading.Event()
    fds: List[int] = []

    def enter() -> None:
        with lockfile.hold(path) as fd:
            fds.append(fd)
            inside.set()

    with held_elsewhere(path) as proc:
        waiter = threading.Thread(target=enter)
        waiter.start()
        assert not inside.wait(0.3)  # blocked while it is held
        release(proc)
        assert inside.wait(30)
        waiter.join(30)
    assert closed(fds[0]) and free_elsewhere(path)


def test_hold_is_exclusive_while_inside_and_appends_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_bytes(b"one\n")
    with lockfile.hold(path, append=True) as fd:
        assert not free_elsewhere(path)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, b"two\n")  # O_APPEND: at the end all the same
    assert path.read_bytes() == b"one\ntwo\n"
    assert closed(fd) and free_elsewhere(path)
    with pytest.raises(RuntimeError):
        with lockfile.hold(path) as fd:
            raise RuntimeError("boom")
    assert closed(fd) and free_elsewhere(path)


# ---- lock_with_pid / holder_pid -----------------------------------------------------------------


def test_lock_with_pid_writes_the_pid_beside_the_lock(tmp_path: Path) -> None:
    lock, pid_file = tmp_path / "w.lock", tmp_path / "w.pid"
    pid_file.write_text("999999999\n")
    fd = lockfile.lock_with_pid(lock, pid_file)
    try:
        assert pid_file.read_text() == f"{os.getpid()}\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["w.lock", "w.pid"]  # no temp file left
        assert not free_elsewhere(lock)
    finally:
        os.close(fd)


def test_lock_with_pid_without_a_pid_file_writes_it_into_the_lock(tmp_path: Path) -> None:
    lock = tmp_path / "sidecar.lock"
    lock.write_text("999999999999\n")
    fd = lockfile.lock_with_pid(lock)
    try:
        assert lock.read_text() == f"{os.getpid()}\n"
        assert not free_elsewhere(lock)
    finally:
        os.close(fd)


def test_lock_with_pid_held_elsewhere_leaves_the_pid_file_alone(tmp_path: Path) -> None:
    lock, pid_file = tmp_path / "w.lock", tmp_path / "w.pid"
    with held_elsewhere(lock, "77") as proc:
        pid_file.write_text(f"{proc.pid}\n")
        with pytest.raises(lockfile.Held) as e:
            lockfile.lock_with_pid(lock, pid_file)
        assert e.value.holder == "77"
        assert pid_file.read_text() == f"{proc.pid}\n"


def test_lock_with_pid_lets_go_when_the_pid_cannot_be_written(tmp_path: Path) -> None:
    lock = tmp_path / "w.lock"
    with pytest.raises(FileNotFoundError):
        lockfile.lock_with_pid(lock, tmp_path / "missing" / "w.pid")
    assert free_elsewhere(lock)


def test_holder_pid_names_the_process_holding_the_lock(tmp_path: Path) -> None:
    lock, pid_file = tmp_path / "q.lock", tmp_path / "q.pid"
    with held_elsewhere(lock) as proc:
        assert lockfile.holder_pid(lock, pid_file) is None  # held, but the pid not written yet
        pid_file.write_text("")
        assert lockfile.holder_pid(lock, pid_file) is None
        pid_file.write_text("not a pid\n")
        assert lockfile.holder_pid(lock, pid_file) is None
        pid_file.write_text(f"{proc.pid}\n")
        assert lockfile.holder_pid(lock, pid_file) == proc.pid
    assert lockfile.holder_pid(lock, pid_file) is None  # its pid file stays, but nobody holds the lock
    assert free_elsewhere(lock)  # asking did not keep it


def test_holder_pid_sees_what_lock_with_pid_took(tmp_path: Path) -> None:
    lock, pid_file = tmp_path / "q.lock", tmp_path / "q.pid"
    code = ("import sys\nfrom rgtlib import lockfile\n"
            "lockfile.lock_with_pid(sys.argv[1], sys.argv[2])\nprint('locked', flush=True)\nsys.stdin.read()")
    root = str(Path(lockfile.__file__).resolve().parent.parent)
    proc = subprocess.Popen([sys.executable, "-c", code, str(lock), str(pid_file)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": root})
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
        assert lockfile.holder_pid(lock, pid_file) == proc.pid
    finally:
        release(proc)
    assert lockfile.holder_pid(lock, pid_file) is None


def test_holder_pid_is_none_when_the_lock_cannot_be_opened(tmp_path: Path) -> None:
    assert lockfile.holder_pid(tmp_path / "missing" / "q.lock", tmp_path / "q.pid") is None
