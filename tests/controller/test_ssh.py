"""controller.box.ssh against a real OpenSSH sshd on 127.0.0.1 (tests.sshbox)."""
from __future__ import annotations

import os
import random
import shlex
import signal
import socket
import stat
import threading
from pathlib import Path
from typing import Iterator, List

import psutil
import pytest

from controller.box.ssh import (
    SOCKET_PATH_MAX,
    AuthFailed,
    HostKeyChanged,
    HostKeyUnknown,
    LocalShell,
    Ssh,
    SshError,
    Unreachable,
    fallback_socket_dir,
    short_socket_path,
    ssh_config_file,
)
from rgtlib.backoff import Backoff
from tests.helpers import wait_until
from tests.sshbox import SshBox, free_port, keygen, sshbox  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e


class EchoServer:
    """A unix-socket echo server standing in for the sidecar on the box side."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.sock.settimeout(0.05)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="test-echo-server")
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    while True:
                        data = conn.recv(65536)
                        if not data:
                            break
                        conn.sendall(data)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.path.unlink(missing_ok=True)


def echo(path: Path, payload: bytes = b"ping") -> bytes:
    """Send payload through the socket at `path`, half-close, read until EOF."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.settimeout(5)
        c.connect(str(path))
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        got = b""
        while True:
            chunk = c.recv(65536)
            if not chunk:
                return got
            got += chunk


@pytest.fixture
def server(sshbox: SshBox) -> Iterator[EchoServer]:  # noqa: F811
    srv = EchoServer(sshbox.home / "srv.sock")
    yield srv
    srv.close()


@pytest.fixture
def ssh(sshbox: SshBox, tmp_path: Path) -> Ssh:  # noqa: F811
    return sshbox.ssh(tmp_path / "ctl")


# -- the master -------------------------------------------------------------------------


def test_one_master_per_alias_carries_every_command(sshbox: SshBox, ssh: Ssh) -> None:  # noqa: F811
    assert ssh.master_pid() is None
    pid = ssh.start_master()
    assert pid > 0 and ssh.master_pid() == pid
    assert ssh.start_master() == pid
    # A second Ssh for the same alias and config shares the socket, hence the master.
    again = sshbox.track(Ssh("box", control_dir=ssh.control_path.parent, config_file=sshbox.config_file))
    assert again.control_path == ssh.control_path and again.start_master() == pid
    # Commands ride the master's TCP connection: the box sees one client port for all.
    seen = {ssh.run("echo $SSH_CONNECTION").stdout for _ in range(3)}
    assert len(seen) == 1 and b"127.0.0.1" in seen.pop()
    assert len(sshbox.session_pids()) == 1
    assert stat.S_IMODE(os.stat(ssh.control_path.parent).st_mode) == 0o700


def test_the_box_home_is_its_own(ssh: Ssh, sshbox: SshBox) -> None:  # noqa: F811
    assert ssh.run("echo ~").stdout.decode().strip() == str(sshbox.home)


def test_stop_master_ends_it_and_is_quiet_when_none_runs(ssh: Ssh) -> None:
    ssh.stop_master()
    ssh.start_master()
    ssh.stop_master()
    assert ssh.master_pid() is None and not ssh.control_path.exists()
    ssh.stop_master()


def test_options_are_strict_and_name_the_control_path(ssh: Ssh, sshbox: SshBox) -> None:  # noqa: F811
    opts = ssh.options()
    assert opts[:2] == ["-F", str(sshbox.config_file)]
    for needed in ("BatchMode=yes", "StrictHostKeyChecking=yes", f"ControlPath={ssh.control_path}",
                   "ExitOnForwardFailure=yes", "StreamLocalBindUnlink=yes", "ServerAliveInterval=5",
                   "ServerAliveCountMax=3", "ConnectTimeout=10"):
        assert needed in opts
    assert str(ssh.control_path) in ssh.rsync_shell()
    other = Ssh("box", control_dir=ssh.control_path.parent, config_file=sshbox.root / "other_config")
    assert other.control_path != ssh.control_path


# -- commands ---------------------------------------------------------------------------


