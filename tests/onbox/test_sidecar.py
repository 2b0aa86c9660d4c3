"""`rgt-onbox serve` as a real process, spoken to over real ZeroMQ sockets."""
from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
from pathlib import Path
from typing import Iterator, List

import psutil
import pytest
import zmq
import zmq.auth

from onbox.sidecar.journal import CURRENT, read_all
from protocol import (
    ErrorReply,
    Event,
    Hello,
    HelloReply,
    Since,
    SinceReply,
    encode_request,
)
from protocol.endpoints import Endpoints
from tests.helpers import Client, SidecarProcess, onbox_cmd, wait_until


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    sc = SidecarProcess(tmp_path / "active" / "run-x", "--heartbeat", "0.2").start()
    try:
        yield sc
    finally:
        sc.stop()


@pytest.fixture
def client(sidecar: SidecarProcess) -> Iterator[Client]:
    c = Client(Endpoints.read(sidecar.run_dir / "rgt"))
    try:
        yield c
    finally:
        c.close()


def hello_ok(c: Client) -> HelloReply:
    reply = c.ask(encode_request(Hello(id="h")))
    assert isinstance(reply, HelloReply), reply
    return reply


def test_hello_and_since(client: Client, sidecar: SidecarProcess) -> None:
    first = hello_ok(client)
    assert first.run == "run-x" and first.protocol_version == 1 and first.boot_id
    wait_until(lambda: hello_ok(client).last_seq >= 3, what="heartbeats")
    reply = client.ask(encode_request(Since(id="s", seq=0, limit=2)))
    assert isinstance(reply, SinceReply) and reply.more
    assert [e.seq for e in reply.events] == [1, 2] and reply.events[0].kind == "sidecar.started"
    assert reply.events[0].data["boot_id"] == first.boot_id


@pytest.mark.parametrize("frames, code", [
    ([b"garbage"], "bad_request"),
    ([b"\x00\xff" * 10], "bad_request"),
    ([b"{}", b"{}"], "bad_request"),
    ([b'{"v":1,"id":"q","op":"format_disk"}'], "unknown_op"),
    ([b'{"v":2,"id":"q","op":"hello"}'], "version"),
    ([b"x" * (10 << 20)], "too_large"),
    # A lone surrogate id used to make the error reply raise and the sidecar exit.
    ([b'{"v":1,"id":"\\ud800","op":"format_disk"}'], "bad_request"),
    ([b'{"v":1,"id":"\\ud800","op":"hello"}'], "bad_request"),
    ([b'{"v":1,"id":"q","op":"hello","client":"\\udfff"}'], "bad_request"),
    ([b'{"v":1,"id":"q","op":"since","seq":' + b"9" * 400 + b"}"], "bad_request"),
    ([b'{"v":1,"id":"q","op":"renew","ttl_s":' + b"9" * 5000 + b"}"], "bad_request"),
    ([b'{"v":1,"id":"' + b"x" * 300 + b'","op":"hello"}'], "bad_request"),
    ([b'{"v":1,"id":"q","op":"' + b"o" * 200_000 + b'"}'], "unknown_op"),
])
def test_bad_requests_get_error_replies_and_the_daemon_keeps_serving(
        client: Client, frames: List[bytes], code: str) -> None:
    reply = client.ask(frames)
    assert isinstance(reply, ErrorReply) and reply.code == code, reply
    if code == "version":
        assert "2" in reply.message and "1" in reply.message
    hello_ok(client)


def test_garbage_on_the_wire_does_not_stop_the_stream(client: Client, sidecar: SidecarProcess) -> None:
    for _ in range(50):
        client.ask([os.urandom(64)], timeout_ms=2000)
    before = hello_ok(client).last_seq
    assert client.next_event().seq > 0
    wait_until(lambda: hello_ok(client).last_seq > before, what="heartbeats after garbage")


def test_socket_dir_is_private_and_nothing_listens_on_tcp(sidecar: SidecarProcess) -> None:
    ep = Endpoints.read(sidecar.run_dir / "rgt")
    sock_dir = Path(ep.ctl[len("ipc://"):]).parent
    assert stat.S_IMODE(sock_dir.stat().st_mode) == 0o700
    for name in ("ctl", "pub"):
        assert stat.S_IMODE((sock_dir / name).stat().st_mode) == 0o600
    conns = psutil.Process(sidecar.pid).net_connections(kind="inet")
    assert [c for c in conns if c.status == psutil.CONN_LISTEN] == []
    assert [c for c in conns] == []


