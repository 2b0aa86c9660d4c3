"""onbox.integrations: the two-line HF and Lightning callbacks, run inside the real stock jobs.

The jobs (tests/frameworks/*_tiny.py --integration) run as their own processes in a temp cwd with
the launcher's RGT_* environment; the tests read what they left in the run dir.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from onbox import hints
from onbox.integrations import hf as hf_integration
from onbox.integrations import resume_from

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "frameworks"
PY = sys.executable
JOB_TIMEOUT_S = 300
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason="transformers is not installed here")
needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                     reason="lightning is not installed here")
HF_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin",
            "trainer_state.json")


class Run:
    """A run dir and a job cwd under tmp_path, and the environment the launcher would give."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path / "run"
        self.cwd = tmp_path / "cwd"
        (self.dir / "rgt").mkdir(parents=True)
        self.cwd.mkdir()

    def env(self, rgt: bool = True, **extra: str) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RGT_")}
        env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        if rgt:
            env.update(RGT_RUN_DIR=str(self.dir), RGT_METRICS=str(self.dir / "metrics.jsonl"),
                       RGT_CKPT_DIR=str(self.dir / "checkpoints"))
        env.update(extra)
        return env

    def job(self, script: str, *args: str, rgt: bool = True,
            **extra: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([PY, str(JOBS / script), "--integration", *args], cwd=self.cwd,
                              env=self.env(rgt, **extra), capture_output=True, text=True,
                              timeout=JOB_TIMEOUT_S)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    def metrics(self) -> List[Dict[str, Any]]:
        return [json.loads(line) for line in (self.dir / "metrics.jsonl").read_text().splitlines()]

    def hints(self) -> List[Dict[str, Any]]:
        return hints.HintReader(self.dir).poll()


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return Run(tmp_path)


@pytest.fixture
def popen() -> Iterator[List[subprocess.Popen[str]]]:
    """Jobs started by a test, ended by pid afterwards."""
    procs: List[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def _wait(what: str, check: Any, proc: subprocess.Popen[str], deadline_s: float = JOB_TIMEOUT_S) -> Any:
    """Poll `check()` until it returns something truthy; fail when the job ends or at the deadline."""
    deadline = time.monotonic() + deadline_s
    pause = threading.Event()   # never set: its timed wait paces the polls
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"job exited {proc.returncode} before {what}: "
                                 f"{proc.stdout.read()[-3000:] if proc.stdout else ''}")
        pause.wait(0.05)
    raise AssertionError(f"no {what} within {deadline_s} s")


def _hang_line(script: str) -> int:
    lines = (JOBS / script).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if "NEVER.wait()" in line)   # the job's hang


def _dump_until(path: Path, pid: int, needle: str, outer: str, proc: subprocess.Popen[str]) -> str:
    """Send the stack signal until a dump holding `needle` arrives (the job may not hang yet), then read
    on until the dump also holds the `outer` frame: faulthandler writes a dump in many small writes, the
    innermost frame first, so a read can land between the hung frame and the ones around it."""
    def dumped() -> Optional[Tuple[int]]:
        size = path.stat().st_size
        os.kill(pid, signal.SIGUSR2)
        text = _wait("a stack dump", lambda: path.stat().st_size > size and path.read_text()[size:], proc, 60)
        return (size,) if needle in text else None   # a tuple: the dump may start at offset 0

    (start,) = _wait(f"a dump with {needle!r}", dumped, proc)

    def whole() -> Optional[str]:
        text = path.read_text()[start:]
        return text if outer in text else None

    return str(_wait(f"the dump to reach {outer!r}", whole, proc, 60))


# ---- import and no-op --------------------------------------------------------------------------------


def test_importing_the_integrations_imports_no_framework_and_no_torch() -> None:
    code = ("import sys, onbox.integrations, onbox.integrations.hf, onbox.integrations.lightning\n"
            "heavy = ('torch', 'transformers', 'lightning', 'pytorch_lightning')\n"
            "print([m for m in heavy if m in sys.modules])\n")
    out = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.splitlines() == ["[]"]


@needs_hf
def test_the_callback_class_is_built_from_the_framework_on_first_access() -> None:
    code = ("import sys, onbox.integrations.hf as hf\n"
            "assert 'transformers' not in sys.modules\n"
            "from onbox.integrations.hf import RgtCallback\n"
            "import transformers\n"
            "assert issubclass(RgtCallback, transformers.TrainerCallback) and hf.RgtCallback is RgtCallback\n"
            "print(RgtCallback.__module__, RgtCallback.__qualname__)\n")
    out = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["onbox.integrations.hf", "RgtCallback"], out.stderr[-2000:]


