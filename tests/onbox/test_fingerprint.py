"""onbox.launch.fingerprint over real files and real interpreters: what a run was made of, for
`rgt compare`."""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from onbox.launch import fingerprint
from onbox.launch.fingerprint import (
    MAX_TEXT_BYTES,
    build_fingerprint,
    find_configs,
    list_packages,
    name_kind,
    seed_args,
    seed_env,
    write_fingerprint,
)

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/home/someone"}


def files(root: Path, spec: Dict[str, str]) -> None:
    for rel, text in spec.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_config_files_are_found_in_every_argument_form(tmp_path: Path) -> None:
    files(tmp_path, {"conf/a.yaml": "lr: 0.1\n", "b.json": '{"x": 1}\n', "c.toml": "x = 1\n",
                     "d.ini": "[s]\nx = 1\n", "notes.txt": "not a config\n"})
    argv = ["python", "train.py", "--config", "conf/a.yaml", "--extra=b.json", "data=c.toml", "d.ini",
            "missing.yaml", "--log", "notes.txt", "--again", "conf/a.yaml"]
    found = find_configs(argv, tmp_path)
    assert [(c["slot"], c["arg"], c["format"]) for c in found] == [
        ("--config", "conf/a.yaml", "yaml"), ("--extra", "b.json", "json"), ("data", "c.toml", "toml"),
        ("#1", "d.ini", "ini")]  # train.py is #0; a file named twice is listed once
    a = found[0]
    assert a["path"] == str((tmp_path / "conf/a.yaml").resolve())
    assert a["size"] == 8 and a["sha256"] == sha(tmp_path / "conf/a.yaml") and a["text"] == "lr: 0.1\n"


def test_config_paths_resolve_against_the_job_cwd_not_ours(tmp_path: Path) -> None:
    files(tmp_path / "job", {"cfg.json": "{}"})
    assert find_configs(["python", "cfg.json"], tmp_path) == []
    assert [c["arg"] for c in find_configs(["python", "cfg.json"], tmp_path / "job")] == ["cfg.json"]


