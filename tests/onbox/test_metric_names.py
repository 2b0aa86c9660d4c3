"""Only metrics become scalars on the box: real log lines from torchrun, tqdm, Lightning and the HF
Trainer; `time` fields in metrics.jsonl, a CSV logger and TensorBoard; and report.save's step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

from onbox import hints, report
from onbox.detectors.training import ProgressReporter, TrainingThresholds, is_loss_name
from onbox.sources.csvlog import CsvLogReader
from onbox.sources.metrics import MetricsSource
from onbox.sources.tfevents import TfEventsReader, frame
from onbox.sources.trainlog import LogParser, LogSource

REPO = Path(__file__).resolve().parents[2]

# Lines as these programs print them (torch 2.x torchrun, transformers' shard loading, Lightning 2.x).
TEXT_ONLY = [
    "W0115 10:32:01.123000 140234 torch/distributed/run.py:874] ",
    "W0115 10:32:01.123000 140234 torch/distributed/run.py:874] *****************************************",
    "W0115 10:32:01.123000 140234 torch/distributed/run.py:874] Setting OMP_NUM_THREADS environment variable "
    "for each process to be 1 in default, to avoid your system being overloaded, please further tune the "
    "variable for optimal performance in your application as needed.",
    "Loading checkpoint shards: 100%|██████████| 2/2 [00:01<00:00,  1.52it/s]",
    "Loading checkpoint shards: 2",
    "GPU available: False, used: False",
    "TPU available: False, using: 0 TPU cores",
    "HPU available: False, using: 0 HPUs",
    "Using bfloat16 Automatic Mixed Precision (AMP)",
    "Using default `ModelCheckpoint`. Consider installing `litmodels` package to enable "
    "`LitModelCheckpoint` for automatic upload to the Lightning model registry.",
    "/venv/lib/python3.11/site-packages/transformers/loss/loss_utils.py:88: UserWarning: reduction",
    "loss_utils.py:88: UserWarning",
    "[rank0]:   File \"/src/train.py\", line 42, in <module>",
    "{'batch_size': 32, 'seed': 42, 'num_workers': 4}",
]


@pytest.mark.parametrize("line", TEXT_ONLY)
def test_text_is_not_turned_into_metrics(line: str) -> None:
    record, bad = LogParser().parse(line)
    assert not bad
    assert record is None or (not record.scalars and record.step is None), record


def test_the_hf_trainer_dict_line_still_parses() -> None:
    record, bad = LogParser().parse("{'loss': 2.3, 'grad_norm': 1.25, 'learning_rate': 5e-05, 'epoch': 0.5}")
    assert not bad and record is not None
    assert record.epoch == 0.5
    assert dict(record.scalars) == {"loss": 2.3, "grad_norm": 1.25, "learning_rate": 5e-05}
    final, _ = LogParser().parse("{'train_runtime': 12.5, 'train_samples_per_second': 40.1, "
                                 "'train_loss': 2.1, 'epoch': 1.0}")
    assert final is not None and "train_runtime" not in final.scalars and final.scalars["train_loss"] == 2.1


def test_lightning_bar_keeps_the_loss_and_drops_v_num() -> None:
    record, _ = LogParser().parse("Epoch 0:  50%|█████     | 30/60 [00:01<00:01, 20.1it/s, v_num=0, "
                                  "train_loss=0.512]")
    assert record is not None and dict(record.scalars) == {"train_loss": 0.512} and record.epoch == 0.0


def test_declared_names_are_read_from_text_and_time_never(tmp_path: Path) -> None:
    assert LogParser().parse("step=5 margin=0.3 time=1700000000.5")[0].scalars == {}  # type: ignore[union-attr]
    record, _ = LogParser(declared=["margin"]).parse("step=5 margin=0.3 time=1700000000.5")
    assert record is not None and (record.step, dict(record.scalars)) == (5, {"margin": 0.3})
    regex, _ = LogParser(r"it (?P<step>\d+) m=(?P<margin>\S+) t=(?P<time>\S+)").parse("it 3 m=0.5 t=9.5")
    assert regex is not None and dict(regex.scalars) == {"margin": 0.5}   # a regex group "time" neither


def test_a_real_train_log_file_gives_only_the_metrics(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    path.write_bytes(("\n".join(TEXT_ONLY) + "\n"
                      + "{'loss': 2.3, 'grad_norm': 1.25, 'learning_rate': 5e-05, 'epoch': 0.5}\n"
                      + "step=20 loss=1.5 lr=0.001\n").encode())
    src = LogSource(path)
    got = src.drain()
    src.close()
    hf = {"loss": 2.3, "grad_norm": 1.25, "learning_rate": 5e-05}
    assert [dict(r.scalars) for r in got.records] == [hf, {"loss": 1.5, "lr": 0.001}]
    assert got.bad == 0


def test_file_names_are_not_losses() -> None:
    assert is_loss_name("loss") and is_loss_name("eval_loss") and is_loss_name("train/loss")
    assert not is_loss_name("loss_utils.py") and not is_loss_name("loss_utils.py:88")


def test_time_fields_in_metrics_jsonl_csv_and_tfevents_are_no_scalars(tmp_path: Path) -> None:
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text('{"step": 10, "epoch": 0.1, "loss": 0.5, "time": 1700000000.5, "timestamp": 1, '
                     '"epoch_time": 3.2, "wall_time": 5}\n{"time": 1700000001.0}\n')
    src = MetricsSource(jsonl)
    got = src.poll()
    src.close()
    assert [(r.step, dict(r.scalars)) for r in got.records] == [(10, {"loss": 0.5})] and got.bad == 0

    csv = tmp_path / "metrics.csv"
    csv.write_text("epoch,step,time,train_loss\n0,4,1700000000.5,0.9\n")
    rows = CsvLogReader(csv).poll().records
    assert [(r.step, dict(r.scalars)) for r in rows] == [(4, {"train_loss": 0.9})]

    events = tmp_path / "events.out.tfevents.1.box"
    events.write_bytes(frame(_event(7, {"train/loss": 0.25, "time": 1.7e9, "step_time": 0.4})))
    (record,) = TfEventsReader(events).poll().records
    assert record.step == 7 and dict(record.scalars) == {"train/loss": 0.25}


def _event(step: int, values: Dict[str, float]) -> bytes:
    """An Event protobuf: step (field 2), summary (5) of values (1) with tag (1) and simple_value (2)."""
    import struct

    def varint(n: int) -> bytes:
        out = b""
        while True:
            byte, n = n & 0x7F, n >> 7
            out += bytes([byte | (0x80 if n else 0)])
            if not n:
                return out

    def field(number: int, data: bytes) -> bytes:
        return varint(number << 3 | 2) + varint(len(data)) + data

    summary = b"".join(field(1, field(1, tag.encode()) + varint(2 << 3 | 5) + struct.pack("<f", value))
                       for tag, value in values.items())
    return varint(2 << 3) + varint(step) + field(5, summary)


def test_progress_never_carries_a_time_field() -> None:
    progress = ProgressReporter(TrainingThresholds())
    progress.observe(1.0, 10, None, {"loss": 0.5, "time": 1.7e9, "run.py": 874.0})
    assert progress.snapshot(2.0)["scalars"] == {"loss": 0.5}


def test_train_tiny_metrics_reach_the_box_without_its_time_field(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    metrics = tmp_path / "metrics.jsonl"
    env = {**os.environ, "RGT_METRICS": str(metrics), "RGT_CKPT_DIR": str(tmp_path / "ck")}
    env.pop("RGT_RESUME_FROM", None)
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "train_tiny.py"), "--steps", "20",
                           "--log-every", "10", "--ckpt-every", "100", "--step-seconds", "0"],
                          env=env, cwd=tmp_path, capture_output=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert all("time" in json.loads(line) for line in metrics.read_text().splitlines())  # it writes one
    src = MetricsSource(metrics)
    records = src.poll().records
    src.close()
    assert [r.step for r in records] == [10, 20]
    assert all(set(r.scalars) == {"loss"} for r in records)


# ---- report.save(step=N) ---------------------------------------------------------------------------


@pytest.fixture
def job_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    run = tmp_path / "run"
    (run / "rgt").mkdir(parents=True)
    monkeypatch.setenv("RGT_RUN_DIR", str(run))
    monkeypatch.setenv("RGT_CKPT_DIR", str(run / "checkpoints"))
    return run


def test_report_save_records_the_step_whatever_the_name(job_env: Path) -> None:
    torch = pytest.importorskip("torch")
    latest = report.save({"w": torch.zeros(2)}, "latest.pt", step=300)
    named = report.save({"w": torch.ones(2)}, "step{step:06d}.pt", step=400)
    unstepped = report.save({"w": torch.ones(2)}, "other.pt")
    reader = hints.HintReader(job_env)
    got = [(h["kind"], h["path"], h.get("step")) for h in reader.poll()]
    assert got == [("step", str(latest), 300), ("checkpoint", str(latest), 300),
                   ("step", str(named), 400), ("checkpoint", str(named), 400)]
    assert latest.is_file() and named.name == "step000400.pt" and unstepped.is_file()


def test_report_save_outside_rgt_writes_no_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("RGT_RUN_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    path = report.save({"w": torch.zeros(1)}, "latest.pt", step=5)
    assert path == Path("checkpoints") / "latest.pt" and path.is_file()
    assert not list(tmp_path.rglob("hints.jsonl"))