@pytest.mark.parametrize("script", [pytest.param("hf_tiny.py", marks=needs_hf),
                                    pytest.param("lightning_tiny.py", marks=needs_lightning)])
def test_without_the_launchers_environment_the_callbacks_write_nothing(run: Run, script: str) -> None:
    before = set(os.listdir(run.cwd))
    run.job(script, "--steps", "10", "--save-every", "5", rgt=False)
    assert os.listdir(run.dir / "rgt") == []
    made = {str(p.relative_to(run.cwd)) for p in run.cwd.rglob("*")} - before
    assert made  # the framework wrote its outputs...
    assert not [p for p in made if "metrics.jsonl" in p or "hints" in p or "stacks" in p]  # ...rgt nothing


IGNORED = "is set but training starts from step 0"


# ---- Hugging Face ----------------------------------------------------------------------------------


@needs_hf
def test_hf_job_reports_steps_checkpoints_rotation_output_dir_and_stack_dumps_then_resumes(run: Run) -> None:
    """One job reports; a second resumes from its last checkpoint; a third ignores it and is told."""
    run.job("hf_tiny.py", "--steps", "30", "--save-every", "10", "--log-every", "5")
    steps = [m for m in run.metrics() if "loss" in m]
    assert [m["step"] for m in steps] == [5, 10, 15, 20, 25, 30]
    for m in steps:
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["learning_rate"] > 0
        assert 0 < m["epoch"] < 1  # sub-epoch: the step is what says where the run is
    got = run.hints()
    out = run.cwd / "out"
    assert [h["path"] for h in got if h["kind"] == "output_dir"] == [str(out)]
    ckpts = [h for h in got if h["kind"] == "checkpoint"]
    assert [(h["path"], h["step"], h["framework"]) for h in ckpts] == [
        (str(out / f"checkpoint-{n}"), n, "hf") for n in (10, 20, 30)]
    assert [h["path"] for h in got if h["kind"] == "removed"] == [str(out / "checkpoint-10")]
    assert sorted(os.listdir(out)) == ["checkpoint-20", "checkpoint-30"]  # save_total_limit=2
    for h in ckpts[1:]:  # the kept ones were complete before their hint was written
        state = Path(h["path"]) / "trainer_state.json"
        assert all((Path(h["path"]) / f).is_file() for f in HF_FILES)
        assert json.loads(state.read_text())["global_step"] == h["step"]
        assert state.stat().st_mtime <= h["ts"]
    [fh] = [h for h in got if h["kind"] == "faulthandler"]
    assert fh["signal"] == signal.SIGUSR2 and fh["path"] == str(hints.stacks_path(str(run.dir), fh["pid"]))

    old_style = out / "checkpoint-30" / "trainer_state.json"  # a file inside the checkpoint dir
    done = len(run.metrics())
    resumed = run.job("hf_tiny.py", "--steps", "40", "--save-every", "10", "--log-every", "5",
                      RGT_RESUME_FROM=str(old_style))
    assert [m["step"] for m in run.metrics()[done:] if "loss" in m] == [35, 40]
    assert IGNORED not in resumed.stderr
    done = len(run.metrics())
    fresh = run.job("hf_tiny.py", "--steps", "10", "--save-every", "10", "--ignore-resume",
                    RGT_RESUME_FROM=str(old_style.parent))
    assert [m["step"] for m in run.metrics()[done:] if "loss" in m] == [5, 10]
    assert f"RGT_RESUME_FROM={old_style.parent} {IGNORED}" in fresh.stderr
    assert "resume_from_checkpoint=onbox.integrations.resume_from()" in fresh.stderr


