"""The OpenSSH seam: the only module that runs the ssh, rsync and scp binaries.

We drive the OpenSSH client rather than a Python SSH library so that the
user's ~/.ssh/config (aliases, ProxyJump, keys, agent) works unchanged, and
so that one ControlMaster per host alias carries everything that goes to
that host: commands, rsync, and the unix-socket forwards to each run's
sidecar (`ssh -O forward -L local.sock:remote.sock`). No TCP port is opened
on either machine; a socket file in a 0700 directory is the only way in.

Host keys are checked strictly: an unknown or changed key is refused with a
hint, never accepted on the user's behalf. Secrets reach the box on stdin,
never on a command line. Every subprocess has a deadline.
"""
from __future__ import annotations

import contextlib
import enum
import fnmatch
import hashlib
import logging
import os
import posixpath
import re
import shlex
import shutil
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, List, Mapping, Optional, Protocol, Sequence

from rgtlib import lockfile

from controller import paths, procrun

log = logging.getLogger(__name__)

# sun_path holds 107 bytes plus NUL, and ssh first binds the ControlPath under a
# name 17 bytes longer (".%016x") before renaming it into place.
SOCKET_PATH_MAX = 90
# The master ends itself this long after its last session or forwarded connection closed
# (measured: an idle forward listener does not keep it, an open forwarded connection does).
# Nobody has to stop a shared master, so no user of it can cut off another's session.
MASTER_IDLE_S = 60
# Characters that need no quoting in `-o ControlPath=`, in a `-L a:b` spec and
# in rsync's -e string; anything else goes to the short fallback directory.
_SAFE_PATH = re.compile(r"^[A-Za-z0-9._/+@,-]+$")
_MUX_TIMEOUT_S = 10.0
_STDERR_TAIL_LINES = 6

# Options for ssh invocations that are not the master: never become a master, and
# ignore forwards, RemoteCommand or a tty that the user's config adds to the alias.
_CLIENT_OPTIONS = ("ControlMaster=no", "ClearAllForwardings=yes", "RemoteCommand=none",
                   "RequestTTY=no", "PermitLocalCommand=no")


