"""controller.runs.plot and `rgt plot`: PNG files from stored train.progress events."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from click.testing import CliRunner

from controller.cli import watch as cli_watch
from controller.cli.base import RgtGroup
from controller.runs import plot
from controller.store.db import Store
from protocol import Event

RUN = "train-7f3a"
REF = "train-base"
PNG = b"\x89PNG\r\n\x1a\n"


def progress(seq: int, run: str, step: int, loss: Any) -> Event:
    return Event(run=run, host="box1", seq=seq, ts=1_700_000_000.0 + seq, kind="train.progress", sev="info",
                 data={"step": step, "scalars": {"loss": loss, "acc": step / 1000}})


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    monkeypatch.setenv("RGT_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    with Store.open() as s:
        s.upsert_run(RUN, host="box1")
        s.upsert_run(REF, host="box0")
        s.apply(RUN, [progress(i, RUN, i * 10, 2.0 / i) for i in range(1, 20)]
                + [progress(20, RUN, 200, "nan")], 20)
        s.apply(REF, [progress(i, REF, i * 10, 2.2 / i) for i in range(1, 30)], 29)
        yield s


def test_curves_skip_non_finite_values(store: Store) -> None:
    axis, series = plot.curves(store, RUN)
    assert axis == "step"
    assert len(series["loss"]) == 19 and series["loss"][0] == (10.0, 2.0)
    assert len(series["acc"]) == 20


def test_plot_writes_a_png(store: Store, tmp_path: Path) -> None:
    out = plot.plot(store, RUN, None, tmp_path / "a.png")
    assert out.read_bytes()[:8] == PNG


def test_plot_with_a_reference_and_chosen_metrics(store: Store, tmp_path: Path) -> None:
    alone = plot.plot(store, RUN, None, tmp_path / "alone.png", ["loss"])
    both = plot.plot(store, RUN, REF, tmp_path / "both.png", ["loss"])
    assert both.read_bytes()[:8] == PNG
    assert both.read_bytes() != alone.read_bytes()   # the reference curve is drawn too


def test_unknown_metric_and_no_progress_are_clear_errors(store: Store, tmp_path: Path) -> None:
    with pytest.raises(plot.PlotError, match="no values of bleu") as e:
        plot.plot(store, RUN, None, tmp_path / "x.png", ["bleu"])
    assert e.value.hint is not None and "loss" in e.value.hint
    store.upsert_run("empty", host="box2")
    with pytest.raises(plot.PlotError, match="no training values"):
        plot.plot(store, "empty", None, tmp_path / "y.png")
    assert not (tmp_path / "x.png").exists()


def test_missing_matplotlib_names_the_extra(store: Store, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # `import matplotlib` now fails
    with pytest.raises(plot.PlotError) as e:
        plot.plot(store, RUN, None, tmp_path / "a.png")
    assert e.value.hint == "pip install 'remote-gpu-trainer[plot]'"
    rgt = RgtGroup("rgt")   # the group prints a CliError's hint line, as `rgt` does
    rgt.add_command(cli_watch.plot_command)
    result = CliRunner().invoke(rgt, ["plot", RUN, "-o", str(tmp_path / "a.png")])
    assert result.exit_code == 1
    assert "hint: pip install 'remote-gpu-trainer[plot]'" in result.output
    assert not (tmp_path / "a.png").exists()


def test_plot_command(store: Store, tmp_path: Path) -> None:
    out = tmp_path / "cmp.png"
    args = [RUN, "--ref", REF, "--metric", "loss", "-o", str(out)]
    result = CliRunner().invoke(cli_watch.plot_command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == PNG and f"wrote {out}" in result.output
