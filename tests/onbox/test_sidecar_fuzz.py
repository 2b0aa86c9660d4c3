"""A live sidecar under tens of thousands of random control requests (the box is untrusted,
and so is whatever reaches its control socket).

A real `rgt-onbox serve` on real ipc sockets in a temp run dir gets batches of seeded random
requests: valid ones, near misses (a byte changed, cut, doubled), JSON of the wrong shape (huge
integers, lone surrogate escapes, NaN constants, deep nesting, long ids, wrong types, unknown
ops), several frames, plain bytes. Every request must get exactly the answer the codec's own
decode_request says it should (its reply, or an error reply with the code of its ProtocolError);
after each batch the sidecar answers hello and its journal is seqs 1..N without a gap; at the end
its heartbeat counts no request that failed inside the handler and none dropped.

The generator and the checker are shared with bench/fuzz.py (a bigger run, with rates).
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import zmq

from onbox.sidecar.journal import read_all
from protocol import (
    ErrorReply,
    Hello,
    HelloReply,
    Manifest,
    ManifestReply,
    ProtocolError,
    Renew,
    RenewReply,
    Since,
    SinceReply,
    decode_reply,
    decode_request,
    encode_request,
)
from protocol.codec import MAX_FRAME_BYTES, request_id_of
from protocol.endpoints import Endpoints
from tests.helpers import Client, SidecarProcess, wait_until

SEED = 15
BATCHES = 40
PER_BATCH = 500          # 20,000 requests in all
REPLY_TIMEOUT_MS = 20_000

# ---- random requests ---------------------------------------------------------------------------

OPS = ["hello", "since", "manifest", "renew"]
HOSTILE_TEXT = [
    b"9" * 400, b"-" + b"9" * 30, b"18446744073709551616", b"-9223372036854775809", b"1e400", b"-1e400",
    b"NaN", b"Infinity", b"-Infinity", b'"\\ud800"', b'"a\\udfffb"', b'"\\ud83d\\ude00"', b'"\\\\ud800"',
    b'"\\u0000"', b"[" * 40 + b"]" * 40, b"{}", b"[]", b"null", b"true", b'""', b'"' + b"x" * 300 + b'"',
    b"0", b"-1", b"1.5", b"10000", b"10001", b"604800", b"604801",
]
HOSTILE_KEYS = [b"v", b"id", b"op", b"seq", b"limit", b"ttl_s", b"client", b"includes", b"\\ud800", b"x"]
INCLUDES = [[], ["*.log"], ["../etc/passwd"], ["/abs"], [""], ["a\x00b"], ["metrics.jsonl"], ["*"] * 65,
            ["x" * 1025], [7], None, "metrics.jsonl"]


def _id(rng: random.Random) -> Any:
    return rng.choice(["a", "", f"r{rng.randrange(10 ** 6)}", "x" * rng.choice((200, 256, 257, 1000)),
                       rng.randrange(100), None, ["a"], "\u202e\u00e9"])


def _valid(rng: random.Random) -> Dict[str, Any]:
    op = rng.choice(OPS) if rng.random() < 0.9 else rng.choice(["format_disk", "", "HELLO", "x" * 500])
    body: Dict[str, Any] = {"v": 1, "id": _id(rng) if rng.random() < 0.2 else f"q{rng.randrange(10 ** 6)}",
                            "op": op}
    if op == "hello":
        body["client"] = rng.choice(["rgt 0.1.0", "", 7, None, "x" * 1000])
    elif op == "since":
        body["seq"] = rng.choice([0, 1, 2, rng.randrange(100), rng.randrange(10 ** 9), -1, "1", 1.5])
        if rng.random() < 0.8:
            body["limit"] = rng.choice([1, 2, 10, 1000, 10_000, 0, 10_001, -5, True, "10"])
    elif op == "manifest" and rng.random() < 0.3:  # a manifest hashes the run dir: keep them few
        body["includes"] = rng.choice(INCLUDES)
    elif op == "manifest":
        body["op"] = "hello"
    elif op == "renew":
        body["ttl_s"] = rng.choice([None, 60, 0.5, 0, -1, 604800, 604801, 1e308, "60", True])
    if rng.random() < 0.05:
        body["v"] = rng.choice([2, 0, "1", None, 1.0])
    if rng.random() < 0.05:
        del body[rng.choice(list(body))]
    return body


def _mutate(rng: random.Random, raw: bytes) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        how = rng.random()
        i = rng.randrange(len(data) + 1)
        if how < 0.4 and data:
            data[min(i, len(data) - 1)] = rng.randrange(256)
        elif how < 0.6:
            data[i:i] = rng.choice([b"\\ud800", b"9" * 30, b",", b"{", b'"', b"\xff", b"\\"])
        elif how < 0.8:
            del data[i:i + rng.randint(1, 8)]
        else:
            data = data[:i] + data[i:][:rng.randint(0, 20)] + data[i:]
    return bytes(data)


def _hostile(rng: random.Random) -> bytes:
    """A request object written as raw JSON text, with values json.dumps would never write."""
    fields = {b"v": b"1", b"id": b'"h"', b"op": b'"%s"' % rng.choice(OPS).encode()}
    for _ in range(rng.randint(1, 3)):
        fields[rng.choice(HOSTILE_KEYS)] = rng.choice(HOSTILE_TEXT)
    return b"{" + b",".join(b'"%s":%s' % kv for kv in fields.items()) + b"}"


def random_request(rng: random.Random) -> List[bytes]:
    """One control message, as a list of frames (never empty: a DEALER cannot send no frames)."""
    roll = rng.random()
    if roll < 0.30:
        return [json.dumps(_valid(rng)).encode()]
    if roll < 0.45:
        return [_mutate(rng, json.dumps(_valid(rng)).encode())]
    if roll < 0.70:
        return [_hostile(rng)]
    if roll < 0.80:
        return [rng.randbytes(rng.randrange(0, 200))]
    if roll < 0.88:
        return [json.dumps(_valid(rng), ensure_ascii=rng.random() < 0.5).encode()
                .replace(b'"q', rng.choice([b'"\\udc00q', b'"\\ud83d\\ude00q', b'"q']), 1)]
    if roll < 0.97:
        return [json.dumps(_valid(rng)).encode() for _ in range(rng.randint(2, 4))]
    if roll < 0.995:
        return [rng.choice([b"", b" ", b"\xef\xbb\xbf{}", b"{" * 20, b'{"v":1,"id":"a","op":"hello"} x'])]
    return [b'{"v":1,"id":"big","op":"hello","pad":"' + b"x" * (MAX_FRAME_BYTES + 1) + b'"}']


# ---- what the sidecar must answer ----------------------------------------------------------------


def check_reply(frames: List[bytes], reply: Any) -> str:
    """Assert that `reply` is the answer the codec says `frames` must get; the kind of answer
    ("refused:<code>" for a request the codec refuses, "error:<code>" for one the sidecar could
    not do, else the request's op)."""
    try:
        req = decode_request(frames)
    except ProtocolError as e:
        assert isinstance(reply, ErrorReply), (frames, reply)
        assert reply.code == e.code, (frames, reply, str(e))
        assert reply.id == ("" if e.code == "too_large" else request_id_of(frames)), (frames, reply)
        return f"refused:{e.code}"
    if isinstance(reply, ErrorReply):
        assert reply.id == req.id and (isinstance(req, (Manifest, Renew)) or reply.code == "too_large"), (
            frames, reply)
        assert reply.code != "internal" or isinstance(req, (Manifest, Renew)), (frames, reply)
        return f"error:{reply.code}"
    assert reply.id == req.id, (frames, reply)
    expected = {Hello: HelloReply, Since: SinceReply, Manifest: ManifestReply, Renew: RenewReply}[type(req)]
    assert isinstance(reply, expected), (frames, reply)
    if isinstance(req, Since):
        assert isinstance(reply, SinceReply)
        assert len(reply.events) <= req.limit and all(e.seq > req.seq for e in reply.events)
        seqs = [e.seq for e in reply.events]
        assert seqs == list(range(req.seq + 1, req.seq + 1 + len(seqs))), seqs
    return type(req).__name__.lower()


def run_batch(dealer: zmq.Socket, requests: List[List[bytes]],
              timeout_ms: int = REPLY_TIMEOUT_MS) -> Dict[str, int]:
    """Send every request, then read one reply each, in order; counts of each kind of answer."""
    for frames in requests:
        dealer.send_multipart(frames)
    answers: Dict[str, int] = {}
    for frames in requests:
        assert dealer.poll(timeout_ms), f"no reply to {frames!r:.200} within {timeout_ms} ms"
        kind = check_reply(frames, decode_reply(dealer.recv_multipart()))
        answers[kind] = answers.get(kind, 0) + 1
    return answers


def journal_seqs(run_dir: Path) -> List[int]:
    return [e["seq"] for e in read_all(run_dir / "rgt")]


def check_alive(client: Client, run_dir: Path) -> Tuple[int, int]:
    """The sidecar answers hello and its journal is seqs 1..N: (N, the hello's last_seq)."""
    seqs = journal_seqs(run_dir)  # first: the hello after it has seen every one of them
    assert seqs == list(range(1, len(seqs) + 1)), f"journal gap or disorder near {_first_gap(seqs)}"
    hello = client.ask(encode_request(Hello(id="alive")))
    assert isinstance(hello, HelloReply), hello
    assert hello.last_seq >= len(seqs), (hello.last_seq, len(seqs))
    return len(seqs), hello.last_seq


def _first_gap(seqs: List[int]) -> Optional[int]:
    return next((i + 1 for i, s in enumerate(seqs) if s != i + 1), None)


def heartbeats(run_dir: Path) -> List[Dict[str, Any]]:
    return [e["data"] for e in read_all(run_dir / "rgt") if e["kind"] == "heartbeat"]


def heartbeat_after(run_dir: Path, seen: int, requests_at_least: int) -> Optional[Dict[str, Any]]:
    """A heartbeat journaled after the first `seen` ones, counting at least that many requests.
    Only one journaled after every reply arrived counts them all: the liveness checks between
    batches are requests too, so an earlier beat can pass the count mid-batch."""
    beats = heartbeats(run_dir)
    return beats[-1] if len(beats) > seen and beats[-1].get("requests", 0) >= requests_at_least else None


def start_sidecar(tmp_path: Path) -> SidecarProcess:
    """A sidecar whose HOME is a temp dir: renew requests touch no real dead-man lease."""
    home = tmp_path / "home"
    home.mkdir()
    return SidecarProcess(tmp_path / "active" / "run-fuzz", "--heartbeat", "0.2", "--gpu", "none",
                          "--no-kmsg", env={"HOME": str(home), "RGT_DEADMAN": "off"}).start()


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Tuple[SidecarProcess, Client]]:
    sc = start_sidecar(tmp_path)
    client = Client(Endpoints.read(sc.run_dir / "rgt"))
    try:
        yield sc, client
    finally:
        client.close()
        sc.stop()


