"""The box's secrets: which files count (onbox/launch/secrets.py), and what a launch does with them.

The job proves it got a value by printing a hash of it, never the value; then every file of the
run (run.json, train.log, the journal, the sidecar's log) and the processes rgt started are
searched for the value.
"""
from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from onbox.cli.launch import run_launch
from onbox.launch.launcher import RESERVED_ENV
from onbox.launch.secrets import MAX_VALUE_BYTES, maskable, read_secrets, secrets_dir
from onbox.runs import read_json
from onbox.sidecar.journal import read_all
from tests.helpers import wait_until
from tests.onbox.test_launch import WAIT_GO, Rig, log_line, proc_bytes, py, sha12

TOKEN = "tok-4f1d9a77-secret-value"


def secret_dir(tmp_path: Path, files: Dict[str, bytes], mode: int = 0o700) -> Path:
    where = tmp_path / "secrets"
    where.mkdir(mode=0o700)
    for name, value in files.items():
        path = where / name
        path.write_bytes(value)
        path.chmod(0o600)
    where.chmod(mode)
    return where


def read(where: Path, **kw: Any) -> tuple[Dict[str, str], List[str]]:
    warnings: List[str] = []
    found = read_secrets(where, warn=warnings.append, **kw)
    return found, warnings


# ---- which files count ------------------------------------------------------------------------


def test_the_directory_comes_from_the_environment(tmp_path: Path) -> None:
    assert secrets_dir({"RGT_SECRETS_DIR": str(tmp_path)}) == tmp_path
    assert secrets_dir({"RGT_SECRETS_DIR": "", "HOME": "/home/u"}) == Path("/home/u/.rgt/secrets")
    assert read(tmp_path / "absent") == ({}, [])


def test_good_files_are_read_exactly_and_others_skipped_naming_only_the_file(tmp_path: Path) -> None:
    where = secret_dir(tmp_path, {
        "HF_TOKEN": b"hf-value-1\n",           # exact bytes: the newline stays
        "PLAIN": "h\u00e9llo w\u00f6rld".encode(),
        "OPEN": b"open-value-2",
        "9BAD": b"bad-name-value-3",
        ".PUSH.tmp.123": b"in-flight-value-4",
        "NUL": b"nul\0value-5",
        "BIG": b"x" * (MAX_VALUE_BYTES + 1),
        "RGT_RUN_ID": b"reserved-value-6",
    })
    (where / "OPEN").chmod(0o640)
    (where / "LINK").symlink_to(where / "HF_TOKEN")
    (where / "SUBDIR").mkdir()
    found, warnings = read(where, reserved=RESERVED_ENV)
    assert found == {"HF_TOKEN": "hf-value-1\n", "PLAIN": "h\u00e9llo w\u00f6rld"}
    text = "\n".join(warnings)
    for name, why in [("OPEN", "mode 640"), ("9BAD", "not a variable name"), ("NUL", "NUL byte"),
                      ("BIG", "bytes, over"), ("RGT_RUN_ID", "sets RGT_RUN_ID itself"),
                      ("LINK", "cannot open"), ("SUBDIR", "not a regular file")]:
        assert any(str(where / name) in w and why in w for w in warnings), (name, text)
    assert ".PUSH" not in text and len(warnings) == 7
    for value in ("open-value-2", "bad-name-value-3", "in-flight-value-4", "nul", "reserved-value-6"):
        assert value not in text


def test_a_directory_others_may_write_or_that_is_not_ours_gives_nothing(tmp_path: Path) -> None:
    where = secret_dir(tmp_path, {"A_TOKEN": b"value-a"}, mode=0o770)
    found, warnings = read(where)
    assert found == {} and "others may write" in warnings[0] and str(where) in warnings[0]
    where.chmod(0o755)  # readable by others: read, with a warning
    found, warnings = read(where)
    assert found == {"A_TOKEN": "value-a"} and "chmod 700" in warnings[0]
    where.chmod(0o700)
    found, warnings = read(where, uid=os.geteuid() + 1)
    assert found == {} and "not by this user" in warnings[0]