def test_a_config_text_keeps_no_secret_but_its_hash_is_of_the_real_bytes(tmp_path: Path) -> None:
    token = "hf_" + "q" * 30
    text = (f"model: small\napi_key: sk12345678\ndb:\n  password = 'hunter2hunter2'\n"
            f'"auth_token": "zzzz9999",\nurl: https://me:pw123456@example.org/x\nhub: {token}\n'
            f"note: the value abc-def-xyz-123 is known secret\n")
    files(tmp_path, {"run.yaml": text})
    env = {**ENV, "MY_TOKEN": "abc-def-xyz-123"}
    doc = build_fingerprint(["python", "t.py", "run.yaml"], tmp_path, env, None, tmp_path)
    entry = doc["configs"][0]
    assert entry["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    for secret in ("sk12345678", "hunter2hunter2", "zzzz9999", "pw123456", token, "abc-def-xyz-123"):
        assert secret not in json.dumps(doc), secret
    assert entry["text"].splitlines()[0] == "model: small"
    assert "api_key: ***" in entry["text"]


def test_secret_looking_config_files_are_not_read(tmp_path: Path) -> None:
    files(tmp_path, {"creds.json": '{"k": "v"}', "secrets.yaml": "a: b\n", "ok.yaml": "a: b\n"})
    found = find_configs(["python", "t.py", "--credentials", "creds.json", "secrets.yaml", "ok.yaml"],
                         tmp_path)
    assert [(c["arg"], "sha256" in c, "skipped" in c) for c in found] == [
        ("creds.json", False, True), ("secrets.yaml", False, True), ("ok.yaml", True, False)]


def test_a_large_config_is_hashed_without_its_text(tmp_path: Path) -> None:
    big = "x: " + "1" * MAX_TEXT_BYTES + "\n"
    files(tmp_path, {"big.yaml": big})
    (entry,) = find_configs(["python", "big.yaml"], tmp_path)
    assert entry["text"] is None and entry["size"] == len(big)
    assert entry["sha256"] == sha(tmp_path / "big.yaml")
    assert "larger than" in entry["text_skipped"]


def test_seed_and_determinism_arguments() -> None:
    argv = ["python", "train.py", "--seed", "7", "trainer.seed=3", "--data-seed=11", "--deterministic",
            "--lr", "0.1", "--cudnn-deterministic", "true", "+seed=5", "--api-key", "SEED9",
            "--", "--seed", "1"]
    assert seed_args(argv) == [
        {"name": "--seed", "value": "7", "kind": "seed"},
        {"name": "trainer.seed", "value": "3", "kind": "seed"},
        {"name": "--data-seed", "value": "11", "kind": "seed"},
        {"name": "--deterministic", "value": True, "kind": "determinism"},
        {"name": "--cudnn-deterministic", "value": "true", "kind": "determinism"},
        {"name": "seed", "value": "5", "kind": "seed"},
    ]
    assert (name_kind("RANDOM_SEED"), name_kind("PYTHONHASHSEED"), name_kind("CUBLAS_WORKSPACE_CONFIG"),
            name_kind("--lr"), name_kind("--seeds-dir")) == ("seed", "seed", "determinism", None, None)


def test_only_seed_and_determinism_variables_have_their_values_recorded(tmp_path: Path) -> None:
    env = {**ENV, "PYTHONHASHSEED": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CUDA_LAUNCH_BLOCKING": "1",
           "GLOBAL_SEED": "42", "WANDB_PROJECT": "private-project-name", "HF_TOKEN": "hf_secretsecret",
           "MY_SECRET_SEED": "9999999"}
    assert seed_env(env) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CUDA_LAUNCH_BLOCKING": "1",
                             "GLOBAL_SEED": "42", "PYTHONHASHSEED": "0"}
    text = json.dumps(build_fingerprint(["python", "t.py"], tmp_path, env, None, tmp_path))
    for value in ("private-project-name", "hf_secretsecret", "9999999", "/home/someone"):
        assert value not in text


def test_packages_come_from_the_jobs_interpreter(tmp_path: Path) -> None:
    doc = list_packages(sys.executable, ENV, tmp_path)
    assert doc["error"] is None and doc["python"] == platform.python_version()
    assert doc["distributions"]["pytest"] == importlib.metadata.version("pytest")
    assert all(name == name.lower() and "_" not in name for name in doc["distributions"])


# importlib.metadata's view from the same interpreter and sys.path, the first of a name winning
# (the one `import` finds): what the listing must agree with, read the slow way.
_IMPORTLIB_VIEW = """\
import json
from importlib import metadata
dists = {}
for d in metadata.distributions():
    dists.setdefault(d.metadata["Name"] or "", d.version)
print(json.dumps(dists))
"""


def _importlib_view(env: Dict[str, str], cwd: Path) -> Dict[str, str]:
    done = subprocess.run([sys.executable, "-c", _IMPORTLIB_VIEW], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60, check=True)
    return {re.sub(r"[-_.]+", "-", k).lower(): v for k, v in json.loads(done.stdout).items() if k}


def test_the_package_listing_reads_each_header_as_importlib_metadata_does(tmp_path: Path) -> None:
    """The listing reads only the head of each METADATA / PKG-INFO; what it lists matches
    importlib.metadata's whole parse, here on odd layouts and on this interpreter's own packages."""
    first, second = tmp_path / "first", tmp_path / "second"
    files = {
        first / "Alpha_Pkg-1.0.dist-info" / "METADATA":   # a body that looks like headers is not read
            "Metadata-Version: 2.1\nName: Alpha_Pkg\nVersion: 1.0\nSummary: a\n"
            "\nName: not-this\nVersion: 9\n",
        first / "dupe-1.0.dist-info" / "METADATA": "Metadata-Version: 2.1\nName: dupe\nVersion: 1.0\n",
        second / "dupe-2.0.dist-info" / "METADATA": "Metadata-Version: 2.1\nName: dupe\nVersion: 2.0\n",
        second / "beta.egg-info": "Metadata-Version: 1.1\nName: beta\nVersion: 0.3\n",   # an egg-info file
        second / "gamma.egg-info" / "PKG-INFO": "Metadata-Version: 1.1\nName: gamma\nVersion: 2\n",
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (second / "empty-1.0.dist-info").mkdir()   # no METADATA: no name, not listed
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(first), str(second)])}
    listed = list_packages(sys.executable, env, tmp_path)["distributions"]
    assert {k: listed.get(k) for k in ("alpha-pkg", "dupe", "beta", "gamma")} == \
        {"alpha-pkg": "1.0", "dupe": "1.0", "beta": "0.3", "gamma": "2"}
    assert "not-this" not in listed and "empty" not in listed
    assert listed == _importlib_view(env, tmp_path)


