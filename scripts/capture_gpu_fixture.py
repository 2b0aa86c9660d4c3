"""Capture what a real GPU box reports, as a test fixture (run it where a GPU is lent).

Runs the NVML probe (a few samples per GPU) and `rgt-onbox health --json`,
drops what identifies the machine (UUIDs, serials, host names, process names,
pids), and writes tests/onbox/data/real_gpu/<gpu-name>.json. The `gpu`-marked
tests replay these files through the detectors on machines without a GPU.

    python scripts/capture_gpu_fixture.py [--samples 5] [--tag idle] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from onbox.sources.nvml import NvmlProbe  # noqa: E402


def scrub_sample(sample: Any) -> Dict[str, Any]:
    data = dataclasses.asdict(sample)
    data["processes"] = [{"used_memory_bytes": p["used_memory_bytes"]} for p in data.get("processes", [])]
    return data


def scrub_info(info: Any, index: int) -> Dict[str, Any]:
    data = dataclasses.asdict(info)
    data["uuid"] = f"GPU-00000000-0000-0000-0000-{index:012d}"
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--tag", default="", help="suffix for the file name, e.g. idle or load")
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "onbox" / "data" / "real_gpu")
    args = ap.parse_args()
    probe = NvmlProbe()
    cap = probe.init()
    try:
        if not cap.available:
            print(f"no GPU: {cap.reason}", file=sys.stderr)
            return 2
        devices = probe.devices()
        samples: List[List[Dict[str, Any]]] = [[] for _ in devices]
        for _ in range(args.samples):
            for i, dev in enumerate(devices):
                samples[i].append(scrub_sample(probe.sample(dev.index)))
            time.sleep(1.0)
    finally:
        probe.close()
    health = subprocess.run([sys.executable, "-m", "onbox.cli", "health", "--seconds", "3", "--json"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    capture = {
        "schema": 1, "captured": time.strftime("%Y-%m"),
        "capability": {**dataclasses.asdict(cap)},
        "devices": [scrub_info(d, i) for i, d in enumerate(devices)],
        "samples": samples,
        "health_exit": health.returncode,
        "health": json.loads(health.stdout) if health.stdout.strip().startswith("{") else health.stdout,
    }
    text = json.dumps(capture, indent=1, default=str)
    text = re.sub(r'"(host|hostname|serial|node)":\s*"[^"]*"', r'"\1": "redacted"', text)
    text = re.sub(r'"pid":\s*\d+', '"pid": 0', text)
    text = re.sub(r'pids [\d, ]+', 'pids 0', text)
    name = re.sub(r"[^A-Za-z0-9]+", "-", devices[0].name or "gpu").strip("-").lower()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}{'-' + args.tag if args.tag else ''}.json"
    path.write_text(text + "\n")
    print(f"wrote {path} ({len(devices)} GPUs, {args.samples} samples each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
