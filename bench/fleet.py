"""A fleet of light sidecars in one process: the box side of bench/daemon_scale.py.

Real sidecars cost the box 0.75 % of a core each (bench/controller_scale.py), so 256 of them
do not fit beside everything else on a 2-core machine; the controller's side does not care
what serves the protocol. Each run here has what a sidecar shows the controller: a ROUTER and a
PUB on unix sockets in <run_dir>/rgt/sock/, endpoints.json beside them, a journal (in memory),
hello / since answered as the sidecar does, a renewal refused as a box without a lease does. It
publishes what a training run's sidecar publishes at rest: sidecar.started and job.started, a
heartbeat every 30 s, a train.progress every 5 s (staggered over the runs). A run id sent to
its trigger socket (ipc://ROOT/fleet.trigger, a PULL) is published a train.nonfinite at once.

    python bench/fleet.py SPEC.json      (a list of {"run", "host", "run_dir"}; runs until SIGTERM)
"""
from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import zmq  # noqa: E402

from protocol import PACKAGE_VERSION, PROTOCOL_VERSION, Event, encode_event  # noqa: E402
from protocol.codec import decode_request, encode_reply  # noqa: E402
from protocol.control import ErrorReply, Hello, HelloReply, Since, SinceReply  # noqa: E402
from protocol.endpoints import Endpoints  # noqa: E402

HEARTBEAT_S = 30.0
PROGRESS_S = 5.0


class FakeRun:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], run: str, host: str, run_dir: Path) -> None:
        self.run, self.host = run, host
        rgt = run_dir / "rgt"
        sock = rgt / "sock"
        sock.mkdir(parents=True, exist_ok=True)
        os.chmod(sock, 0o700)
        self.router, self.pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
        for s in (self.router, self.pub):
            s.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"ipc://{sock}/ctl")
        self.pub.bind(f"ipc://{sock}/pub")
        Endpoints(pub=f"ipc://{sock}/pub", ctl=f"ipc://{sock}/ctl", pid=os.getpid()).write(rgt)
        self.boot = uuid.uuid4().hex[:12]
        self.journal: List[bytes] = []
        self.step = 0
        now = time.monotonic()
        self.next_heartbeat = now + random.uniform(0, HEARTBEAT_S)
        self.next_progress = now + random.uniform(0, PROGRESS_S)
        self.emit("sidecar.started", "info", {"boot_id": self.boot, "pid": os.getpid()})
        self.emit("job.started", "info", {"pid": os.getpid(), "command": ["python", "train.py"]})

    def emit(self, kind: str, sev: str, data: Dict[str, Any]) -> None:
        frame = encode_event(Event(run=self.run, host=self.host, seq=len(self.journal) + 1, ts=time.time(),
                                   kind=kind, sev=sev, data=data))
        self.journal.append(frame)
        self.pub.send(frame)

    def timers(self, now: float) -> None:
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + HEARTBEAT_S
            self.emit("heartbeat", "info", {"interval_s": HEARTBEAT_S, "uptime_s": 1.0})
        if now >= self.next_progress:
            self.next_progress = now + PROGRESS_S
            self.step += 3
            self.emit("train.progress", "info", {
                "step": self.step, "epoch": None, "steps_per_s": 0.6667, "data_age_s": 0.4,
                "scalars": {"loss": round(3.0 / (1.0 + 0.01 * self.step), 6)}})

    def answer(self) -> None:
        while True:
            try:
                who, *frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            req = decode_request(frames)
            last = len(self.journal)
            if isinstance(req, Hello):
                reply = encode_reply(HelloReply(id=req.id, protocol_version=PROTOCOL_VERSION,
                                                package_version=PACKAGE_VERSION, boot_id=self.boot,
                                                host=self.host, run=self.run, run_meta={}, last_seq=last,
                                                oldest_seq=1))
            elif isinstance(req, Since):
                page = self.journal[req.seq:req.seq + req.limit]
                head = SinceReply(id=req.id, events=(), more=req.seq + len(page) < last, last_seq=last,
                                  oldest_seq=1)
                reply = encode_reply(head, page)
            else:   # a renewal: this box has no lease (the subscriber stops asking)
                reply = encode_reply(ErrorReply(id=req.id, code="refused", message="no lease here"))
            self.router.send_multipart([who, *reply])


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    runs = {r["run"]: FakeRun(ctx, r["run"], r["host"], Path(r["run_dir"])) for r in spec["runs"]}
    trigger = ctx.socket(zmq.PULL)
    trigger.setsockopt(zmq.LINGER, 0)
    trigger.bind(f"ipc://{spec['trigger']}")
    poller = zmq.Poller()
    by_socket = {}
    for fake in runs.values():
        poller.register(fake.router, zmq.POLLIN)
        by_socket[fake.router] = fake
    poller.register(trigger, zmq.POLLIN)
    print("ready", flush=True)
    while not stop["now"]:
        ready = dict(poller.poll(50))
        for sock in ready:
            if sock is trigger:
                run = trigger.recv_string()
                if run in runs:
                    runs[run].emit("train.nonfinite", "critical", {
                        "state": "onset", "name": "loss", "value": "nan", "step": runs[run].step,
                        "epoch": None, "source": "metrics.jsonl"})
            else:
                by_socket[sock].answer()
        now = time.monotonic()
        for fake in runs.values():
            fake.timers(now)
    for fake in runs.values():
        fake.router.close()
        fake.pub.close()
    trigger.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