class SshError(Exception):
    """ssh, rsync or the remote command failed; `hint` says what a person can do."""

    def __init__(self, message: str, hint: Optional[str] = None, returncode: Optional[int] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.returncode = returncode

    def __str__(self) -> str:
        return self.message


class HostKeyChanged(SshError):
    """The box presented a key other than the recorded one: refused, never re-accepted."""


class HostKeyUnknown(SshError):
    """No known_hosts entry for the box under StrictHostKeyChecking=yes."""


class AuthFailed(SshError):
    """The box refused our key (or user)."""


class Unreachable(SshError):
    """No connection: refused, timed out, name not resolved, or dropped."""


def ssh_config_file(env: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """$RGT_SSH_CONFIG if set (the tests point it at their sshd), else None.

    With None no -F is passed and ssh reads the user's ~/.ssh/config itself.
    """
    environ = os.environ if env is None else env
    value = environ.get("RGT_SSH_CONFIG", "")
    return Path(value).expanduser() if value else None


def fallback_socket_dir() -> Path:
    """/tmp/rgt-<uid>: short enough for any socket name we make."""
    return Path("/tmp") / f"rgt-{os.getuid()}"


def short_socket_path(directory: Path, name: str) -> Path:
    """directory/name, or a hashed name in fallback_socket_dir() when that path is
    too long for a unix socket (SOCKET_PATH_MAX) or holds characters ssh would
    need quoted. The same inputs always give the same path. Touches no disk."""
    path = os.path.join(os.path.abspath(directory), name)
    if len(os.fsencode(path)) <= SOCKET_PATH_MAX and _SAFE_PATH.match(path):
        return Path(path)
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:20]
    suffix = Path(name).suffix
    if not _SAFE_PATH.match(suffix) or len(suffix) > 16:
        suffix = ""
    return fallback_socket_dir() / f"{digest}{suffix}"


def _private_dir(directory: Path) -> None:
    """Create `directory` 0700 if missing; an existing one must be ours (the shared fallback in /tmp
    may have been made by another user first) and is tightened to 0700: sockets live only there."""
    try:
        paths.private_dir(directory, follow=directory != fallback_socket_dir())
    except paths.UnsafeDir as e:
        raise SshError(f"{e}; refusing to put sockets there", hint=e.hint) from e


def _unlink_socket(path: Path) -> None:
    """Remove a socket file left behind; refuse to delete anything that is not a socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SshError(f"{path} exists and is not a socket; refusing to replace it")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _execute(argv: Sequence[str], *, input: Optional[bytes] = None, timeout_s: float,
             capture_stdout: bool = True) -> subprocess.CompletedProcess[bytes]:
    """procrun.execute (own process group, a deadline, dies with us, bounded output); a box that
    prints without end is an SshError like any other failed command."""
    try:
        return procrun.execute(argv, input=input, timeout_s=timeout_s, capture_stdout=capture_stdout)
    except procrun.OutputTooLarge as e:
        raise SshError(str(e), hint="the box printed far more than any answer: look at it by hand") from None


def _tail(data: bytes, lines: int = _STDERR_TAIL_LINES) -> str:
    text = data.decode("utf-8", "replace")
    kept = [line.rstrip() for line in text.splitlines()
            if line.strip() and not line.startswith("Control socket connect(")]
    return " | ".join(kept[-lines:])[-2000:]


class _FromEnv(enum.Enum):
    """classify()'s default config: the one rgt's own ssh calls use, $RGT_SSH_CONFIG or none."""

    CONFIG = 0


FROM_ENV = _FromEnv.CONFIG


def by_hand(alias: str, config_file: Optional[Path]) -> str:
    """The ssh command a person runs to reach `alias` the way rgt does: with `-F FILE` when rgt
    reads another config ($RGT_SSH_CONFIG), since plain `ssh alias` reads ~/.ssh/config, which may not
    know the alias or may send it elsewhere."""
    if config_file is None:
        return f"ssh {shlex.quote(alias)}"
    return f"ssh -F {shlex.quote(str(config_file))} {shlex.quote(alias)}"


def classify(alias: str, stderr: bytes, returncode: Optional[int] = None, *,
             config_file: Path | None | _FromEnv = FROM_ENV) -> Optional[SshError]:
    """The SshError subclass that ssh's stderr describes, or None when it names no
    connection failure (then the remote command itself failed). `config_file` is the -F file the
    failed call used (default: $RGT_SSH_CONFIG); the hints name it, so a command they give works."""
    config = ssh_config_file() if isinstance(config_file, _FromEnv) else config_file
    ssh_cmd = by_hand(alias, config)
    where = f"`{alias}` in {config}" if config is not None else f"`{alias}` in ~/.ssh/config"
    text = "\n".join(line for line in stderr.decode("utf-8", "replace").splitlines()
                     if not line.startswith("Control socket connect("))
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in text or re.search(r"Host key for \S+ has changed", text):
        fix = re.search(r"ssh-keygen -f .* -R .*", text)
        return HostKeyChanged(
            f"{alias}: the host key has changed since it was recorded; connection refused "
            "(a changed key is never accepted automatically)",
            hint="a re-created box gets a new key, but so does an attack: verify the new key's fingerprint "
                 "with the provider (console or API), then remove the old entry yourself with "
                 f"`{fix.group(0) if fix else f'ssh-keygen -R {shlex.quote(alias)}'}` and connect once "
                 f"with `{ssh_cmd}`",
            returncode=returncode)
    if re.search(r"No \S+ host key is known for", text):
        return HostKeyUnknown(
            f"{alias}: no known_hosts entry for this host; refused under strict host key checking",
            hint=f"connect once with `{ssh_cmd}`, check the fingerprint against the one the "
                 "provider shows, and accept it",
            returncode=returncode)
    if "Host key verification failed" in text:
        return SshError(f"{alias}: host key verification failed",
                        hint="check the known_hosts entry for this host; rgt never accepts keys itself",
                        returncode=returncode)
    line = _first_line(text, ("Permission denied", "Too many authentication failures"))
    if line:
        return AuthFailed(f"{alias}: authentication failed: {line}",
                          hint=f"check the User and IdentityFile of {where} and that "
                               "the public key is in the box's authorized_keys",
                          returncode=returncode)
    line = _first_line(text, ("Connection refused", "timed out", "Could not resolve", "No route to host",
                              "Network is unreachable", "Connection reset", "Connection closed",
                              "closed by remote host", "not responding", "kex_exchange_identification",
                              "Broken pipe"))
    if line:
        return Unreachable(f"{alias}: unreachable: {line}",
                           hint="the box may be stopped, or its address or port changed (many providers "
                                f"assign new ones on restart): check the entry {where}",
                           returncode=returncode)
    return None


def _first_line(text: str, needles: Sequence[str]) -> str:
    for line in text.splitlines():
        if any(n in line for n in needles):
            return line.strip()[:300]
    return ""


def _remote_path(path: str) -> str:
    """`path` as text for the remote shell: quoted, except that a leading ~/ expands."""
    if path == "~":
        return "~"
    if path.startswith("~/"):
        rest = path[2:]
        return "~/" + shlex.quote(rest) if rest else "~/"
    return shlex.quote(path)


@contextlib.contextmanager
def _locked(path: Path, timeout_s: float) -> Iterator[None]:
    """An exclusive flock on `path`, waited for with a deadline, so that two rgt
    processes never start two masters for one alias at once."""
    fd = lockfile.wait_lock(path, timeout_s)
    if fd is None:
        raise SshError(f"another rgt is starting the ssh master ({path} stays locked)")
    try:
        yield
    finally:
        os.close(fd)


class Shell(Protocol):
    """What Ssh and LocalShell have in common: run a command there, put files there."""

    alias: str

    def run(self, command: str, *, input: Optional[bytes] = None, timeout_s: float = 60,
            check: bool = True) -> subprocess.CompletedProcess[bytes]: ...

    def put(self, files: Sequence[Path], remote_dir: str, timeout_s: float = 600) -> None: ...

    def push(self, source: Path, remote_path: str, *, excludes: Sequence[str] = (),
             timeout_s: float = 3600) -> str: ...


class Ssh:
    """One host alias: its ControlMaster, forwards over it, commands and copies through it."""

    def __init__(self, alias: str, *, control_dir: Path, config_file: Optional[Path] = None,
                 alive_interval_s: int = 5, alive_count: int = 3, connect_timeout_s: int = 10,
                 ssh_bin: str = "ssh", rsync_bin: str = "rsync", scp_bin: str = "scp") -> None:
        if not alias or alias.startswith("-") or any(c.isspace() or c in "'\"\\" for c in alias):
            raise ValueError(f"not a usable ssh host alias: {alias!r}")
        self.alias = alias
        self.config_file = config_file
        self.alive_interval_s = alive_interval_s
        self.alive_count = alive_count
        self.connect_timeout_s = connect_timeout_s
        self.ssh_bin = ssh_bin
        self.rsync_bin = rsync_bin
        self.scp_bin = scp_bin
        key = f"{alias}\0{os.path.abspath(config_file) if config_file is not None else ''}"
        name = "cm-" + hashlib.sha256(key.encode()).hexdigest()[:16]
        self.control_path = short_socket_path(control_dir, name)

    def __repr__(self) -> str:
        return f"Ssh({self.alias!r}, control_path={str(self.control_path)!r})"

    def options(self) -> List[str]:
        """The options every ssh call for this alias shares (command-line -o wins over config files)."""
        opts: List[str] = []
        if self.config_file is not None:
            opts += ["-F", str(self.config_file)]
        for option in ("BatchMode=yes", "StrictHostKeyChecking=yes", f"ControlPath={self.control_path}",
                       f"ServerAliveInterval={self.alive_interval_s}",
                       f"ServerAliveCountMax={self.alive_count}",
                       f"ConnectTimeout={self.connect_timeout_s}", "ExitOnForwardFailure=yes",
                       "StreamLocalBindUnlink=yes", "LogLevel=ERROR"):
            opts += ["-o", option]
        return opts

    def _failure(self, stderr: bytes, returncode: Optional[int]) -> Optional[SshError]:
        """classify() for this alias, its hints naming the config file these calls use."""
        return classify(self.alias, stderr, returncode, config_file=self.config_file)

    def _client_options(self) -> List[str]:
        opts = self.options()
        for option in _CLIENT_OPTIONS:
            opts += ["-o", option]
        return opts

    # -- the master ---------------------------------------------------------------

    def start_master(self, timeout_s: float = 30) -> int:
        """Start the ControlMaster for this alias unless one answers; return its pid."""
        _private_dir(self.control_path.parent)
        with _locked(Path(f"{self.control_path}.lock"), timeout_s):
            pid = self.master_pid()
            if pid is not None:
                return pid
            if os.path.lexists(self.control_path):
                raise SshError(
                    f"{self.alias}: a master holds {self.control_path} but does not answer",
                    hint=f"end it with `ssh -o ControlPath={self.control_path} -O exit {self.alias}`")
            argv = [self.ssh_bin, *self.options(), "-o", "ControlMaster=yes",
                    "-o", f"ControlPersist={MASTER_IDLE_S}",
                    "-o", "RemoteCommand=none", "-N", "-f", "--", self.alias]
            try:
                done = _execute(argv, timeout_s=timeout_s, capture_stdout=False)
            except subprocess.TimeoutExpired:
                raise Unreachable(f"{self.alias}: no ssh connection within {timeout_s:g}s",
                                  hint="the box may be stopped or its address changed") from None
            if done.returncode != 0:
                raise self._failure(done.stderr, done.returncode) or SshError(
                    f"{self.alias}: ssh master failed (exit {done.returncode}): {_tail(done.stderr)}",
                    returncode=done.returncode)
            pid = self.master_pid()
            if pid is None:
                raise SshError(f"{self.alias}: the ssh master exited right after it started: "
                               f"{_tail(done.stderr)}")
            log.debug("ssh master for %s is pid %d", self.alias, pid)
            return pid

    def _mux(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        argv = [self.ssh_bin, *self.options(), *args, "--", self.alias]
        try:
            return _execute(argv, timeout_s=_MUX_TIMEOUT_S, capture_stdout=False)
        except subprocess.TimeoutExpired:
            raise SshError(f"{self.alias}: the ssh master did not answer `ssh {' '.join(args)}` "
                           f"within {_MUX_TIMEOUT_S:g}s") from None

    def master_pid(self) -> Optional[int]:
        """The pid of the master that answers `-O check`, or None. A socket file
        nobody listens on (the master was killed) is removed."""
        if not os.path.lexists(self.control_path):
            return None
        try:
            done = self._mux("-O", "check")
        except SshError:
            return None
        found = re.search(rb"pid=(\d+)", done.stderr)
        if done.returncode == 0 and found:
            return int(found.group(1))
        if b"Connection refused" in done.stderr:
            log.debug("removing stale control socket %s", self.control_path)
            with contextlib.suppress(SshError):
                _unlink_socket(self.control_path)
        return None

    def stop_master(self, timeout_s: float = 5.0) -> None:
        """Ask the master to exit and wait until its socket is gone; no error if none runs."""
        if not os.path.lexists(self.control_path):
            return
        done = self._mux("-O", "exit")
        if done.returncode != 0:
            self.master_pid()  # removes a stale socket
            return
        pause = threading.Event()
        deadline = time.monotonic() + timeout_s
        while os.path.lexists(self.control_path):
            if time.monotonic() >= deadline:
                log.warning("ssh master for %s acknowledged exit but %s is still there",
                            self.alias, self.control_path)
                return
            pause.wait(0.02)

    # -- forwards -----------------------------------------------------------------

    def _forward_spec(self, local_socket: Path, remote_socket: str) -> str:
        local = os.path.abspath(local_socket)
        if not _SAFE_PATH.match(local) or len(os.fsencode(local)) > SOCKET_PATH_MAX:
            raise SshError(f"local socket path {local!r} is too long or needs quoting; "
                           "make it with short_socket_path()")
        if (not remote_socket.startswith("/") or not _SAFE_PATH.match(remote_socket)
                or len(remote_socket.encode()) > 104):
            raise SshError(f"remote socket path {remote_socket!r} must be absolute, at most 104 bytes, "
                           "and plain (letters, digits, ._/+@,-)")
        return f"{local}:{remote_socket}"

    def forward(self, local_socket: Path, remote_socket: str) -> None:
        """Make local_socket reach remote_socket on the box through the running master."""
        spec = self._forward_spec(local_socket, remote_socket)
        _private_dir(Path(os.path.abspath(local_socket)).parent)
        # A forward with the same spec may survive from before; the master would
        # answer "exists" for it even after its socket file was removed.
        self._mux("-O", "cancel", "-L", spec)
        _unlink_socket(local_socket)
        done = self._mux("-O", "forward", "-L", spec)
        if done.returncode != 0:
            if b"No such file or directory" in done.stderr and not os.path.lexists(self.control_path):
                raise SshError(f"{self.alias}: no ssh master runs, so nothing can be forwarded",
                               hint="start the master first (Ssh.start_master)", returncode=done.returncode)
            raise self._failure(done.stderr, done.returncode) or SshError(
                f"{self.alias}: could not forward {local_socket} to {remote_socket}: {_tail(done.stderr)}",
                returncode=done.returncode)

    def cancel_forward(self, local_socket: Path, remote_socket: str) -> None:
        """Stop forwarding local_socket and remove it; no error if it was not forwarded."""
        spec = self._forward_spec(local_socket, remote_socket)
        if os.path.lexists(self.control_path):
            self._mux("-O", "cancel", "-L", spec)  # ssh answers 0 whether or not it existed
        with contextlib.suppress(SshError):
            _unlink_socket(local_socket)

    # -- commands and copies ------------------------------------------------------

    def run(self, command: str, *, input: Optional[bytes] = None, timeout_s: float = 60,
            check: bool = True) -> subprocess.CompletedProcess[bytes]:
        """Run `command` (one string for the box's login shell; quote with
        shlex.quote) through the master if one runs. Secrets go in `input`.

        With check=True an exit code other than 0 raises SshError. Either way a
        failure of ssh itself (exit 255 with a connection error) raises the
        matching subclass: a dead link is never reported as the command's answer.
        """
        argv = [self.ssh_bin, *self._client_options(), "--", self.alias, command]
        try:
            done = _execute(argv, input=input, timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            raise SshError(f"{self.alias}: remote command timed out after {timeout_s:g}s") from None
        if done.returncode == 255:
            failure = self._failure(done.stderr, 255)
            if failure is not None:
                raise failure
        if check and done.returncode != 0:
            raise SshError(
                f"{self.alias}: remote command exited with {done.returncode}: {_tail(done.stderr)}",
                returncode=done.returncode)
        return done

    def rsync_shell(self) -> str:
        """The `rsync -e` value: ssh with our options, so rsync rides the master."""
        return shlex.join([self.ssh_bin, *self._client_options()])

    def _make_remote_dir(self, remote_dir: str) -> str:
        """mkdir -p remote_dir on the box and return it as an absolute path there."""
        where = _remote_path(remote_dir)
        done = self.run(f"mkdir -p -- {where} && cd -- {where} && pwd", timeout_s=60)
        lines = done.stdout.decode("utf-8", "replace").strip().splitlines()
        if not lines or not lines[-1].startswith("/"):
            raise SshError(f"{self.alias}: could not resolve {remote_dir!r} on the box")
        return lines[-1]

    def put(self, files: Sequence[Path], remote_dir: str, timeout_s: float = 600) -> None:
        """Copy files (or directories) into remote_dir on the box, created first; a
        leading ~/ means the box user's home. rsync when both ends have it, else scp."""
        dest = self._make_remote_dir(remote_dir)
        if not files:
            return
        # Absolute sources: a colon before the first slash would make rsync/scp read a host name.
        sources = [os.path.abspath(f) for f in files]
        target = f"{self.alias}:{dest.rstrip('/')}/"
        if shutil.which(self.rsync_bin):
            argv = [self.rsync_bin, "--protect-args", "--recursive", "--links", "--perms", "--times",
                    "-e", self.rsync_shell(), "--", *sources, target]
            done = self._copy(argv, "rsync", timeout_s)
            if done.returncode == 0:
                return
            if not re.search(rb"rsync: (command )?not found|rsync: No such file", done.stderr):
                raise self._failure(done.stderr, done.returncode) or SshError(
                    f"{self.alias}: rsync failed (exit {done.returncode}): {_tail(done.stderr)}",
                    returncode=done.returncode)
            log.info("%s has no rsync; copying with scp", self.alias)
        argv = [self.scp_bin, "-q", "-p", "-r", "-S", self.ssh_bin, *self.options(), "--", *sources, target]
        done = self._copy(argv, "scp", timeout_s)
        if done.returncode != 0:
            raise self._failure(done.stderr, done.returncode) or SshError(
                f"{self.alias}: scp failed (exit {done.returncode}): {_tail(done.stderr)}",
                returncode=done.returncode)

    def _copy(self, argv: List[str], what: str, timeout_s: float) -> subprocess.CompletedProcess[bytes]:
        try:
            return _execute(argv, timeout_s=timeout_s, capture_stdout=False)
        except subprocess.TimeoutExpired:
            raise SshError(f"{self.alias}: {what} did not finish within {timeout_s:g}s") from None

    def push(self, source: Path, remote_path: str, *, excludes: Sequence[str] = (),
             timeout_s: float = 3600) -> str:
        """rsync `source` to `remote_path` (parents made; ~/ is home there) over the master: a file to that
        name (rsync renames a temporary into place), a directory's contents into it; `excludes` are rsync
        patterns (/x anchored at `source`); nothing there is deleted. Returns the absolute path there."""
        src = os.path.abspath(source)
        is_dir = os.path.isdir(src)
        parent, name = (remote_path, "") if is_dir else posixpath.split(remote_path.rstrip("/"))
        if not is_dir and not name:
            raise ValueError(f"push {src}: {remote_path!r} names no file")
        base = self._make_remote_dir(parent or "~").rstrip("/")
        dest = f"{base}/{name}" if name else base
        argv = [self.rsync_bin, "--protect-args", "--recursive", "--links", "--perms", "--times",
                *(f"--exclude={pattern}" for pattern in excludes), "-e", self.rsync_shell(), "--",
                src + "/" if is_dir else src, f"{self.alias}:{dest}/" if is_dir else f"{self.alias}:{dest}"]
        done = self._copy(argv, "rsync", timeout_s)
        if done.returncode == 0:
            return dest
        missing = re.search(rb"rsync: (command )?not found|rsync: No such file", done.stderr)
        raise self._failure(done.stderr, done.returncode) or SshError(
            f"{self.alias}: rsync of {src} failed (exit {done.returncode}): {_tail(done.stderr)}",
            hint="install rsync on the box (apt-get install -y rsync)" if missing else None,
            returncode=done.returncode)


class LocalShell:
    """Host `local`: run() and put() on this machine, no ssh at all. Nothing to
    connect, so the master calls answer 0 and forwards are refused."""

    alias = "local"

    def start_master(self, timeout_s: float = 30) -> int:
        return 0

    def master_pid(self) -> Optional[int]:
        return 0

    def stop_master(self, timeout_s: float = 5.0) -> None:
        return None

    def forward(self, local_socket: Path, remote_socket: str) -> None:
        raise SshError("host local needs no forwards")

    def cancel_forward(self, local_socket: Path, remote_socket: str) -> None:
        raise SshError("host local needs no forwards")

    def run(self, command: str, *, input: Optional[bytes] = None, timeout_s: float = 60,
            check: bool = True) -> subprocess.CompletedProcess[bytes]:
        """`sh -c command` here (the same one-string contract as Ssh.run)."""
        try:
            done = _execute(["sh", "-c", command], input=input, timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            raise SshError(f"local: command timed out after {timeout_s:g}s") from None
        if check and done.returncode != 0:
            raise SshError(f"local: command exited with {done.returncode}: {_tail(done.stderr)}",
                           returncode=done.returncode)
        return done

    def put(self, files: Sequence[Path], remote_dir: str, timeout_s: float = 600) -> None:
        dest = Path(os.path.expanduser(remote_dir))
        dest.mkdir(parents=True, exist_ok=True)
        for f in files:
            target = dest / Path(f).name
            if Path(f).is_dir():
                shutil.copytree(f, target, symlinks=True, dirs_exist_ok=True)
            else:
                shutil.copy2(f, target)

    def push(self, source: Path, remote_path: str, *, excludes: Sequence[str] = (),
             timeout_s: float = 3600) -> str:
        """Ssh.push on this machine: a file is copied beside its name and renamed into place."""
        src = Path(os.path.abspath(source))
        dest = Path(os.path.abspath(os.path.expanduser(remote_path)))
        if src.is_dir():
            shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True, ignore=_ignoring(src, excludes))
            return str(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.rgt-{os.getpid()}.tmp")
        shutil.copy2(src, tmp)
        os.replace(tmp, dest)
        return str(dest)


def _ignoring(root: Path, patterns: Sequence[str]) -> Callable[[str, List[str]], List[str]]:
    """shutil.copytree's ignore for rsync-like patterns: `/a/b` is anchored at `root`, others match names."""
    def ignore(directory: str, names: List[str]) -> List[str]:
        at = "/" + os.path.relpath(os.path.join(directory, "x"), root)[:-1]
        return [n for n in names if any(fnmatch.fnmatchcase(at + n if p.startswith("/") else n, p.rstrip("/"))
                                        for p in patterns)]
    return ignore
