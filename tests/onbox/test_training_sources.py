"""The training sources over real files: the tail (partial lines, truncation, rotation, restore,
bounded reads) and the parsers of metrics.jsonl and train.log."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Dict, List

import pytest

from onbox.errors import ConfigError
from onbox.sources.metrics import FileTail, MetricsSource, Record, to_number
from onbox.sources.trainlog import LogParser, LogSource


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


# ---- the tail -------------------------------------------------------------------------------------


def test_a_partial_last_line_waits_for_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tail = FileTail(path)
    assert tail.poll().lines == []  # no file yet: nothing, no error
    append(path, b'{"step": 1}\n{"step": 2, "lo')
    got = tail.poll()
    assert got.lines == [b'{"step": 1}'] and got.new_bytes == 27
    assert tail.position() == (path.stat().st_ino, 12)  # just past the last whole line
    append(path, b'ss": 0.5}\n')
    os.utime(path, (1234.5, 1234.5))
    got = tail.poll()
    assert got.lines == [b'{"step": 2, "loss": 0.5}'] and got.mtime == 1234.5  # when it was written
    got = tail.poll()
    assert got.lines == [] and got.new_bytes == 0 and got.mtime is None
    tail.close()


def test_each_poll_stats_once_and_reads_only_the_new_bytes(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    append(path, b"a\n" * 1000)
    calls: List[str] = []

    def stat(p: str) -> os.stat_result:
        calls.append(p)
        return os.stat(p)

    tail = FileTail(path, stat=stat)
    assert len(tail.poll().lines) == 1000
    append(path, b"b\n")
    got = tail.poll()
    assert got.new_bytes == 2 and got.lines == [b"b"]
    assert tail.poll().new_bytes == 0
    assert len(calls) == 3
    tail.close()


def test_truncation_in_place_reads_the_file_again_from_its_start(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    append(path, b'{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    tail = FileTail(path)
    assert len(tail.poll().lines) == 3
    with open(path, "wb") as f:
        f.write(b'{"step": 9}\n')
    got = tail.poll()
    assert got.truncated and got.lines == [b'{"step": 9}']
    tail.close()


def test_rotation_drains_the_old_file_then_reads_the_new_from_its_start(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    append(path, b"one\n")
    tail = FileTail(path)
    assert tail.poll().lines == [b"one"]
    append(path, b"two\nthree-unterminated")
    os.rename(path, tmp_path / "train.log.1")
    append(path, b"four\n")
    got = tail.poll()
    assert got.rotated and got.lines == [b"two", b"three-unterminated", b"four"]
    tail.close()


def test_a_vanished_path_keeps_the_open_file_until_a_new_one_appears(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    append(path, b"a\n")
    tail = FileTail(path)
    tail.poll()
    with open(path, "ab") as writer:
        os.unlink(path)
        writer.write(b"b\n")
        writer.flush()
        assert tail.poll().lines == [b"b"]  # the writer still appends to the unlinked file
    append(path, b"c\n")
    got = tail.poll()
    assert got.rotated and got.lines == [b"c"]
    tail.close()


def test_a_restored_position_skips_old_lines_and_a_stale_one_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    append(path, b"old1\nold2\n")
    first = FileTail(path)
    first.poll()
    pos = first.position()
    first.close()
    assert pos is not None
    append(path, b"new\n")
    again = FileTail(path)
    again.restore(*pos)
    assert again.poll().lines == [b"new"] and again.restored
    again.close()
    stale = FileTail(path)
    stale.restore(pos[0] + 1, pos[1])  # another inode: the file was replaced
    assert stale.poll().lines == [b"old1", b"old2", b"new"] and not stale.restored
    stale.close()


def test_an_overlong_line_is_dropped_and_counted_and_the_next_line_survives(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tail = FileTail(path, max_line_bytes=100)
    append(path, b"x" * 150)
    got = tail.poll()
    assert got.lines == [] and got.overlong == 1
    append(path, b"y" * 150 + b"\nok\n")
    got = tail.poll()
    assert got.lines == [b"ok"] and got.overlong == 0
    tail.close()


def test_reads_are_bounded_and_history_is_cut_to_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    append(path, b"".join(b"line%04d\n" % i for i in range(1000)))  # 9000 bytes
    bounded = FileTail(path, max_read_bytes=900)
    assert len(bounded.poll().lines) == 100
    assert len(bounded.drain().lines) == 900
    bounded.close()
    cut = FileTail(path, history_bytes=95)  # the cut lands inside a line: that line is dropped
    assert cut.drain().lines == [b"line%04d" % i for i in range(990, 1000)]
    cut.close()


# ---- metrics.jsonl --------------------------------------------------------------------------------


def test_metrics_lines_become_records_and_garbage_is_counted(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    append(path, b"\n".join([
        b'{"step": 10, "epoch": 0.5, "loss": 0.25, "ok": true, "tag": "x", "lr": "1e-4"}',
        b'{"global_step": 11, "loss": "nan", "grad": "-inf", "eval": {"acc": 0.5}}',
        b'{"step": 12, "loss": NaN}',
        b"not json at all",
        b"[1, 2, 3]",
        b"",
        b'{"note": "no numbers here"}',
        b'{"step": 13, "loss": Infinity}',
    ]) + b"\n")
    src = MetricsSource(path)
    got = src.poll()
    assert got.bad == 2 and src.bad_lines == 2 and src.bad_example == "not json at all"
    first, second, third, fourth = got.records
    assert first == Record("metrics", 10, 0.5, {"loss": 0.25, "lr": 1e-4})
    assert second.step == 11 and math.isnan(second.scalars["loss"]) and second.scalars["grad"] == -math.inf
    assert second.scalars["eval/acc"] == 0.5
    assert math.isnan(third.scalars["loss"]) and fourth.scalars["loss"] == math.inf
    src.close()


@pytest.mark.parametrize("value, expected", [
    ("nan", math.nan), ("-inf", -math.inf), ("Infinity", math.inf), (True, None), (3, 3.0),
    ("abc", None), (None, None), (10 ** 400, math.inf),
])
def test_to_number(value: Any, expected: Any) -> None:
    got = to_number(value)
    if expected is None or not math.isnan(expected):
        assert got == expected
    else:
        assert got is not None and math.isnan(got)


# ---- train.log ------------------------------------------------------------------------------------


@pytest.mark.parametrize("line, step, epoch, scalars", [
    ("{'loss': 0.12, 'grad_norm': 1.5, 'learning_rate': 5e-05, 'epoch': 0.5}", None, 0.5,
     {"loss": 0.12, "grad_norm": 1.5, "learning_rate": 5e-05}),
    ("{'loss': np.float32(0.5), 'epoch': 1.0}", None, 1.0, {"loss": 0.5}),
    ('{"level": "info", "ok": true, "loss": 0.5}', None, None, {"loss": 0.5}),
    ("2024-01-01 12:00:00,123 INFO step=10 Loss=0.5 lr=1e-4 level: info", 10, None,
     {"loss": 0.5, "lr": 1e-4}),
    ("Epoch 3/10 | Step: 120 | acc=95% time=3.2s version=1.2.3 url http://host:8080", 120, 3.0,
     {"acc": 95.0}),   # a time is no metric
    ("\x1b[32m  5%|5    | 50/1000 [00:10<03:10,  5.00it/s, loss=0.123]\x1b[0m", 50, None, {"loss": 0.123}),
])
def test_log_lines_give_their_counters_and_scalars(line: str, step: Any, epoch: Any, scalars: Any) -> None:
    record, bad = LogParser().parse(line)
    assert not bad and record is not None
    assert (record.step, record.epoch, dict(record.scalars)) == (step, epoch, scalars)


def test_nonfinite_values_in_log_lines_are_read_as_such() -> None:
    parser = LogParser()
    hf, _ = parser.parse("{'loss': nan, 'grad_norm': inf, 'epoch': 0.5}")
    kv, _ = parser.parse("step=7 loss=NaN eval_acc=-inf")
    assert hf is not None and math.isnan(hf.scalars["loss"]) and hf.scalars["grad_norm"] == math.inf
    assert kv is not None and math.isnan(kv.scalars["loss"]) and kv.scalars["eval_acc"] == -math.inf


def test_a_dict_line_is_never_evaluated(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    line = f"{{'loss': __import__('os').system('touch {marker}'), 'epoch': 1}}"
    record, bad = LogParser().parse(line)
    assert (record, bad) == (None, True)
    assert not marker.exists()
    assert LogParser().parse("{'unrelated': __import__('os')}") == (None, False)  # not a metrics dict


def test_the_user_regex_wins_and_a_non_number_group_is_bad() -> None:
    parser = LogParser(r"it (?P<step>\d+) L=(?P<loss>\S+)(?: E=(?P<epoch>\S+))?")
    record, bad = parser.parse("it 5 L=0.25 E=1.5 junk=3")
    assert not bad and record == Record("log", 5, 1.5, {"loss": 0.25})
    assert parser.parse("it 5 L=abc") == (None, True)
    fallback, _ = parser.parse("step=3 loss=0.1")  # no match: the built-in parsers
    assert fallback is not None and fallback.step == 3
    with pytest.raises(ConfigError):
        LogParser(r"(unclosed")
    with pytest.raises(ConfigError):
        LogParser(r"no groups")


def test_log_source_splits_carriage_returns_and_counts_only_bad_dicts(tmp_path: Path) -> None:
    path = tmp_path / "train.log"
    append(path, b"loading...\r10%|# | loss=0.9\r20%|## | loss=0.8\n"
                 b"{'loss': 0.7, 'epoch': oops}\nplain text\n")
    src = LogSource(path)
    got = src.poll()
    assert [r.scalars["loss"] for r in got.records] == [0.9, 0.8]
    assert got.bad == 1 and src.bad_lines == 1 and src.bad_example is not None
    assert all(r.source == "log" for r in got.records)
    src.close()


# ---- framework files: TensorBoard events, Lightning metrics.csv, HF trainer_state.json ------------

def test_tfevents_from_a_real_summary_writer_old_and_new_style(tmp_path: Path) -> None:
    SummaryWriter = pytest.importorskip("torch.utils.tensorboard").SummaryWriter  # not in the 3.9 venv

    from onbox.sources.tfevents import TfEventsReader
    w = SummaryWriter(str(tmp_path))
    for step in range(3):
        w.add_scalar("train_loss", 1.0 / (step + 1), step)
        w.add_scalar("train/grad_norm", float("nan") if step == 2 else 0.5, step, new_style=True)
        w.add_scalar("epoch", 0.0, step)
    w.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    got = TfEventsReader(path).poll()
    assert got.bad == 0 and [r.step for r in got.records] == [0, 1, 2]
    last = got.records[-1]
    assert last.epoch == 0.0 and last.scalars["train_loss"] == pytest.approx(1 / 3)
    assert math.isnan(last.scalars["train/grad_norm"]) and got.records[0].scalars["train/grad_norm"] == 0.5


def test_tfevents_torn_and_garbage_records_are_skipped_and_counted(tmp_path: Path) -> None:
    SummaryWriter = pytest.importorskip("torch.utils.tensorboard").SummaryWriter  # not in the 3.9 venv

    from onbox.sources.tfevents import TfEventsReader, frame
    w = SummaryWriter(str(tmp_path))
    w.add_scalar("loss", 0.5, 1)
    w.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    good = path.read_bytes()                                              # file_version + loss@1
    bad_data = bytearray(frame(b"\x10\x02"))
    bad_data[-1] ^= 0xFF                                                  # its data crc is wrong
    path.write_bytes(good + b"garbage!" * 3 + bytes(bad_data) + good + frame(b"\xff\xff"))
    reader = TfEventsReader(path)
    got = reader.poll()                # garbage (resync), a bad crc, an undecodable event: 3 bad
    assert [(r.step, dict(r.scalars)) for r in got.records] == [(1, {"loss": 0.5})] and got.bad == 3
    half = frame(b"\x10\x07" + b"")[:9]
    with open(path, "ab") as f:
        f.write(half)                                                    # a record still being written
    assert reader.poll().records == []
    with open(path, "ab") as f:
        f.write(frame(b"\x10\x07")[9:])
    assert reader.poll().bad == 0


def test_csv_rows_appended_then_rewritten_with_a_new_column(tmp_path: Path) -> None:
    from onbox.sources.csvlog import CsvLogReader
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,step,train_loss\n0,4,0.9\n0,9,\n")
    reader = CsvLogReader(path)
    got = reader.poll()
    assert [(r.step, dict(r.scalars)) for r in got.records] == [(4, {"train_loss": 0.9}), (9, {})]
    with open(path, "a") as f:
        f.write("0,14,nan\n0,19,0.")                                     # a partial last row waits
    got = reader.poll()
    assert [r.step for r in got.records] == [14] and math.isnan(got.records[0].scalars["train_loss"])
    ino = path.stat().st_ino
    with open(path, "r+") as f:                                          # Lightning's in-place rewrite
        f.truncate(0)
        f.write("epoch,step,train_loss,val_acc\n0,4,0.9,\n0,9,,\n0,14,nan,\n0,19,0.5,\n0,24,0.4,0.7\n")
    assert path.stat().st_ino == ino
    got = reader.poll()
    assert [(r.step, dict(r.scalars)) for r in got.records] == [(19, {"train_loss": 0.5}),
                                                                 (24, {"train_loss": 0.4, "val_acc": 0.7})]
    saved = reader.position()
    again = CsvLogReader(path)
    assert again.restore(saved) and again.poll().records == []


def _hf_state(path: Path, global_step: int, losses: Dict[int, float], max_steps: int = 100) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    history = [{"loss": v, "grad_norm": 0.5, "epoch": s / 1000, "step": s} for s, v in losses.items()]
    path.write_text(json.dumps({"global_step": global_step, "max_steps": max_steps,
                                "epoch": global_step / 1000, "log_history": history}))


def test_trainer_state_files_give_new_entries_once_and_a_restart_its_whole_history(tmp_path: Path) -> None:
    from onbox.sources.hfstate import HfStateSource
    from onbox.sources.jobfiles import scan
    out = tmp_path / "out"
    _hf_state(out / "checkpoint-20" / "trainer_state.json", 20, {10: 1.0, 20: 0.9})
    _hf_state(out / "checkpoint-40" / "trainer_state.json", 40, {10: 1.0, 20: 0.9, 30: 0.8, 40: float("nan")})
    src = HfStateSource()
    found = scan(tmp_path)["hfstate"]
    got = src.read(found)
    steps = [r.step for r in got.records]
    assert steps == [10, 20, 20, 30, 40, 40] and got.records[-1].total == 100
    assert math.isnan(got.records[-2].scalars["loss"])
    assert src.read(found).records == []                                  # unchanged: nothing again
    _hf_state(out / "checkpoint-10" / "trainer_state.json", 10, {5: 2.0, 10: 1.9})  # a restart
    got = src.read(scan(tmp_path)["hfstate"])
    assert [r.step for r in got.records] == [5, 10, 10]


def test_the_scan_is_bounded_and_finds_the_framework_places(tmp_path: Path) -> None:
    from onbox.sources.jobfiles import scan
    (tmp_path / "lightning_logs" / "version_0").mkdir(parents=True)
    (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").write_text("step\n")
    (tmp_path / "lightning_logs" / "version_0" / "events.out.tfevents.1.host.1.0").write_bytes(b"")
    (tmp_path / "notes" / "metrics.csv").parent.mkdir()
    (tmp_path / "notes" / "metrics.csv").write_text("x\n")                 # not a CSVLogger place
    deep = tmp_path / "a" / "b" / "c" / "d" / "version_1"
    deep.mkdir(parents=True)
    (deep / "metrics.csv").write_text("step\n")                            # below the depth bound
    (tmp_path / ".git" / "version_2").mkdir(parents=True)
    (tmp_path / ".git" / "version_2" / "metrics.csv").write_text("step\n")
    found = scan(tmp_path)
    csvs = [p.relative_to(tmp_path).as_posix() for p in found["csv"]]
    assert csvs == ["lightning_logs/version_0/metrics.csv"]
    assert len(found["tfevents"]) == 1
    assert scan(tmp_path, max_entries=2)["csv"] == []
