"""`make test` again and again beside busy loops: does the suite pass every time on a loaded machine?

A test that passes on a quiet machine and fails when the cores are busy depends on timing, and
CI loses the whole landing to it. This clones the repository at a revision (a fresh clone, as CI
has), then runs `.ci/run` there N times in a row, each beside --burners processes spinning
`while True: pass`, and records each run's wall time, result and pytest's closing lines.

    .venv/bin/python bench/suite_series.py [--runs 10] [--burners 2] [--rev HEAD] [--keep-going]

Between runs the clone is cleaned (`git clean -xdf` but its venvs and wheelhouse). `.ci/run`
itself clones again under an odd path and builds that clone's venvs every run (pip's cache warm
after the first), as CI does on a fresh machine. A run counts as passed only when `make test` passed with
no test printed FLAKY (failed, then passed on its lone re-run: tests/rerun.py). Stops at the first
failure unless --keep-going. Prints a table and writes bench/results/suite_series.json (after
every run), each run's output beside it in bench/results/suite_series/<UTC time>-<rev>-run<N>.log
(named so that a later series never writes over an earlier one's logs).

Each run is also appended, as one JSON line, to the tracked bench/series/suite_series.jsonl
(commit it): runs add up across sessions and days, and the closing line counts the green runs in
a row at its end under load (two busy loops or more; a quieter run neither counts nor breaks it).

Ends the busy loops it started, by pid; on SIGTERM or Ctrl-C it also interrupts the run in
progress (SIGINT to its process group, so pytest's fixtures end what the tests started) and
waits for it.
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
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from boxrig import REPO, RESULTS, write_results

from controller.render import table

KEEP = (".venv", ".venv39", ".wheelhouse")
# Every run ever made, one JSON line each, in the repository: runs add up across sessions and days.
RECORD = REPO / "bench" / "series" / "suite_series.jsonl"
# pytest's closing line, e.g. "2506 passed, 3 skipped in 536.21s (0:08:56)" or "1 failed, 2505 passed ..."
SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in ([\d.]+)s", re.M)


def clone(rev: str, where: Path) -> str:
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(where)], check=True)
    subprocess.run(["git", "-C", str(where), "checkout", "-q", rev], check=True)
    return subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()


def run_logged(cmd: List[str], cwd: Path, log: Path, env: Optional[Dict[str, str]] = None) -> int:
    """Run `cmd` in a session of its own, its output to `log`; its exit status. Interrupted (Ctrl-C,
    SIGTERM), it sends SIGINT to the command's process group, so pytest's fixtures end what the
    tests started, and waits for it."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            return proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait()
            raise


def one_run(repo: Path, burners: int, log: Path) -> Dict[str, Any]:
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    began = time.monotonic()
    try:
        rc = run_logged(["bash", ".ci/run"], repo, log, {**os.environ, "CI": "true"})
    finally:
        for p in spin:
            p.send_signal(signal.SIGKILL)
            p.wait()
    text = log.read_text(errors="replace")
    legs = [{"counts": m.group(1), "seconds": float(m.group(2))} for m in SUMMARY.finditer(text)]
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)))
    # make test passes a test that failed and then passed alone (tests/rerun.py); here it is a failure
    flaky = sorted(set(re.findall(r"^FLAKY (\S+):", text, re.M)))
    return {"rc": rc, "ok": rc == 0 and not flaky, "wall_s": round(time.monotonic() - began, 1),
            "legs": legs, "failed": failed, "flaky": flaky, "log": str(log.relative_to(REPO))}


def append_record(record: Path, rev: str, burners: int, r: Dict[str, Any]) -> None:
    """One line for this run: when, at which revision, beside how many busy loops, and its result."""
    line = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rev": rev, "burners": burners,
            "cores": os.cpu_count(), **{k: r[k] for k in ("ok", "rc", "wall_s", "legs", "failed", "flaky")}}
    record.parent.mkdir(parents=True, exist_ok=True)
    with record.open("a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def green_streak(record: Path, min_burners: int = 2) -> int:
    """How many runs in a row at the end of the record passed with no FLAKY test, each beside at
    least `min_burners` busy loops (a quieter run neither counts nor breaks the streak)."""
    streak = 0
    try:
        lines = record.read_text(encoding="utf-8").splitlines()
    except OSError:
        return 0
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or (row.get("burners") or 0) < min_burners:
            continue
        streak = streak + 1 if row.get("ok") is True else 0
    return streak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--burners", type=int, default=2, help="busy loops beside each run (default 2)")
    ap.add_argument("--record", type=Path, default=RECORD,
                    help=f"the tracked record each run is appended to (default {RECORD.relative_to(REPO)})")
    ap.add_argument("--rev", default="HEAD", help="the revision to clone (default HEAD)")
    ap.add_argument("--keep-going", action="store_true", help="go on after a failed run")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the runs' clean-up, as for Ctrl-C
    logs = RESULTS / "suite_series"
    logs.mkdir(parents=True, exist_ok=True)
    runs: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rgt-series-", dir="/tmp") as tmp:
        repo = Path(tmp) / "clone"
        rev = clone(args.rev, repo)
        print(f"series of {args.runs} at {rev}, {args.burners} busy loop(s) beside, in {repo}", flush=True)
        for n in range(1, args.runs + 1):
            if n > 1:
                subprocess.run(["git", "-C", str(repo), "clean", "-q", "-xdf", *(f"-e{k}" for k in KEEP)],
                               check=True)
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            r = {"run": n, **one_run(repo, args.burners, logs / f"{stamp}-{rev}-run{n}.log")}
            runs.append(r)
            append_record(args.record, rev, args.burners, r)
            legs = "; ".join(f"{leg['counts']} in {leg['seconds']:.0f}s" for leg in r["legs"])
            named = " ".join([*r["failed"], *(f"FLAKY {t}" for t in r["flaky"])])
            print(f"run {n}: rc {r['rc']}, {r['wall_s']:.0f} s: {legs} {named}", flush=True)
            write_results("suite_series", {"rev": rev, "burners": args.burners, "runs": runs})
            if not r["ok"] and not args.keep_going:
                break
    passed = sum(r["ok"] for r in runs)
    rows = [[str(r["run"]), "pass" if r["ok"] else f"FAIL rc {r['rc']}" if r["rc"] else "FLAKY",
             f"{r['wall_s'] / 60:.1f} min",
             "; ".join(leg["counts"] for leg in r["legs"])] for r in runs]
    print(table(["RUN", "RESULT", "WALL", "PYTEST LEGS"], rows))
    print(f"{passed} of {len(runs)} passed at {rev}; results in {RESULTS / 'suite_series.json'}")
    record = args.record.resolve()
    shown = record.relative_to(REPO) if record.is_relative_to(REPO) else record   # --record may lie elsewhere
    print(f"green in a row under load (>= 2 busy loops), by {shown}: {green_streak(record)}")
    return 0 if passed == len(runs) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
