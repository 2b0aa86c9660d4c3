"""onbox.report, the helper training scripts import: metrics lines, atomic saves, resume, seeds."""
from __future__ import annotations

import glob
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, List

import pytest

from onbox import report
from onbox.sources.metrics import MetricsSource
from tests.helpers import pyenv_glob

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The launcher's environment for a run dir under tmp_path."""
    run = tmp_path / "run"
    monkeypatch.setenv("RGT_RUN_DIR", str(run))
    monkeypatch.setenv("RGT_METRICS", str(run / "metrics.jsonl"))
    monkeypatch.setenv("RGT_CKPT_DIR", str(run / "checkpoints"))
    monkeypatch.delenv("RGT_RESUME_FROM", raising=False)
    return run


# ---- log ------------------------------------------------------------------------------------------


def test_log_appends_json_lines_with_nonfinite_values_as_strings(env: Path) -> None:
    np = pytest.importorskip("numpy")
    report.log(step=1, epoch=0.5, loss=0.25, acc=np.float32(0.5), note="warmup")
    report.log(step=np.int64(2), loss=float("nan"), grad=float("-inf"), big=float("inf"))
    lines = (env / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "epoch": 0.5, "loss": 0.25, "acc": 0.5, "note": "warmup"}
    assert json.loads(lines[1]) == {"step": 2, "loss": "nan", "grad": "-inf", "big": "inf"}
    records = MetricsSource(env / "metrics.jsonl").poll().records  # what the sidecar reads back
    assert records[1].step == 2 and math.isnan(records[1].scalars["loss"])


def test_log_takes_torch_scalars(env: Path) -> None:
    torch = pytest.importorskip("torch")
    report.log(step=torch.tensor(3), loss=torch.tensor(float("nan"), requires_grad=True) * 1)
    assert json.loads((env / "metrics.jsonl").read_text()) == {"step": 3, "loss": "nan"}