def _script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.parametrize("case", ["absent", "fails", "hangs", "none"])
def test_a_package_listing_that_fails_is_recorded_not_raised(tmp_path: Path, case: str) -> None:
    python = {"absent": str(tmp_path / "no-python"),
              "fails": _script(tmp_path / "fails", "echo 'broken interpreter' >&2; exit 7\n"),
              "hangs": _script(tmp_path / "hangs", "exec sleep 60\n"), "none": None}[case]
    doc = build_fingerprint(["python", "t.py"], tmp_path, ENV, python, tmp_path, packages_timeout_s=0.5)
    error = doc["packages"]["error"]
    assert doc["packages"]["distributions"] == {}
    assert {"absent": "could not run", "fails": "exited 7: broken interpreter",
            "hangs": "took over 0.5s", "none": "no interpreter known"}[case] in error


def test_the_gpu_comes_from_the_preflight_report(tmp_path: Path) -> None:
    assert build_fingerprint(["python"], tmp_path, ENV, None, tmp_path)["gpu"] is None
    (tmp_path / "rgt").mkdir()
    report = {"result": "PASS", "gpu": {"available": True, "driver_version": "580.159.04", "devices": 2,
                                        "names": ["NVIDIA H200", "NVIDIA H200"]}, "checks": []}
    (tmp_path / "rgt" / "preflight.json").write_text(json.dumps(report))
    assert build_fingerprint(["python"], tmp_path, ENV, None, tmp_path)["gpu"] == {
        "available": True, "driver_version": "580.159.04", "devices": 2, "names": ["NVIDIA H200"] * 2}
    del report["gpu"]["names"]  # today's report: count and driver, no model names
    (tmp_path / "rgt" / "preflight.json").write_text(json.dumps(report))
    assert build_fingerprint(["python"], tmp_path, ENV, None, tmp_path)["gpu"]["names"] == []


def test_write_fingerprint_writes_the_document_atomically(tmp_path: Path) -> None:
    files(tmp_path / "src", {"c.json": '{"a": 1}'})
    run_dir = tmp_path / "run"
    doc = write_fingerprint(run_dir, ["python", "t.py", "c.json", "--seed", "1"], tmp_path / "src", ENV,
                            sys.executable)
    path = run_dir / "rgt" / "fingerprint.json"
    assert json.loads(path.read_text()) == doc
    assert doc["v"] == 1 and doc["errors"] == [] and doc["configs"][0]["arg"] == "c.json"
    assert doc["seed"]["args"] == [{"name": "--seed", "value": "1", "kind": "seed"}]
    assert sorted(p.name for p in path.parent.iterdir()) == ["fingerprint.json"]


def test_nothing_stops_a_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the run directory should be")
    doc = write_fingerprint(blocker, ["python", "t.py"], tmp_path, ENV, None)
    assert any(e.startswith("write: ") for e in doc["errors"])

    def broken(*args: object, **kwargs: object) -> List[str]:
        raise RuntimeError("boom")
    monkeypatch.setattr(fingerprint, "list_packages", broken)
    doc = build_fingerprint(["python", "t.py"], tmp_path, ENV, sys.executable, tmp_path)
    assert doc["errors"] == ["packages: RuntimeError: boom"] and doc["packages"]["distributions"] == {}
