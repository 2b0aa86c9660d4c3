"""`verify()`: each proof fails on its own named reason while a clean pulled run passes.

Real torch.save / safetensors files, a real PULL_MANIFEST.json, the real seam child process (only
where a test needs it: each costs a torch import)."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from safetensors.torch import save_file

from controller.verify import identity as verify_identity
from controller.verify import load as verify_load
from controller.verify import units as verify_units
from controller.verify.identity import hash_file, hash_files
from controller.verify.metric import EvalCommandError, Target, targets
from controller.verify.prove import Report, verify
from tests.controller.verifykit import (
    MANIFEST,
    PT_FILE,
    VERIFIED,
    Evil,
    entries_of,
    make_run,
    rewrite_safetensors,
    sha256_of,
    write_manifest,
)

ST100, ST200 = "checkpoints/step000100.safetensors", "checkpoints/step000200.safetensors"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return make_run(tmp_path)


@pytest.fixture
def no_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any seam child would start (the default NaN/Inf check of the newest
    checkpoint, which needs one, is off for these tests)."""
    def refuse(*args: Any) -> List[str]:
        raise AssertionError("a seam child was started")
    monkeypatch.setattr(verify_load, "seam_command", refuse)
    monkeypatch.setattr(verify_units, "newest_units", lambda steps: [])


def failures(report: Report) -> List[str]:
    return report.failures()


def one_failure(report: Report, prefix: str) -> str:
    assert not report.ok
    lines = report.failures()
    assert len(lines) == 1, lines
    assert lines[0].startswith(prefix), lines
    return lines[0]


def stored(run: Path) -> Dict[str, Any]:
    doc: Dict[str, Any] = json.loads((run / VERIFIED).read_text())
    return doc


# ---- a clean run -----------------------------------------------------------------------------


def test_clean_run_passes_every_proof_and_writes_a_bound_report(tmp_path: Path) -> None:
    run = make_run(tmp_path, with_pt=True)
    manifest = json.loads((run / MANIFEST).read_text())
    report = verify(run, check_finite=True)
    assert report.ok, report.failures()
    assert report.failures() == []
    doc = stored(run)
    assert doc["schema"] == "rgt.pull_verified" and doc["version"] == 1 and doc["ok"] is True
    assert doc["manifest_sha256"] == manifest["sha256"] == sha256_of(manifest)
    assert doc["run_id"] == "run-abc"
    assert doc["proofs"]["identity"]["status"] == "passed"
    assert doc["proofs"]["safe_load"] == {**doc["proofs"]["safe_load"], "status": "passed", "loaded": 4,
                                          "unknown_format": 1, "failed": 0}
    assert doc["proofs"]["metric"]["status"] == "skipped"
    files = {f["path"]: f for f in doc["files"]}
    assert set(files) == {e[0] for e in entries_of(run)}
    for f in manifest["files"]:
        assert (files[f["path"]]["size"], files[f["path"]]["sha256"]) == (f["size"], f["sha256"])
        assert files[f["path"]]["identity"] == "ok"
    pt = files[PT_FILE[0]]
    assert pt["load"] == "ok"
    assert pt["load_detail"]["tensors"] == 3 and pt["load_detail"]["nonfinite"] == 0
    assert files[ST200]["load_detail"]["dtypes"] == {"F32": 2, "I64": 1}
    assert files[ST200]["load_detail"]["nonfinite"] == 0
    assert files["config.json"]["load"] == "ok"
    assert files["config.json"]["method"] == "identity only (parsed as JSON)"
    assert files["metrics.jsonl"]["load"] == "not loadable: unknown format"
    assert files[PT_FILE[0]]["method"] == files[ST200]["method"] == "weights"
    assert doc["tools"]["torch"] and doc["tools"]["hashlib"].startswith(("openssl", "builtin"))
    assert [p.name for p in (run / "rgt").iterdir() if p.name.endswith(".tmp")] == []


def test_a_second_verify_ignores_its_own_report(run: Path, no_seam: None) -> None:
    assert verify(run).ok
    assert (run / VERIFIED).exists()
    assert verify(run).ok  # PULL_VERIFIED.json is not an extra file


