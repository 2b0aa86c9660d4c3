"""`rgt explain`: how fast the catalog loads and answers, and how well it ranks real descriptions.

The problem descriptions and their right entries are the acceptance list DESCRIPTIONS of
tests/controller/test_explain.py, loaded from that file (not copied). Measured here:

- the catalog's cold load (import, parse and validate controller/data/catalog.toml) and the BM25F
  index build, each in a fresh interpreter (p50 of --cold runs), and the parse alone, warm;
- a free-text query in-process (parse_query + answer, the command's path without rendering), over
  every description x --repeats, p50/p99;
- `rgt explain "..."` end to end as a subprocess (what a person waits for), p50 of --cold runs,
  next to a bare `python -c pass` (the interpreter's own start) and `import controller.cli.main`;
- top-1 and top-3 hit rates over the descriptions (the index's search, as the test does);
- entry_for_event for a few event kinds, p50/p99 over --calls calls each;
- the eval set (tests/controller/explain_cases/*.jsonl: long questions, Chinese ones, platform
  ones): top-1 and top-3 rates per group, the time per question in-process, and `rgt explain
  "<question>"` end to end for every question (the interpreter's start-up included), p50/p99/max.

    .venv/bin/python bench/explain_rank.py [--repeats 20] [--cold 5] [--calls 2000]

Prints tables and writes bench/results/explain_rank.json. Nothing is asserted on timings.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from controller.insight import catalog, explain  # noqa: E402
from tests.controller import explain_eval  # noqa: E402

COLD_CODE = """
import json, time
t0 = time.perf_counter()
from controller.insight.catalog import default_catalog
cat = default_catalog()
t1 = time.perf_counter()
from controller.insight.explain import default_index
default_index()
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "index_s": t2 - t1, "entries": len(cat.entries)}))
"""

EVENTS: Tuple[Tuple[str, Mapping[str, Any]], ...] = (
    ("gpu.xid", {"code": 79, "class": "node_reboot", "fatal": True}),
    ("job.exited", {"code": 137, "signal": None, "oom_killed": True, "vanished": False}),
    ("job.exited", {"code": None, "signal": 15, "oom_killed": False, "vanished": False}),
    ("train.nonfinite", {"name": "loss", "value": "nan"}),
    ("gpu.throttle", {"reasons": ["HwSlowdown", "HwThermalSlowdown"]}),
    ("gpu.melted", {"code": 1}),
)


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def descriptions() -> List[Tuple[str, str]]:
    """DESCRIPTIONS from the test module, loaded by path (tests/controller is no package)."""
    path = REPO / "tests" / "controller" / "test_explain.py"
    spec = importlib.util.spec_from_file_location("_bench_test_explain", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = module.DESCRIPTIONS
    return [(str(text), str(wanted)) for text, wanted in found]


def timed_run(argv: List[str], env: Dict[str, str]) -> Tuple[float, subprocess.CompletedProcess[str]]:
    t = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    return time.perf_counter() - t, done


def cold(runs: int, env: Dict[str, str], first: str) -> Dict[str, Any]:
    loads: List[float] = []
    index: List[float] = []
    entries = 0
    for _ in range(runs):
        _, done = timed_run([sys.executable, "-c", COLD_CODE], env)
        doc = json.loads(done.stdout.strip().splitlines()[-1])
        loads.append(doc["load_s"])
        index.append(doc["index_s"])
        entries = doc["entries"]
    rgt = Path(sys.executable).parent / "rgt"
    cmd = [str(rgt)] if rgt.exists() else [sys.executable, "-m", "controller.cli.main"]
    walls: Dict[str, List[float]] = {"python -c pass": [], "python -c 'import controller.cli.main'": [],
                                     f'rgt explain "{first[:30]}..."': [], "rgt explain xid 79": []}
    argvs = ([sys.executable, "-c", "pass"], [sys.executable, "-c", "import controller.cli.main"],
             [*cmd, "explain", first], [*cmd, "explain", "xid", "79"])
    codes = set()
    for _ in range(runs):
        for name, argv in zip(walls, argvs):
            took, done = timed_run(argv, env)
            walls[name].append(took)
            codes.add(done.returncode)
    main_text, more = catalog._read_packaged()
    warm: List[float] = []
    for _ in range(runs):
        t = time.perf_counter()
        catalog.parse(main_text, more=more)
        warm.append(time.perf_counter() - t)
    return {"entries": entries, "load_ms_p50": round(1000 * statistics.median(loads), 1),
            "index_ms_p50": round(1000 * statistics.median(index), 1),
            "parse_warm_ms_p50": round(1000 * statistics.median(warm), 2), "exit_codes": sorted(codes),
            "wall_ms_p50": {k: round(1000 * statistics.median(v), 1) for k, v in walls.items()},
            "rgt": " ".join(cmd)}


def queries(cases: List[Tuple[str, str]], repeats: int) -> Dict[str, Any]:
    explain.default_index()  # built once, as in a process that answers
    took: List[float] = []
    for _ in range(repeats):
        for text, _ in cases:
            t = time.perf_counter()
            explain.answer(explain.parse_query([text]))
            took.append(time.perf_counter() - t)
    return {"count": len(took), "p50_ms": round(1000 * pct(took, 0.5), 3),
            "p99_ms": round(1000 * pct(took, 0.99), 3), "max_ms": round(1000 * max(took), 3)}


def quality(cases: List[Tuple[str, str]]) -> Dict[str, Any]:
    index = explain.default_index()
    top1 = top3 = 0
    misses: List[Dict[str, Any]] = []
    for text, wanted in cases:
        got = [h.entry.id for h in index.search(text, 3)]
        top1 += got[:1] == [wanted]
        top3 += wanted in got
        if got[:1] != [wanted]:
            misses.append({"text": text, "wanted": wanted, "got": got, "in_top3": wanted in got})
    n = len(cases)
    return {"descriptions": n, "top1": top1, "top3": top3, "top1_rate": round(top1 / n, 3),
            "top3_rate": round(top3 / n, 3), "not_first": misses}


def eval_set(env: Dict[str, str], rgt: List[str]) -> Dict[str, Any]:
    """The eval set (tests/controller/explain_cases): top-1 and top-3 rates, each question's time in
    the process, and `rgt explain "<question>"` end to end per question (start-up included)."""
    cases = explain_eval.load_cases()
    t = time.perf_counter()
    results = explain_eval.run(cases)
    per_q_ms = 1000 * (time.perf_counter() - t) / len(cases)
    walls: List[float] = []
    for case in cases:
        took, _ = timed_run([*rgt, "explain", case.q], env)
        walls.append(took)
    n = len(results)

    def rate(rs: List[explain_eval.Result], what: str) -> Optional[float]:
        return round(sum(getattr(r, what) for r in rs) / len(rs), 3) if rs else None

    groups = {"all": results, "chinese": [r for r in results if r.case.chinese],
              "platform": [r for r in results if r.case.platform]}
    return {"cases": n, "in_process_ms_per_question": round(per_q_ms, 2),
            "end_to_end_ms": {"p50": round(1000 * pct(walls, 0.5), 1),
                              "p99": round(1000 * pct(walls, 0.99), 1), "max": round(1000 * max(walls), 1)},
            "rates": {g: {"n": len(rs), "top1": rate(rs, "top1"), "top3": rate(rs, "top3")}
                      for g, rs in groups.items()},
            "misses": [{"where": r.case.where, "want": list(r.case.want), "got": list(r.got)}
                       for r in results if not r.top3]}


def events(calls: int) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    for kind, data in EVENTS:
        entry: Optional[str] = explain.entry_for_event(kind, data)  # warm the catalog
        took: List[float] = []
        for _ in range(calls):
            t = time.perf_counter()
            explain.entry_for_event(kind, data)
            took.append(time.perf_counter() - t)
        out.append({"kind": kind, "data": dict(data), "entry": entry,
                    "p50_us": round(1e6 * pct(took, 0.5), 1), "p99_us": round(1e6 * pct(took, 0.99), 1)})
    return out


def print_tables(r: Dict[str, Any]) -> None:
    c, q, k = r["cold"], r["query"], r["quality"]
    rows = [("catalog cold load (import+parse+validate), p50", f"{c['load_ms_p50']:.1f} ms"),
            ("index build (BM25F), cold, p50", f"{c['index_ms_p50']:.1f} ms"),
            ("catalog parse+validate, warm, p50", f"{c['parse_warm_ms_p50']:.2f} ms"),
            (f"text query in-process, p50 ({q['count']} queries)", f"{q['p50_ms']:.3f} ms"),
            ("text query in-process, p99", f"{q['p99_ms']:.3f} ms")]
    rows += [(f"{name}, wall p50", f"{ms:.0f} ms") for name, ms in c["wall_ms_p50"].items()]
    n = k["descriptions"]
    rows += [(f"top-1 hits ({n} short descriptions)", f"{k['top1']} ({100 * k['top1_rate']:.1f} %)")]
    rows += [("top-3 hits", f"{k['top3']} ({100 * k['top3_rate']:.1f} %)")]
    ev = r["eval"]
    for group, got in ev["rates"].items():
        if got["n"]:
            rows += [(f"eval set, {group} ({got['n']} questions): top-1 / top-3",
                      f"{100 * got['top1']:.1f} % / {100 * got['top3']:.1f} %")]
    rows += [("eval set, in-process per question", f"{ev['in_process_ms_per_question']:.2f} ms"),
             ("eval set, rgt explain end to end p50 / p99 / max",
              f"{ev['end_to_end_ms']['p50']:.0f} / {ev['end_to_end_ms']['p99']:.0f} / "
              f"{ev['end_to_end_ms']['max']:.0f} ms")]
    width = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"{a.ljust(width)}  {b}")
    print()
    print(f"{'entry_for_event':<44}{'entry':<26}{'p50 us':>8}{'p99 us':>8}")
    for e in r["events"]:
        what = e["kind"] + " " + ",".join(f"{a}={b}" for a, b in list(e["data"].items())[:2])
        print(f"{what[:43]:<44}{str(e['entry']):<26}{e['p50_us']:>8.1f}{e['p99_us']:>8.1f}")
    print()
    for miss in k["not_first"]:
        where = "top-3" if miss["in_top3"] else "MISS "
        print(f"{where} want {miss['wanted']:<28} got {', '.join(miss['got']) or '-'}")
    for miss in ev["misses"]:
        got = ", ".join(miss["got"]) or "-"
        print(f"EVAL MISS {miss['where']}: want {', '.join(miss['want'])} got {got}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20, help="passes over the descriptions (default 20)")
    ap.add_argument("--cold", type=int, default=5, help="fresh-process runs per cold measure (default 5)")
    ap.add_argument("--calls", type=int, default=2000, help="entry_for_event calls per kind (default 2000)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "explain_rank.json")
    args = ap.parse_args()
    cases = descriptions()
    with tempfile.TemporaryDirectory(prefix="rgt-explain-bench-") as home:
        env = {**os.environ, "RGT_HOME": home, "PYTHONPATH": str(REPO)}
        report: Dict[str, Any] = {"cold": cold(args.cold, env, cases[0][0])}
        report["eval"] = eval_set(env, report["cold"]["rgt"].split())
    report.update({"query": queries(cases, args.repeats), "quality": quality(cases),
                   "events": events(args.calls), "repeats": args.repeats, "cold_runs": args.cold,
                   "calls": args.calls,
                   "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
                   "loadavg_at_end": list(os.getloadavg())})
    print_tables(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}; {os.cpu_count()} cpus, load average {report['loadavg_at_end']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