@needs_hf
def test_hf_hang_the_hinted_checkpoint_is_whole_and_the_signal_dumps_the_hung_frame(
        run: Run, popen: List[subprocess.Popen[str]]) -> None:
    proc = subprocess.Popen([PY, str(JOBS / "hf_tiny.py"), "--integration", "--steps", "40",
                             "--save-every", "10", "--hang-at", "12"], cwd=run.cwd, env=run.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    popen.append(proc)
    reader = hints.HintReader(run.dir)
    seen: List[Dict[str, Any]] = []

    def hinted(kind: str) -> Optional[Dict[str, Any]]:
        seen.extend(reader.poll())
        return next((h for h in seen if h["kind"] == kind), None)

    fh = _wait("the faulthandler hint", lambda: hinted("faulthandler"), proc)
    assert fh["pid"] == proc.pid
    ckpt = _wait("the checkpoint hint", lambda: hinted("checkpoint"), proc)
    assert all((Path(ckpt["path"]) / f).is_file() for f in HF_FILES), os.listdir(ckpt["path"])
    needle = f'hf_tiny.py", line {_hang_line("hf_tiny.py")} in on_step_end'
    text = _dump_until(Path(fh["path"]), proc.pid, needle, "in train", proc)
    assert "most recent call first" in text
    assert proc.poll() is None  # the dump did not end the job


def test_hf_callback_hooks_log_eval_metrics_nonfinite_values_and_never_raise(
        run: Run, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The hooks without a Trainer: HF hands on_log its evaluation metrics too."""
    for k, v in run.env().items():
        if k.startswith("RGT_"):
            monkeypatch.setenv(k, v)
    hooks = hf_integration.RgtHooks()
    state = SimpleNamespace(is_world_process_zero=True, global_step=7, epoch=0.5)
    args = SimpleNamespace(output_dir=str(run.cwd / "out"))
    hooks.on_log(args, state, None, logs={"eval_loss": 1.5, "eval_runtime": 0.1, "epoch": 0.5})
    hooks.on_log(args, state, None, logs={"loss": 2.0, "grad_norm": float("nan"), "learning_rate": 1e-4,
                                          "note": "text", "epoch": 0.5})
    assert run.metrics() == [
        {"step": 7, "epoch": 0.5, "eval_loss": 1.5, "eval_runtime": 0.1},
        {"step": 7, "epoch": 0.5, "loss": 2.0, "grad_norm": "nan", "learning_rate": 1e-4}]
    with caplog.at_level(logging.WARNING, logger="onbox.integrations"):
        hooks.on_save(object(), state, None)  # an args without output_dir: the hook fails...
        hooks.on_save(object(), state, None)
    failures = [r for r in caplog.records if "on_save failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info  # ...logs once, with its traceback, and returns


# ---- Lightning ---------------------------------------------------------------------------------------


@needs_lightning
def test_lightning_job_reports_steps_checkpoint_files_rotation_output_dir_and_stack_dumps_then_resumes(
        run: Run) -> None:
    """One job reports; a second resumes from its last checkpoint; a third ignores it and is told."""
    run.job("lightning_tiny.py", "--steps", "60", "--save-every", "20", "--log-every", "5")
    steps = run.metrics()
    assert [m["step"] for m in steps] == list(range(5, 61, 5))
    for m in steps:
        assert m["loss"] == m["train_loss"] and math.isfinite(m["loss"])
        assert m["grad_norm"] > 0 and m["lr"] == 0.05 and 0 < m["epoch"] <= 1
    got = run.hints()
    ckdir = run.cwd / "lightning_logs" / "version_0" / "checkpoints"
    assert [h["path"] for h in got if h["kind"] == "output_dir"] == [str(ckdir)]
    ckpts = [h for h in got if h["kind"] == "checkpoint"]
    assert [(h["path"], h["step"]) for h in ckpts] == [
        (str(ckdir / f"epoch=0-step={n}.ckpt"), n) for n in (20, 40, 60)]
    removed = [h["path"] for h in got if h["kind"] == "removed"]
    on_disk = sorted(str(p) for p in ckdir.iterdir())
    assert len(removed) == 1 and removed[0] not in on_disk  # save_top_k=2
    assert sorted(h["path"] for h in ckpts if h["path"] not in removed) == on_disk
    for h in ckpts:
        if h["path"] in on_disk:
            assert os.stat(h["path"]).st_mtime <= h["ts"]
    [fh] = [h for h in got if h["kind"] == "faulthandler"]
    assert fh["signal"] == signal.SIGUSR2 and fh["framework"] == "lightning"

    [ckpt] = ckdir.glob("*step=60.ckpt")
    done = len(run.metrics())
    resumed = run.job("lightning_tiny.py", "--steps", "70", "--save-every", "20", "--log-every", "5",
                      RGT_RESUME_FROM=str(ckpt))
    assert [m["step"] for m in run.metrics()[done:]] == [65, 70]
    assert IGNORED not in resumed.stderr
    fresh = run.job("lightning_tiny.py", "--steps", "5", "--ignore-resume", RGT_RESUME_FROM=str(ckpt))
    assert f"{IGNORED}; pass it on: trainer.fit(model, ckpt_path=" in fresh.stderr


@needs_lightning
def test_lightning_hang_the_hinted_ckpt_is_on_disk_and_the_signal_dumps_the_hung_frame(
        run: Run, popen: List[subprocess.Popen[str]]) -> None:
    proc = subprocess.Popen([PY, str(JOBS / "lightning_tiny.py"), "--integration", "--steps", "60",
                             "--save-every", "20", "--hang-at", "25"], cwd=run.cwd, env=run.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    popen.append(proc)
    reader = hints.HintReader(run.dir)
    seen: List[Dict[str, Any]] = []

    def hinted(kind: str) -> Optional[Dict[str, Any]]:
        seen.extend(reader.poll())
        return next((h for h in seen if h["kind"] == kind), None)

    fh = _wait("the faulthandler hint", lambda: hinted("faulthandler"), proc)
    ckpt = _wait("the checkpoint hint", lambda: hinted("checkpoint"), proc)
    assert ckpt["path"].endswith("step=20.ckpt") and os.path.getsize(ckpt["path"]) > 0
    needle = f'lightning_tiny.py", line {_hang_line("lightning_tiny.py")} in training_step'
    assert needle in _dump_until(Path(fh["path"]), fh["pid"], needle, "in fit", proc)


def test_legacy_pytorch_lightning_gets_a_callback_of_its_own_package(run: Run) -> None:
    if importlib.util.find_spec("pytorch_lightning") is None:
        pytest.skip("pytorch_lightning is not installed here")
    code = """
import sys, torch, pytorch_lightning as pl
from onbox.integrations.lightning import RgtCallback
assert issubclass(RgtCallback, pl.Callback) and "lightning.pytorch" not in sys.modules

class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
    def training_step(self, batch, i):
        return self.net(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 2)), batch_size=4)