def test_stdin_round_trips_bytes_and_never_reaches_argv(sshbox: SshBox, tmp_path: Path) -> None:  # noqa: F811
    argv_log = tmp_path / "argv.log"
    wrapper = tmp_path / "ssh-wrapper"
    wrapper.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" >> {shlex.quote(str(argv_log))}\nexec ssh \"$@\"\n")
    wrapper.chmod(0o755)
    ssh = sshbox.ssh(tmp_path / "ctl", ssh_bin=str(wrapper))
    secret = b"hf_SECRET-token-5d1c0e"
    payload = bytes(range(256)) * 64 + secret + b"\n\x00\r\n"
    for through_master in (False, True):
        if through_master:
            ssh.start_master()
        assert ssh.run("cat", input=payload).stdout == payload
        assert ssh.run("cat > ~/secret && cat ~/secret", input=secret).stdout == secret
    logged = argv_log.read_bytes()
    assert b"cat > ~/secret" in logged  # the log does see the command line
    assert secret not in logged and b"SECRET" not in logged


def test_exit_code_and_stderr_surface(ssh: Ssh) -> None:
    with pytest.raises(SshError) as err:
        ssh.run("echo first >&2; echo boom >&2; exit 7")
    assert err.value.returncode == 7
    assert "boom" in str(err.value) and "7" in str(err.value) and str(err.value) == err.value.message
    done = ssh.run("echo out; echo boom >&2; exit 3", check=False)
    assert (done.returncode, done.stdout, done.stderr) == (3, b"out\n", b"boom\n")


def test_a_command_that_overruns_its_timeout_is_ended(ssh: Ssh) -> None:
    # (A short remote sleep: the box keeps running it after our ssh is gone.)
    with pytest.raises(SshError, match="timed out after 0.5s"):
        ssh.run("sleep 4", timeout_s=0.5)


def test_a_dead_link_is_never_an_exit_code(sshbox: SshBox, tmp_path: Path) -> None:  # noqa: F811
    cfg = sshbox.write_client_config(tmp_path / "closed_config", port=free_port())
    ssh = Ssh("box", control_dir=tmp_path / "ctl", config_file=cfg)
    with pytest.raises(Unreachable):
        ssh.run("true", check=False)


# -- forwards ---------------------------------------------------------------------------


def test_forward_reaches_a_unix_socket_on_the_box(ssh: Ssh, server: EchoServer, tmp_path: Path) -> None:
    ssh.start_master()
    local = tmp_path / "fwd" / "run.sock"
    ssh.forward(local, str(server.path))
    assert stat.S_ISSOCK(os.lstat(local).st_mode)
    assert echo(local, b"hello box") == b"hello box"
    ssh.forward(local, str(server.path))  # idempotent
    assert echo(local) == b"ping"
    ssh.cancel_forward(local, str(server.path))
    assert not local.exists()
    ssh.cancel_forward(local, str(server.path))  # nothing to cancel: no error


def test_forward_replaces_a_stale_socket_but_no_other_file(ssh: Ssh, server: EchoServer,
                                                           tmp_path: Path) -> None:
    ssh.start_master()
    local = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(local))  # closed without unlink: a stale socket file, nobody listening
    ssh.forward(local, str(server.path))
    assert echo(local) == b"ping"
    precious = tmp_path / "precious"
    precious.write_text("data")
    with pytest.raises(SshError, match="not a socket"):
        ssh.forward(precious, str(server.path))
    assert precious.read_text() == "data"


def test_forward_without_a_master_says_so(ssh: Ssh, server: EchoServer, tmp_path: Path) -> None:
    with pytest.raises(SshError, match="no ssh master"):
        ssh.forward(tmp_path / "x.sock", str(server.path))


