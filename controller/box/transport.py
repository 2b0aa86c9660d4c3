"""ZeroMQ for the controller: SUB for live events, DEALER for control requests.

The only controller module that imports zmq. It moves frames; what they mean
is the subscriber's business.

The box is not trusted, so what it can make this process hold is bounded: libzmq drops the
connection of a peer that sends a part over ZMQ_MAXMSGSIZE (an event frame on the SUB, any
reply frame on the DEALER), the RCVHWMs bound how many messages wait, and a reply of more parts
than a since reply can have is read part by part and dropped, never handed on. libzmq itself
holds a multipart message whole before the first part can be read (its delivery is atomic), so
one reply still costs up to MAX_REPLY_FRAMES frames in libzmq until it is dropped here: only a
reply's per-frame size is capped on the wire, not its part count.
"""
from __future__ import annotations

import dataclasses
import logging
import select
from typing import Dict, List, Optional, Set, Tuple

import zmq  # noqa: TID251 (the zmq seam)
from protocol import MAX_EVENT_BYTES, MAX_FRAME_BYTES
from protocol.codec import MAX_REPLY_FRAMES
from protocol.endpoints import Endpoints

log = logging.getLogger(__name__)

_DRAIN_MAX = 2000
# Replies read in one poll: far more than the one request a subscriber has in flight.
_REPLIES_MAX = 64
# Complete replies libzmq may queue: the subscriber asks one thing at a time.
_DEALER_RCVHWM = 64
_HEARTBEAT_MS = 10_000
# A control request or answer of the follower daemon: a run id and a few fields, or a list of runs.
_CONTROL_MAX = 1 << 20
# ZMQ_MAXMSGSIZE is per part; a frame over it is what no sidecar sends: the peer is dropped.
_SLACK = 1024


