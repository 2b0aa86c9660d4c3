"""protocol.metrics: the one rule of what a scalar metric is, on the box and on the laptop."""
from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import metrics

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", [
    "loss", "train_loss", "eval_loss", "val/loss", "train/loss", "lossG", "lr", "learning_rate", "lr-AdamW",
    "grad_norm", "train/grad_norm", "accuracy", "acc", "eval_accuracy", "ppl", "perplexity", "eval_bleu",
    "train_samples_per_second", "top1", "f1",
])
def test_known_names_are_metrics_from_text_and_files(name: str) -> None:
    assert metrics.is_metric_name(name)
    assert metrics.is_metric_name(name, strict=True)


@pytest.mark.parametrize("name", [
    "time", "Time", "timestamp", "ts", "epoch_time", "epochTime", "wall_time", "wallclock", "wall_clock",
    "train_runtime", "eval_runtime", "runtime", "elapsed_s", "step_time", "data_time", "train/time",
])
def test_clock_and_duration_fields_are_never_metrics(name: str) -> None:
    assert metrics.is_time_name(name)
    assert not metrics.is_metric_name(name)
    assert not metrics.is_metric_name(name, declared=[name], strict=True)   # not even declared


@pytest.mark.parametrize("name", [
    "torch/distributed/run.py", "run.py", "loss_utils.py", "run.py:874", "loss_utils.py:88",
    "/usr/lib/x", "trainer.cc", "config.yaml", "file.py:12]", "a//b",
])
def test_file_names_and_line_numbers_are_never_metrics(name: str) -> None:
    assert metrics.looks_like_file(name) or ":" in name
    assert not metrics.is_metric_name(name)
    assert not metrics.is_loss_name(name)


@pytest.mark.parametrize("name", ["using", "shards", "v_num", "used", "available"])
def test_banner_words_are_not_metrics_unless_declared(name: str) -> None:
    assert not metrics.is_metric_name(name)
    assert not metrics.is_metric_name(name, strict=True)


@pytest.mark.parametrize("name", ["step", "epoch", "global_step", "iter", "train/epoch"])
def test_counters_are_not_metrics(name: str) -> None:
    assert not metrics.is_metric_name(name)


def test_text_wants_a_known_or_declared_name_files_do_not() -> None:
    assert metrics.is_metric_name("reward_model_margin")          # a metrics.jsonl key: written on purpose
    assert not metrics.is_metric_name("batch_size", strict=True)   # a printed config
    assert not metrics.is_metric_name("margin", strict=True)
    assert metrics.is_metric_name("margin", declared=["Margin"], strict=True)
    assert not metrics.is_metric_name("", strict=False) and not metrics.is_metric_name("a b")
    assert not metrics.is_metric_name(3) and not metrics.is_metric_name("x" * 65)


def test_scalars_keeps_numbers_under_metric_names() -> None:
    doc = {"step": 3, "epoch": 0.5, "loss": 0.25, "time": 1.7e9, "ok": True, "note": "warm", "acc": 1,
           "nan_loss": float("nan"), "grad_norm": float("inf"), "timestamp": 12, "run.py:874": 1}
    assert metrics.scalars(doc) == {"loss": 0.25, "acc": 1.0}
    box = metrics.scalars(doc, finite=False)   # the box keeps a NaN loss: its detector wants it
    assert set(box) == {"loss", "acc", "nan_loss", "grad_norm"} and math.isnan(box["nan_loss"])
    assert metrics.scalars({"shards": 2, "loss": 1}, strict=True) == {"loss": 1.0}


def test_value_of() -> None:
    assert metrics.value_of(True) is None and metrics.value_of("0.5") is None
    assert metrics.value_of(10 ** 400, finite=False) == math.inf and metrics.value_of(10 ** 400) is None
    assert metrics.value_of(2) == 2.0


_WORD = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_WORD, _WORD, st.sampled_from(["time", "timestamp", "runtime", "ts", "wall"]))
def test_a_time_word_anywhere_is_never_a_metric(head: str, tail: str, word: str) -> None:
    for name in (f"{head}_{word}", f"{word}_{tail}", f"{head}_{word}_{tail}", f"{head}/{word}"):
        assert not metrics.is_metric_name(name, declared=[name]), name


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_WORD, st.sampled_from(["py", "cc", "json", "log"]), st.integers(min_value=0, max_value=10 ** 6))
def test_a_file_name_is_never_a_loss(stem: str, suffix: str, line: int) -> None:
    for name in (f"{stem}loss.{suffix}", f"loss_{stem}.{suffix}", f"a/{stem}loss.{suffix}:{line}"):
        assert not metrics.is_loss_name(name), name


def test_the_schema_runs_on_python_3_9_syntax() -> None:
    """The box's sidecar imports it: it must compile for 3.9 (no match, no X | Y at runtime)."""
    source = (REPO / "protocol" / "metrics.py").read_text()
    ast.parse(source, feature_version=(3, 9))
    out = subprocess.run([sys.executable, "-c", "import protocol.metrics"], cwd=REPO, capture_output=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