def test_a_failing_log_write_warns_once_and_does_not_raise(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("RGT_METRICS", str(tmp_path / "file" / "metrics.jsonl"))  # a file as parent dir
    monkeypatch.setattr(report, "_LOG_WARNED", False)
    with pytest.warns(RuntimeWarning, match="cannot write"):
        report.log(step=1, loss=1.0)
    report.log(step=2, loss=1.0)  # no second warning (pytest's warns would not fail; the flag shows it)
    assert report._LOG_WARNED


# ---- save -----------------------------------------------------------------------------------------


class Peek:
    """Pickled in the middle of a torch.save: looks at the directory while the write is under way."""

    seen: List[Any] = []

    def __init__(self, final: Path) -> None:
        self.final = final

    def __reduce__(self) -> Any:
        final = self.final
        tmps = glob.glob(str(final.parent / ".*.tmp"))
        inodes = [os.stat(t).st_ino for t in tmps]
        Peek.seen.append((final.read_bytes() if final.exists() else None, tmps, inodes))
        return (str, ("peeked",))


class Boom:
    def __reduce__(self) -> Any:
        raise RuntimeError("disk full")


def test_save_is_atomic_a_reader_sees_the_old_file_or_the_whole_new_one(env: Path) -> None:
    torch = pytest.importorskip("torch")
    ckpt = env / "checkpoints"
    old = report.save({"w": torch.zeros(3)}, "latest.pt")
    assert old == ckpt / "latest.pt"
    old_bytes = old.read_bytes()
    Peek.seen = []
    new = report.save({"w": torch.ones(3), "peek": Peek(ckpt / "latest.pt")}, "latest.pt")
    (under_final, tmps, inodes), = Peek.seen
    assert under_final == old_bytes                       # mid-write: still the old, whole file
    assert len(tmps) == 1 and tmps[0].endswith(".tmp") and Path(tmps[0]).parent == ckpt
    assert new.stat().st_ino == inodes[0]                 # the final name is the temp file, renamed
    state = torch.load(new, weights_only=False)
    assert torch.equal(state["w"], torch.ones(3)) and state["peek"] == "peeked"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest.pt"]   # no temp file left


def test_a_failed_save_leaves_the_old_file_and_no_temp_file(env: Path) -> None:
    torch = pytest.importorskip("torch")
    good = report.save({"w": torch.zeros(2)}, "latest.pt")
    before = good.read_bytes()
    with pytest.raises(RuntimeError, match="disk full"):
        report.save({"w": torch.ones(2), "boom": Boom()}, "latest.pt")
    assert good.read_bytes() == before
    assert sorted(p.name for p in good.parent.iterdir()) == ["latest.pt"]


def test_save_fills_the_step_and_takes_explicit_paths(env: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = report.save({"step": 100}, "step{step:06d}.pt", step=100)
    assert path == env / "checkpoints" / "step000100.pt"
    elsewhere = report.save({"a": torch.ones(1)}, tmp_path / "other" / "x.pt")
    assert elsewhere == tmp_path / "other" / "x.pt" and elsewhere.is_file()
    with pytest.raises(ValueError):
        report.save({}, "x.bin", fmt="pickle")


def test_save_safetensors_from_numpy_and_torch(env: Path) -> None:
    np = pytest.importorskip("numpy")
    st_numpy = pytest.importorskip("safetensors.numpy")
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    path = report.save(arrays, "model-{step}.safetensors", fmt="safetensors", step=7)
    assert path.name == "model-7.safetensors"
    assert np.array_equal(st_numpy.load_file(str(path))["w"], arrays["w"])
    from safetensors import safe_open
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"step": "7"}
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    tpath = report.save({"b": torch.full((2,), 2.0)}, "t.safetensors", fmt="safetensors")
    assert torch.equal(st_torch.load_file(str(tpath))["b"], torch.full((2,), 2.0))
    with pytest.raises(TypeError):
        report.save([1, 2], "bad.safetensors", fmt="safetensors")
    assert not list((env / "checkpoints").glob("*.tmp")) and not list((env / "checkpoints").glob(".*.tmp"))


# ---- resume ---------------------------------------------------------------------------------------


def test_latest_checkpoint_prefers_the_launchers_choice_then_the_newest_file(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = env / "checkpoints"
    assert report.latest_checkpoint() is None            # no dir yet
    ckpt.mkdir(parents=True)
    for name, mtime in (("a.pt", 100), ("b.pt", 300), ("c.pt.tmp", 400), (".d.pt.1.tmp", 500)):
        (ckpt / name).write_text(name)
        os.utime(ckpt / name, (mtime, mtime))
    (ckpt / "subdir").mkdir()
    os.utime(ckpt / "subdir", (900, 900))
    assert report.latest_checkpoint() == ckpt / "b.pt"
    monkeypatch.setenv("RGT_RESUME_FROM", str(ckpt / "a.pt"))
    assert report.latest_checkpoint() == ckpt / "a.pt"
    monkeypatch.setenv("RGT_RESUME_FROM", str(ckpt / "gone.pt"))
    assert report.latest_checkpoint() == ckpt / "b.pt"


def test_latest_checkpoint_hands_on_a_directory_the_launcher_chose(
        env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hugging Face checkpoint is a directory: RGT_RESUME_FROM naming one is what to resume."""
    hf = env / "out" / "checkpoint-20"
    hf.mkdir(parents=True)
    (hf / "trainer_state.json").write_text("{}")
    monkeypatch.setenv("RGT_RESUME_FROM", str(hf))
    assert report.latest_checkpoint() == hf


# ---- seed -----------------------------------------------------------------------------------------


def test_seed_seeds_everything_importable_and_records_it(env: Path) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    report.seed(1234)
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    record = report.seed(1234)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws
    saved = json.loads((env / "rgt" / "seed.json").read_text())
    assert saved == record
    assert (saved["seed"], saved["deterministic"]) == (1234, False)
    assert saved["seeded"] == ["python", "numpy", "torch"]
    assert saved["cudnn_benchmark"] is False
    assert not list((env / "rgt").glob("*.tmp")) and not list((env / "rgt").glob(".*.tmp"))


def test_deterministic_seed_turns_on_torch_determinism(env: Path) -> None:
    torch = pytest.importorskip("torch")
    try:
        record = report.seed(7, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert record["deterministic"] is True and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


# ---- import hygiene -------------------------------------------------------------------------------


def test_importing_report_pulls_in_nothing_heavy() -> None:
    code = ("import sys\nfrom onbox import report\n"
            "heavy = [m for m in ('torch', 'numpy', 'safetensors', 'zmq', 'psutil', 'pynvml')"
            " if m in sys.modules]\nassert not heavy, heavy\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _python39() -> str:
    found = pyenv_glob("3.9.*/bin/python3.9")
    return found[-1] if found else ""


@pytest.mark.skipif(not _python39(), reason="no Python 3.9 on this machine")
def test_report_works_on_python39_with_only_the_standard_library(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from onbox import report\n"
            "report.log(step=1, loss=float('nan'))\n"
            "assert 'zmq' not in sys.modules and 'psutil' not in sys.modules\n")
    out = subprocess.run([_python39(), "-I", "-c", code, str(REPO)], capture_output=True, text=True,
                         timeout=60, env={"RGT_METRICS": str(metrics), "PATH": os.environ.get("PATH", "")})
    assert out.returncode == 0, out.stderr
    assert json.loads(metrics.read_text()) == {"step": 1, "loss": "nan"}