def fuzz(sc: SidecarProcess, client: Client, batches: int, per_batch: int, seed: int,
         after_batch: Callable[[int], None] = lambda _: None) -> Dict[str, int]:
    rng = random.Random(seed)
    answers: Dict[str, int] = {}
    for batch in range(batches):
        for kind, n in run_batch(client.dealer, [random_request(rng) for _ in range(per_batch)]).items():
            answers[kind] = answers.get(kind, 0) + n
        assert sc.proc is not None and sc.proc.poll() is None, sc.log.read_text()[-3000:]
        check_alive(client, sc.run_dir)
        after_batch(batch)
    return answers


def test_fuzz_live_sidecar_answers_20000_random_requests_and_keeps_its_journal(
        live: Tuple[SidecarProcess, Client]) -> None:
    sc, client = live
    started = time.monotonic()
    answers = fuzz(sc, client, BATCHES, PER_BATCH, SEED)
    print(f"fuzz: {BATCHES * PER_BATCH} requests in {time.monotonic() - started:.1f} s: {answers}")
    total = BATCHES * PER_BATCH
    assert sum(answers.values()) == total
    # Every family of request was met, not only garbage.
    for kind in ("hello", "since", "renew", "manifest", "error:refused", "refused:bad_request",
                 "refused:unknown_op", "refused:version", "refused:too_large"):
        assert answers.get(kind, 0) > 0, (kind, answers)
    seen = len(heartbeats(sc.run_dir))   # every reply has arrived: the next beat counts them all
    beat = wait_until(lambda: heartbeat_after(sc.run_dir, seen, total),
                      what="a heartbeat counting every request")
    assert beat["request_errors"] == 0 and beat["requests_dropped"] == 0, beat
    assert beat["refused"] == sum(n for k, n in answers.items() if k.startswith("refused:")), (beat, answers)
    assert "Traceback" not in sc.log.read_text()   # how long it took is printed above, never asserted


def test_the_checker_catches_a_wrong_answer() -> None:
    # The oracle itself: a reply that does not match what the codec says must fail it.
    frames = [b'{"v":1,"id":"\\ud800","op":"hello"}']
    with pytest.raises(AssertionError):
        check_reply(frames, ErrorReply(id="", code="internal", message="UnicodeEncodeError"))
    assert check_reply(frames, ErrorReply(id="", code="bad_request", message="x")) == "refused:bad_request"
    with pytest.raises(AssertionError):
        check_reply([b'{"v":1,"id":"a","op":"hello"}'], ErrorReply(id="a", code="internal", message="x"))