# ---- identity ------------------------------------------------------------------------------------


def test_truncated_file_fails_identity_on_size(run: Path, no_seam: None) -> None:
    data = (run / ST200).read_bytes()
    (run / ST200).write_bytes(data[:-10])
    report = verify(run)
    line = one_failure(report, f"{ST200}: identity: ")
    assert f"size {len(data) - 10} bytes, manifest says {len(data)} (truncated)" in line
    f = {x.path: x for x in report.files}[ST200]
    assert f.load == "skipped: identity failed"
    assert stored(run)["ok"] is False


def test_one_flipped_bit_fails_identity_on_sha256(run: Path, no_seam: None) -> None:
    data = bytearray((run / ST100).read_bytes())
    data[-3] ^= 0x01
    (run / ST100).write_bytes(bytes(data))
    line = one_failure(verify(run), f"{ST100}: identity: sha256 differs: local ")
    assert hashlib.sha256(bytes(data)).hexdigest()[:16] in line


@pytest.mark.parametrize("rel, reason", [
    ("notes.txt", "extra file: not in the manifest"),
    ("checkpoints/step000300.safetensors", "extra file: not in the manifest"),
    ("rgt/pull.log", "extra file: not in the manifest"),
    ("checkpoints/.step000200.safetensors.Ab12Cd", "rsync temporary file"),
    ("checkpoints/.rsync-partial/step000300.safetensors", "rsync partial-transfer leftover"),
])
def test_an_unlisted_file_fails_identity(run: Path, no_seam: None, rel: str, reason: str) -> None:
    (run / rel).parent.mkdir(parents=True, exist_ok=True)
    (run / rel).write_bytes(b"x")
    line = one_failure(verify(run), f"{rel}: identity: {reason}")
    assert line


def test_a_missing_file_fails_identity(run: Path, no_seam: None) -> None:
    (run / "config.json").unlink()
    one_failure(verify(run), "config.json: identity: missing")


def test_a_symlink_is_not_the_file(run: Path, tmp_path: Path, no_seam: None) -> None:
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((run / "config.json").read_bytes())
    (run / "config.json").unlink()
    (run / "config.json").symlink_to(outside)
    one_failure(verify(run), "config.json: identity: a symlink, not a regular file")


def test_a_manifest_that_does_not_hash_to_itself_fails_everything(run: Path, no_seam: None) -> None:
    def shrink(doc: Dict[str, Any]) -> None:
        doc["files"][0]["size"] -= 1
        doc["total_bytes"] -= 1
    doc = write_manifest(run, entries_of(run), edit=shrink)
    report = verify(run)
    assert not report.ok
    assert report.failures() == [report.failures()[0]]
    assert report.failures()[0].startswith("identity: manifest does not hash to its own sha256")
    assert report.proofs["safe_load"]["status"] == "skipped"
    assert report.files == []
    assert stored(run)["manifest_sha256"] == doc["sha256"] and stored(run)["ok"] is False


def test_an_empty_manifest_proves_nothing(run: Path, no_seam: None) -> None:
    for rel in [e[0] for e in entries_of(run)]:
        (run / rel).unlink()
    write_manifest(run, [])
    report = verify(run)
    assert not report.ok
    assert report.failures() == ["identity: the manifest lists no files: refusing to prove an empty pull"]


def test_a_listed_file_behind_a_symlinked_directory_fails(run: Path, tmp_path: Path, no_seam: None) -> None:
    (run / "checkpoints").rename(tmp_path / "moved")
    (run / "checkpoints").symlink_to(tmp_path / "moved")
    report = verify(run)
    assert f"{ST100}: identity: reached through a symlinked directory" in report.failures()
    assert "checkpoints: identity: extra: a symlink, not in the manifest" in report.failures()


# ---- safe load -----------------------------------------------------------------------------------


