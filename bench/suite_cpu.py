"""What each test file costs the machine in CPU: where `make test`'s time goes on two cores.

The suite is bound by CPU more than by its waits (the jobs' `import torch`, the frameworks, the
processes each test starts), so a test's wall time, inflated by whatever ran beside it, says
little. This runs the pytest suite with bench/suite_cpu_plugin.py: every xdist worker in a cgroup
of its own, every test's CPU read from the cgroup's counter around it, the processes it started
in the background included.

    sudo .venv/bin/python bench/suite_cpu.py [--workers 6] [--top 25] [PYTEST ARGS...]

Prints the costliest files and tests and writes bench/results/suite_cpu.json. Needs root (a
cgroup); the tests it runs end what they start.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from boxrig import REPO, write_results
from suite_cpu_plugin import cgroup_base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--top", type=int, default=25)
    args, pytest_args = ap.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="rgt-suite-cpu-") as out:
        cgroup = f"rgt-suite-cpu-{os.getpid()}"
        env = {**os.environ, "RGT_SUITE_CPU_DIR": out, "RGT_SUITE_CPU_CGROUP": cgroup,
               "PYTHONPATH": os.pathsep.join([str(REPO / "bench"), os.environ.get("PYTHONPATH", "")])}
        began = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", str(args.workers), "--dist",
                               "loadgroup", "-p", "suite_cpu_plugin", "-p", "no:cacheprovider", *pytest_args],
                              cwd=REPO, env=env, check=False)
        wall_s = time.monotonic() - began
        base = cgroup_base()
        if base is not None and (base / cgroup).is_dir():   # empty once the workers are gone
            for cg in sorted((base / cgroup).iterdir()):
                if cg.is_dir():
                    cg.rmdir()
            (base / cgroup).rmdir()
        rows: List[Dict[str, Any]] = [json.loads(line) for f in Path(out).glob("*.jsonl")
                                      for line in f.read_text().splitlines()]
    if not rows:
        print("no test was measured: run as root on a machine with cgroup v2 or v1's cpuacct")
        return 1
    by_file: Dict[str, List[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        f = by_file[r["id"].split("::")[0]]
        f[0], f[1], f[2] = f[0] + r["cpu_s"], f[1] + r["wall_s"], f[2] + 1
    total = sum(r["cpu_s"] for r in rows)
    files = sorted(by_file.items(), key=lambda kv: -kv[1][0])
    print(f"{len(rows)} tests, {total:.0f} CPU-s in tests, {wall_s:.0f} s wall, "
          f"pytest exit {done.returncode}")
    print(f"{'CPU s':>8} {'share':>6} {'tests':>5}  file")
    for name, (cpu, _, n) in files[:args.top]:
        print(f"{cpu:8.1f} {cpu / total:6.1%} {int(n):5d}  {name}")
    tests = sorted(rows, key=lambda r: -r["cpu_s"])[:args.top]
    print(f"\n{'CPU s':>8} {'wall s':>7}  test")
    for r in tests:
        print(f"{r['cpu_s']:8.1f} {r['wall_s']:7.1f}  {r['id'][:120]}")
    path = write_results("suite_cpu", {
        "workers": args.workers, "wall_s": round(wall_s, 1), "cpu_s": round(total, 1),
        "tests": len(rows), "pytest_exit": done.returncode,
        "files": [{"file": k, "cpu_s": round(v[0], 2), "wall_s": round(v[1], 2), "tests": int(v[2])}
                  for k, v in files],
        "costliest_tests": tests})
    print(f"\nwrote {path}")
    return 0 if done.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
