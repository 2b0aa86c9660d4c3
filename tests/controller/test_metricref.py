"""controller.runs.metrics: `rgt status --ref` compares the SAME step, and every logged point is read."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence

import pytest

from controller.runs import metrics as metricref
from controller.store.db import Store
from protocol import Event

RUN, REF = "train-now", "train-ref"


def progress(run: str, seq: int, step: int, **scalars: Any) -> Event:
    return Event(run=run, host="box1", seq=seq, ts=1_700_000_000.0 + seq, kind="train.progress", sev="info",
                 data={"step": step, "epoch": step / 1000, "scalars": scalars})


def put(store: Store, run: str, points: Sequence[Dict[str, Any]]) -> None:
    store.apply(run, [progress(run, i + 1, **p) for i, p in enumerate(points)], len(points))


def now(step: int, **scalars: Any) -> Dict[str, Any]:
    """`progress` as controller.runs.status builds it for the current run."""
    return {"step": step, "epoch": step / 1000, "scalars": {k: {"value": v, "data_age_s": 1.0}
                                                            for k, v in scalars.items()}}


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    monkeypatch.chdir(tmp_path)   # ./runs/<id> is looked up from here
    with Store.open() as s:
        s.upsert_run(RUN, host="box1")
        s.upsert_run(REF, host="box0")
        yield s


def test_a_step_between_two_logged_ones_is_interpolated_not_the_earlier_one(store: Store) -> None:
    put(store, REF, [{"step": 240, "loss": 2.0}, {"step": 360, "loss": 1.4}])
    ref = metricref.reference(store, REF, now(300, loss=1.6))
    row = ref["metrics"]["loss"]
    assert (ref["by"], ref["at"]) == ("step", 300)
    assert row["ref_at"] == 300 and row["how"] == "interpolated"
    assert row["ref_value"] == pytest.approx(1.7) and row["diff"] == pytest.approx(-0.1)
    assert row["note"] == "at step 300 (interpolated between 240 and 360)"


def test_the_same_step_is_read_as_it_is(store: Store) -> None:
    put(store, REF, [{"step": 200, "loss": 2.0}, {"step": 300, "loss": 1.5}, {"step": 400, "loss": 1.0}])
    row = metricref.reference(store, REF, now(300, loss=1.2))["metrics"]["loss"]
    assert (row["ref_at"], row["ref_value"], row["how"]) == (300, 1.5, "same step")
    assert row["note"] == "at step 300"
    assert row["rel_diff"] == pytest.approx(-0.2)


def test_past_the_reference_end_both_runs_are_read_at_the_nearest_shared_step(store: Store) -> None:
    put(store, REF, [{"step": 120, "loss": 3.0}, {"step": 240, "loss": 2.0}])
    put(store, RUN, [{"step": 120, "loss": 2.9}, {"step": 240, "loss": 1.9}, {"step": 300, "loss": 0.85}])
    ref = metricref.reference(store, REF, now(300, loss=0.85), run=RUN)
    row = ref["metrics"]["loss"]
    # never this run at 300 (0.85) against the reference at 240 (2.0): "-57.5 %"
    assert (row["at"], row["value"], row["ref_value"]) == (240, 1.9, 2.0)
    assert row["how"] == "nearest shared step" and row["note"] == "nearest shared step 240"
    assert row["rel_diff"] == pytest.approx(-0.05)


def test_without_the_current_run_a_step_the_reference_never_reached_is_not_compared(store: Store) -> None:
    put(store, REF, [{"step": 120, "loss": 3.0}, {"step": 240, "loss": 2.0}])
    ref = metricref.reference(store, REF, now(300, loss=0.85))
    assert ref["metrics"] == {}
    assert ref["skipped"] == {"loss": "the reference logged loss only up to step 240"}


def test_no_shared_step_interpolates_the_reference_at_this_runs_nearest_step(store: Store) -> None:
    put(store, REF, [{"step": 100, "loss": 3.0}, {"step": 200, "loss": 2.0}])
    put(store, RUN, [{"step": 150, "loss": 2.4}, {"step": 260, "loss": 1.0}])
    row = metricref.reference(store, REF, now(260, loss=1.0), run=RUN)["metrics"]["loss"]
    assert (row["at"], row["value"], row["ref_value"], row["how"]) == (150, 2.4, 2.5, "nearest step")


def test_time_fields_are_never_compared(store: Store) -> None:
    put(store, REF, [{"step": 100, "loss": 2.0, "time": 1.7e9},
                     {"step": 200, "loss": 1.0, "time": 1.7e9 + 9}])
    ref = metricref.reference(store, REF, now(200, loss=1.0, time=1.8e9, timestamp=5.0))
    assert set(ref["metrics"]) == {"loss"} and ref["skipped"] == {}


def test_a_nan_value_is_shown_without_a_difference(store: Store) -> None:
    put(store, REF, [{"step": 100, "loss": 2.0}, {"step": 200, "loss": 1.0}])
    row = metricref.reference(store, REF, now(200, loss="nan"))["metrics"]["loss"]
    assert (row["value"], row["ref_value"], row["diff"], row["rel_diff"]) == ("nan", 1.0, None, None)


def test_epochs_are_the_axis_when_the_reference_logs_no_steps(store: Store) -> None:
    store.apply(REF, [Event(run=REF, host="b", seq=i, ts=1.0 + i, kind="train.progress", sev="info",
                            data={"epoch": float(i), "scalars": {"acc": 0.1 * i}}) for i in (1, 2, 3)], 3)
    ref = metricref.reference(store, REF, {"step": None, "epoch": 1.5, "scalars": {"acc": {"value": 0.2}}})
    row = ref["metrics"]["acc"]
    assert ref["by"] == "epoch" and row["ref_value"] == pytest.approx(0.15)
    assert row["note"] == "at epoch 1.5 (interpolated between 1 and 2)"


# ---- every logged point --------------------------------------------------------------------------


def write_jsonl(path: Path, rows: List[Dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9999, "lo')   # a torn tail


def test_a_pulled_metrics_jsonl_gives_every_point_and_events_add_the_newer_ones(store: Store,
                                                                               tmp_path: Path) -> None:
    pulled = tmp_path / "elsewhere" / REF
    write_jsonl(pulled / "metrics.jsonl",
                [{"step": s, "loss": 10.0 / s, "time": 1e9 + s} for s in range(1, 101)])
    store.add_local_event(REF, "pull.done", "info", {"dest": str(pulled)})
    put(store, REF, [{"step": 50, "loss": 7.0}, {"step": 100, "loss": 7.0}, {"step": 150, "loss": 0.05}])
    curves = metricref.load(store, REF)
    assert curves.source == f"metrics.jsonl ({pulled / 'metrics.jsonl'}) + train.progress events after it"
    points = curves.points("loss")
    assert len(points) == 101 and points[0] == (1.0, 10.0) and points[-1] == (150.0, 0.05)
    assert points[49] == (50.0, 0.2)   # the file's value, not the summary's
    assert curves.names() == ["loss"]   # no time curve
    row = metricref.reference(store, REF, now(33, loss=0.3))["metrics"]["loss"]
    assert (row["how"], row["ref_value"]) == ("same step", pytest.approx(10.0 / 33))


def test_runs_dir_and_a_local_run_dir_are_read_too(store: Store, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "runs" / RUN / "metrics.jsonl", [{"step": s, "acc": s / 10} for s in range(1, 6)])
    assert metricref.load(store, RUN).points("acc")[-1] == (5.0, 0.5)
    local = tmp_path / "box" / "run-l"
    write_jsonl(local / "metrics.jsonl", [{"global_step": 7, "eval": {"loss": 0.5}}])
    store.upsert_run("run-l", host="", target="local", run_dir=str(local))
    assert metricref.load(store, "run-l").points("eval/loss") == [(7.0, 0.5)]


def test_value_at() -> None:
    points = [(10.0, 1.0), (20.0, 3.0)]
    assert metricref.value_at(points, 15.0) == (2.0, "interpolated", (10.0, 20.0))
    assert metricref.value_at(points, 20.0) == (3.0, "same step", None)
    assert metricref.value_at(points, 25.0) is None and metricref.value_at([], 1.0) is None