def test_a_checkpoint_without_tensors_fails(run: Path, no_seam: None) -> None:
    save_file({}, str(run / ST200))
    write_manifest(run, entries_of(run))
    one_failure(verify(run), f"{ST200}: safe_load: holds no tensors")
    result = verify_load._interpret({"ok": True, "tensors": 0}, "checkpoint", 1 << 30)
    assert (result.status, result.reason) == ("failed", "holds no tensors")
    assert verify_load._interpret({"ok": True, "tensors": 0}, "include", 1 << 30).status == "ok"


def test_a_malicious_pickle_is_refused_by_weights_only_and_never_runs(run: Path, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    torch.save({"w": torch.zeros(2), "payload": Evil(marker)}, run / "checkpoints/step000300.pt")
    write_manifest(run, [*entries_of(run), ("checkpoints/step000300.pt", "checkpoint", 300)])
    line = one_failure(verify(run), "checkpoints/step000300.pt: safe_load: weights_only=True refused it: ")
    assert "posix.system" in line or "os.system" in line
    assert "weights_only` set to `False`" not in line
    assert not marker.exists()


def test_a_training_args_bin_naming_os_system_is_refused_and_never_runs(run: Path, tmp_path: Path) -> None:
    """training_args.bin is proven by identity alone (it pickles code), but its pickle is read for the
    globals it names: os.system is no TrainingArguments, so the file is refused, never loaded."""
    marker = tmp_path / "PWNED"
    torch.save({"args": Evil(marker)}, run / "training_args.bin")
    write_manifest(run, [*entries_of(run), ("training_args.bin", "include", None)])
    line = one_failure(verify(run), "training_args.bin: safe_load: its pickle names ")
    assert "system" in line and "refused, not loaded" in line
    assert not marker.exists()


def test_an_include_that_will_not_load_safely_is_proven_by_identity_only(run: Path, tmp_path: Path) -> None:
    """An include (not a checkpoint's companion) that weights_only refuses does not fail the pull:
    its bytes are still proven, and it never runs."""
    marker = tmp_path / "PWNED"
    torch.save({"args": Evil(marker)}, run / "extra_state.pt")
    write_manifest(run, [*entries_of(run), ("extra_state.pt", "include", None)])
    report = verify(run)
    assert report.ok, report.failures()
    row = next(f for f in report.to_dict()["files"] if f["path"] == "extra_state.pt")
    assert row["identity"] == "ok" and row["load"].startswith("identity only (an include")
    assert not marker.exists()


@pytest.mark.parametrize("edit, extra, cut, reason", [
    (lambda h: h["layer.weight"].update(data_offsets=[h["layer.weight"]["data_offsets"][0],
                                                      h["layer.weight"]["data_offsets"][1] + 4096]),
     b"", 0, "shape [8, 4] x F32 is 128 bytes but its span"),
    (lambda h: h["layer.bias"].update(shape=[9]), b"", 0, "shape [9] x F32 is 36 bytes"),
    (lambda h: None, b"", 8, "ends beyond the"),
    (lambda h: h["layer.bias"].update(data_offsets=[16, 48]), b"", 0, "overlaps the tensor before it"),
    (lambda h: None, b"\0" * 8, 0, "unaccounted for"),
    (lambda h: h["steps"].update(dtype="Q99"), b"", 0, "unknown dtype 'Q99'"),
])
def test_a_lying_safetensors_header_fails_safe_load(run: Path, no_seam: None, edit: Any, extra: bytes,
                                                    cut: int, reason: str) -> None:
    rewrite_safetensors(run / ST100, edit, extra, cut)
    write_manifest(run, entries_of(run))
    line = one_failure(verify(run), f"{ST100}: safe_load: safetensors: ")
    assert reason in line


def test_a_span_beyond_the_file_names_the_tensor(run: Path, no_seam: None) -> None:
    def grow(h: Dict[str, Any]) -> None:  # a consistent header whose last tensor is 64 KiB long
        last = max(h.values(), key=lambda t: t["data_offsets"][1] if isinstance(t, dict) and
                   "data_offsets" in t else -1)
        last.update(shape=[8192], dtype="I64",
                    data_offsets=[last["data_offsets"][0], last["data_offsets"][0] + 65536])
    rewrite_safetensors(run / ST100, grow)
    write_manifest(run, entries_of(run))
    line = one_failure(verify(run), f"{ST100}: safe_load: safetensors: tensor ")
    assert "ends beyond the" in line and "lying header" in line


def test_a_hung_loader_is_killed_at_the_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run(tmp_path, with_pt=True)
    hang = [sys.executable, "-c", "import threading; threading.Event().wait()"]  # a loader that never ends
    monkeypatch.setattr(verify_load, "seam_command", lambda *a: hang)
    report = verify(run, load_timeout_s=0.5)
    # each file the child had started is charged, and a fresh child goes on with the next one
    killed = "safe_load: timed out after 0.5s: the loader was killed"
    assert sorted(report.failures()) == [f"{PT_FILE[0]}: {killed}", f"{ST200}: {killed}"]


def test_the_address_space_limit_applies_to_the_loader(tmp_path: Path) -> None:
    run = make_run(tmp_path, with_pt=True)
    lines = verify(run, load_memory_bytes=96 << 20).failures()
    line = next(ln for ln in lines if ln.startswith(f"{PT_FILE[0]}: safe_load: "))
    assert "96 MiB address-space limit" in line


def test_old_torch_refuses_pickle_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              no_seam: None) -> None:
    run = make_run(tmp_path, with_pt=True)
    monkeypatch.setattr(verify_load, "torch_version", lambda: "2.9.1")
    line = one_failure(verify(run), f"{PT_FILE[0]}: safe_load: torch 2.9.1 is older than 2.10")
    assert "known CVEs" in line and "refused" in line and "--trust-pickle" in line