@dataclasses.dataclass(frozen=True)
class CurveClient:
    """Keys for the opt-in TCP transport: the server's public key and ours."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(cls, server_public: str, client_secret_file: str) -> CurveClient:
        import zmq.auth  # noqa: TID251 (the zmq seam)

        public, secret = zmq.auth.load_certificate(client_secret_file)
        if secret is None:
            raise ValueError(f"{client_secret_file} holds no secret key")
        return cls(server_public=server_public.encode(), public=public, secret=secret)


class Link:
    """One connection to one sidecar: a SUB and a DEALER, polled together. On its own (`rgt track`,
    the tests) it has its own context and poller; in a Hub it shares the hub's, and the hub polls it
    with every other link."""

    def __init__(self, endpoints: Endpoints, curve: Optional[CurveClient] = None,
                 hub: Optional[Hub] = None) -> None:
        self.endpoints = endpoints
        self._curve = curve
        self._hub = hub
        self._ctx: Optional[zmq.Context[zmq.Socket[bytes]]] = None
        self._sub: Optional[zmq.Socket[bytes]] = None
        self._dealer: Optional[zmq.Socket[bytes]] = None
        self._poller = zmq.Poller()
        self.dropped_replies = 0   # replies of more than MAX_REPLY_FRAMES parts, dropped unread

    def open(self) -> None:
        self._poller = zmq.Poller()   # a reopened link polls only its new sockets
        self._ctx = self._hub.context if self._hub is not None else zmq.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_BYTES + _SLACK)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        dealer = self._ctx.socket(zmq.DEALER)
        # Queue nothing for a peer that is not connected: a request sent into a
        # dead link is refused at once and retried, never delivered stale.
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        dealer.setsockopt(zmq.SNDHWM, 16)
        dealer.setsockopt(zmq.RCVHWM, _DEALER_RCVHWM)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + _SLACK)
        for sock in (sub, dealer):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            # ZMTP heartbeats notice a frozen peer behind a live tunnel: every 10 s, dropped after
            # 30 s (every 2 s was 0.8 % of a core in the daemon's I/O thread at 64 runs).
            sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * _HEARTBEAT_MS)
            if self._curve is not None:
                sock.curve_serverkey = self._curve.server_public
                sock.curve_publickey = self._curve.public
                sock.curve_secretkey = self._curve.secret
        sub.connect(self.endpoints.pub)
        dealer.connect(self.endpoints.ctl)
        self._sub, self._dealer = sub, dealer
        if self._hub is not None:   # the hub's epoll covers them; this link's poller stays empty
            self._hub.add(self, sub, dealer)
        else:
            self._poller.register(sub, zmq.POLLIN)
            self._poller.register(dealer, zmq.POLLIN)

    def send(self, frames: List[bytes]) -> bool:
        """Queue one request; False when no connection can take it now."""
        assert self._dealer is not None
        try:
            self._dealer.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        finally:
            if self._hub is not None:
                self._hub.sent(self._dealer)

    def poll(self, timeout_ms: int) -> Tuple[List[bytes], List[List[bytes]]]:
        """Wait up to timeout_ms; return (live event frames, control replies)."""
        assert self._sub is not None and self._dealer is not None
        ready = dict(self._poller.poll(timeout_ms))
        return self._read(self._dealer in ready, self._sub in ready)

    def read(self) -> Tuple[List[bytes], List[List[bytes]]]:
        """What has arrived, without waiting: (live event frames, control replies). For a hub's
        link, once the hub's poll named it."""
        if self._sub is None or self._dealer is None:
            return [], []
        return self._read(True, True)

    def _read(self, replies_ready: bool, live_ready: bool) -> Tuple[List[bytes], List[List[bytes]]]:
        assert self._sub is not None and self._dealer is not None
        live: List[bytes] = []
        replies: List[List[bytes]] = []
        if replies_ready:
            while len(replies) < _REPLIES_MAX:
                try:
                    reply = self._recv_reply(self._dealer)
                except zmq.Again:
                    break
                if reply is not None:
                    replies.append(reply)
        if live_ready:
            while len(live) < _DRAIN_MAX:
                try:
                    live.append(self._sub.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
        return live, replies

    def _recv_reply(self, dealer: zmq.Socket[bytes]) -> Optional[List[bytes]]:
        """One reply, part by part; None (dropped, counted) past MAX_REPLY_FRAMES parts."""
        frames = [dealer.recv(zmq.NOBLOCK)]
        extra = 0
        while dealer.getsockopt(zmq.RCVMORE):
            try:
                if len(frames) < MAX_REPLY_FRAMES:
                    frames.append(dealer.recv(zmq.NOBLOCK))
                else:
                    dealer.recv(zmq.NOBLOCK, copy=False)  # read to free it; never kept
                    extra += 1
            except zmq.Again:  # pragma: no cover - the parts of one message arrive together
                break
        if extra:
            self.dropped_replies += 1
            log.warning("dropped a control reply of %d parts (at most %d)", len(frames) + extra,
                        MAX_REPLY_FRAMES)
            return None
        return frames

    def close(self) -> None:
        if self._hub is not None:
            self._hub.remove(self._sub, self._dealer)
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None and self._hub is None:
            self._ctx.term()
        self._sub = self._dealer = None
        self._ctx = None


class Hub:
    """Many links in one process (the follower daemon): one ZeroMQ context (one I/O thread for all)
    and one epoll over every link's sockets, plus the daemon's own control socket, a ROUTER bound
    on a unix socket in a 0700 directory, which takes a request of one JSON frame and answers one.

    zmq_poll walks every socket on every call (at 64 runs, 129 sockets, it was 58 % of the
    daemon's CPU: bench/controller_scale.py), so the hub registers each socket's ZMQ_FD with
    epoll once. That descriptor only says "look again": a socket is readable when its ZMQ_EVENTS
    says so, and reading ZMQ_EVENTS is what re-arms it. So a socket that was read from (it may
    hold more than one read took) or sent on (a send can take the signal of a message that came
    in) is looked at again before the next wait."""

    def __init__(self) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._epoll = select.epoll()
        self._by_fd: Dict[int, Tuple[zmq.Socket[bytes], Optional[Link]]] = {}
        self._fd: Dict[zmq.Socket[bytes], int] = {}
        self._look_again: Set[zmq.Socket[bytes]] = set()
        self._control: Optional[zmq.Socket[bytes]] = None

    def add(self, link: Optional[Link], *sockets: zmq.Socket[bytes]) -> None:
        for sock in sockets:
            fd = int(sock.getsockopt(zmq.FD))
            self._by_fd[fd] = (sock, link)
            self._fd[sock] = fd
            self._epoll.register(fd, select.EPOLLIN)
            self._look_again.add(sock)   # it may have become readable before it was registered

    def remove(self, *sockets: Optional[zmq.Socket[bytes]]) -> None:
        for sock in sockets:
            fd = self._fd.pop(sock, None) if sock is not None else None
            if fd is None:
                continue
            self._by_fd.pop(fd, None)
            self._epoll.unregister(fd)
            self._look_again.discard(sock)

    def sent(self, sock: zmq.Socket[bytes]) -> None:
        """SOCK was sent on: look at it again before the next wait."""
        if sock in self._fd:
            self._look_again.add(sock)

    def bind_control(self, path: str) -> None:
        """Answer requests on ipc://PATH (the caller made its directory 0700)."""
        sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _CONTROL_MAX)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.bind(f"ipc://{path}")
        self._control = sock
        self.add(None, sock)

    def poll(self, timeout_ms: int) -> Tuple[Set[Link], bool]:
        """Wait up to timeout_ms: (the links with something to read, whether a request waits)."""
        ready = {sock for sock in self._look_again if _readable(sock)}
        self._look_again.clear()
        for fd, _ in self._epoll.poll(0 if ready else max(0, timeout_ms) / 1000.0):
            entry = self._by_fd.get(fd)
            if entry is not None and _readable(entry[0]):
                ready.add(entry[0])
        self._look_again |= ready   # what is read now may hold more than one read takes
        links = {link for sock, link in (self._by_fd[self._fd[sock]] for sock in ready) if link is not None}
        return links, self._control is not None and self._control in ready

    def requests(self) -> List[Tuple[bytes, bytes]]:
        """The waiting requests: (who asked, the request's one frame); others are dropped."""
        out: List[Tuple[bytes, bytes]] = []
        while self._control is not None and len(out) < _REPLIES_MAX:
            try:
                frames = self._control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) == 3 and frames[1] == b"":   # a REQ's envelope: who, delimiter, body
                out.append((frames[0], frames[2]))
        return out

    def answer(self, who: bytes, body: bytes) -> None:
        assert self._control is not None
        try:
            self._control.send_multipart([who, b"", body], zmq.NOBLOCK)
        except zmq.ZMQError as e:   # the asker left (it timed out): nobody to answer
            log.debug("control answer dropped: %s", e)
        self.sent(self._control)

    def close(self) -> None:
        if self._control is not None:
            self.remove(self._control)
            self._control.close(linger=0)
            self._control = None
        for sock in list(self._fd):
            self.remove(sock)
            sock.close(linger=0)
        self._epoll.close()
        self.context.term()


def _readable(sock: zmq.Socket[bytes]) -> bool:
    """Whether SOCK holds a message now (reading ZMQ_EVENTS also re-arms its ZMQ_FD)."""
    try:
        return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
    except zmq.ZMQError:   # closed under us: nothing to read
        return False


def ask(path: str, body: bytes, timeout_ms: int) -> Optional[bytes]:
    """One request to a Hub's control socket at ipc://PATH: its answer, or None when none came
    within timeout_ms (nobody serves there, or it is ending)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _CONTROL_MAX)
        sock.connect(f"ipc://{path}")
        sock.send(body)
        if not sock.poll(timeout_ms, zmq.POLLIN):
            return None
        return sock.recv(zmq.NOBLOCK)
    except zmq.ZMQError as e:
        log.debug("control request to %s failed: %s", path, e)
        return None
    finally:
        sock.close(linger=0)
        ctx.term()
