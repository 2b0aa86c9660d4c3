"""Pull and verify about 2 GB of checkpoints: rgt against the plain tools people use today.

A throw-away sshd on 127.0.0.1 plays the box (tests/sshbox.py). A job launched there with
`rgt launch` writes N safetensors checkpoints of random bytes (random: delta transfer and
compression cannot shortcut them) and waits; custody hashes each. Then:

- pull: `rgt pull RUN --to DIR` (fresh manifest on the box, one rsync over the ControlMaster with the
  exact file list, staging, size check, rename) against a plain `rsync -a` of the same files over a
  fresh ssh connection. Target ratio (rgt / rsync) <= 1.1.
- verify: `rgt verify DIR` (roster, sizes, SHA-256 in parallel, safetensors parsed) against
  `sha256sum` over the same files. Target ratio (sha256sum time / rgt time) >= 1.0.

    .venv/bin/python bench/pull_verify.py [--files 8] [--mib 256]

Prints a table and writes bench/results/pull_verify.json.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from boxrig import BoxRig, write_results

JOB = """
import json, os, sys, time
n, mib = int(sys.argv[1]), int(sys.argv[2])
ckpt = os.environ["RGT_CKPT_DIR"]
os.makedirs(ckpt, exist_ok=True)
size = mib << 20
header = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
header += b" " * (-len(header) % 8)
for i in range(n):
    tmp = os.path.join(ckpt, f".step{i:06d}.tmp")
    with open(tmp, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        left = size
        while left:
            chunk = os.urandom(min(left, 8 << 20))
            f.write(chunk)
            left -= len(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt, f"step{i:06d}.safetensors"))
    with open(os.environ["RGT_METRICS"], "a") as m:
        m.write(json.dumps({"step": i, "loss": 1.0 / (i + 1)}) + "\\n")
while not os.path.exists(os.path.join(os.environ["RGT_RUN_DIR"], "stop")):
    time.sleep(0.2)
"""


def timed(argv: List[str], env: Dict[str, str]) -> float:
    t = time.monotonic()
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=1800)
    return time.monotonic() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--mib", type=int, default=256, help="size of each checkpoint")
    args = ap.parse_args()
    with BoxRig() as rig:
        env = rig.env
        rgt = rig.rgt
        run, run_dir = rig.launch(sys.executable, "-c", JOB, str(args.files), str(args.mib))
        print(f"writing {args.files} x {args.mib} MiB of random checkpoints on the box ...", flush=True)
        rig.wait_stored(run, "ckpt.saved", args.files, timeout_s=900)
        root, box = rig.root, rig.box
        files = sorted((run_dir / "checkpoints").glob("*.safetensors"))
        total = sum(f.stat().st_size for f in files)

        pulled = root / "pulled"
        t_pull = timed([*rgt, "pull", run, "--to", str(pulled), "--json"], env)
        plain = root / "plain"
        plain.mkdir()
        listing = root / "files.txt"
        listing.write_text("".join(f"{f.relative_to(run_dir)}\n" for f in files))
        t_rsync = timed(["rsync", "-a", "--files-from", str(listing), "-e",
                         f"ssh -F {box.config_file} -o ControlPath=none",
                         f"{box.alias}:{run_dir}/", str(plain) + "/"], env)

        t_verify = timed([*rgt, "verify", str(pulled), "--json"], env)
        t_sha = timed(["sha256sum", *[str(p) for p in sorted(plain.rglob("*.safetensors"))]], env)
        mb = total / 1e6
        report: Dict[str, Any] = {
            "files": len(files), "total_bytes": total, "cores": os.cpu_count(),
            "rgt_pull_s": round(t_pull, 3), "plain_rsync_s": round(t_rsync, 3),
            "pull_ratio": round(t_pull / t_rsync, 3),
            "rgt_verify_s": round(t_verify, 3), "sha256sum_s": round(t_sha, 3),
            "verify_ratio": round(t_sha / t_verify, 3),
            "rgt_pull_mb_s": round(mb / t_pull, 1), "plain_rsync_mb_s": round(mb / t_rsync, 1),
            "rgt_verify_mb_s": round(mb / t_verify, 1), "sha256sum_mb_s": round(mb / t_sha, 1),
        }
        print(f"{'':<34}{'seconds':>9}{'MB/s':>9}")
        print(f"{'rgt pull (manifest, rsync, move)':<34}{t_pull:>9.2f}{report['rgt_pull_mb_s']:>9.0f}")
        print(f"{'plain rsync -a over ssh':<34}{t_rsync:>9.2f}{report['plain_rsync_mb_s']:>9.0f}")
        print(f"{'rgt verify (all proofs)':<34}{t_verify:>9.2f}{report['rgt_verify_mb_s']:>9.0f}")
        print(f"{'sha256sum':<34}{t_sha:>9.2f}{report['sha256sum_mb_s']:>9.0f}")
        print(f"pull ratio {report['pull_ratio']} (target <= 1.1); verify ratio {report['verify_ratio']} "
              f"(sha256sum / rgt, target >= 1.0); {mb:.0f} MB, {os.cpu_count()} cores")
        write_results("pull_verify", report)
        return 0


if __name__ == "__main__":
    sys.exit(main())