def test_trust_pickle_loads_under_old_torch_and_says_so(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run(tmp_path, with_pt=True)
    monkeypatch.setattr(verify_load, "torch_version", lambda: "2.9.1")
    report = verify(run, trust_pickle=True)
    assert report.ok, report.failures()
    notes = report.proofs["safe_load"]["notes"]
    assert len(notes) == 1 and "torch 2.9.1" in notes[0]
    assert "loaded (weights_only=True) anyway because of --trust-pickle" in notes[0]


def test_check_finite_fails_a_nan_tensor(run: Path) -> None:
    bad = {"w": torch.tensor([1.0, float("nan"), float("inf")]), "ok": torch.ones(2)}
    save_file(bad, str(run / ST100))  # not the newest: checked only with check_finite
    write_manifest(run, entries_of(run))
    assert verify(run, write=False).ok  # structurally fine, and the newest (ST200) is finite
    line = one_failure(verify(run, check_finite=True), f"{ST100}: safe_load: ")
    assert line.endswith("2 non-finite values (NaN/Inf) in w")


def test_the_newest_checkpoint_is_checked_for_nan_by_default(run: Path) -> None:
    save_file({"w": torch.tensor([1.0, float("nan")])}, str(run / ST200))
    write_manifest(run, entries_of(run))
    report = verify(run)
    line = one_failure(report, f"{ST200}: safe_load: ")
    assert line.endswith("1 non-finite values (NaN/Inf) in w")
    assert report.nonfinite == [ST200] and stored(run)["nonfinite"] == [ST200]
    allowed = verify(run, allow_nonfinite=True)
    assert allowed.ok and allowed.nonfinite == [ST200]  # reported, not failed
    row = next(u for u in allowed.units if u["unit"] == ST200)
    assert row["newest"] and row["weights_finite"] is False


# ---- recomputed metric ---------------------------------------------------------------------------


def eval_script(tmp_path: Path, loss: float) -> str:
    """An eval command that records its argv and prints a loss (last JSON line wins)."""
    script = tmp_path / "eval.py"
    script.write_text(
        "import json, os, sys\n"
        f"open({str(tmp_path / 'calls.jsonl')!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "assert len(sys.argv) == 2 and os.path.isfile(sys.argv[1]), sys.argv\n"
        "print(json.dumps({'loss': 99.0}))\nprint('evaluating...')\n"
        f"print(json.dumps({{'loss': {loss!r}, 'acc': 0.5}}))\n")
    return shlex.join([sys.executable, str(script), "{ckpt}"])


def calls(tmp_path: Path) -> List[List[str]]:
    return [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]


def given_in_a_view(run: Path, arg: str, rel: str) -> None:
    """The eval got `rel` inside a view beside the run (never the pulled dir), removed since."""
    root = Path(arg[: -len(rel)])
    assert arg.endswith("/" + rel) and root.parent == run.parent and root.name.startswith(".rgt-eval-"), arg
    assert not root.exists()


def test_the_newest_checkpoint_recomputes_the_reported_loss(run: Path, tmp_path: Path, no_seam: None) -> None:
    report = verify(run, eval_cmd=eval_script(tmp_path, 0.25 * (1 + 1e-6)))
    assert report.ok, report.failures()
    [res] = report.proofs["metric"]["evaluated"]
    assert (res["step"], res["reported_step"], res["reported"]) == (200, 200, 0.25)
    [[arg]] = calls(tmp_path)
    given_in_a_view(run, arg, ST200)
    assert res["given"] == [ST200] and res["withheld"] == [] and res["view"] == "hard links"
    assert {f.path: f.metric for f in report.files}[ST100] == "skipped: not the newest checkpoint"


def test_a_disagreeing_metric_fails_with_both_numbers(run: Path, tmp_path: Path, no_seam: None) -> None:
    line = one_failure(verify(run, eval_cmd=eval_script(tmp_path, 0.3)), f"{ST200}: metric: ")
    assert "loss recomputed 0.3, run reported 0.25 at step 200" in line
    assert stored(run)["proofs"]["metric"]["status"] == "failed"


def test_eval_all_compares_each_checkpoint_at_its_own_step_only(run: Path, tmp_path: Path,
                                                                no_seam: None) -> None:
    (run / "metrics.jsonl").write_text('{"step": 90, "loss": 0.25}\n{"step": 200, "loss": 0.25}\n')
    write_manifest(run, entries_of(run))
    report = verify(run, eval_cmd=eval_script(tmp_path, 0.25), eval_all=True)
    assert report.ok, report.failures()
    got = [(r["step"], r["reported_step"], r["compared"]) for r in report.proofs["metric"]["evaluated"]]
    assert got == [(100, None, False), (200, 200, True)]   # step 90's value never stands for step 100
    assert "no 'loss' at step 100 (it logged it at step 90 and 200)" in \
        report.proofs["metric"]["evaluated"][0]["reason"]
    assert len(calls(tmp_path)) == 1


def test_no_reported_value_is_nothing_to_compare(run: Path, tmp_path: Path, no_seam: None) -> None:
    (run / "metrics.jsonl").write_text('{"step": 300, "loss": 0.25}\n{"step": 200, "acc": 1}\n')
    write_manifest(run, entries_of(run))
    line = one_failure(verify(run, eval_cmd=eval_script(tmp_path, 0.25)), f"{ST200}: metric: ")
    assert "nothing to compare: the run reported no 'loss' at step 200 (it logged it at step 300)" in line


def test_the_checkpoint_path_is_one_argument_never_shell_text(tmp_path: Path, no_seam: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # where an injected `touch` would land
    base = tmp_path / "a b; touch PWNED $(touch PWNED2)"
    base.mkdir()
    run = make_run(base)
    report = verify(run, eval_cmd=eval_script(tmp_path, 0.25))
    assert report.ok, report.failures()
    [[arg]] = calls(tmp_path)
    given_in_a_view(run, arg, ST200)
    assert not list(tmp_path.rglob("PWNED*"))


def test_files_of_one_step_are_one_checkpoint_directory() -> None:
    found = targets([("ck/checkpoint-500/model.safetensors", 500), ("ck/checkpoint-500/optimizer.pt", 500),
                     ("ck/checkpoint-900/model.safetensors", 900), ("ck/checkpoint-900/optimizer.pt", 900),
                     ("ck/checkpoint-900/rng_state.pth", 900), ("ck/last.pt", None)], every=False)
    assert found == [Target(900, "ck/checkpoint-900", ("ck/checkpoint-900/model.safetensors",
                                                       "ck/checkpoint-900/optimizer.pt",
                                                       "ck/checkpoint-900/rng_state.pth"))]
    assert [t.ckpt for t in targets([("a.pt", 1), ("b.pt", 2)], every=True)] == ["a.pt", "b.pt"]
    assert targets([("last.pt", None)], every=True) == []


def test_an_eval_command_without_the_placeholder_is_a_usage_error(run: Path) -> None:
    with pytest.raises(EvalCommandError, match="must contain"):
        verify(run, eval_cmd="python eval.py")
    assert not (run / VERIFIED).exists()


def test_a_checkpoint_that_failed_safe_load_is_never_evaluated(run: Path, tmp_path: Path,
                                                               no_seam: None) -> None:
    rewrite_safetensors(run / ST200, lambda h: h["steps"].update(dtype="Q99"))
    write_manifest(run, entries_of(run))
    report = verify(run, eval_cmd=eval_script(tmp_path, 0.25))
    assert not (tmp_path / "calls.jsonl").exists()
    assert f"{ST200}: metric: not evaluated: {ST200} failed identity or safe load" in report.failures()


# ---- hashing and the report file -----------------------------------------------------------------


def test_parallel_hashing_matches_serial(tmp_path: Path) -> None:
    sizes = [0, 1, 4095, verify_identity.CHUNK_BYTES - 1, verify_identity.CHUNK_BYTES,
             verify_identity.CHUNK_BYTES * 2 + 17, 1 << 16, 123457]
    paths = []
    for i, n in enumerate(sizes):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(n))
        paths.append(p)
    serial = hash_files(paths, workers=1)
    parallel = hash_files(paths, workers=4)
    assert serial == parallel
    assert serial == {p: (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in paths}


def test_an_interrupted_hash_does_not_finish_the_rest_first(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker: the interrupt comes once it holds the second file, and that file is let go only
    once the rest are cancelled. Each step waits for the one before it, never for a time: the
    worker cannot miss the second file, nor pick up a third."""
    paths = []
    for i in range(20):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(b"x" * i)
    hashed: List[Path] = []
    real = verify_identity.hash_file
    futures = verify_identity.concurrent.futures
    submitted: List[Any] = []
    second_taken = threading.Event()
    rest_cancelled = threading.Event()

    def on_done(_: Any) -> None:  # runs as each future finishes or is cancelled
        if len(submitted) == len(paths) and all(f.cancelled() for f in submitted[2:]):
            rest_cancelled.set()

    class Pool(futures.ThreadPoolExecutor):
        """The real pool; it keeps each future it hands out, so the test sees what is cancelled."""

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            fut = super().submit(fn, *args, **kwargs)
            submitted.append(fut)
            fut.add_done_callback(on_done)
            return fut

    def fake(p: Path) -> Any:
        hashed.append(p)
        if len(hashed) == 2:
            second_taken.set()
            # A hash_many that does not cancel hashes every file after this bound, and fails below.
            rest_cancelled.wait(10)
        return real(p)

    monkeypatch.setattr(futures, "ThreadPoolExecutor", Pool)
    monkeypatch.setattr(verify_identity, "hash_file", fake)

    def interrupt(stage: str, done: int, total: int) -> None:
        assert second_taken.wait(10), "the worker never took the second file"
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        verify_identity.hash_many(paths, workers=1, progress=interrupt)
    assert len(hashed) == 2 and rest_cancelled.is_set()


def test_hashing_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        hash_file(fifo)  # returns at once: never blocks waiting for a writer
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target")
    (tmp_path / "target").write_bytes(b"x")
    with pytest.raises(OSError):
        hash_file(link)


def test_the_report_is_replaced_atomically(run: Path, no_seam: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert verify(run).ok
    before = (run / VERIFIED).read_bytes()
    (run / "config.json").write_text("{}")

    def broken_replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space left"):
        verify(run)
    assert (run / VERIFIED).read_bytes() == before
    assert sorted(p.name for p in (run / "rgt").iterdir()) == ["PULL_MANIFEST.json", "PULL_VERIFIED.json"]
    monkeypatch.undo()
    assert not verify(run).ok
    assert stored(run)["ok"] is False  # a failure replaces the earlier pass
