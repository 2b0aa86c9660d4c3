"""`make test`'s pytest, with one re-run of each failed test, alone, in a fresh process.

    python -m tests.rerun [--max-reruns N] [--report FILE] -- PYTEST_ARGS...

The suite runs once with PYTEST_ARGS and this module loaded as a plugin (`-p tests.rerun`), which
notes every test that failed (in setup, call or teardown) with the first `E` line of its failure. When
the run fails only by such tests, each is run again on its own (`pytest NODEID`, no workers, the
same `-p`/`-o` options), one after the other:

- a test that fails again fails the run;
- one that passes is printed as `FLAKY NODEID: FIRST FAILURE`: the run passes, and
  bench/suite_series.py counts the run as a failure all the same.

No re-run happens when collection failed, the run was interrupted or broke (pytest's exit codes
other than 1), or more than --max-reruns tests failed (that is no flake). The report (JSON) says
what ran and why the run ended as it did. The same as CPython's `regrtest --rerun`: a flake never
costs a landing, and is never hidden. Remove the re-run once the series is green ten times in a row.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

FAILURES_ENV = "RGT_RERUN_FAILURES"   # where the plugin writes what failed (one JSON line each)
PYTEST_OK, PYTEST_FAILED = 0, 1


# ---- the plugin: what failed, as it is reported (in xdist's controller too) --------------------


_WORKER = [False]   # whether this process is an xdist worker (set at pytest_configure)


def pytest_configure(config: Any) -> None:
    # By the config, not $PYTEST_XDIST_WORKER: a suite run by a test inside a worker inherits that.
    _WORKER[0] = hasattr(config, "workerinput")


def _note(record: Dict[str, Any]) -> None:
    path = os.environ.get(FAILURES_ENV)
    if not path or _WORKER[0]:
        return   # workers' reports reach the controller, which notes them once
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


def _first_error(report: Any) -> str:
    """The failure's first `E` line (its assertion or exception), else its last line."""
    text = str(getattr(report, "longreprtext", "") or "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("E ")]
    return (errors[0] if errors else lines[-1] if lines else "failed")[:300]


def pytest_runtest_logreport(report: Any) -> None:
    if report.failed:
        _note({"nodeid": report.nodeid, "when": report.when, "first": _first_error(report)})


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _note({"nodeid": report.nodeid, "when": "collect", "first": _first_error(report)})


# ---- the runner ------------------------------------------------------------------------------------


def rerun_options(args: Sequence[str]) -> List[str]:
    """The options a lone re-run keeps: plugins (-p) and ini overrides (-o); not the workers, the
    selection (paths, -k, --ignore, --deselect) nor the reports (-r, --durations)."""
    kept: List[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-p", "-o") and i + 1 < len(args):
            if not (arg == "-p" and args[i + 1] == "tests.rerun"):
                kept += [arg, args[i + 1]]
            i += 2
            continue
        if arg.startswith(("-p", "-o")) and len(arg) > 2 and arg[2:] != "tests.rerun":
            kept.append(arg)
        i += 1
    return kept


def read_failures(path: Path) -> List[Dict[str, Any]]:
    found: List[Dict[str, Any]] = []
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return found
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("nodeid"), str):
            found.append(record)
    return found


def first_failures(records: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Each failed test once, with its first failure, in the order they failed."""
    by_test: Dict[str, Dict[str, Any]] = {}
    for record in records:
        by_test.setdefault(record["nodeid"], record)
    return by_test


def pytest(args: Sequence[str], env: Dict[str, str]) -> int:
    return subprocess.call([sys.executable, "-m", "pytest", *args], env=env)


def run(pytest_args: Sequence[str], max_reruns: int, report: Optional[Path], workdir: Path) -> int:
    failures_file = workdir / "failures.jsonl"
    failures_file.unlink(missing_ok=True)
    env = {**os.environ, FAILURES_ENV: str(failures_file)}
    code = pytest(["-p", "tests.rerun", *pytest_args], env)
    failed = first_failures(read_failures(failures_file))
    result: Dict[str, Any] = {"args": list(pytest_args), "first_exit": code,
                              "failed": list(failed.values()), "reruns": [], "flaky": []}
    why = ""
    if code == PYTEST_OK:
        why = "passed"
    elif code != PYTEST_FAILED:
        why = f"pytest exited {code} (interrupted, an internal error or a usage error): no re-run"
    elif not failed:
        why = "pytest failed and named no failed test: no re-run"
    elif any(r["when"] == "collect" for r in failed.values()):
        why = "collection failed: no re-run"
    elif len(failed) > max_reruns:
        why = f"{len(failed)} tests failed, more than --max-reruns {max_reruns}: no re-run"
    if why:
        return _finish(result, code, why, report)

    print(f"\n== re-running {len(failed)} failed test(s), each alone in a fresh process ==", flush=True)
    solo_env = {k: v for k, v in os.environ.items() if k != FAILURES_ENV}
    options = rerun_options(pytest_args)
    for nodeid, first in failed.items():
        began = time.monotonic()
        again = pytest(["-q", *options, nodeid], solo_env)
        result["reruns"].append({"nodeid": nodeid, "exit": again,
                                 "seconds": round(time.monotonic() - began, 1)})
        if again == PYTEST_OK:
            result["flaky"].append({"nodeid": nodeid, "first": first["first"], "when": first["when"]})
    still = [r["nodeid"] for r in result["reruns"] if r["exit"] != PYTEST_OK]
    print("\n== re-run summary ==")
    for flake in result["flaky"]:
        print(f"FLAKY {flake['nodeid']}: failed first ({flake['when']}) with: {flake['first']}")
    for nodeid in still:
        print(f"FAILED AGAIN {nodeid}")
    if still:
        return _finish(result, PYTEST_FAILED, f"{len(still)} test(s) failed again alone", report)
    return _finish(result, PYTEST_OK, f"{len(result['flaky'])} flaky test(s) passed alone on a re-run: "
                   "the run passes; each FLAKY above is a bug to fix", report)


def _finish(result: Dict[str, Any], code: int, why: str, report: Optional[Path]) -> int:
    result.update({"exit": code, "why": why})
    if result["reruns"] or code != PYTEST_OK:
        print(f"tests.rerun: {why}", flush=True)
    if report is not None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else ([], argv)
    ap = argparse.ArgumentParser(prog="python -m tests.rerun", description=__doc__.splitlines()[0])
    ap.add_argument("--max-reruns", type=int, default=5,
                    help="re-run only when at most this many tests failed (default 5)")
    ap.add_argument("--report", type=Path, help="write what ran and why it ended here (JSON)")
    args = ap.parse_args(ours)
    import tempfile
    with tempfile.TemporaryDirectory(prefix="rgt-rerun-") as tmp:
        try:
            return run(pytest_args, args.max_reruns, args.report, Path(tmp))
        except KeyboardInterrupt:   # pytest, in the same process group, has had its Ctrl-C too
            return 130


if __name__ == "__main__":
    sys.exit(main())