def test_deep_directories_get_short_socket_paths(sshbox: SshBox, server: EchoServer,  # noqa: F811
                                                 tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    ssh = sshbox.ssh(deep)
    assert len(str(ssh.control_path)) <= SOCKET_PATH_MAX
    assert ssh.control_path.parent == fallback_socket_dir()
    local = short_socket_path(deep, "run-1.pub.sock")
    assert len(str(local)) <= SOCKET_PATH_MAX and local.suffix == ".sock"
    assert local == short_socket_path(deep, "run-1.pub.sock") != short_socket_path(deep, "run-2.pub.sock")
    assert short_socket_path(tmp_path, "a.sock") == tmp_path / "a.sock"
    ssh.start_master()
    assert stat.S_IMODE(os.stat(fallback_socket_dir()).st_mode) == 0o700
    ssh.forward(local, str(server.path))
    try:
        assert echo(local) == b"ping"
    finally:
        ssh.cancel_forward(local, str(server.path))
        ssh.stop_master()
        Path(f"{ssh.control_path}.lock").unlink(missing_ok=True)


def test_a_killed_master_is_noticed_and_replaced(ssh: Ssh, server: EchoServer, tmp_path: Path) -> None:
    pid = ssh.start_master()
    local = tmp_path / "run.sock"
    ssh.forward(local, str(server.path))
    os.kill(pid, signal.SIGKILL)  # the master is ours: we started it
    wait_until(lambda: ssh.master_pid() is None, 10, "the killed master to be noticed")
    assert not ssh.control_path.exists()  # the stale control socket is gone
    new = ssh.start_master()
    assert new != pid
    ssh.forward(local, str(server.path))
    assert echo(local) == b"ping"


def test_a_frozen_box_ends_the_master(sshbox: SshBox, tmp_path: Path) -> None:  # noqa: F811
    ssh = sshbox.ssh(tmp_path / "ctl", alive_interval_s=1, alive_count=2)
    ssh.start_master()
    sshbox.freeze()
    try:
        wait_until(lambda: ssh.master_pid() is None, 10, "ServerAlive to end the master")
    finally:
        sshbox.thaw()


def test_a_stopped_box_ends_the_master(sshbox: SshBox, ssh: Ssh) -> None:  # noqa: F811
    ssh.start_master()
    sshbox.stop()
    wait_until(lambda: ssh.master_pid() is None, 10, "the master to notice the box is gone")
    sshbox.start()
    assert ssh.start_master() > 0


# -- refusals ---------------------------------------------------------------------------


def test_a_changed_host_key_is_refused(sshbox: SshBox, ssh: Ssh) -> None:  # noqa: F811
    sshbox.rotate_host_key()
    with pytest.raises(HostKeyChanged) as err:
        ssh.start_master()
    assert "box" in err.value.message and "refused" in err.value.message
    assert err.value.hint is not None and "ssh-keygen" in err.value.hint and "-R" in err.value.hint
    assert "provider" in err.value.hint
    assert ssh.master_pid() is None
    with pytest.raises(HostKeyChanged):
        ssh.run("true", check=False)


def test_an_unknown_host_is_refused(sshbox: SshBox, tmp_path: Path) -> None:  # noqa: F811
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    cfg = sshbox.write_client_config(tmp_path / "config", known_hosts=empty)
    ssh = sshbox.track(Ssh("box", control_dir=tmp_path / "ctl", config_file=cfg))
    with pytest.raises(HostKeyUnknown) as err:
        ssh.start_master()
    assert err.value.hint is not None and "fingerprint" in err.value.hint
    assert empty.read_text() == ""  # nothing was accepted for us


def test_a_wrong_key_fails_authentication(sshbox: SshBox, tmp_path: Path) -> None:  # noqa: F811
    keygen(tmp_path / "stranger")
    cfg = sshbox.write_client_config(tmp_path / "config", identity=tmp_path / "stranger")
    ssh = sshbox.track(Ssh("box", control_dir=tmp_path / "ctl", config_file=cfg))
    with pytest.raises(AuthFailed, match="Permission denied"):
        ssh.start_master()


def test_a_closed_port_is_unreachable(sshbox: SshBox, tmp_path: Path) -> None:  # noqa: F811
    cfg = sshbox.write_client_config(tmp_path / "config", port=free_port())
    ssh = sshbox.track(Ssh("box", control_dir=tmp_path / "ctl", config_file=cfg))
    with pytest.raises(Unreachable) as err:
        ssh.start_master()
    assert "Connection refused" in err.value.message and err.value.hint


def test_an_alias_that_looks_like_an_option_is_rejected(tmp_path: Path) -> None:
    for bad in ("-oProxyCommand=touch /tmp/x", "", "a b"):
        with pytest.raises(ValueError):
            Ssh(bad, control_dir=tmp_path)


# -- copies -----------------------------------------------------------------------------


def _files(tmp_path: Path) -> List[Path]:
    src = tmp_path / "src"
    src.mkdir()
    big = src / "weights part.bin"
    big.write_bytes(random.Random(1).randbytes(300_000))
    small = src / "run.json"
    small.write_text('{"id": "r1"}\n')
    return [big, small]


def _assert_landed(files: List[Path], where: Path) -> None:
    for f in files:
        copied = where / f.name
        assert copied.stat().st_size == f.stat().st_size
        assert copied.read_bytes() == f.read_bytes()


def test_put_copies_into_a_new_directory_under_the_box_home(ssh: Ssh, sshbox: SshBox,  # noqa: F811
                                                            tmp_path: Path) -> None:
    files = _files(tmp_path)
    ssh.start_master()
    ssh.put(files, "~/x/y")
    _assert_landed(files, sshbox.home / "x" / "y")


def test_put_falls_back_to_scp_without_local_rsync(sshbox: SshBox, tmp_path: Path) -> None:  # noqa: F811
    ssh = sshbox.ssh(tmp_path / "ctl", rsync_bin=str(tmp_path / "no-rsync-here"))
    files = _files(tmp_path)
    ssh.put(files, "~/by scp")
    _assert_landed(files, sshbox.home / "by scp")


def test_put_falls_back_to_scp_when_the_box_lacks_rsync(sshbox: SshBox, tmp_path: Path) -> None:  # noqa: F811
    wrapper = tmp_path / "rsync-wrapper"
    wrapper.write_text('#!/bin/sh\nexec rsync --rsync-path=/nonexistent/rsync "$@"\n')
    wrapper.chmod(0o755)
    ssh = sshbox.ssh(tmp_path / "ctl", rsync_bin=str(wrapper))
    files = _files(tmp_path)
    ssh.put(files, str(sshbox.home / "abs"))
    _assert_landed(files, sshbox.home / "abs")


# -- pieces without a box ---------------------------------------------------------------


class _Edge(random.Random):
    """An rng that always picks one end of the interval: shows the bounds exactly."""

    def __init__(self, top: bool) -> None:
        super().__init__(0)
        self.top = top

    def uniform(self, a: float, b: float) -> float:
        return b if self.top else a


def test_backoff_grows_is_capped_and_never_tight() -> None:
    high = Backoff(base_s=0.5, cap_s=4.0, rng=_Edge(top=True))
    assert [high.next() for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]
    low = Backoff(base_s=0.5, cap_s=4.0, rng=_Edge(top=False))
    assert {low.next() for _ in range(7)} == {0.25}
    assert high.attempts == 7
    high.reset()
    assert high.attempts == 0 and high.next() == 0.5
    many = Backoff(base_s=0.5, cap_s=30.0, rng=random.Random(3))
    waits = [many.next() for _ in range(3000)]  # no overflow however long the outage
    assert all(0.25 <= w <= 30.0 for w in waits)


def test_backoff_is_jittered_and_seeded() -> None:
    a = Backoff(base_s=1.0, cap_s=8.0, rng=random.Random(42))
    b = Backoff(base_s=1.0, cap_s=8.0, rng=random.Random(42))
    first = [a.next() for _ in range(20)]
    assert first == [b.next() for _ in range(20)]
    assert len({round(w, 9) for w in first[4:]}) > 10  # capped region still spread out
    assert max(first[4:]) > 4.0 and min(first[4:]) < 4.0


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_local_shell_runs_and_puts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    local = LocalShell()
    payload = bytes(range(256)) * 8
    assert local.run("cat", input=payload).stdout == payload
    assert local.run("echo $HOME").stdout.decode().strip() == str(tmp_path / "home")
    with pytest.raises(SshError) as err:
        local.run("echo nope >&2; exit 4")
    assert err.value.returncode == 4 and "nope" in str(err.value)
    assert local.run("exit 4", check=False).returncode == 4
    pid_file = tmp_path / "bg.pid"
    with pytest.raises(SshError, match="timed out"):
        local.run(f"sleep 30 & echo $! > {pid_file}; wait", timeout_s=0.5)
    background = int(pid_file.read_text())  # the whole process group was ended, not just sh
    wait_until(lambda: _gone(background), 30, "the background sleep to end")
    files = _files(tmp_path)
    local.put(files, "~/x/y")
    _assert_landed(files, tmp_path / "home" / "x" / "y")
    assert local.start_master() == 0 and local.master_pid() == 0
    with pytest.raises(SshError, match="no forwards"):
        local.forward(tmp_path / "a.sock", "/b.sock")


def test_ssh_config_file_comes_from_the_environment(tmp_path: Path) -> None:
    assert ssh_config_file({"RGT_SSH_CONFIG": str(tmp_path / "cfg")}) == tmp_path / "cfg"
    assert ssh_config_file({}) is None
