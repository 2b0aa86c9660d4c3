"""A fake sidecar: `python sidecar.py SCENARIO.json RUN_DIR`. It binds where a real one would (the run's
rgt/ dir, published in endpoints.json) and answers hello and since with what the scenario says: another
run's id, another host, events no decoder should accept, replies of any size. Ended by the test, by pid
(or by itself after LIFETIME_S).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import zmq

LIFETIME_S = 300.0


def _frame(obj: Any) -> bytes:
    return obj.encode("utf-8", "surrogatepass") if isinstance(obj, str) else json.dumps(obj).encode()


def main() -> int:
    scenario_path, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
    sc: Dict[str, Any] = json.loads(scenario_path.read_text())
    rgt = run_dir / "rgt"
    rgt.mkdir(parents=True, exist_ok=True)
    ctx = zmq.Context()
    router, pub = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB)
    for sock in (router, pub):
        sock.setsockopt(zmq.LINGER, 0)
    ctl_ep, pub_ep = f"ipc://{rgt}/ctl", f"ipc://{rgt}/pub"
    router.bind(ctl_ep)
    pub.bind(pub_ep)
    (rgt / "endpoints.json").write_text(json.dumps({"pub": pub_ep, "ctl": ctl_ep, "pid": 0}))
    # events: [{"seq": N, "frame": <dict or raw JSON text>}]; since answers those above the asked seq.
    events: List[Dict[str, Any]] = sc.get("events", [])
    last_seq = max([int(e["seq"]) for e in events], default=0)
    log = open(scenario_path.with_name("requests.jsonl"), "a")
    sys.stdout.write("ready\n")   # the fake onbox answers the launch once it reads this
    sys.stdout.flush()
    sys.stdout.close()
    deadline = time.monotonic() + LIFETIME_S
    while time.monotonic() < deadline:
        if not router.poll(200):
            continue
        ident, *frames = router.recv_multipart()
        try:
            req = json.loads(frames[0])
        except ValueError:
            continue
        log.write(json.dumps(req) + "\n")
        log.flush()
        rid, op = req.get("id", ""), req.get("op")
        head: Dict[str, Any] = {"v": 1, "id": rid, "op": op}
        extra: List[bytes] = []
        if op == "hello":
            head.update(protocol_version=1, package_version="0.1.0", boot_id=sc.get("boot_id", "evil-boot"),
                        host=sc.get("host", "evilbox"), run=sc.get("run", ""),
                        run_meta=sc.get("run_meta", {}), last_seq=last_seq, oldest_seq=1 if last_seq else 0)
            head.update(sc.get("hello_extra", {}))
            pad = int(sc.get("hello_pad_bytes", 0))
            if pad:
                head["run_meta"] = {"pad": "x" * pad}
        elif op == "since":
            after = int(req.get("seq", 0))
            limit = int(req.get("limit", 1000))
            extra = [_frame(e["frame"]) for e in events if int(e["seq"]) > after][:limit]
            head.update(count=len(extra), more=False, last_seq=last_seq, oldest_seq=1 if last_seq else 0)
        else:
            head.update(op="error", code="unknown_op", message="the fake sidecar does not do that")
        router.send_multipart([ident, json.dumps(head).encode(), *extra])
    return 0


if __name__ == "__main__":
    sys.exit(main())
