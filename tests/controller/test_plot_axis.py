"""`rgt plot`: a log y axis for a loss spanning more than a decade, every logged point, the reference
beside it, and no `time` panel."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from click.testing import CliRunner

from controller.cli import watch as cli_watch
from controller.runs import plot
from controller.store.db import Store
from protocol import Event

pytest.importorskip("matplotlib")

RUN, REF = "train-7f3a", "train-base"
PNG = b"\x89PNG\r\n\x1a\n"


def progress(run: str, seq: int, step: int, loss: Any) -> Event:
    return Event(run=run, host="box1", seq=seq, ts=1_700_000_000.0 + seq, kind="train.progress", sev="info",
                 data={"step": step, "scalars": {"loss": loss, "time": 1.7e9 + seq}})


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    monkeypatch.chdir(tmp_path)
    with Store.open() as s:
        s.upsert_run(RUN, host="box1")
        s.upsert_run(REF, host="box0")
        yield s


def pulled(store: Store, tmp_path: Path, run: str, steps: int, scale: float) -> None:
    """A pulled metrics.jsonl with every step (the job's own log, `time` field included)."""
    where = tmp_path / "pulls" / run
    where.mkdir(parents=True)
    rows = [{"step": s, "loss": scale * 10.0 / s, "acc": s / steps, "time": 1.7e9 + s}
            for s in range(1, steps + 1)]
    (where / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    store.add_local_event(run, "pull.done", "info", {"dest": str(where)})


def test_a_loss_spanning_decades_is_on_a_log_axis_from_every_point(store: Store, tmp_path: Path) -> None:
    # the box's 5 s summaries: 12 points; the job logged 500
    store.apply(RUN, [progress(RUN, i, i * 40, 10.0 / (i * 40)) for i in range(1, 13)], 12)
    pulled(store, tmp_path, RUN, 500, 1.0)
    pulled(store, tmp_path, REF, 400, 1.1)
    fig = plot.figure(store, RUN, REF, ["loss", "acc"])
    loss_ax, acc_ax = fig.axes
    assert loss_ax.get_yscale() == "log" and acc_ax.get_yscale() == "linear"
    mine, theirs = loss_ax.get_lines()
    assert len(mine.get_xdata()) == 500 and len(theirs.get_xdata()) == 400
    assert (mine.get_label(), theirs.get_label()) == (RUN, REF)
    assert theirs.get_linestyle() == "--"


def test_a_loss_within_a_decade_stays_linear(store: Store) -> None:
    store.apply(RUN, [progress(RUN, i, i * 10, 2.0 - 0.1 * i) for i in range(1, 10)], 9)
    (ax,) = plot.figure(store, RUN, None).axes
    assert ax.get_yscale() == "linear" and ax.get_ylabel() == "loss"   # and no "time" panel


def test_log_scale_rule() -> None:
    assert plot.log_scale("train/loss", [10.0, 0.5])
    assert plot.log_scale("eval_ppl", [400.0, 20.0]) and plot.log_scale("perplexity", [400.0, 20.0])
    assert not plot.log_scale("loss", [2.0, 0.5]) and not plot.log_scale("loss", [10.0, 0.0])
    assert not plot.log_scale("acc", [0.001, 0.9]) and not plot.log_scale("loss", [])


def test_plot_command_draws_the_pulled_points(store: Store, tmp_path: Path) -> None:
    pulled(store, tmp_path, RUN, 60, 1.0)
    out = tmp_path / "p.png"
    result = CliRunner().invoke(cli_watch.plot_command, [RUN, "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == PNG
    with pytest.raises(plot.PlotError, match="no values of time"):
        plot.plot(store, RUN, None, tmp_path / "t.png", ["time"])