def test_deep_run_dir_gets_short_socket_paths(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "active" / "run-deep"
    sc = SidecarProcess(deep).start()
    try:
        ep = Endpoints.read(deep / "rgt")
        assert len(ep.ctl) < 108 and str(deep) not in ep.ctl
        c = Client(ep)
        try:
            assert hello_ok(c).run == "run-deep"
        finally:
            c.close()
    finally:
        sc.stop()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_tcp_with_curve_admits_only_allowed_clients(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    clients = tmp_path / "clients"
    clients.mkdir()
    good_pub, good_sec = zmq.auth.create_certificates(str(clients), "good")
    _, bad_sec = zmq.auth.create_certificates(str(clients), "bad")
    (keys / "authorized").mkdir(parents=True)
    os.chmod(keys, 0o700)
    (keys / "authorized" / "good.key").write_bytes(Path(good_pub).read_bytes())
    port = _free_port()
    sc = SidecarProcess(tmp_path / "r", "--tcp", f"127.0.0.1:{port}", "--curve-dir", str(keys)).start()
    try:
        ep = Endpoints.read(tmp_path / "r" / "rgt")
        assert ep.ctl == f"tcp://127.0.0.1:{port}" and ep.curve_server_key
        listening = {c.laddr.ip for c in psutil.Process(sc.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN}
        assert listening == {"127.0.0.1"}
        server = ep.curve_server_key.encode()
        gpub, gsec = zmq.auth.load_certificate(good_sec)
        good = Client(ep, (server, gpub, gsec))
        bpub, bsec = zmq.auth.load_certificate(bad_sec)
        bad = Client(ep, (server, bpub, bsec))
        try:
            assert hello_ok(good).run == "r"
            assert bad.ask(encode_request(Hello(id="b")), timeout_ms=1500) is None
        finally:
            good.close()
            bad.close()
    finally:
        sc.stop()


def test_second_sidecar_for_the_same_run_is_refused(sidecar: SidecarProcess) -> None:
    out = subprocess.run(onbox_cmd("serve", "--run-dir", str(sidecar.run_dir)),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "already serves" in out.stderr


def test_torn_journal_line_is_repaired_on_start(tmp_path: Path) -> None:
    run_dir = tmp_path / "run-t"
    SidecarProcess(run_dir, "--gpu", "none", "--no-kmsg").start().stop()
    before = [e["seq"] for e in read_all(run_dir / "rgt")]
    with open(run_dir / "rgt" / CURRENT, "ab") as f:
        f.write(b'{"v":1,"run":"run-t","host":"h","seq":')
    sc2 = SidecarProcess(run_dir, "--gpu", "none", "--no-kmsg").start()
    try:
        c = Client(Endpoints.read(run_dir / "rgt"))
        try:
            restarted = hello_ok(c).last_seq
        finally:
            c.close()
    finally:
        sc2.stop()
    seqs = [e["seq"] for e in read_all(run_dir / "rgt")]
    assert restarted > len(before) and seqs == list(range(1, len(seqs) + 1))
    assert seqs[: len(before)] == before
    assert list((run_dir / "rgt").glob(f"{CURRENT}.torn.*"))


def test_full_disk_degrades_keeps_serving_and_flushes_when_space_returns(tmp_path: Path) -> None:
    run_dir = tmp_path / "run-full"
    sc = SidecarProcess(run_dir, "--heartbeat", "0.05").start()
    c = Client(Endpoints.read(run_dir / "rgt"))
    try:
        size = (run_dir / "rgt" / CURRENT).stat().st_size
        psutil.Process(sc.pid).rlimit(psutil.RLIMIT_FSIZE, (size + 2000, resource.RLIM_INFINITY))
        degraded = wait_until(lambda: _live_kind(c, "sidecar.degraded"), what="sidecar.degraded")
        # RLIMIT_FSIZE first cuts a write short, then fails the next with EFBIG.
        assert "short write" in degraded.data["error"] or "EFBIG" in degraded.data["error"]
        assert sc.proc is not None and sc.proc.poll() is None
        ring_seq = hello_ok(c).last_seq
        reply = c.ask(encode_request(Since(id="r", seq=ring_seq - 3, limit=10)))
        # Served from memory: the three before the hello's last, and any heartbeat journaled since
        # (one every 50 ms; counting exactly three raced with them on a loaded machine).
        assert isinstance(reply, SinceReply) and len(reply.events) >= 3
        assert [e.seq for e in reply.events] == list(range(ring_seq - 2, reply.events[-1].seq + 1))
        psutil.Process(sc.pid).rlimit(psutil.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        recovered = wait_until(lambda: _live_kind(c, "sidecar.recovered"), what="sidecar.recovered")
        assert recovered.data["events_buffered"] > 0
    finally:
        c.close()
        sc.stop()
    seqs = [e["seq"] for e in read_all(run_dir / "rgt")]
    assert seqs == list(range(1, len(seqs) + 1))
    assert all(json.loads(line) for line in (run_dir / "rgt" / CURRENT).read_bytes().splitlines())


def test_a_metrics_line_with_a_lone_surrogate_is_a_bad_line_not_the_end_of_progress(tmp_path: Path) -> None:
    # One `\ud800` escape in metrics.jsonl used to make every later train.progress fail to encode.
    run_dir = tmp_path / "active" / "run-m"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_bytes(b'{"step": 1, "lo\\ud800ss": 0.5}\n{"step": 2, "loss": 0.25}\n')
    sc = SidecarProcess(run_dir, "--gpu", "none", "--no-kmsg").start()
    try:
        progress = wait_until(lambda: [e for e in read_all(run_dir / "rgt") if e["kind"] == "train.progress"],
                              what="train.progress")
        c = Client(Endpoints.read(run_dir / "rgt"))
        try:
            hello_ok(c)
        finally:
            c.close()
    finally:
        sc.stop()
    assert progress[0]["data"]["step"] == 2 and progress[0]["data"]["scalars"] == {"loss": 0.25}
    kinds = [e["kind"] for e in read_all(run_dir / "rgt")]
    assert "sidecar.degraded" not in kinds and "sidecar.stopping" in kinds


def _live_kind(c: Client, kind: str) -> Event | None:
    ev = c.next_event()
    return ev if ev.kind == kind else None


@pytest.mark.parametrize("run_id, host", [("a..b", "box"), ("run\n", "box"), ("run", "box\n"), ("run", "..")])
def test_a_run_id_or_host_off_the_grammar_is_refused_before_anything_is_made(
        tmp_path: Path, run_id: str, host: str) -> None:
    from onbox.errors import ConfigError
    from onbox.sidecar.server import Sidecar, SidecarConfig

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(ConfigError, match="must be 1-128 of A-Z a-z 0-9"):
        Sidecar(SidecarConfig(run_dir=run_dir, run_id=run_id, host=host))
    assert list(run_dir.iterdir()) == []
