"""`rgt compare`: no seed-to-seed spread from fewer than three seeds, and metrics at one shared step."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from controller.insight.compare import MIN_SEEDS, NOT_ENOUGH
from tests.controller.test_compare import TRAIN, losses, make_run, report_of, rgt


def seeds(root: Path, lasts: List[float]) -> Dict[str, Path]:
    """Runs r0, r1, ... differing only by their seed; run i ends at lasts[i]."""
    return {f"r{i}": make_run(root, f"r{i}", [*TRAIN, "--lr", "0.1", "--seed", str(i + 1)],
                              env={"PYTHONHASHSEED": str(i + 1)}, metrics=losses([2.0, 1.5, last]))
            for i, last in enumerate(lasts)}


def test_two_runs_estimate_no_spread(tmp_path: Path) -> None:
    runs = seeds(tmp_path, [1.000, 1.0122])   # a 1.22 % gap, only the seed differs
    rep = report_of(str(runs["r0"]), str(runs["r1"]))
    (row,) = rep["metrics"]
    assert rep["seed_only"] is True and "spread" not in row
    assert row["spread_note"] == f"{NOT_ENOUGH}: 1 seed at step 30 per side, {MIN_SEEDS} needed"
    assert rep["warnings"][0] == f"only the seed differs: loss: {row['spread_note']}"
    res = rgt(str(runs["r0"]), str(runs["r1"]))
    assert res.exit_code == 0 and "OUTSIDE" not in res.stdout + res.stderr
    assert NOT_ENOUGH in res.stderr
    assert "not enough seeds" in res.stdout   # the table's SEED SPREAD column says so too, not "-"


def test_two_seeds_beside_a_are_still_not_enough(tmp_path: Path) -> None:
    runs = seeds(tmp_path, [1.00, 1.50, 1.01])   # A's group without B: r0 and r2, two seeds
    rep = report_of(str(runs["r0"]), str(runs["r1"]))
    (row,) = rep["metrics"]
    assert "spread" not in row and "2 seeds" in row["spread_note"]
    assert "OUTSIDE" not in " ".join(rep["warnings"])


def test_three_seeds_estimate_the_spread(tmp_path: Path) -> None:
    runs = seeds(tmp_path, [1.00, 1.50, 1.01, 0.99])
    rep = report_of(str(runs["r0"]), str(runs["r1"]))
    (row,) = rep["metrics"]
    assert row["spread"]["groups"][0]["seeds"] == 3 and row["spread"]["inside"] is False
    assert "spread_note" not in row
    assert rep["warnings"][0] == "only the seed differs: loss OUTSIDE the seed-to-seed spread"


def test_metrics_are_compared_at_one_step_both_logged_and_say_so(tmp_path: Path) -> None:
    a = make_run(tmp_path, "ra", TRAIN, metrics=[{"step": s, "loss": 1.0 / s} for s in (100, 200, 300)])
    b = make_run(tmp_path, "rb", TRAIN, metrics=[{"step": s, "loss": 2.0 / s} for s in (100, 240)])
    (row,) = report_of(str(a), str(b))["metrics"]
    assert (row["step"], row["a"], row["b"]) == (100, 0.01, 0.02)   # not A at 300 against B at 240
    assert row["note"] == ("compared at step 100, the last step both logged "
                           "(A logged to step 300, B to step 240)")


def test_a_metric_with_no_shared_step_is_refused(tmp_path: Path) -> None:
    a = make_run(tmp_path, "ra", TRAIN, metrics=[{"step": s, "loss": 1.0} for s in (100, 200)])
    b = make_run(tmp_path, "rb", TRAIN, metrics=[{"step": s, "loss": 2.0} for s in (150, 250)])
    rep = report_of(str(a), str(b))
    (row,) = rep["metrics"]
    assert (row["step"], row["a"], row["b"], row["diff"]) == (None, None, None, None)
    refused = "loss: no step logged by both runs (A logged steps 100-200, B 150-250): not compared"
    assert refused in rep["warnings"]
