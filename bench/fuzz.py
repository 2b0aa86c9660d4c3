"""Fuzz throughput: random frames through the decoders, random control requests through a live
sidecar; the number that matters is crashes = 0 (the box is untrusted).

    .venv/bin/python bench/fuzz.py [--frames 100000] [--requests 100000] [--quick] [--seed 15]

Decoders: frames from the generator of tests/onbox/test_sidecar_fuzz.py (valid requests, near
misses, hostile JSON text, plain bytes), event frames with a byte changed or a hostile value
written into a field, and multi-frame replies, each through decode_json, decode_event,
decode_request and decode_reply. Anything but ProtocolError is a crash. The frames are made
first; only decoding is timed. decode_event of a valid heartbeat frame is timed on its own too.

Live: a real `rgt-onbox serve` on ipc sockets in a temp run dir gets the requests in batches of
500, pipelined; each reply is checked against what the codec says it must be (a wrong answer, a
missing one or a dead sidecar is a crash), and after each batch the sidecar answers hello and its
journal is seqs 1..N. The default run (100,000 of each) takes about a minute on two cores.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from protocol import (  # noqa: E402
    Event,
    ProtocolError,
    decode_event,
    decode_json,
    decode_reply,
    decode_request,
    encode_event,
)
from protocol.endpoints import Endpoints  # noqa: E402
from tests.helpers import Client  # noqa: E402
from tests.onbox.test_sidecar_fuzz import (  # noqa: E402
    HOSTILE_TEXT,
    PER_BATCH,
    _mutate,
    check_alive,
    last_heartbeat,
    random_request,
    run_batch,
    start_sidecar,
)

EVENT_FIELDS = [b"v", b"run", b"host", b"seq", b"ts", b"kind", b"sev", b"data"]
HEARTBEAT = Event(run="run-1", host="box", seq=123456, ts=1700000000.25, kind="heartbeat", sev="info", data={
    "boot_id": "0123456789abcdef0123456789abcdef", "interval_s": 30.0, "uptime_s": 1234.5, "last_seq": 123456,
    "journal_bytes": 12345678, "degraded": False, "ring_events": 0, "lost_seqs": None, "requests": 12,
    "refused": 0, "too_large": 0, "cpu_pct": 1.5, "rss_bytes": 45678901,
    "monitor": {"gpu": "on", "kmsg": True, "samples": 1234, "errors": 0},
    "training": {"step": 1000, "nonfinite": [], "bad_lines": 0, "loss": 0.1234},
    "custody": {"watched": 3, "recorded": 12, "pending": 0}})


def random_frames(rng: random.Random, count: int) -> List[List[bytes]]:
    """`count` messages (lists of frames) for the decoders."""
    valid = encode_event(HEARTBEAT)
    out: List[List[bytes]] = []
    while len(out) < count:
        roll = rng.random()
        if roll < 0.45:
            out.append(random_request(rng))
        elif roll < 0.65:
            out.append([_mutate(rng, valid)])
        elif roll < 0.90:
            field = rng.choice(EVENT_FIELDS)
            head, _, tail = valid.partition(b'"' + field + b'":')
            rest = tail.split(b",", 1)[1] if b"," in tail and field != b"data" else b'"x":1}'
            out.append([head + b'"' + field + b'":' + rng.choice(HOSTILE_TEXT) + b"," + rest])
        else:
            header = b'{"v":1,"id":"s","op":"since","count":%d,"more":false,"last_seq":9,"oldest_seq":1}'
            parts = [_mutate(rng, valid) if rng.random() < 0.5 else valid for _ in range(rng.randint(0, 5))]
            out.append([header % rng.randint(0, 5), *parts])
    return out


DECODERS: Dict[str, Callable[[List[bytes]], Any]] = {
    "decode_json": lambda m: decode_json(m[0]),
    "decode_event": lambda m: decode_event(m[0]),
    "decode_request": decode_request,
    "decode_reply": decode_reply,
}


def bench_decoders(frames: int, seed: int) -> Dict[str, Any]:
    messages = random_frames(random.Random(seed), frames)
    examples: List[str] = []
    counts = {"accepted": 0, "refused": 0, "crashes": 0}
    t0 = time.perf_counter()
    for message in messages:
        for name, decode in DECODERS.items():
            try:
                decode(message)
                counts["accepted"] += 1
            except ProtocolError:
                counts["refused"] += 1
            except Exception as e:  # a crash: what the bench is here to count
                counts["crashes"] += 1
                if len(examples) < 5:
                    examples.append(f"{name}: {type(e).__name__}: {e!s:.100} on {message[0][:80]!r}")
    wall = time.perf_counter() - t0
    valid = encode_event(HEARTBEAT)
    n = 20_000
    t1 = time.perf_counter()
    for _ in range(n):
        decode_event(valid)
    per_event = (time.perf_counter() - t1) / n
    return {"frames": frames, "decodes": frames * len(DECODERS), "wall_s": round(wall, 3),
            "frames_per_s": round(frames / wall), "decodes_per_s": round(frames * len(DECODERS) / wall),
            "accepted": counts["accepted"], "refused": counts["refused"],
            "crashes": counts["crashes"], "crash_examples": examples,
            "valid_heartbeat_bytes": len(valid), "valid_decode_event_us": round(per_event * 1e6, 2)}


def bench_live(requests: int, seed: int) -> Dict[str, Any]:
    batches = max(1, requests // PER_BATCH)
    rng = random.Random(seed)
    answers: Dict[str, int] = {}
    crashes: List[str] = []
    with tempfile.TemporaryDirectory(prefix="rgt-fuzz-") as t:
        sc = start_sidecar(Path(t))
        client = Client(Endpoints.read(sc.run_dir / "rgt"))
        wire_s = 0.0
        t0 = time.perf_counter()
        try:
            for _ in range(batches):
                batch = [random_request(rng) for _ in range(PER_BATCH)]
                t1 = time.perf_counter()
                try:
                    for kind, n in run_batch(client.dealer, batch).items():
                        answers[kind] = answers.get(kind, 0) + n
                    wire_s += time.perf_counter() - t1
                    check_alive(client, sc.run_dir)
                except AssertionError as e:  # a wrong or missing answer, a gap, a dead sidecar
                    crashes.append(f"{e!s:.300}")
                    break
            wall = time.perf_counter() - t0
            rss_mb = psutil.Process(sc.pid).memory_info().rss / 1e6
            sent = batches * PER_BATCH
            deadline = time.monotonic() + 10
            beat = None
            while beat is None and time.monotonic() < deadline and not crashes:
                beat = last_heartbeat(sc.run_dir, sent)
                if beat is None:
                    client.dealer.poll(100)
        finally:
            client.close()
            code = sc.stop()
        log = sc.log.read_text()
    if beat is not None and (beat["request_errors"] or beat["requests_dropped"]):
        crashes.append(f"sidecar counted {beat['request_errors']} failed and {beat['requests_dropped']} "
                       "dropped requests")
    if "Traceback" in log:
        crashes.append("a traceback in the sidecar's log")
    return {"requests": batches * PER_BATCH, "batch": PER_BATCH, "wall_s": round(wall, 2),
            "requests_per_s": round(batches * PER_BATCH / wall), "wire_requests_per_s":
            round(batches * PER_BATCH / wire_s) if wire_s else None, "answers": dict(sorted(answers.items())),
            "sidecar_rss_mb_end": round(rss_mb, 1), "sidecar_exit": code, "crashes": len(crashes),
            "crash_examples": crashes[:5]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=100_000, help="messages through the decoders")
    ap.add_argument("--requests", type=int, default=100_000, help="requests to the live sidecar")
    ap.add_argument("--quick", action="store_true", help="10,000 frames and 5,000 requests (seconds)")
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fuzz.json")
    args = ap.parse_args()
    if args.quick:
        args.frames, args.requests = 10_000, 5_000
    started = time.perf_counter()
    dec = bench_decoders(args.frames, args.seed)
    live = bench_live(args.requests, args.seed)
    result = {
        "bench": "fuzz", "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "seed": args.seed,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "decoders": dec, "live": live, "total_s": round(time.perf_counter() - started, 1),
        "targets": {"crashes": 0},
    }
    result["pass"] = dec["crashes"] == 0 and live["crashes"] == 0
    rows = [
        ("decoder messages", f"{dec['frames']:,}", ""),
        ("  through 4 decoders", f"{dec['frames_per_s']:,} frames/s", f"{dec['decodes_per_s']:,} decodes/s"),
        ("  accepted / refused", f"{dec['accepted']:,} / {dec['refused']:,}", ""),
        ("  crashes", f"{dec['crashes']}", "= 0"),
        ("  valid heartbeat", f"{dec['valid_decode_event_us']} us",
         f"decode_event, {dec['valid_heartbeat_bytes']} B"),
        ("live requests", f"{live['requests']:,}", f"batches of {live['batch']}"),
        ("  rate, checks included", f"{live['requests_per_s']:,} requests/s", ""),
        ("  rate on the wire", f"{live['wire_requests_per_s'] or 0:,} requests/s", ""),
        ("  sidecar RSS at end", f"{live['sidecar_rss_mb_end']} MB", ""),
        ("  crashes", f"{live['crashes']}", "= 0"),
    ]
    print(f"fuzz bench: seed {args.seed}, {result['total_s']} s")
    for name, value, note in rows:
        print(f"  {name:<26} {value:>24}   {note}")
    for example in dec["crash_examples"] + live["crash_examples"]:
        print(f"  crash: {example}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
