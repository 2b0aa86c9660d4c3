"""`rgt-onbox close`: sealing active/<run-id> into export/<run-id>, refusals and quarantine.

One test launches a real run (the real wrapper, supervisor, sidecar and custody); the others build
a run dir by hand (no job record: not running) so each refusal is checked on its own.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any, Iterator, List

import pytest
from click.testing import CliRunner

from onbox.cli.pull import close_command
from onbox.custody import manifest, pullmanifest
from onbox.custody.closeout import QUARANTINE_FILE, close_run
from onbox.custody.gateview import gate_view
from onbox.custody.pullmanifest import MANIFEST_REL
from onbox.runs import run_status
from protocol.pull import check_manifest
from tests.helpers import SidecarProcess, wait_until
from tests.onbox.test_launch import WAIT_GO, Rig, py
from tests.onbox.test_pullmanifest import make_run, record


def _writable(tmp_path: Path) -> None:
    """Give the sealed (read-only) trees their write bits back so tmp_path can be removed."""
    for base, dirs, files in os.walk(tmp_path):
        for name in dirs:
            path = os.path.join(base, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755)
        for name in files:
            path = os.path.join(base, name)
            if not os.path.islink(path):
                os.chmod(path, 0o644)


@pytest.fixture(autouse=True)
def restore_write_bits(tmp_path: Path) -> Iterator[None]:
    yield
    _writable(tmp_path)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return make_run(tmp_path / "root")


def layout(run_dir: Path) -> Any:
    project = run_dir.parents[1]
    return project / "export" / run_dir.name, project / "export" / ".partial", project / "quarantine"


def invoke(*args: str) -> Any:
    return CliRunner().invoke(close_command, list(args), catch_exceptions=False)


def test_seal_a_real_run_refused_while_running_then_sealed(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    job = ("import os\n"
           "p = os.path.join(os.environ['RGT_CKPT_DIR'], 'step000010.bin')\n"
           "open(p + '.tmp', 'wb').write(b'w' * 5000)\n"
           "os.replace(p + '.tmp', p)\n"
           "open(os.path.join(os.environ['RGT_RUN_DIR'], 'metrics.jsonl'), 'a').write('{\"step\": 10}\\n')\n"
           + WAIT_GO)
    try:
        run_dir = rig.launch(py(job), run_id="sealme").run_dir
        wait_until(lambda: manifest.read(run_dir), 20, "custody to record the checkpoint")
        export, partial_root, _ = layout(run_dir)

        refused = invoke(str(run_dir), "--json")
        assert refused.exit_code == 1
        doc = json.loads(refused.stdout)
        assert doc["outcome"] == "refused" and "running" in doc["detail"]
        assert run_dir.is_dir() and not export.exists()

        rig.go(run_dir)
        assert rig.finished(run_dir)["code"] == 0
        wait_until(lambda: not run_status(run_dir).sidecar_alive, 15, "the sidecar to end")
        sealed = invoke("p/sealme", "--root", str(rig.root), "--json")
        assert sealed.exit_code == 0, sealed.output
        result = json.loads(sealed.stdout)
    finally:
        rig.end()
    assert result["outcome"] == "sealed" and result["export_dir"] == str(export)
    assert not run_dir.exists() and export.is_dir() and list(partial_root.iterdir()) == []
    doc = json.loads((export / MANIFEST_REL).read_text())
    check_manifest(doc)
    assert doc["sha256"] == result["manifest_sha256"] and result["problems"] == []
    entry = next(f for f in doc["files"] if f["path"] == "checkpoints/step000010.bin")
    assert entry["hashed"] == "custody" and entry["size"] == 5000
    assert {"metrics.jsonl", "run.json", "train.log", "rgt/exit.json"} <= {f["path"] for f in doc["files"]}
    assert stat.S_IMODE(os.stat(export).st_mode) == 0o555
    assert stat.S_IMODE(os.stat(export / "checkpoints").st_mode) == 0o555
    assert stat.S_IMODE(os.stat(export / "checkpoints" / "step000010.bin").st_mode) == 0o444
    view = gate_view(export)  # run.json names .../active/sealme/checkpoints: found under the export
    assert view["ckpt_dir"] == "checkpoints" and view["unrecorded"] == [] and view["missing"] == []
    assert list(view["checkpoints"]) == ["checkpoints/step000010.bin"]


def test_seal_by_hand_made_run_and_human_output(run_dir: Path) -> None:
    export, partial_root, quarantine = layout(run_dir)
    out = invoke(str(run_dir))
    assert out.exit_code == 0, out.output
    assert f"sealed p/run-1 -> {export}" in out.stdout and "manifest sha256" in out.stdout
    assert not run_dir.exists() and list(partial_root.iterdir()) == [] and not quarantine.exists()
    assert (export / "checkpoints" / "step000010.bin").read_bytes() == b"weights-10" * 100


def test_refused_while_a_sidecar_serves_the_run(run_dir: Path) -> None:
    sc = SidecarProcess(run_dir, "--heartbeat", "5", "--gpu", "none", "--no-kmsg").start()
    try:
        result = close_run(run_dir)
    finally:
        sc.stop()
    assert result.outcome == "refused" and "a sidecar holds sidecar.lock" in result.detail
    export, partial_root, _ = layout(run_dir)
    assert run_dir.is_dir() and not export.exists() and not partial_root.exists()
    assert close_run(run_dir).outcome == "sealed"  # once it is gone


def test_an_existing_export_is_never_overwritten(run_dir: Path) -> None:
    export, partial_root, _ = layout(run_dir)
    export.mkdir(parents=True)
    (export / "run.json").write_text("sealed earlier")
    out = invoke(str(run_dir), "--json")
    assert out.exit_code == 1
    result = json.loads(out.stdout)
    assert result["outcome"] == "refused" and "never overwritten" in result["detail"]
    assert (export / "run.json").read_text() == "sealed earlier"
    assert sorted(os.listdir(export)) == ["run.json"]
    assert (run_dir / "checkpoints" / "step000010.bin").exists() and not partial_root.exists()


def test_an_interrupted_close_is_not_closed_over(run_dir: Path) -> None:
    _, partial_root, _ = layout(run_dir)
    (partial_root / "run-1").mkdir(parents=True)
    result = close_run(run_dir)
    assert result.outcome == "refused" and "interrupted" in result.detail and run_dir.is_dir()


def test_a_byte_flipped_after_the_manifest_quarantines_the_run(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = pullmanifest.write_manifest

    def write_then_flip(where: Path, *args: Any, **kw: Any) -> Path:
        path = real(where, *args, **kw)
        ckpt = Path(where) / "checkpoints" / "step000010.bin"
        data = bytearray(ckpt.read_bytes())
        data[100] ^= 0x01  # same size: only the hash can tell
        ckpt.write_bytes(bytes(data))
        return path

    monkeypatch.setattr(pullmanifest, "write_manifest", write_then_flip)
    out = invoke(str(run_dir), "--json")
    assert out.exit_code == 1
    result = json.loads(out.stdout)
    export, partial_root, quarantine = layout(run_dir)
    assert result["outcome"] == "quarantined" and result["quarantine_dir"] == str(quarantine / "run-1")
    assert not run_dir.exists() and not export.exists() and list(partial_root.iterdir()) == []
    reason = json.loads((quarantine / "run-1" / QUARANTINE_FILE).read_text())
    assert reason["run_id"] == "run-1" and reason["from"] == str(run_dir)
    assert len(reason["problems"]) == 1
    assert reason["problems"][0].startswith("checkpoints/step000010.bin: listed 1000")
    assert reason["manifest_sha256"] == result["manifest_sha256"]
    assert stat.S_IMODE(os.stat(quarantine / "run-1").st_mode) & 0o200  # quarantine stays writable


def test_a_lying_custody_record_and_a_missing_checkpoint_quarantine(
        tmp_path: Path, short_grace: None) -> None:
    root = tmp_path / "root"
    liar = make_run(root, "liar")
    (liar / "checkpoints" / "step000020.bin").write_bytes(b"20")
    record(liar, "checkpoints/step000020.bin", digest="cd" * 32, step=20, ts=2000.0)
    result = close_run(liar)
    assert result.outcome == "quarantined" and "checkpoints/step000020.bin" in result.problems[0]

    gone = make_run(root, "gone")
    (gone / "checkpoints" / "step000010.bin").unlink()
    first = close_run(gone)
    assert first.outcome == "quarantined" and "missing" in first.problems[0]
    again = make_run(root, "gone")  # the same run id quarantined twice: never overwritten
    (again / "checkpoints" / "step000010.bin").unlink()
    second = close_run(again)
    assert second.quarantine_dir == str(root / "p" / "quarantine" / "gone--2")
    assert (Path(first.quarantine_dir or "") / QUARANTINE_FILE).exists()


def test_another_filesystem_is_refused_with_nothing_moved(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: List[Any] = []

    def exdev(src: Any, dst: Any) -> None:
        calls.append((src, dst))
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))

    monkeypatch.setattr(os, "rename", exdev)
    out = invoke(str(run_dir), "--json")
    assert out.exit_code == 1 and len(calls) == 1
    result = json.loads(out.stdout)
    assert result["outcome"] == "refused" and "another filesystem" in result["detail"]
    export, partial_root, quarantine = layout(run_dir)
    assert run_dir.is_dir() and not export.exists() and list(partial_root.iterdir()) == []
    assert not quarantine.exists() and not (run_dir / MANIFEST_REL).exists()


def test_usage_and_unknown_runs(tmp_path: Path, run_dir: Path) -> None:
    assert CliRunner().invoke(close_command, []).exit_code == 2
    out = CliRunner().invoke(close_command, ["nope", "--root", str(tmp_path / "root")])
    assert out.exit_code == 1 and "no run 'nope'" in out.output
    loose = tmp_path / "loose"
    (loose / "rgt").mkdir(parents=True)
    result = close_run(loose)
    assert result.outcome == "refused" and "active" in result.detail
