"""ZeroMQ for the sidecar: PUB for live events, ROUTER for control.

The only onbox module that imports zmq. Sockets are unix sockets (ipc://) in a
0700 directory by default, each socket file 0600. TCP is opt-in, binds
127.0.0.1 only and requires CURVE with an allow-list of client keys; any other
address is refused before anything is bound.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import zmq  # noqa: TID251 (the zmq seam)
import zmq.auth  # noqa: TID251 (the zmq seam)
from protocol.endpoints import Endpoints
from zmq.auth.thread import ThreadAuthenticator  # noqa: TID251 (the zmq seam)

from onbox.errors import ConfigError

log = logging.getLogger(__name__)

# Unix socket paths are capped at 108 bytes including the NUL.
_MAX_IPC_PATH = 100
# Requests between the 256 KiB frame cap and this get an error reply; bigger
# ones make libzmq drop the connection (documented in the README).
MAX_REQUEST_BYTES = 16 << 20
LOOPBACK = "127.0.0.1"

Handler = Callable[[List[bytes]], List[bytes]]


def check_loopback(host: str) -> None:
    """Refuse every TCP bind address but 127.0.0.1."""
    if host != LOOPBACK:
        raise ConfigError(
            f"refusing to bind TCP on {host!r}: only {LOOPBACK} is allowed. "
            "Reach a remote sidecar through the SSH tunnel (the default), never an open port."
        )


def parse_tcp(spec: str) -> Tuple[str, int]:
    """'127.0.0.1:PORT' -> (host, port); the control socket takes PORT, PUB takes PORT+1."""
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65535:
        raise ConfigError(f"--tcp wants 127.0.0.1:PORT, got {spec!r}")
    check_loopback(host)
    return host, int(port)


def private_dir(path: Path) -> Path:
    """Create (or check) a directory that only we can enter: 0700, ours, no symlink."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ConfigError(f"{path} is not a directory owned by this user; refusing to put sockets there")
    os.chmod(path, 0o700)
    return path


def socket_dir_for(rgt_dir: Path) -> Path:
    """<run>/rgt/sock, or a short private dir when that path is too long for ipc://."""
    preferred = rgt_dir / "sock"
    if len(str(preferred / "ctl")) <= _MAX_IPC_PATH:
        return preferred
    digest = hashlib.sha256(str(rgt_dir.resolve()).encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / f"rgt-{os.getuid()}"
    private_dir(base)
    return base / digest


@dataclasses.dataclass(frozen=True)
class CurveServer:
    public: bytes
    secret: bytes
    authorized_dir: Path


def load_curve_server(curve_dir: Path) -> CurveServer:
    """The server keypair in curve_dir (made once, 0600) and the client allow-list dir.

    Allowed clients are public-key certificates (zmq.auth format) placed in
    curve_dir/authorized/.
    """
    private_dir(curve_dir)
    authorized = private_dir(curve_dir / "authorized")
    secret_file = curve_dir / "server.key_secret"
    if not secret_file.exists():
        old = os.umask(0o077)
        try:
            zmq.auth.create_certificates(str(curve_dir), "server")
        finally:
            os.umask(old)
    public, secret = zmq.auth.load_certificate(str(secret_file))
    if secret is None:
        raise ConfigError(f"{secret_file} holds no secret key")
    return CurveServer(public=public, secret=secret, authorized_dir=authorized)


class EventServer:
    """Owns the ZeroMQ context and both sockets of one sidecar."""

    def __init__(self, sock_dir: Optional[Path] = None, tcp: Optional[Tuple[str, int]] = None,
                 curve: Optional[CurveServer] = None, linger_ms: int = 200) -> None:
        if (sock_dir is None) == (tcp is None):
            raise ConfigError("bind either unix sockets (the default) or TCP on 127.0.0.1, not both")
        if tcp is not None:
            check_loopback(tcp[0])
            if curve is None:
                raise ConfigError("TCP needs CURVE keys (--curve-dir); plain TCP is never offered")
        self._sock_dir = sock_dir
        self._tcp = tcp
        self._curve = curve
        self._linger_ms = linger_ms
        self._ctx: Optional[zmq.Context[zmq.Socket[bytes]]] = None
        self._auth: Optional[ThreadAuthenticator] = None
        self._pub: Optional[zmq.Socket[bytes]] = None
        self._router: Optional[zmq.Socket[bytes]] = None
        self._wake_lock = threading.Lock()

    def bind(self) -> Endpoints:
        self._ctx = zmq.Context()
        if self._curve is not None:
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(self._curve.authorized_dir))
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 10_000)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        for sock in (self._pub, self._router):
            sock.setsockopt(zmq.LINGER, self._linger_ms)
            if self._curve is not None:
                sock.curve_server = True
                sock.curve_publickey = self._curve.public
                sock.curve_secretkey = self._curve.secret
        if self._tcp is not None:
            host, port = self._tcp
            ctl, pub = f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}"
        else:
            assert self._sock_dir is not None
            private_dir(self._sock_dir)
            ctl, pub = (f"ipc://{self._sock_dir / name}" for name in ("ctl", "pub"))
        self._bind(self._router, ctl)
        self._bind(self._pub, pub)
        key = self._curve.public.decode() if self._curve else None
        return Endpoints(pub=pub, ctl=ctl, pid=os.getpid(), curve_server_key=key)

    @staticmethod
    def _bind(sock: zmq.Socket[bytes], endpoint: str) -> None:
        if endpoint.startswith("ipc://"):
            path = Path(endpoint[len("ipc://"):])
            if path.is_socket():
                path.unlink()  # left by a killed sidecar; the run lock says it is ours
            old = os.umask(0o177)
            try:
                sock.bind(endpoint)
            finally:
                os.umask(old)
            os.chmod(path, 0o600)
        else:
            sock.bind(endpoint)

    def publish(self, frame: bytes) -> None:
        """Send one event frame; callers serialize (the sidecar's emit lock)."""
        assert self._pub is not None
        try:
            self._pub.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            pass  # no room for a slow subscriber: it repairs the gap with `since`

    def serve(self, handler: Handler, stop: threading.Event, poll_ms: int = 200) -> None:
        """Answer control requests until `stop` is set. The handler should never raise; one that
        does loses only the request it was answering, and an empty reply is sent as nothing."""
        assert self._router is not None
        router = self._router
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if not poller.poll(poll_ms):
                continue
            while True:
                try:
                    msg = router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    reply = handler(msg[1:])
                except Exception:  # a handler bug must not end the serve loop (and the sidecar)
                    log.exception("control handler raised; request dropped")
                    continue
                if not reply:
                    continue  # the handler dropped it: not even an error reply could be encoded
                try:
                    router.send_multipart([msg[0], *reply], zmq.NOBLOCK)
                except zmq.ZMQError as e:  # the peer is gone or too slow; it will ask again
                    log.debug("control reply dropped: %s", e)

    def close(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=self._linger_ms)
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.term()
        self._pub = self._router = None
        self._ctx = None
        self._auth = None
        if self._sock_dir is not None:
            for name in ("ctl", "pub"):
                try:
                    (self._sock_dir / name).unlink()
                except OSError:
                    pass
