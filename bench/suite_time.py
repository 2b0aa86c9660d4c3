"""How long `make test` takes, phase by phase, from a fresh clone and again with its venvs made.

The suite's speed is measured here, never asserted in a test. This clones the repository at a
revision (as CI has it), then runs the phases of `make test` one after the other, as its recipe
does (`test-setup`: the venvs and system packages; `test-checks`: lint, mypy and the assert-rewrite
caches; `pytest`: the main suite; `py39`: the 3.9 leg), twice: the first pass is the fresh run
(set-up included; pip's cache is whatever this machine has), the second the warm one (venvs made).
For each phase it records the wall time and how busy the whole machine was (/proc/stat: near 100 %
means the phase is bound by the cores, not by waits), and from the main suite pytest's closing line
and its 15 slowest tests.

    .venv/bin/python bench/suite_time.py [--rev HEAD] [--burners 0] [--passes fresh,warm]

Run it on an otherwise quiet machine for the quiet figures (issue 43 asks for make test <= 10 min
fresh and <= 6 min warm on 2 cores), or with --burners N busy loops beside it for loaded ones.
Prints a table, writes bench/results/suite_time.json (each phase's output beside it in
bench/results/suite_time/) and appends one line to the tracked bench/series/suite_time.jsonl, so
figures add up across sessions. Ends what it started by pid; Ctrl-C or SIGTERM interrupts the phase
in progress (SIGINT to its process group, so pytest's fixtures end what the tests started).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from boxrig import REPO, RESULTS, write_results
from suite_series import SUMMARY, clone, run_logged

from controller.render import table

RECORD = REPO / "bench" / "series" / "suite_time.jsonl"
PHASES = ("test-setup", "test-checks", "pytest", "py39")
# one line of pytest's --durations table, e.g. "90.51s call     tests/slurm/test_x.py::test_y"
DURATION = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S+)$", re.M)


def cpu_ticks() -> Tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
    return sum(fields) - idle, sum(fields)


def run_phase(repo: Path, phase: str, log: Path) -> Dict[str, Any]:
    busy0, total0 = cpu_ticks()
    began = time.monotonic()
    rc = run_logged(["make", "--no-print-directory", phase], repo, log)
    wall = time.monotonic() - began
    busy1, total1 = cpu_ticks()
    text = log.read_text(errors="replace")
    summary = SUMMARY.search(text)
    return {"phase": phase, "rc": rc, "wall_s": round(wall, 1),
            "busy_pct": round(100 * (busy1 - busy0) / max(1, total1 - total0)),
            "cpu_s": round((busy1 - busy0) / os.sysconf("SC_CLK_TCK")),
            "counts": summary.group(1) if summary else "",
            "flaky": sorted(set(re.findall(r"^FLAKY (\S+):", text, re.M))),
            "slowest": [{"s": float(m.group(1)), "when": m.group(2), "test": m.group(3)}
                        for m in DURATION.finditer(text)][:15],
            "log": str(log.relative_to(REPO))}


def one_pass(repo: Path, name: str, logs: Path, stamp: str) -> Dict[str, Any]:
    phases: List[Dict[str, Any]] = []
    for phase in PHASES:
        r = run_phase(repo, phase, logs / f"{stamp}-{name}-{phase}.log")
        phases.append(r)
        print(f"{name} {phase}: rc {r['rc']}, {r['wall_s']:.0f} s, {r['busy_pct']} % busy "
              f"{r['counts']}", flush=True)
        if r["rc"] != 0:
            break
    ok = all(p["rc"] == 0 for p in phases) and len(phases) == len(PHASES)
    return {"pass": name, "ok": ok, "wall_s": round(sum(p["wall_s"] for p in phases), 1), "phases": phases}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="the revision to clone (default HEAD)")
    ap.add_argument("--burners", type=int, default=0, help="busy loops beside the runs (default 0: quiet)")
    ap.add_argument("--passes", default="fresh,warm",
                    help="fresh (a new clone, set-up included) and/or warm (again, venvs made)")
    ap.add_argument("--record", type=Path, default=RECORD,
                    help=f"the tracked record appended to (default {RECORD.relative_to(REPO)})")
    args = ap.parse_args()
    names = [n for n in args.passes.split(",") if n]
    if not names or set(names) - {"fresh", "warm"}:
        ap.error("--passes takes fresh, warm or fresh,warm")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logs = RESULTS / "suite_time"
    logs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    passes: List[Dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="rgt-suite-time-", dir="/tmp") as tmp:
            repo = Path(tmp) / "clone"
            rev = clone(args.rev, repo)
            print(f"make test's phases at {rev}, {args.burners} busy loop(s) beside, in {repo}", flush=True)
            for name in ("fresh", "warm"):
                if name == "warm" and ("warm" not in names or (passes and not passes[-1]["ok"])):
                    break   # fresh only, or a failed fresh pass
                result = one_pass(repo, name, logs, f"{stamp}-{rev}")
                if name in names:
                    passes.append(result)
                    write_results("suite_time", {"rev": rev, "burners": args.burners, "passes": passes})
    finally:
        for p in spin:
            p.send_signal(signal.SIGKILL)
            p.wait()
    line = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rev": rev, "burners": args.burners,
            "cores": os.cpu_count(),
            "passes": [{**{k: p[k] for k in ("pass", "ok", "wall_s")},
                        "phases": {ph["phase"]: ph["wall_s"] for ph in p["phases"]}} for p in passes]}
    args.record.parent.mkdir(parents=True, exist_ok=True)
    with args.record.open("a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
    rows = []
    for phase in PHASES:
        cells = []
        for p in passes:
            found = [ph for ph in p["phases"] if ph["phase"] == phase]
            cells.append(f"{found[0]['wall_s']:.0f} s ({found[0]['busy_pct']} % busy)" if found else "-")
        rows.append([phase, *cells])
    rows.append(["make test", *(f"{p['wall_s'] / 60:.1f} min" + ("" if p["ok"] else " FAILED")
                                for p in passes)])
    print(table(["PHASE", *(p["pass"].upper() for p in passes)], rows))
    main_leg = next((ph for ph in passes[0]["phases"] if ph["phase"] == "pytest"), None) if passes else None
    if main_leg and main_leg["slowest"]:
        print(table(["SECONDS", "WHEN", "SLOWEST TESTS (" + passes[0]["pass"] + ")"],
                    [[f"{t['s']:.1f}", t["when"], t["test"]] for t in main_leg["slowest"]]))
    print(f"results in {RESULTS / 'suite_time.json'}; appended to {args.record.relative_to(REPO)}")
    return 0 if passes and all(p["ok"] for p in passes) else 1


if __name__ == "__main__":
    sys.exit(main())
