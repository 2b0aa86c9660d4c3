"""tests/rerun.py: `make test` re-runs a failed test once, alone, and prints it as FLAKY when it passes.

Each case runs the runner on a small suite of its own in a temporary directory, through xdist as
`make test` does, and reads its exit, its output and its JSON report.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest

from tests.helpers import REPO
from tests.rerun import rerun_options

SUITE = '''
import os
from pathlib import Path

def test_fine():
    pass

def test_flaky():
    mark = Path(os.environ["FLAKE_MARK"])
    if not mark.exists():
        mark.write_text("")
        assert 1 == 2, "the first try fails"

def test_broken():
    if os.environ.get("WITH_BROKEN"):
        assert "always" == "fails"
'''


def runner(tmp_path: Path, *pytest_args: str, env: Dict[str, str],
           **kw: str) -> Tuple[int, str, Dict[str, Any]]:
    report = tmp_path / "report.json"
    ours = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    out = subprocess.run([sys.executable, "-m", "tests.rerun", "--report", str(report), *ours, "--",
                          "-q", "-p", "no:cacheprovider", *pytest_args],
                         cwd=tmp_path / "project", env={**os.environ, "PYTHONPATH": str(REPO), **env},
                         capture_output=True, text=True, timeout=300)
    return out.returncode, out.stdout + out.stderr, json.loads(report.read_text())


@pytest.fixture
def project(tmp_path: Path) -> Path:
    suite = tmp_path / "project" / "suite"
    suite.mkdir(parents=True)
    (tmp_path / "project" / "pytest.ini").write_text("[pytest]\n")
    (suite / "test_some.py").write_text(SUITE)
    return tmp_path


def test_a_test_that_passes_alone_is_flaky_and_the_run_passes(project: Path) -> None:
    mark = project / "flaked"
    code, out, report = runner(project, "-n", "2", "suite", env={"FLAKE_MARK": str(mark)})
    assert code == 0, out
    assert report["first_exit"] == 1, out
    assert [r["nodeid"] for r in report["failed"]] == ["suite/test_some.py::test_flaky"]
    assert report["flaky"] == [{"nodeid": "suite/test_some.py::test_flaky", "when": "call",
                                "first": report["flaky"][0]["first"]}], report
    assert "the first try fails" in report["flaky"][0]["first"]
    assert "FLAKY suite/test_some.py::test_flaky: failed first (call) with: E" in out, out
    assert [r["exit"] for r in report["reruns"]] == [0]


def test_a_test_that_fails_again_alone_fails_the_run(project: Path) -> None:
    mark = project / "flaked"
    code, out, report = runner(project, "-n", "2", "suite", env={"FLAKE_MARK": str(mark), "WITH_BROKEN": "1"})
    assert code == 1, out
    assert sorted(r["nodeid"] for r in report["reruns"]) == ["suite/test_some.py::test_broken",
                                                            "suite/test_some.py::test_flaky"]
    assert [f["nodeid"] for f in report["flaky"]] == ["suite/test_some.py::test_flaky"]
    assert "FAILED AGAIN suite/test_some.py::test_broken" in out, out


def test_no_rerun_past_the_limit_nor_after_a_collection_error(project: Path) -> None:
    env = {"FLAKE_MARK": str(project / "flaked"), "WITH_BROKEN": "1"}
    code, out, report = runner(project, "suite", env=env, max_reruns="1")
    assert code == 1 and report["reruns"] == [] and "more than --max-reruns 1" in report["why"], out
    (project / "project" / "suite" / "test_torn.py").write_text("def test_half(:\n")
    code, out, report = runner(project, "suite", env={"FLAKE_MARK": str(project / "flaked-2")})
    assert code != 0 and report["reruns"] == [] and "no re-run" in report["why"], out


def test_a_passing_run_runs_once_and_says_nothing_more(project: Path) -> None:
    (project / "flaked").write_text("")
    code, out, report = runner(project, "suite", env={"FLAKE_MARK": str(project / "flaked")})
    assert code == 0 and report["failed"] == [] and report["reruns"] == [], out
    assert "re-run" not in out


def test_a_lone_rerun_keeps_plugins_and_ini_overrides_only() -> None:
    args = ["-q", "-rs", "-p", "tests.click81", "-n", "6", "--dist", "loadgroup", "--durations=15", "-k",
            "not fuzz", "tests/onbox", "--ignore=tests/x.py", "-o", "timeout=60", "-pno:randomly",
            "-p", "tests.rerun"]
    assert rerun_options(args) == ["-p", "tests.click81", "-o", "timeout=60", "-pno:randomly"]
