"""What a hostile box can make the controller's Link hold, on real zmq sockets: a reply
frame over the cap drops the connection, a reply of more parts than a since reply can have is
dropped unread, an event frame over the event cap never arrives; normal traffic goes on after."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from controller.box.transport import Link
from protocol import MAX_EVENT_BYTES, MAX_FRAME_BYTES, Hello, encode_request
from protocol.codec import MAX_REPLY_FRAMES
from protocol.endpoints import Endpoints
from tests.helpers import wait_until


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Tuple[Link, zmq.Socket, zmq.Socket]]:
    """A Link connected to a bare ROUTER and PUB that play a hostile sidecar."""
    ctx = zmq.Context()
    router, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
    for s in (router, pub):
        s.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{tmp_path}/ctl")
    pub.bind(f"ipc://{tmp_path}/pub")
    link = Link(Endpoints(pub=f"ipc://{tmp_path}/pub", ctl=f"ipc://{tmp_path}/ctl"))
    link.open()
    try:
        yield link, router, pub
    finally:
        link.close()
        router.close()
        pub.close()
        ctx.term()


def ask(link: Link, router: zmq.Socket) -> bytes:
    """Send a hello through the link until the router has it; the requester's routing id."""
    def arrived() -> List[bytes]:
        link.send(encode_request(Hello(id="h")))
        return router.recv_multipart() if router.poll(50) else []
    return wait_until(arrived, what="a request at the router")[0]


def test_a_reply_of_too_many_parts_is_dropped_unread_and_the_next_one_arrives(box: tuple) -> None:
    link, router, _ = box
    peer = ask(link, router)
    router.send_multipart([peer, b"header"] + [b"e"] * MAX_REPLY_FRAMES)  # one part over
    router.send_multipart([peer, b"ok"])
    got = wait_until(lambda: link.poll(50)[1], what="the reply after the dropped one")
    assert got == [[b"ok"]] and link.dropped_replies == 1
    router.send_multipart([peer, b"header"] + [b"e"] * (MAX_REPLY_FRAMES - 1))  # exactly the cap
    got = wait_until(lambda: link.poll(50)[1], what="a reply at the cap")
    assert len(got[0]) == MAX_REPLY_FRAMES and link.dropped_replies == 1


@contextlib.contextmanager
def dropped_by_peer(sock: zmq.Socket) -> Iterator[None]:
    """Run the block, then wait for the peer to drop `sock`'s connection (its monitor says so)."""
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        yield
        assert monitor.poll(10_000), "the peer kept the connection"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        sock.disable_monitor()
        monitor.close()


def test_a_reply_frame_over_the_cap_drops_the_connection(box: tuple) -> None:
    # libzmq treats it as a protocol error and does not reconnect that socket: the link stays down
    # (the watch ends on its link budget) until it is opened again.
    link, router, _ = box
    peer = ask(link, router)
    with dropped_by_peer(router):
        router.send_multipart([peer, b"x" * (MAX_FRAME_BYTES + 4096)])
    assert link.poll(0)[1] == []
    wait_until(lambda: not link.send(encode_request(Hello(id="h"))), what="the DEALER to refuse sends")
    link.close()
    link.open()
    peer = ask(link, router)
    router.send_multipart([peer, b"x" * MAX_FRAME_BYTES])
    got = wait_until(lambda: link.poll(50)[1], what="a reply at the frame cap")
    assert got == [[b"x" * MAX_FRAME_BYTES]]


def test_an_event_frame_over_the_event_cap_never_arrives(box: tuple) -> None:
    link, _, pub = box

    def live() -> List[bytes]:
        pub.send(b"small")
        return link.poll(50)[0]
    wait_until(live, what="the subscription")
    with dropped_by_peer(pub):
        pub.send(b"x" * (MAX_EVENT_BYTES + 2048))
    seen: List[bytes] = []
    for _ in range(5):
        seen += link.poll(10)[0]
    assert all(frame == b"small" for frame in seen), [len(f) for f in seen]
