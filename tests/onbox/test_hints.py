"""onbox.hints: the job's hint lines (checkpoint, output_dir, removed, faulthandler) and
their reader."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from onbox import hints


@pytest.fixture
def run(tmp_path: Path) -> Path:
    (tmp_path / "run" / "rgt").mkdir(parents=True)
    return tmp_path / "run"


def test_each_kind_round_trips_through_the_reader(run: Path) -> None:
    reader = hints.HintReader(run)
    stacks = hints.stacks_path(str(run), 4242)
    assert hints.write("checkpoint", str(run / "out" / "checkpoint-10"), step=10, framework="hf",
                       run_dir=str(run))
    assert hints.write("output_dir", str(run / "out"), framework="hf", run_dir=str(run))
    assert hints.write("removed", str(run / "out" / "checkpoint-10"), framework="hf", run_dir=str(run))
    assert hints.write("faulthandler", str(stacks), pid=4242, signal=int(signal.SIGUSR2),
                       framework="hf", run_dir=str(run))
    got = reader.poll()
    assert [(h["kind"], h["path"]) for h in got] == [
        ("checkpoint", str(run / "out" / "checkpoint-10")), ("output_dir", str(run / "out")),
        ("removed", str(run / "out" / "checkpoint-10")), ("faulthandler", str(stacks))]
    assert got[0]["step"] == 10 and "step" not in got[2]
    assert got[3]["pid"] == 4242 and got[3]["signal"] == signal.SIGUSR2 and got[3]["framework"] == "hf"
    assert stacks == run / "rgt" / "stacks" / "4242.txt"
    assert reader.poll() == []


@pytest.mark.parametrize("pid, sig", [(None, 12), (4242, None), (0, 12), (-1, 12), (True, 12),
                                      (4242, 0), (4242, 999), (4242, "12"), ("4242", 12)])
def test_a_faulthandler_hint_needs_a_valid_pid_and_signal(run: Path, pid: object, sig: object) -> None:
    assert not hints.write("faulthandler", str(hints.stacks_path(str(run), 4242)), pid=pid,
                           signal=sig, run_dir=str(run))
    assert not (run / "rgt" / hints.FILENAME).exists()
    line = json.dumps({"v": 1, "kind": "faulthandler", "path": "/x/rgt/stacks/4242.txt",
                       "pid": pid, "signal": sig}).encode()
    assert hints.parse(line) is None


def test_the_reader_drops_a_faulthandler_hint_pointing_anywhere_but_the_pids_stack_file(run: Path) -> None:
    """A stack file is read by the sidecar: the job may not name another file (its own or not)."""
    lines = [
        {"v": 1, "kind": "faulthandler", "path": "/etc/shadow", "pid": 7, "signal": 12},
        {"v": 1, "kind": "faulthandler", "path": str(hints.stacks_path(str(run), 8)), "pid": 7, "signal": 12},
        {"v": 1, "kind": "faulthandler", "path": str(hints.stacks_path(str(run), 7)), "pid": 7, "signal": 12},
    ]
    (run / "rgt" / hints.FILENAME).write_text("".join(json.dumps(d) + "\n" for d in lines))
    got = hints.HintReader(run).poll()
    assert [(h["pid"], h["path"]) for h in got] == [(7, str(hints.stacks_path(str(run), 7)))]


def test_outside_an_rgt_launch_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RGT_RUN_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert not hints.write("checkpoint", "out/checkpoint-1")
    assert not hints.write("unknown-kind", "x", run_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []
