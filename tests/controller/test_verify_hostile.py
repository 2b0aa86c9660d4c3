"""`rgt verify` against a hostile pull: an eval never sees a file that failed safe load, a
safetensors header built to crash the parser is a named failure, and a verification whose checking
raised still replaces an earlier passing report.

Real files: a torch.save'd pickle that runs `touch MARKER` when loaded with plain torch.load, real
safetensors files, the real seam child where a torch file must be loaded."""
from __future__ import annotations

import json
import shlex
import struct
import sys
from pathlib import Path
from typing import Any, List

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import save_file

from controller.cli.base import RgtGroup
from controller.cli.verify import verify_command
from controller.teardown import gate as teardown
from controller.verify import units as verify_units
from controller.verify.prove import verify
from rgtlib import safetensors_header
from tests.controller.verifykit import VERIFIED, Evil, entries_of, make_run, tensors, write_manifest

ST200 = "checkpoints/step000200.safetensors"
HF = "checkpoints/checkpoint-300"


def rgt(*args: str) -> Result:
    group = RgtGroup("rgt")
    group.add_command(verify_command)
    return CliRunner().invoke(group, ["verify", *args], catch_exceptions=False)


def stored(run: Path) -> Any:
    return json.loads((run / VERIFIED).read_text())


@pytest.fixture
def quiet_finite(monkeypatch: pytest.MonkeyPatch) -> None:
    """No default NaN/Inf check of the newest checkpoint (it needs a seam child of its own)."""
    monkeypatch.setattr(verify_units, "newest_units", lambda steps: [])


# ---- the eval sees only what passed ----------------------------------------------------------------


def hf_run_with_a_hostile_include(tmp_path: Path, marker: Path) -> Path:
    """A pulled run whose newest checkpoint dir also holds evil.pt: a pickle that touches `marker`
    when loaded, which the box lists as a mere include (a box can call a file anything)."""
    run = make_run(tmp_path)
    ck = run / HF
    ck.mkdir(parents=True)
    save_file(tensors(7), str(ck / "model.safetensors"), metadata={"step": "300"})
    (ck / "config.json").write_text('{"hidden": 8}\n')
    (ck / "training_args.bin").write_bytes(b"\x80\x04N.")  # a pickle of code: never handed over
    torch.save({"w": torch.ones(2), "payload": Evil(marker)}, ck / "evil.pt")
    (run / "metrics.jsonl").write_text('{"step": 300, "loss": 0.125}\n')
    entries = entries_of(run) + [(f"{HF}/model.safetensors", "checkpoint", 300),
                                 (f"{HF}/config.json", "include", None),
                                 (f"{HF}/training_args.bin", "include", None),
                                 (f"{HF}/evil.pt", "include", None)]
    write_manifest(run, entries)
    return run


def eval_that_loads_everything(tmp_path: Path) -> str:
    """An eval that lists the checkpoint's directory and torch.loads (weights_only=False, as a
    careless script would) every .pt it finds there."""
    script = tmp_path / "eval.py"
    script.write_text(
        "import json, os, sys, torch\n"
        "ckpt = sys.argv[1]\n"
        "top = os.path.dirname(os.path.dirname(ckpt))\n"
        "seen = sorted(os.path.relpath(os.path.join(d, n), top) for d, _, ns in os.walk(top) for n in ns)\n"
        f"open({str(tmp_path / 'seen.json')!r}, 'w').write(json.dumps({{'ckpt': ckpt, 'seen': seen}}))\n"
        "for name in seen:\n"
        "    if name.endswith('.pt'):\n"
        "        torch.load(os.path.join(top, name), weights_only=False)\n"
        "print(json.dumps({'loss': 0.125}))\n")
    return shlex.join([sys.executable, str(script), "{ckpt}"])


def test_the_eval_never_sees_a_file_that_failed_safe_load_and_verify_fails(tmp_path: Path,
                                                                           quiet_finite: None) -> None:
    marker = tmp_path / "PWNED"
    run = hf_run_with_a_hostile_include(tmp_path, marker)
    res = rgt(str(run), "--eval-cmd", eval_that_loads_everything(tmp_path))
    assert not marker.exists(), "the refused pickle ran inside the eval"
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["seen"] == ["checkpoint-300/config.json", "checkpoint-300/model.safetensors"], seen
    assert not seen["ckpt"].startswith(str(run) + "/")  # a view, not the pulled dir
    assert res.exit_code == 1 and "PULL VERIFIED" not in res.stdout, res.output
    assert f"error: {HF}/evil.pt: safe_load: weights_only=True refused it" in res.stderr
    assert f"warning: withheld from the eval of step 300: {HF}/evil.pt: failed safe load" in res.stderr
    doc = stored(run)
    assert doc["ok"] is False and doc["proofs"]["safe_load"]["status"] == "failed"
    [result] = doc["proofs"]["metric"]["evaluated"]
    assert result["ok"] is True and result["given"] == [f"{HF}/config.json", f"{HF}/model.safetensors"]
    withheld = {w["path"]: w["reason"] for w in result["withheld"]}
    assert set(withheld) == {f"{HF}/evil.pt", f"{HF}/training_args.bin"}
    assert withheld[f"{HF}/evil.pt"].startswith("failed safe load (weights_only=True refused it")
    assert withheld[f"{HF}/training_args.bin"].startswith("not proven safe to load (identity only")
    assert not list(run.parent.glob(".rgt-eval-*"))  # the view is gone


def test_a_file_changed_after_hashing_is_withheld_and_the_checkpoint_not_evaluated(
        tmp_path: Path, quiet_finite: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from controller.verify import metric as verify_metric
    run = make_run(tmp_path)
    real = verify_metric.build_view

    def overwrite_then_build(run_dir: Path, paths: Any, refused: Any, pins: Any) -> Any:
        (run / ST200).write_bytes(b"\0" * (run / ST200).stat().st_size)  # after identity hashed it
        return real(run_dir, paths, refused, pins)
    monkeypatch.setattr(verify_metric, "build_view", overwrite_then_build)
    report = verify(run, eval_cmd=eval_that_loads_everything(tmp_path))
    assert not (tmp_path / "seen.json").exists()
    [result] = report.proofs["metric"]["evaluated"]
    assert result["reason"] == f"not evaluated: {ST200} changed since it was hashed (or never pinned)"
    assert not report.ok


# ---- a header built to crash the parser ---------------------------------------------------------------


def header_file(path: Path, header: bytes, data: bytes = b"", length: int = -1) -> None:
    n = len(header) if length < 0 else length
    path.write_bytes(struct.pack("<Q", n) + header + data)


HOSTILE = {
    "nested 100000 deep": (b"[" * 100_000 + b"]" * 100_000, -1, "header nests 100000 levels deep (limit 64)"),
    "nested in a tensor": (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": '
                           + b"{\"a\":" * 100_000 + b"1" + b"}" * 100_000 + b"}}", -1,
                           "header nests 100002 levels deep (limit 64)"),
    "huge length field": (b"{}", (1 << 64) - 1, f"header length {(1 << 64) - 1} exceeds the"),
    "length past the end": (b"{}", 50_000_000, "header length 50000000 runs past the end"),
    "a 5000-digit number": (b'{"n": ' + b"7" * 5000 + b"}", -1, "header does not parse: ValueError"),
    "rank 65": (b'{"w": {"dtype": "U8", "shape": [' + b"1, " * 64 + b'1], "data_offsets": [0, 1]}}', -1,
                "has more than 64 dimensions"),
    "a shape whose size overflows": (b'{"w": {"dtype": "F32", "shape": [4294967296, 4294967296], '
                                     b'"data_offsets": [0, 4]}}', -1, "overflows 64 bits"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_header_is_a_named_header_error(tmp_path: Path, name: str) -> None:
    header, length, text = HOSTILE[name]
    path = tmp_path / "x.safetensors"
    header_file(path, header, b"\0" * 4, length)
    with pytest.raises(safetensors_header.HeaderError) as info:
        safetensors_header.parse_path(path)
    assert text in str(info.value), str(info.value)


def test_too_many_containers_or_values_are_refused_before_parsing(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.setattr(safetensors_header, "MAX_CONTAINERS", 100)
    header_file(tmp_path / "a.safetensors", b'{"x": [' + b"[]," * 200 + b"[]]}")
    with pytest.raises(safetensors_header.HeaderError, match="holds 203 arrays/objects"):
        safetensors_header.parse_path(tmp_path / "a.safetensors")
    monkeypatch.setattr(safetensors_header, "MAX_ITEMS", 100)
    header_file(tmp_path / "b.safetensors", b'{"x": [' + b"0," * 200 + b"0]}")
    with pytest.raises(safetensors_header.HeaderError, match="about 202 values"):
        safetensors_header.parse_path(tmp_path / "b.safetensors")
    header_file(tmp_path / "c.safetensors", b'{"__metadata__": {"x": "' + b"[" * 5000 + b'\\""}}')
    layout = safetensors_header.parse_path(tmp_path / "c.safetensors")  # brackets inside a string are text
    assert layout.tensors == () and layout.metadata == {"x": "[" * 5000 + '"'}


@pytest.mark.parametrize("name", ["nested 100000 deep", "huge length field"])
def test_verify_names_the_hostile_header_and_replaces_an_earlier_pass(tmp_path: Path, name: str,
                                                                      quiet_finite: None) -> None:
    run = make_run(tmp_path)
    assert verify(run).ok and stored(run)["ok"] is True
    header, length, text = HOSTILE[name]
    header_file(run / ST200, header, b"", length)
    write_manifest(run, entries_of(run))
    report = verify(run)
    assert not report.ok
    [line] = [ln for ln in report.failures() if ln.startswith(ST200)]
    assert line.startswith(f"{ST200}: safe_load: safetensors: {text}"), line
    assert stored(run)["ok"] is False  # the earlier pass is replaced


def test_checking_that_raises_still_writes_a_failing_report(tmp_path: Path, quiet_finite: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run(tmp_path)
    assert verify(run).ok
    real = safetensors_header.parse_path

    def explode(path: Path) -> Any:
        raise RecursionError("maximum recursion depth exceeded")
    monkeypatch.setattr(safetensors_header, "parse_path", explode)
    report = verify(run)
    assert not report.ok and report.proofs["identity"]["status"] == "passed"
    assert report.failures() == ["safe_load: checking raised RecursionError: maximum recursion depth "
                                 "exceeded (verification did not finish)"]
    doc = stored(run)
    assert doc["ok"] is False and doc["proofs"]["metric"]["status"] == "skipped"

    def interrupt(path: Path) -> Any:
        raise KeyboardInterrupt
    monkeypatch.setattr(safetensors_header, "parse_path", real)
    assert verify(run).ok
    monkeypatch.setattr(safetensors_header, "parse_path", interrupt)
    with pytest.raises(KeyboardInterrupt):
        verify(run)
    assert stored(run)["ok"] is False  # an interrupted verification leaves no pass behind


# ---- the box's own suspects --------------------------------------------------------------------------


def custody_log(run: Path, lines: List[Any]) -> None:
    (run / "rgt" / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + "[[[[\n")


def test_a_live_suspect_in_the_pulled_custody_log_fails_identity(tmp_path: Path, quiet_finite: None) -> None:
    run = make_run(tmp_path)
    bad = {"v": 1, "op": "suspect", "path": "checkpoints/step000300.safetensors", "code": "bad_structure",
           "reason": "safetensors: header nests 100000 levels deep (over 64): refused unparsed", "ts": 5.0}
    cleared = {"v": 1, "op": "suspect", "path": "checkpoints/step000250.pt", "code": "check_failed",
               "reason": "checking it raised OSError", "ts": 3.0}
    saved_again = {"v": 1, "path": "checkpoints/step000250.pt", "size": 1, "sha256": "a" * 64, "ts": 4.0}
    custody_log(run, [bad, cleared, saved_again])
    write_manifest(run, entries_of(run) + [("rgt/manifest.jsonl", "include", None)])
    report = verify(run)
    assert not report.ok and report.proofs["identity"]["status"] == "failed"
    assert report.failures() == [
        "checkpoints/step000300.safetensors: identity: the box's custody recorded this checkpoint as "
        "suspect (bad_structure: safetensors: header nests 100000 levels deep (over 64): refused "
        "unparsed), so no pull proves it"]
    assert stored(run)["suspect"] == [{"path": bad["path"], "code": "bad_structure", "reason": bad["reason"]}]
    gate = teardown.judge("run-abc", run, lambda: {"checkpoints": {}, "unrecorded": [], "missing": [],
                                                  "partials": []})
    assert gate.code == "verify_failed" and f"({bad['path']}: the box's custody recorded it as suspect)" \
        in gate.reason, gate
    custody_log(run, [bad, {**saved_again, "path": bad["path"], "ts": 6.0}])  # saved again, and passed
    write_manifest(run, entries_of(run))
    assert verify(run).ok
