"""`rgt verify RUN_DIR` through click, inside an RgtGroup as controller/cli/main.py will attach it."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any, List

import pytest
from click.testing import CliRunner, Result

from controller.cli.base import RgtGroup
from controller.cli.verify import verify_command
from controller.verify import load as verify_load
from controller.verify import units as verify_units
from tests.controller.verifykit import MANIFEST, VERIFIED, entries_of, make_run, write_manifest

ST100 = "checkpoints/step000100.safetensors"


@pytest.fixture(autouse=True)
def no_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> List[str]:
        raise AssertionError("a seam child was started")
    monkeypatch.setattr(verify_load, "seam_command", refuse)
    monkeypatch.setattr(verify_units, "newest_units", lambda steps: [])  # its NaN check needs a child


def rgt(*args: str) -> Result:
    group = RgtGroup("rgt")
    group.add_command(verify_command)
    runner = CliRunner()
    return runner.invoke(group, ["verify", *args], catch_exceptions=False)


def lines(text: str) -> List[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def test_a_clean_run_prints_one_line_per_proof_and_exits_0(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    res = rgt(str(run))
    assert res.exit_code == 0, res.output
    out = lines(res.stdout)
    assert [ln.split()[:2] for ln in out[:3]] == [["identity", "passed"], ["safe_load", "passed"],
                                                   ["metric", "skipped"]]
    assert out[0].split(None, 2)[2].startswith("4/4 files match")
    assert out[-1] == f"PULL VERIFIED: {run / VERIFIED}"
    assert f"  {ST100}: 1 file, weights not checked for NaN/Inf" in out
    assert res.stderr == ""


def test_a_failing_file_is_one_error_line_and_the_last_names_the_proof(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    (run / ST100).write_bytes(b"\x1b[2J" + (run / ST100).read_bytes()[4:])  # same size, other bytes
    (run / "extra\x1b]0;evil\x07.txt").write_text("x")
    res = rgt(str(run))
    assert res.exit_code == 1
    assert lines(res.stdout)[0].split()[:2] == ["identity", "failed"]
    err = lines(res.stderr)
    assert err[0].startswith(f"error: {ST100}: identity: sha256 differs")
    assert err[1] == "error: extra\\x1b]0;evil\\x07.txt: identity: extra file: not in the manifest"
    assert err[2].startswith("error: verification failed: identity (report: ")
    assert err[3].startswith("hint: nothing on the box may be destroyed")
    assert "\x1b" not in res.output
    assert "PULL VERIFIED" not in res.stdout


def test_json_prints_the_report(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    res = rgt(str(run), "--json")
    assert res.exit_code == 0, res.output
    [line] = lines(res.stdout)
    doc = json.loads(line)
    assert doc["ok"] is True and doc["report_path"] == str(run / VERIFIED)
    stored = json.loads((run / VERIFIED).read_text())
    assert {k: v for k, v in doc.items() if k != "report_path"} == stored


def test_json_still_fails_with_exit_1(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    (run / "config.json").unlink()
    res = rgt(str(run), "--json")
    assert res.exit_code == 1
    [line] = lines(res.stdout)
    doc = json.loads(line)
    assert doc["ok"] is False
    by_path = {f["path"]: f for f in doc["files"]}
    assert by_path["config.json"]["identity"].startswith("missing")
    assert lines(res.stderr)[0].startswith("error: verification failed: identity (report: ")


def test_eval_options_reach_the_metric_proof(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    script = tmp_path / "eval.py"
    script.write_text("import json; print(json.dumps({'acc': 0.75}))\n")
    (run / "metrics.jsonl").write_text('{"step": 200, "acc": 0.7}\n')
    write_manifest(run, entries_of(run))
    cmd = shlex.join([sys.executable, str(script), "{ckpt}"])
    res = rgt(str(run), "--eval-cmd", cmd, "--metric", "acc", "--tolerance", "0.1")
    assert res.exit_code == 0, res.output
    assert "step 200: 0.75 vs reported 0.7" in res.stdout
    res = rgt(str(run), "--eval-cmd", cmd, "--metric", "acc")
    assert res.exit_code == 1
    assert "acc recomputed 0.75, run reported 0.7 at step 200" in res.stderr
    assert lines(res.stderr)[-2].startswith("error: verification failed: metric (report:")


@pytest.mark.parametrize("args, text", [
    (["--eval-cmd", "python eval.py"], "must contain {ckpt}"),
    (["--workers", "0"], "--workers"),
    (["--tolerance", "-1"], "--tolerance"),
    (["--manifest", "/nonexistent/PULL_MANIFEST.json"], "--manifest"),
])
def test_usage_errors_exit_2(tmp_path: Path, args: List[str], text: str) -> None:
    run = make_run(tmp_path)
    res = rgt(str(run), *args)
    assert res.exit_code == 2, res.output
    assert text in res.stderr
    assert not (run / VERIFIED).exists()


def test_a_missing_run_dir_is_a_usage_error(tmp_path: Path) -> None:
    res = rgt(str(tmp_path / "nope"))
    assert res.exit_code == 2 and "does not exist" in res.stderr


def test_an_explicit_manifest_elsewhere(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    moved = tmp_path / "box-manifest.json"
    (run / MANIFEST).rename(moved)
    res = rgt(str(run), "--manifest", str(moved))
    assert res.exit_code == 0, res.output
    assert json.loads((run / VERIFIED).read_text())["manifest_path"] == str(moved)