pl.Trainer(max_steps=4, log_every_n_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
           enable_model_summary=False, callbacks=[RgtCallback()]).fit(M(), data)
"""
    proc = subprocess.run([PY, "-c", code], cwd=run.cwd, env=run.env(), capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["step"] for m in run.metrics()] == [2, 4]
    assert all("loss" in m and "grad_norm" in m for m in run.metrics())
    assert [h["kind"] for h in run.hints()][:2] == ["faulthandler", "output_dir"]


# ---- stack registration ----------------------------------------------------------------------------


_REGISTER = """
import faulthandler, os, signal, sys
from onbox.integrations import _common
how = sys.argv[1]
if how == "python":
    signal.signal(signal.SIGUSR2, lambda *a: None)
elif how == "faulthandler":
    faulthandler.register(signal.SIGUSR2, file=sys.stderr)
print(_common.register_stacks("test"), _common.register_stacks("test"))
if how == "free":
    os.kill(os.getpid(), signal.SIGUSR2)  # the dump is synchronous in the handler
"""


@pytest.mark.parametrize("how", ["free", "python", "faulthandler"])
def test_stacks_are_registered_once_and_never_over_a_handler_the_job_set(run: Run, how: str) -> None:
    proc = subprocess.run([PY, "-c", _REGISTER, how], cwd=run.cwd, env=run.env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = run.hints()
    if how != "free":
        assert proc.stdout.split() == ["None", "None"] and got == []
        return
    [fh] = got
    assert proc.stdout.split() == [fh["path"], fh["path"]]
    assert "Current thread" in Path(fh["path"]).read_text() and "<module>" in Path(fh["path"]).read_text()


# ---- resume ----------------------------------------------------------------------------------------


def test_resume_from_hands_on_what_the_framework_resumes_from(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RGT_RESUME_FROM", raising=False)
    assert resume_from() is None
    monkeypatch.setenv("RGT_RESUME_FROM", "")
    assert resume_from() is None
    hf = tmp_path / "out" / "checkpoint-150"
    hf.mkdir(parents=True)
    (hf / "trainer_state.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"x")
    for value, want in ((hf, hf), (hf / "trainer_state.json", hf), (hf / "model.safetensors", hf)):
        monkeypatch.setenv("RGT_RESUME_FROM", str(value))
        assert resume_from() == str(want)
    ckpt = tmp_path / "ckpts" / "epoch=0-step=40.ckpt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"x")
    monkeypatch.setenv("RGT_RESUME_FROM", str(ckpt))
    assert resume_from() == str(ckpt)
    monkeypatch.setenv("RGT_RESUME_FROM", str(tmp_path / "gone" / "checkpoint-9"))
    assert resume_from() == str(tmp_path / "gone" / "checkpoint-9")  # the framework says it is missing
