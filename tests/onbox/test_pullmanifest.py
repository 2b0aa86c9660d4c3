"""PULL_MANIFEST.json on real files: custody hash reuse, fail-closed rules, includes and rosters,
the teardown gate's view, the `manifest` control op against a real sidecar, and the CLI."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest
from click.testing import CliRunner

from onbox.cli.pull import manifest_command
from onbox.custody import manifest, pullmanifest
from onbox.custody.gateview import gate_view
from onbox.custody.pullmanifest import (
    DEFAULT_INCLUDES,
    MANIFEST_REL,
    ManifestError,
    build_manifest,
    check_files,
    write_manifest,
)
from protocol import ErrorReply, Hello, HelloReply, Manifest, ManifestReply, encode_request
from protocol.endpoints import Endpoints
from protocol.pull import check_manifest, manifest_digest
from tests.helpers import Client, SidecarProcess

FAKE_SHA = "ab" * 32


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record(run_dir: Path, rel: str, digest: Optional[str] = None, step: Optional[int] = 10,
           ts: float = 1000.0) -> manifest.Record:
    """Append a custody record pinned to the file as it is now (its real sha256 unless `digest`)."""
    st = (run_dir / rel).stat()
    rec = manifest.Record(path=rel, size=st.st_size, sha256=digest or sha((run_dir / rel).read_bytes()),
                          mtime_ns=st.st_mtime_ns, inode=st.st_ino, step=step, format="other", ts=ts)
    manifest.append(run_dir, rec)
    return rec


def make_run(root: Path, run_id: str = "run-1", project: str = "p") -> Path:
    run_dir = root / project / "active" / run_id
    (run_dir / "rgt").mkdir(parents=True)
    (run_dir / "checkpoints").mkdir()
    (run_dir / "run.json").write_text(json.dumps({"id": run_id, "project": project, "host": "box"}))
    (run_dir / "metrics.jsonl").write_text('{"step": 10, "loss": 0.5}\n')
    (run_dir / "train.log").write_text("step 10 loss 0.5\n")
    (run_dir / "checkpoints" / "step000010.bin").write_bytes(b"weights-10" * 100)
    record(run_dir, "checkpoints/step000010.bin")
    return run_dir


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return make_run(tmp_path / "root")


def paths(doc: Dict[str, Any]) -> List[str]:
    return [f["path"] for f in doc["files"]]


def by_path(doc: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {f["path"]: f for f in doc["files"]}


# ---- custody reuse ------------------------------------------------------------------------------


def test_custody_hash_is_reused_while_unchanged_and_recomputed_when_mtime_moves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = make_run(tmp_path / "root", "run-2")
    ckpt = run_dir / "checkpoints" / "step000020.bin"
    ckpt.write_bytes(b"weights-20" * 100)
    record(run_dir, "checkpoints/step000020.bin", digest=FAKE_SHA, step=20, ts=2000.0)  # a lie we can spot
    hashed: List[str] = []
    real = pullmanifest.sha256_file
    monkeypatch.setattr(pullmanifest, "sha256_file", lambda p, *a: hashed.append(Path(p).name) or real(p, *a))

    entry = by_path(build_manifest(run_dir))["checkpoints/step000020.bin"]
    assert (entry["sha256"], entry["hashed"], entry["step"], entry["kind"]) == (
        FAKE_SHA, "custody", 20, "checkpoint")
    assert "step000020.bin" not in hashed and "step000010.bin" not in hashed

    st = ckpt.stat()
    os.utime(ckpt, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # same bytes, new mtime
    entry = by_path(build_manifest(run_dir))["checkpoints/step000020.bin"]
    assert (entry["sha256"], entry["hashed"]) == (sha(ckpt.read_bytes()), "now")
    assert "step000020.bin" in hashed


def test_the_newest_record_per_path_wins(run_dir: Path) -> None:
    ckpt = run_dir / "checkpoints" / "step000010.bin"
    ckpt.write_bytes(b"rewritten" * 50)
    record(run_dir, "checkpoints/step000010.bin", digest=FAKE_SHA, step=11, ts=5000.0)
    entry = by_path(build_manifest(run_dir))["checkpoints/step000010.bin"]
    assert (entry["sha256"], entry["step"], entry["size"]) == (FAKE_SHA, 11, 450)


def test_a_missing_checkpoint_fails_closed_and_nothing_is_written(
        run_dir: Path, short_grace: None) -> None:
    (run_dir / "checkpoints" / "step000030.bin").write_bytes(b"30")
    record(run_dir, "checkpoints/step000030.bin", step=30, ts=3000.0)
    (run_dir / "checkpoints" / "step000030.bin").unlink()
    with pytest.raises(ManifestError, match="checkpoints/step000030.bin"):
        write_manifest(run_dir)
    assert sorted(p.name for p in (run_dir / "rgt").iterdir()) == ["manifest.jsonl"]


def test_a_recorded_checkpoint_outside_the_run_dir_is_refused(run_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "x.bin").write_bytes(b"x")
    rec = manifest.Record("../../../../elsewhere/x.bin", 1, sha(b"x"), 0, 0, 1, "other", 9.0)
    manifest.append(run_dir, rec)
    with pytest.raises(ManifestError, match="not a path inside the run dir"):
        build_manifest(run_dir)


# ---- includes, roster, exclusions ---------------------------------------------------------------


def test_default_includes_and_what_is_never_listed(run_dir: Path) -> None:
    (run_dir / "rgt" / "exit.json").write_text('{"code": 0}')
    (run_dir / "rgt" / "events.jsonl").write_text("{}\n")
    (run_dir / "rgt" / "sock").mkdir()
    (run_dir / "rgt" / "sock" / "ctl").write_text("")
    (run_dir / "eval" / "test-a").mkdir(parents=True)
    (run_dir / "eval" / "test-a" / "metrics.json").write_text('{"psnr": 30}')
    (run_dir / "eval" / "half.json.tmp").write_text("{")
    (run_dir / "eval" / ".hidden").write_text("x")
    (run_dir / "notes.txt").write_text("not declared")
    write_manifest(run_dir)  # an earlier manifest never lists itself
    doc = build_manifest(run_dir, extra_includes=["rgt/**"])
    assert paths(doc) == ["checkpoints/step000010.bin", "eval/test-a/metrics.json", "metrics.jsonl",
                          "rgt/events.jsonl", "rgt/exit.json", "rgt/manifest.jsonl", "run.json", "train.log"]
    assert all(f["hashed"] == "now" and f["kind"] == "include" and "step" not in f
               for f in doc["files"][1:])
    assert doc["total_bytes"] == sum((run_dir / p).stat().st_size for p in paths(doc))
    assert by_path(doc)["metrics.jsonl"]["sha256"] == sha((run_dir / "metrics.jsonl").read_bytes())
    assert paths(build_manifest(run_dir, includes=())) == ["checkpoints/step000010.bin"]


def test_default_includes_may_match_nothing_but_an_explicit_one_must(run_dir: Path) -> None:
    assert "eval/**" in DEFAULT_INCLUDES and not (run_dir / "eval").exists()
    build_manifest(run_dir)
    with pytest.raises(ManifestError, match="results/\\*.csv"):
        build_manifest(run_dir, extra_includes=["results/*.csv"])
    (run_dir / "results").mkdir()
    (run_dir / "results" / "a.csv").write_text("1,2\n")
    (run_dir / "results" / "deep").mkdir()
    (run_dir / "results" / "deep" / "b.csv").write_text("3\n")  # `*` stays within one directory
    doc = build_manifest(run_dir, extra_includes=["results/*.csv"])
    assert "results/a.csv" in paths(doc) and "results/deep/b.csv" not in paths(doc)
    # a directory named without a glob: every file under it
    assert "results/deep/b.csv" in paths(build_manifest(run_dir, extra_includes=["results"]))
    with pytest.raises(ManifestError, match="inside the run dir"):
        build_manifest(run_dir, extra_includes=["../*"])


def test_roster_lists_exactly_its_files_and_fails_closed(run_dir: Path, tmp_path: Path) -> None:
    (run_dir / "eval").mkdir()
    (run_dir / "eval" / "m.json").write_text("{}")
    roster = tmp_path / "roster.txt"
    roster.write_text("\ufeff# the deliverables\n\neval/m.json\n./train.log\neval/m.json\n", encoding="utf-8")
    doc = build_manifest(run_dir, roster=roster)
    assert paths(doc) == ["checkpoints/step000010.bin", "eval/m.json", "train.log"]
    for text, needle in [("eval/gone.json\n", "does not exist"), ("../secret\n", "inside the run dir"),
                         ("eval\n", "not a regular file"), ("eval/x.tmp\n", "never pulled"),
                         (f"{MANIFEST_REL}\n", "never pulled")]:
        roster.write_text(text)
        with pytest.raises(ManifestError, match=needle):
            build_manifest(run_dir, roster=roster)


def test_symlinks_leading_out_of_the_run_dir_are_refused(run_dir: Path, tmp_path: Path) -> None:
    secret = tmp_path / "outside.txt"
    secret.write_text("not ours")
    (run_dir / "eval").mkdir()
    (run_dir / "eval" / "inside.json").symlink_to(run_dir / "metrics.jsonl")  # inside: fine
    assert "eval/inside.json" in paths(build_manifest(run_dir))
    (run_dir / "eval" / "leak.json").symlink_to(secret)
    with pytest.raises(ManifestError, match="leads out of the run dir"):
        write_manifest(run_dir)
    (run_dir / "eval" / "leak.json").unlink()
    (run_dir / "eval" / "ext").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ManifestError, match="eval/ext leads out"):
        build_manifest(run_dir)
    (run_dir / "eval" / "ext").unlink()
    (run_dir / "train.log").unlink()
    (run_dir / "train.log").symlink_to(secret)
    with pytest.raises(ManifestError, match="train.log leads out"):
        build_manifest(run_dir)
    assert not (run_dir / MANIFEST_REL).exists()


# ---- the written file ---------------------------------------------------------------------------


def test_written_manifest_checks_itself_and_leaves_no_temp_file(run_dir: Path) -> None:
    path = write_manifest(run_dir, host="h1")
    assert path == run_dir / MANIFEST_REL
    doc = json.loads(path.read_text())
    check_manifest(doc)
    assert doc["sha256"] == manifest_digest(doc) and doc["host"] == "h1" and doc["run_id"] == "run-1"
    assert doc["schema"] == "rgt.pull_manifest" and doc["version"] == 1
    assert doc["created_at"].endswith("+00:00")
    assert [p.name for p in (run_dir / "rgt").iterdir() if p.name.endswith(".tmp")] == []
    assert check_files(run_dir, doc) == []
    listed = by_path(doc)["metrics.jsonl"]
    (run_dir / "metrics.jsonl").write_text('{"step": 11}\n')
    now = sha((run_dir / "metrics.jsonl").read_bytes())
    assert check_files(run_dir, doc) == [
        f"metrics.jsonl: listed {listed['size']} bytes sha256 {listed['sha256'][:16]}..., "
        f"is 13 bytes sha256 {now[:16]}..."]
    doc["host"] = "h2"
    with pytest.raises(Exception, match="sha256"):
        check_manifest(doc)


def test_large_files_hash_across_chunks(run_dir: Path) -> None:
    blob = os.urandom(1024) * (9 * 1024) + b"end"  # 9 MiB + 3: three 4 MiB reads
    (run_dir / "eval").mkdir()
    (run_dir / "eval" / "big.bin").write_bytes(blob)
    entry = by_path(build_manifest(run_dir))["eval/big.bin"]
    assert (entry["size"], entry["sha256"]) == (len(blob), sha(blob))


# ---- the gate's view ----------------------------------------------------------------------------


def test_gate_view_lists_unrecorded_changed_missing_and_partial(run_dir: Path) -> None:
    ck = run_dir / "checkpoints"
    (ck / "step000020.bin").write_bytes(b"20")
    record(run_dir, "checkpoints/step000020.bin", step=20, ts=2000.0)
    (ck / "step000030.bin").write_bytes(b"30")
    record(run_dir, "checkpoints/step000030.bin", step=30, ts=3000.0)
    (ck / "step000030.bin").unlink()
    view = gate_view(run_dir)
    assert view["unrecorded"] == [] and view["missing"] == ["checkpoints/step000030.bin"]
    assert view["checkpoints"]["checkpoints/step000010.bin"] == {
        "sha256": sha(b"weights-10" * 100), "size": 1000, "step": 10, "unit": "checkpoints/step000010.bin"}
    assert view["ckpt_dir"] == "checkpoints" and view["run_id"] == "run-1"

    (ck / "step000040.bin").write_bytes(b"40")                  # written after the pull
    (ck / "step000020.bin").write_bytes(b"twenty")              # rewritten in place
    (ck / "step000050.bin.tmp").write_bytes(b"half")            # still being written
    view = gate_view(run_dir)
    assert view["unrecorded"] == [
        {"path": "checkpoints/step000020.bin", "size": 6, "reason": "changed"},
        {"path": "checkpoints/step000040.bin", "size": 2, "reason": "no_record"}]
    assert view["partials"] == ["checkpoints/step000050.bin.tmp"]
    assert not (run_dir / MANIFEST_REL).exists()


def test_gate_view_follows_the_recorded_ckpt_dir(run_dir: Path) -> None:
    other = run_dir / "ckpts"
    other.mkdir()
    (other / "a.bin").write_bytes(b"a")
    meta = json.loads((run_dir / "run.json").read_text())
    meta["watch"] = {"ckpt_dir": str(run_dir / "ckpts")}
    (run_dir / "run.json").write_text(json.dumps(meta))
    view = gate_view(run_dir)
    assert view["ckpt_dir"] == "ckpts" and [u["path"] for u in view["unrecorded"]] == ["ckpts/a.bin"]


# ---- the control op, against a real sidecar -----------------------------------------------------


@pytest.fixture
def client(run_dir: Path) -> Iterator[Client]:
    sc = SidecarProcess(run_dir, "--heartbeat", "5", "--gpu", "none", "--no-kmsg").start()
    c = Client(Endpoints.read(run_dir / "rgt"))
    try:
        yield c
    finally:
        c.close()
        sc.stop()


def test_manifest_op_round_trip(client: Client, run_dir: Path) -> None:
    (run_dir / "eval").mkdir()
    (run_dir / "eval" / "m.json").write_text('{"acc": 1}')
    reply = client.ask(encode_request(Manifest(id="m1", includes=("rgt/manifest.jsonl",))))
    assert isinstance(reply, ManifestReply), reply
    on_disk = json.loads((run_dir / MANIFEST_REL).read_text())
    assert reply.id == "m1" and reply.path == MANIFEST_REL and dict(reply.doc) == on_disk
    assert reply.sha256 == on_disk["sha256"] and reply.files == len(on_disk["files"])
    entry = by_path(on_disk)["checkpoints/step000010.bin"]
    assert entry["hashed"] == "custody" and "eval/m.json" in paths(on_disk)
    assert on_disk["host"] == "box" and on_disk["run_id"] == "run-1"


def test_manifest_op_refuses_and_caps_and_keeps_serving(client: Client, run_dir: Path) -> None:
    reply = client.ask(encode_request(Manifest(id="m2", includes=("results/*.csv",))))
    assert isinstance(reply, ErrorReply) and (reply.id, reply.code) == ("m2", "refused"), reply
    assert "results/*.csv" in reply.message and not (run_dir / MANIFEST_REL).exists()

    many = run_dir / "eval" / ("d" * 60)
    many.mkdir(parents=True)
    for i in range(1500):
        (many / f"sample_{i:05d}.json").write_text(str(i))
    reply = client.ask(encode_request(Manifest(id="m3")), timeout_ms=30000)
    assert isinstance(reply, ErrorReply) and (reply.id, reply.code) == ("m3", "too_large"), reply
    assert MANIFEST_REL in reply.message
    written = json.loads((run_dir / MANIFEST_REL).read_text())
    assert len(written["files"]) > 1500 and written["sha256"] in reply.message
    assert isinstance(client.ask(encode_request(Hello(id="h"))), HelloReply)


# ---- the CLI ------------------------------------------------------------------------------------


def invoke(*args: str) -> Any:
    return CliRunner().invoke(manifest_command, list(args), catch_exceptions=False)


def test_cli_writes_prints_and_reports(run_dir: Path) -> None:
    root = str(run_dir.parents[2])
    out = invoke("p/run-1", "--root", root, "--json")
    assert out.exit_code == 0, out.output
    summary = json.loads(out.output)
    doc = json.loads((run_dir / MANIFEST_REL).read_text())
    assert summary["sha256"] == doc["sha256"] and summary["path"] == str(run_dir / MANIFEST_REL)
    assert (summary["files"], summary["checkpoints"], summary["total_bytes"]) == (
        len(doc["files"]), 1, doc["total_bytes"])
    printed = invoke("run-1", "--root", root, "--print")
    assert printed.exit_code == 0 and json.loads(printed.output)["files"] == doc["files"]
    human = invoke(str(run_dir))
    assert human.exit_code == 0 and "wrote " in human.output and "1 checkpoints" in human.output


def test_cli_gate_prints_the_view_as_json(run_dir: Path) -> None:
    (run_dir / "checkpoints" / "late.bin").write_bytes(b"late")
    out = invoke(str(run_dir), "--gate", "--json")
    assert out.exit_code == 0, out.output
    view = json.loads(out.output)
    assert [u["path"] for u in view["unrecorded"]] == ["checkpoints/late.bin"]
    assert not (run_dir / MANIFEST_REL).exists()


@pytest.mark.parametrize("args, code, needle", [
    (["--include", "nothing/*"], 1, "matches no file"),
    (["--include", "x", "--roster", "r.txt"], 2, "do not mix"),
    (["--json", "--print"], 2, "do not mix"),
    (["--gate", "--include", "x"], 2, "--gate"),
    (["--bogus"], 2, "No such option"),
])
def test_cli_exit_codes(run_dir: Path, args: List[str], code: int, needle: str) -> None:
    out = CliRunner().invoke(manifest_command, [str(run_dir), *args])
    assert out.exit_code == code and needle in out.output, out.output
    assert not (run_dir / MANIFEST_REL).exists()


def test_cli_failed_closed_and_unknown_run(run_dir: Path, tmp_path: Path, short_grace: None) -> None:
    (run_dir / "checkpoints" / "step000010.bin").unlink()
    out = CliRunner().invoke(manifest_command, [str(run_dir)])
    assert out.exit_code == 1 and "error: 1 checkpoint(s)" in out.output and "hint:" in out.output
    out = CliRunner().invoke(manifest_command, ["nope", "--root", str(tmp_path / "root")])
    assert out.exit_code == 1 and "no run 'nope'" in out.output