def test_files_of_another_owner_are_skipped(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    where = secret_dir(tmp_path, {"MINE": b"value-mine", "THEIRS": b"value-theirs"})
    os.chown(where / "THEIRS", 12345, -1)
    found, warnings = read(where)
    assert found == {"MINE": "value-mine"}
    assert len(warnings) == 1 and "THEIRS" in warnings[0] and "owned by uid 12345" in warnings[0]


def test_maskable_values_skip_the_very_short(tmp_path: Path) -> None:
    found = maskable(["abc", "long-enough", "x" * 6], ["other-known"])
    assert found == ["long-enough", "other-known", "xxxxxx"]


# ---- a launch exports them by name ------------------------------------------------------------


HASHES = ("import hashlib, os\n"
          "def h(n):\n"
          "    return hashlib.sha256(os.environ[n].encode()).hexdigest()[:12] if n in os.environ else None\n"
          "print('got', h('MY_DB_URL'), h('SHORT'), h('GIVEN'))\n")


def test_launch_exports_secrets_by_name_and_records_only_names(rig: Rig, tmp_path: Path) -> None:
    where = secret_dir(tmp_path, {"MY_DB_URL": TOKEN.encode(), "SHORT": b"s3c", "GIVEN": b"from-file-777"})
    environ = {**os.environ, "RGT_SECRETS_DIR": str(where)}
    out, err = io.StringIO(), io.StringIO()
    # the value is on the command line too, by mistake: it must be masked even under a harmless name
    opts = rig.opts(py(HASHES + WAIT_GO, f"--db={TOKEN}"), run_id="with-secrets",
                    env=["GIVEN=explicit-888"])
    rig.track(rig.root / "p" / "active" / "with-secrets")
    assert run_launch(opts, True, out, err, environ=environ) == 0, err.getvalue()
    answer = json.loads(out.getvalue())
    run_dir = Path(answer["run_dir"])
    got = wait_until(lambda: log_line(run_dir, "got "), 10, "the job's line")
    assert got == f"{sha12(TOKEN)} {sha12('s3c')} {sha12('explicit-888')}"  # --env wins over the file
    assert answer["secrets"] == ["GIVEN", "MY_DB_URL", "SHORT"]
    sup_file = run_dir / "rgt" / "supervisor.json"
    wait_until(lambda: (read_json(sup_file) or {}).get("sidecar"), 10, "the sidecar")
    job, sup = read_json(run_dir / "rgt" / "job.json"), read_json(sup_file)
    for pid in (job["wrapper"]["pid"], sup["pid"], sup["sidecar"]["pid"]):
        seen = proc_bytes(pid, "cmdline") + proc_bytes(pid, "environ")
        assert seen and TOKEN.encode() not in seen and b"from-file-777" not in seen, pid
    rig.go(run_dir)
    assert rig.finished(run_dir)["code"] == 0

    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["secrets"] == ["GIVEN", "MY_DB_URL", "SHORT"] and meta["env_set"] == ["GIVEN"]
    assert {"MY_DB_URL", "SHORT", "GIVEN"} <= set(meta["env_names"])
    assert meta["command"][-1] == "--db=***"
    assert read_all(run_dir / "rgt")  # the journal exists and is searched below
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"run.json", "train.log", "events.jsonl"} <= {p.name for p in files}
    for path in files:
        data = path.read_bytes()
        assert TOKEN.encode() not in data and b"from-file-777" not in data, path
    assert TOKEN not in out.getvalue() + err.getvalue()


def test_no_secrets_leaves_them_out(rig: Rig, tmp_path: Path) -> None:
    where = secret_dir(tmp_path, {"MY_DB_URL": TOKEN.encode()})
    environ = {**os.environ, "RGT_SECRETS_DIR": str(where)}
    res = rig.launch(py(HASHES.replace("h('GIVEN')", "1")), environ=environ, secrets=False, sidecar=False)
    wait_until(lambda: log_line(res.run_dir, "got "), 10, "the job's line")
    assert log_line(res.run_dir, "got ") == "None None 1" and res.secrets == []
    assert json.loads((res.run_dir / "run.json").read_text())["secrets"] == []
    wait_until(lambda: read_json(res.run_dir / "rgt" / "exit.json"), 10, "the exit record")


def test_the_cli_flag_and_a_skipped_file_warning(rig: Rig, tmp_path: Path) -> None:
    import subprocess

    where = secret_dir(tmp_path, {"MY_DB_URL": TOKEN.encode(), "LOOSE": b"loose-value-9"})
    (where / "LOOSE").chmod(0o644)
    env = {**os.environ, "RGT_SECRETS_DIR": str(where), "PYTHONPATH": str(Path(__file__).parents[2])}
    base = [sys.executable, "-m", "onbox.cli", "launch", "--root", str(rig.root), "--project", "p",
            "--no-preflight", "--probe", "none", "--min-free", "1M", "--sidecar-linger", "0", "--json"]
    for flag, run_id, expected in (([], "cli-on", ["MY_DB_URL"]), (["--no-secrets"], "cli-off", [])):
        rig.track(rig.root / "p" / "active" / run_id)
        done = subprocess.run([*base, *flag, "--run-id", run_id, "--", sys.executable, "-c", "pass"],
                              env=env, capture_output=True, text=True, timeout=60, cwd=rig.cwd)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["secrets"] == expected
        assert ("LOOSE skipped: mode 644" in done.stderr) == (not flag), done.stderr
        assert "loose-value-9" not in done.stdout + done.stderr and TOKEN not in done.stdout + done.stderr
        rig.finished(rig.root / "p" / "active" / run_id)
