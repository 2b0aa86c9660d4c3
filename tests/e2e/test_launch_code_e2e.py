"""`rgt launch HOST --code DIR [--cwd] [--python] -- python train.py`: the first job on a box works.

Through the test sshd: the working tree goes to <root>/<project>/code with its .gitignore'd files
left out, the job runs there under the box's own python3 (/usr/bin/python3 on PATH: no zmq, no
psutil) and still imports onbox.report and onbox.integrations; a missing interpreter is named.
Also the exclude rules and the interpreter choice as units.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from controller.box import codesync
from onbox.launch.env import InterpreterMissing, choose_interpreter
from onbox.runs import read_json, wait_for
from tests.e2e.rgtbox import TEST_ONBOX_ARGS, Rgt

TRAIN = """\
import os, sys
from onbox import report
import onbox.integrations
report.log(step=1, loss=0.25)
print("job python", sys.executable, "cwd", os.getcwd(), "path", os.environ.get("PYTHONPATH"))
"""


def make_tree(root: Path) -> Path:
    code = root / "myproj"
    (code / "data").mkdir(parents=True)
    (code / "pkg" / "__pycache__").mkdir(parents=True)
    (code / "train.py").write_text(TRAIN)
    (code / ".gitignore").write_text("# data and outputs\n/data/\n*.bin\n!keep.bin\nout/\n")
    (code / ".rgtignore").write_text("notes.txt\n")
    with open(code / "big.bin", "wb") as f:  # gitignored: never copied (sparse: costs no disk here)
        f.truncate(300 << 20)
    (code / "keep.bin").write_bytes(b"k")
    (code / "data" / "x.csv").write_text("1\n")
    (code / "notes.txt").write_text("n\n")
    (code / "pkg" / "mod.py").write_text("X = 1\n")
    (code / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    (code / "pkg" / ".gitignore").write_text("gen_*.py\n")
    (code / "pkg" / "gen_a.py").write_text("")
    (code / ".git").mkdir()
    (code / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (code / "venvx").mkdir()
    (code / "venvx" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    return code


# ---- units ----------------------------------------------------------------------------------------


def test_the_exclude_rules_follow_gitignore_and_rgtignore(tmp_path: Path) -> None:
    scan = codesync.scan_tree(make_tree(tmp_path))
    assert sorted(rel for rel, _ in scan.files) == [".gitignore", ".rgtignore", "keep.bin", "pkg/.gitignore",
                                                    "pkg/mod.py", "train.py"]
    assert sorted(rel for rel, _ in scan.left_out) == [".git", "big.bin", "data", "notes.txt",
                                                       "pkg/__pycache__", "pkg/gen_a.py", "venvx"]
    assert "/data/" in scan.rsync_excludes() and "/big.bin" in scan.rsync_excludes()
    assert scan.total_bytes < 4096
    scan.check_size(1 << 20)


@pytest.mark.parametrize("pattern,path,is_dir,hit", [
    ("*.log", "a/b/x.log", False, True), ("/top", "a/top", False, False), ("/top", "top", False, True),
    ("a/**/z", "a/b/c/z", False, True), ("a/**/z", "a/z", False, True), ("**/cache", "x/cache", True, True),
    ("build/", "build", False, False), ("build/", "src/build", True, True),
    ("doc/*.md", "doc/a/b.md", False, False),
    ("f[0-9].txt", "f3.txt", False, True), ("\\#x", "#x", False, True), ("out/**", "out/a/b", False, True)])
def test_gitignore_patterns(pattern: str, path: str, is_dir: bool, hit: bool) -> None:
    rule = codesync.parse_rule(pattern)
    assert rule is not None and rule.matches(path, is_dir) is hit


def test_a_tree_over_the_limit_names_its_biggest_entries(tmp_path: Path) -> None:
    code = tmp_path / "c"
    (code / "weights").mkdir(parents=True)
    with open(code / "weights" / "w.pt", "wb") as f:
        f.truncate(3 << 20)
    (code / "train.py").write_text("")
    with pytest.raises(codesync.CodeError) as e:
        codesync.scan_tree(code).check_size(1 << 20)
    assert "3.0 MiB" in e.value.message and "biggest: weights/ 3.0 MiB" in e.value.message
    assert e.value.hint and ".rgtignore" in e.value.hint and "--yes" in e.value.hint


def test_the_interpreter_is_chosen_explicitly_and_a_missing_one_is_named(tmp_path: Path) -> None:
    notes: List[str] = []
    bindir = str(Path(sys.executable).parent)
    argv, interp = choose_interpreter(["python", "t.py"], None, None, bindir, tmp_path, "gpu1", notes)
    assert interp.source == "PATH" and interp.replaced == "python" and argv[0] == interp.path
    argv, interp = choose_interpreter(["python3", "t.py"], sys.executable, None, "/nowhere", tmp_path,
                                      "gpu1", notes)
    assert (argv[0], interp.source, interp.version) == (sys.executable, "--python",
                                                        ".".join(map(str, sys.version_info[:3])))
    argv, interp = choose_interpreter(["python", "t.py"], None, "/no/conda/python", bindir, tmp_path, "g",
                                      notes)
    assert interp.source == "PATH" and "the profile's interpreter /no/conda/python" in notes[-1]
    cases = ((None, ["python3.11", "t.py"], "python3.11"), ("/nope/python", ["python"], "/nope/python"),
             (None, ["torchrun", "x"], "torchrun"))
    for asked, cmd, named in cases:
        with pytest.raises(InterpreterMissing) as e:
            choose_interpreter(cmd, asked, None, "/nowhere", tmp_path, "gpu1", notes)
        assert str(e.value).startswith(f"{named} not found on gpu1")
    with pytest.raises(InterpreterMissing, match="pass --python /path/to/python or install it"):
        choose_interpreter(["python3.11"], None, None, "/nowhere", tmp_path, "gpu1", notes)


# ---- through the test sshd ------------------------------------------------------------------------


def _launch(rgt: Rgt, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return rgt("launch", "box", "--root", str(rgt.root), "--json", *TEST_ONBOX_ARGS, *args, check=check)


@pytest.mark.e2e
def test_launch_code_syncs_the_tree_and_the_box_python_imports_onbox(rgt_box: Rgt, tmp_path: Path) -> None:
    code = make_tree(tmp_path)
    out = _launch(rgt_box, "--code", str(code), "--", "python", "train.py")
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    rgt_box.runs.append(answer["run_id"])
    there = rgt_box.root / "myproj" / "code"
    assert answer["code"]["dir"] == str(there) and "code: 6 files" in out.stderr
    assert sorted(str(p.relative_to(there)) for p in there.rglob("*") if p.is_file()) == \
        [".gitignore", ".rgtignore", "keep.bin", "pkg/.gitignore", "pkg/mod.py", "train.py"]
    run_dir = Path(answer["run_dir"])
    assert run_dir.parent.parent.name == "myproj"
    assert wait_for(lambda: (read_json(run_dir / "rgt" / "exit.json") or {}).get("code") == 0, 120.0), \
        (run_dir / "train.log").read_text()
    log = (run_dir / "train.log").read_text()
    meta = read_json(run_dir / "run.json") or {}
    job_python = meta["interpreter"]["path"]
    assert meta["interpreter"]["replaced"] == "python" and meta["interpreter"]["source"] == "PATH"
    assert meta["cwd"] == str(there) and meta["code_dir"] == str(there)
    assert f"job python {job_python} cwd {there}" in log
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0]) == {"step": 1, "loss": 0.25}
    # the job's python is not the sidecar's, and has none of its dependencies
    assert job_python != sys.executable and meta["launcher_python"] == sys.executable
    probe = subprocess.run([job_python, "-c", "import importlib.util as u; print(u.find_spec('zmq'))"],
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "None"
    pylib = Path(meta["job_pythonpath"].split(os.pathsep)[-1])
    assert sorted(p.name for p in pylib.iterdir()) == ["onbox", "protocol", "rgtlib"]


@pytest.mark.e2e
def test_launch_refuses_a_missing_python_a_missing_cwd_and_a_big_tree(rgt_box: Rgt, tmp_path: Path) -> None:
    code = make_tree(tmp_path)
    bad = _launch(rgt_box, "--code", str(code), "--python", "/nope/python", "--", "python", "train.py",
                  check=False)
    assert bad.returncode != 0 and "/nope/python not found on" in bad.stderr
    assert "pass --python /path/to/python or install it" in bad.stderr
    nocwd = _launch(rgt_box, "--code", str(code), "--cwd", "no/such", "--", "python", "train.py", check=False)
    assert nocwd.returncode != 0 and "--cwd no/such: no such directory on" in nocwd.stderr
    with open(code / "data.pt", "wb") as f:  # not ignored: over the 200 MiB default
        f.truncate(250 << 20)
    big = _launch(rgt_box, "--code", str(code), "--", "python", "train.py", check=False)
    assert big.returncode != 0 and "over the 200.0 MiB limit; biggest: data.pt 250.0 MiB" in big.stderr
    assert not (rgt_box.root / "myproj" / "code" / "data.pt").exists()
