"""A real, throw-away OpenSSH sshd on 127.0.0.1 that plays "the GPU box".

Use it as `from tests.sshbox import SshBox, sshbox` and take the `sshbox`
fixture. The box's HOME is a temp directory (sshd's `SetEnv HOME=`), so `~` on
the box never means /root. The client side is an ssh_config with one alias,
`box`, to pass as RGT_SSH_CONFIG or `-F`.

An ssh -f master daemonizes, so it is no child of the test and the leak guard
cannot see it: hand every Ssh to `box.track(ssh)` and the fixture stops its
master at teardown (and stopping the box ends any master still connected).
"""
from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import psutil
import pytest

from controller.box.ssh import Ssh, SshError
from tests.helpers import wait_until

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
INSTALL_HINT = "sshd is not installed: run `make system-deps` (openssh-server, openssh-client, rsync)"
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def keygen(path: Path) -> None:
    for p in (path, path.with_name(path.name + ".pub")):
        p.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
                   check=True, timeout=30, stdin=subprocess.DEVNULL)


class SshBox:
    """sshd -D as our child, with its own host key, client key, known_hosts and ssh_config."""

    alias = "box"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "home"
        self.host_key = root / "host_ed25519"
        self.client_key = root / "client_ed25519"
        self.authorized_keys = root / "authorized_keys"
        self.known_hosts = root / "known_hosts"
        self.sshd_config = root / "sshd_config"
        self.config_file = root / "ssh_config"
        self.log = root / "sshd.log"
        self.user = getpass.getuser()
        self.port = 0
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self._tracked: List[Ssh] = []
        self._frozen: List[psutil.Process] = []
        # More variables every session on the box gets (sshd SetEnv); takes effect at (re)start.
        self.env: Dict[str, str] = {}

    # -- files ---------------------------------------------------------------------

    def _prepare(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        if not self.host_key.exists():
            keygen(self.host_key)
        if not self.client_key.exists():
            keygen(self.client_key)
        shutil.copyfile(self.client_key.with_name(self.client_key.name + ".pub"), self.authorized_keys)
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)

    def _write_sshd_config(self) -> None:
        self.sshd_config.write_text("\n".join([
            f"Port {self.port}",
            "ListenAddress 127.0.0.1",
            f"HostKey {self.host_key}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "StrictModes no",
            "PidFile none",
            "AllowTcpForwarding yes",
            "AllowStreamLocalForwarding yes",
            "StreamLocalBindUnlink yes",
            "MaxStartups 50",
            "MaxSessions 50",
            "PermitUserRC no",
            "X11Forwarding no",
            "Subsystem sftp internal-sftp",
            "SetEnv " + " ".join(f"{k}={v}" for k, v in self.session_env().items()),
            "",
        ]))

    def session_env(self) -> Dict[str, str]:
        """What sshd sets in every session: HOME, the compute-thread limits of the tests' own
        environment (tests/conftest.py; sshd passes a session none of ours), and self.env."""
        threads = {k: os.environ[k] for k in THREAD_VARS if k in os.environ}
        return {"HOME": str(self.home), **threads, **self.env}

    def host_public_key(self) -> str:
        """'<type> <base64>' of the current host key."""
        return " ".join(self.host_key.with_name(self.host_key.name + ".pub").read_text().split()[:2])

    def write_client_config(self, path: Path, *, known_hosts: Optional[Path] = None,
                            identity: Optional[Path] = None, port: Optional[int] = None) -> Path:
        """An ssh_config for `box` with some parts swapped (another key, an empty
        known_hosts, a closed port): the negative tests' clients."""
        path.write_text("\n".join([
            f"Host {self.alias}",
            "  HostName 127.0.0.1",
            f"  Port {port if port is not None else self.port}",
            f"  User {self.user}",
            f"  IdentityFile {identity or self.client_key}",
            "  IdentitiesOnly yes",
            f"  UserKnownHostsFile {known_hosts or self.known_hosts}",
            "  GlobalKnownHostsFile /dev/null",
            "  StrictHostKeyChecking yes",
            "  BatchMode yes",
            "  LogLevel ERROR",
            "",
        ]))
        return path

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> SshBox:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self._prepare()
        keep_port = self.port != 0
        for _ in range(1 if keep_port else 3):
            if not keep_port:
                self.port = free_port()
            if self._launch(keep_known_hosts=keep_port):
                return self
        raise AssertionError(f"sshd did not start on 127.0.0.1:{self.port}: {self.log_tail()}")

    def _launch(self, keep_known_hosts: bool) -> bool:
        """Start sshd; True once the port accepts connections, False if sshd died (port taken).
        known_hosts is written for a new port only: a restart keeps what the client trusts."""
        self._write_sshd_config()
        if not keep_known_hosts:
            self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {self.host_public_key()}\n")
        self.write_client_config(self.config_file)
        checked = subprocess.run([SSHD, "-t", "-f", str(self.sshd_config)], capture_output=True, timeout=30)
        assert checked.returncode == 0, f"sshd -t failed: {checked.stderr.decode(errors='replace')}"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.sshd_config)],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        proc = self.proc
        wait_until(lambda: proc.poll() is not None or self._listening(proc.pid), 10, "sshd to listen")
        if proc.poll() is not None:
            proc.wait()
            self.proc = None
            return False
        return True

    def _listening(self, pid: int) -> bool:
        """Whether sshd `pid` itself listens on the port: a connect alone could reach another test's
        sshd that took the port first (this one then dies of it, and is started on another)."""
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port for c in conns)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no sshd log)"

    def stop(self) -> None:
        """End every session, then sshd itself, by pid; wait for all of them."""
        if self.proc is None:
            return
        self.thaw()
        self.kill_sessions()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def restart(self) -> SshBox:
        """Stop and start again on the same port with the same keys."""
        self.stop()
        return self.start()

    def rotate_host_key(self) -> None:
        """Give the box a new host key (as a re-created box gets); known_hosts keeps the old one."""
        self.stop()
        keygen(self.host_key)
        self.start()

    # -- sessions --------------------------------------------------------------------

    def _descendants(self) -> List[psutil.Process]:
        if self.proc is None or self.proc.poll() is not None:
            return []
        try:
            return list(psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            return []

    def session_pids(self) -> List[int]:
        """The per-connection sshd children of the sshd we started."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        try:
            return [p.pid for p in psutil.Process(self.proc.pid).children()]
        except psutil.NoSuchProcess:
            return []

    def freeze(self) -> None:
        """SIGSTOP every session process: connections stay open and go silent."""
        for p in self._descendants():
            try:
                p.send_signal(signal.SIGSTOP)
                self._frozen.append(p)
            except psutil.NoSuchProcess:
                pass

    def thaw(self) -> None:
        for p in self._frozen:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        self._frozen = []

    def kill_sessions(self) -> None:
        """SIGKILL every session process (sshd itself stays): each client sees its connection drop."""
        procs = self._descendants()
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive, f"sshd sessions survived SIGKILL: {alive}"

    # -- clients ---------------------------------------------------------------------

    def track(self, ssh: Ssh) -> Ssh:
        """Stop this Ssh's master at teardown (it is no child of ours, so nothing else would)."""
        self._tracked.append(ssh)
        return ssh

    def ssh(self, control_dir: Path, **kw: Any) -> Ssh:
        """A tracked Ssh for `box` with this box's client config."""
        return self.track(Ssh(self.alias, control_dir=control_dir, config_file=self.config_file, **kw))

    def close(self) -> None:
        """Teardown: stop tracked masters, stop sshd, and check no master outlived it."""
        errors: List[str] = []
        self.thaw()
        for ssh in self._tracked:
            try:
                ssh.stop_master()
            except SshError as e:
                errors.append(str(e))
        self.stop()
        for ssh in self._tracked:
            wait_until(_master_gone(ssh), 10, f"the master of {ssh} to end")
        assert not errors, errors


def _master_gone(ssh: Ssh) -> Callable[[], bool]:
    return lambda: ssh.master_pid() is None


def sshd_available() -> bool:
    return os.access(SSHD, os.X_OK) and all(shutil.which(b) for b in ("ssh", "ssh-keygen"))


@pytest.fixture
def sshbox() -> Iterator[SshBox]:
    """A running SshBox; everything it started is ended at teardown."""
    if not sshd_available():
        pytest.skip(INSTALL_HINT)
    # A short root: the box's unix sockets live under it and sun_path holds 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="rgtbox-", dir="/tmp"))
    box = SshBox(root)
    try:
        box.start()
        yield box
    finally:
        try:
            box.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
