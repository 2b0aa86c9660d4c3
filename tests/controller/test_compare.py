"""`rgt compare` over run directories built the way the launcher builds them: run.json as
onbox/launch/launcher.py writes it, rgt/fingerprint.json from onbox.launch.fingerprint over real
config files and the real interpreter, metrics.jsonl written line by line."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pytest
from click.testing import CliRunner, Result

from controller.box.ssh import LocalShell
from controller.cli.base import RgtGroup
from controller.cli.compare import compare_command
from controller.insight.compare import command_items, compare
from controller.insight.runfacts import load_dir, load_remote, parse_metrics, read_flat_yaml
from controller.store.db import Store
from onbox.launch.fingerprint import write_fingerprint
from tests.sshbox import SshBox, sshbox  # noqa: F401  (the fixture)

BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/home/u", "LANG": "C.UTF-8"}
LOSS = [2.0, 1.5, 1.2, 1.0]


def make_run(root: Path, name: str, argv: Sequence[str], *, files: Optional[Dict[str, str]] = None,
             env: Optional[Dict[str, str]] = None, env_set: Sequence[str] = (),
             metrics: Optional[List[Dict[str, Any]]] = None, git_sha: str = "a" * 40, dirty: bool = False,
             fingerprint: bool = True) -> Path:
    """A run directory like the launcher leaves it; config files live in the run's own cwd."""
    run_dir = root / name
    cwd = root / ".src" / name
    (run_dir / "rgt").mkdir(parents=True)
    cwd.mkdir(parents=True)
    for rel, text in (files or {}).items():
        (cwd / rel).parent.mkdir(parents=True, exist_ok=True)
        (cwd / rel).write_text(text)
    job_env = {**BASE_ENV, **(env or {})}
    names = sorted({*job_env, "RGT_RUN_ID", "RGT_RUN_DIR", "RGT_CKPT_DIR", "RGT_METRICS", "PYTHONUNBUFFERED"})
    run = {"v": 1, "id": name, "project": "proj", "command": list(argv), "command_line": " ".join(argv),
           "cwd": str(cwd), "profile": None, "host": "box", "git_sha": git_sha, "git_dirty": dirty,
           "python": sys.executable, "env_names": names, "env_set": sorted(env_set),
           "ckpt_dir": str(run_dir / "checkpoints"), "metrics": str(run_dir / "metrics.jsonl"),
           "package_version": "0.1.0", "secrets": [], "watch": {}}
    (run_dir / "run.json").write_text(json.dumps(run, indent=1))
    if fingerprint:
        write_fingerprint(run_dir, argv, cwd, job_env, sys.executable)
    rows = metrics if metrics is not None else [{"step": 10 * (i + 1), "epoch": 0, "loss": v}
                                                for i, v in enumerate(LOSS)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def edit_fingerprint(run_dir: Path, **changes: Any) -> None:
    path = run_dir / "rgt" / "fingerprint.json"
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def rgt(*args: str) -> Result:
    group = RgtGroup("rgt")
    group.add_command(compare_command)
    return CliRunner().invoke(group, ["compare", *args], catch_exceptions=False)


def report_of(*args: str) -> Dict[str, Any]:
    res = rgt(*args, "--json")
    assert res.exit_code == 0, res.output
    return dict(json.loads(res.stdout))


def losses(values: Sequence[float], steps: int = 3) -> List[Dict[str, Any]]:
    return [{"step": 10 * (i + 1), "loss": v} for i, v in enumerate(values[:steps])]


TRAIN = ["python", "train.py"]


# ---- what differs --------------------------------------------------------------------------------


def test_one_changed_flag_is_a_clean_single_variable_report(tmp_path: Path) -> None:
    a = make_run(tmp_path, "ra", [*TRAIN, "--lr", "0.1", "--epochs", "3"],
                 metrics=losses([2.0, 1.5, 1.2, 1.0], steps=4))
    b = make_run(tmp_path, "rb", [*TRAIN, "--lr", "0.2", "--epochs", "3"], metrics=losses([2.0, 1.4, 1.5]))
    rep = report_of(str(a), str(b))
    assert rep["differences"] == [{"section": "command", "name": "--lr", "a": "0.1", "b": "0.2",
                                   "variable": "--lr"}]
    assert rep["variables"] == ["--lr"] and rep["attributable"] is True
    assert rep["warnings"] == [] and rep["notes"] == []
    (row,) = rep["metrics"]
    assert row["metric"] == "loss" and row["step"] == 30  # the last step both reached; A went on to 40
    assert (row["a"], row["b"]) == (1.2, 1.5)
    assert row["diff"] == pytest.approx(0.3) and row["rel"] == pytest.approx(0.25)
    res = rgt(str(a), str(b))
    assert res.exit_code == 0 and res.stderr == ""
    table = res.stdout.splitlines()
    assert table[3].split() == ["WHAT", "NAME", "A", "B"]
    assert table[4].split() == ["command", "--lr", "0.1", "0.2"]
    assert "variables changed: 1 (--lr)" in table
    assert [ln.split()[:6] for ln in table if ln.startswith("loss")] == [
        ["loss", "30", "1.2", "1.5", "+0.3", "+25.00%"]]


def test_two_changed_variables_are_flagged_and_both_named(tmp_path: Path) -> None:
    conf = '{"optim": {"lr": 0.1, "warmup": 100}, "model": {"depth": 4}}'
    a = make_run(tmp_path, "ra", [*TRAIN, "--config", "c.json", "--batch", "32"], files={"c.json": conf})
    b = make_run(tmp_path, "rb", [*TRAIN, "--config", "c.json", "--batch", "64"],
                 files={"c.json": conf.replace("100", "500")})
    rep = report_of(str(a), str(b))
    assert rep["variables"] == ["--batch", "--config:optim.warmup"] and rep["attributable"] is False
    assert rep["warnings"][0] == ("2 variables changed (--batch, --config:optim.warmup): cannot attribute "
                                  "the difference to one change")
    res = rgt(str(a), str(b))
    assert res.exit_code == 0
    assert "warning: 2 variables changed (--batch, --config:optim.warmup)" in res.stderr


@pytest.mark.parametrize("fmt", ["json", "toml", "yaml"])
def test_a_config_key_change_is_found_by_key(tmp_path: Path, fmt: str) -> None:
    texts = {
        "json": '{\n "optim": {"lr": 0.1, "wd": 0.0},\n "model": {"depth": 4, "act": "gelu"}\n}\n',
        "toml": '# run config\n[optim]\nlr = 0.1\nwd = 0.0\n\n[model]\ndepth = 4\nact = "gelu"\n',
        "yaml": "# run config\noptim:\n  lr: 0.1   # tuned\n  wd: 0.0\nmodel:\n  depth: 4\n  act: gelu\n",
    }
    text = texts[fmt]
    a = make_run(tmp_path, "ra", [*TRAIN, f"cfg.{fmt}"], files={f"cfg.{fmt}": text})
    b = make_run(tmp_path, "rb", [*TRAIN, f"cfg.{fmt}"],
                 files={f"cfg.{fmt}": text.replace("0.1", "0.05").replace("# run config", "# changed")})
    rep = report_of(str(a), str(b))
    assert rep["differences"] == [{"section": "config", "name": f"cfg.{fmt}:optim.lr", "a": 0.1, "b": 0.05,
                                   "variable": f"cfg.{fmt}:optim.lr"}]
    assert rep["warnings"] == []


def test_another_config_file_in_the_same_place_is_compared_by_content(tmp_path: Path) -> None:
    a = make_run(tmp_path, "ra", [*TRAIN, "--config", "a.yaml"], files={"a.yaml": "lr: 0.1\nseed: 1\n"})
    b = make_run(tmp_path, "rb", [*TRAIN, "--config", "b.yaml"], files={"b.yaml": "lr: 0.1\nseed: 1\n"})
    c = make_run(tmp_path, "rc", [*TRAIN, "--config", "c.yaml"], files={"c.yaml": "lr: 0.3\nseed: 1\n"})
    assert report_of(str(a), str(b))["differences"] == []  # a renamed copy: nothing changed
    rep = report_of(str(a), str(c))
    assert [(d["name"], d["a"], d["b"]) for d in rep["differences"]] == [("--config:lr", 0.1, 0.3)]


def test_a_comment_only_change_is_shown_but_not_counted(tmp_path: Path) -> None:
    a = make_run(tmp_path, "ra", [*TRAIN, "c.yaml"], files={"c.yaml": "lr: 0.1\n"})
    b = make_run(tmp_path, "rb", [*TRAIN, "c.yaml"], files={"c.yaml": "# same\nlr: 0.1\n"})
    rep = report_of(str(a), str(b))
    assert [(d["name"], d["variable"]) for d in rep["differences"]] == [("c.yaml (text only)", None)]
    assert rep["variables"] == [] and rep["warnings"][0].startswith("nothing recorded differs")


def test_commit_packages_environment_and_gpu_are_variables(tmp_path: Path) -> None:
    a = make_run(tmp_path, "ra", TRAIN)
    b = make_run(tmp_path, "rb", TRAIN, git_sha="b" * 40, env={"WANDB_MODE": "offline", "TMUX": "1"},
                 env_set=["WANDB_MODE"])
    pkgs_a = json.loads((a / "rgt" / "fingerprint.json").read_text())["packages"]
    pkgs_b = json.loads(json.dumps(pkgs_a))
    pkgs_b["distributions"].update({"torch": "2.4.0", "remote-gpu-trainer": "9.9"})
    pkgs_a["distributions"]["torch"] = "2.3.1"
    edit_fingerprint(a, packages=pkgs_a, gpu={"available": True, "driver_version": "550.1", "devices": 1,
                                              "names": ["NVIDIA H100 80GB HBM3"]})
    edit_fingerprint(b, packages=pkgs_b, gpu={"available": True, "driver_version": "550.1", "devices": 1,
                                              "names": ["NVIDIA H200"]})
    rep = report_of(str(a), str(b))
    assert rep["variables"] == ["commit", "environment", "env WANDB_MODE", "package torch", "gpu type"]
    rows = {d["name"]: d for d in rep["differences"]}
    assert rows["remote-gpu-trainer"]["variable"] is None  # our monitor, not the job
    assert (rows["gpu type"]["a"], rows["gpu type"]["b"]) == ("1x NVIDIA H100 80GB HBM3", "1x NVIDIA H200")
    assert (rows["TMUX"]["a"], rows["TMUX"]["b"]) == (False, True)
    assert rep["warnings"][0].startswith("5 variables changed (commit, environment, env WANDB_MODE,")


def test_both_dirty_at_one_commit_warns(tmp_path: Path) -> None:
    a = make_run(tmp_path, "ra", TRAIN, dirty=True)
    b = make_run(tmp_path, "rb", TRAIN, dirty=True)
    c = make_run(tmp_path, "rc", TRAIN, dirty=False)
    assert any("uncommitted changes at the same commit" in w for w in report_of(str(a), str(b))["warnings"])
    assert report_of(str(a), str(c))["variables"] == ["uncommitted changes"]


def test_a_run_without_a_fingerprint_is_compared_by_run_json(tmp_path: Path) -> None:
    a = make_run(tmp_path, "ra", [*TRAIN, "--lr", "0.1"], fingerprint=False)
    b = make_run(tmp_path, "rb", [*TRAIN, "--lr", "0.3"])
    rep = report_of(str(a), str(b))
    assert rep["variables"] == ["--lr"] and rep["a"]["fingerprint"] is False
    assert any(w.startswith("ra has no rgt/fingerprint.json") for w in rep["warnings"])


# ---- the seed -------------------------------------------------------------------------------------


def seed_runs(root: Path, b_loss: float) -> Dict[str, Path]:
    """A (seed 1), B (seed 2), two more seeds, and one run with another learning rate."""
    runs = {}
    for name, seed, lr, last in [("ra", 1, "0.1", 1.00), ("rb", 2, "0.1", b_loss), ("rc", 3, "0.1", 1.05),
                                 ("rd", 4, "0.1", 0.98), ("rx", 5, "0.9", 9.0)]:
        runs[name] = make_run(root, name, [*TRAIN, "--lr", lr, "--seed", str(seed)],
                              env={"PYTHONHASHSEED": str(seed)}, metrics=losses([2.0, 1.5, last]))
    return runs


def test_seed_only_difference_inside_the_seed_spread(tmp_path: Path) -> None:
    runs = seed_runs(tmp_path, b_loss=1.02)
    rep = report_of(str(runs["ra"]), str(runs["rb"]))
    assert rep["variables"] == ["seed"] and rep["seed_only"] is True
    assert {d["name"] for d in rep["differences"]} == {"--seed", "PYTHONHASHSEED"}
    (row,) = rep["metrics"]
    spread = row["spread"]
    # A, C and D (B left out; the lr 0.9 run is no seed sibling): 0.98 .. 1.05
    assert spread["groups"] == [{"of": "A", "runs": 3, "seeds": 3, "min": 0.98, "max": 1.05,
                                 "stdev": pytest.approx(0.0360555, rel=1e-4)}]
    assert spread["inside"] is True and spread["range"] == pytest.approx(0.07)
    assert rep["warnings"] == ["only the seed differs: loss inside the seed-to-seed spread"]


def test_seed_only_difference_outside_the_seed_spread(tmp_path: Path) -> None:
    runs = seed_runs(tmp_path, b_loss=1.5)
    res = rgt(str(runs["ra"]), str(runs["rb"]))
    assert res.exit_code == 0
    assert "warning: only the seed differs: loss OUTSIDE the seed-to-seed spread" in res.stderr
    assert "OUTSIDE (range 0.07, 3 seeds)" in res.stdout


def test_a_seed_key_in_a_config_is_the_seed(tmp_path: Path) -> None:
    a = make_run(tmp_path, "ra", [*TRAIN, "c.yaml"], files={"c.yaml": "lr: 0.1\ntrain:\n  seed: 1\n"})
    b = make_run(tmp_path, "rb", [*TRAIN, "c.yaml"], files={"c.yaml": "lr: 0.1\ntrain:\n  seed: 2\n"})
    rep = report_of(str(a), str(b))
    assert rep["differences"] == [{"section": "seed", "name": "c.yaml:train.seed", "a": 1, "b": 2,
                                   "variable": "seed"}]
    assert rep["seed_only"] is True


def test_a_changed_variable_is_measured_against_both_seed_groups(tmp_path: Path) -> None:
    runs = seed_runs(tmp_path, b_loss=1.02)
    rep = report_of(str(runs["ra"]), str(runs["rx"]))
    assert rep["variables"] == ["--lr", "seed"]
    (row,) = rep["metrics"]
    assert [g["of"] for g in row["spread"]["groups"]] == ["A"]  # rx has no seed siblings
    assert row["spread"]["inside"] is False


# ---- metrics --------------------------------------------------------------------------------------


def test_torn_and_missing_metrics_do_not_crash(tmp_path: Path) -> None:
    a = make_run(tmp_path, "ra", TRAIN)
    b = make_run(tmp_path, "rb", TRAIN, metrics=losses([2.1, 1.6, 1.3]))
    with open(b / "metrics.jsonl", "a") as f:
        f.write('not json\n{"epoch": 1, "loss": 0.1}\n[1, 2]\n{"step": 40, "lo')
    rep = report_of(str(a), str(b))
    (row,) = rep["metrics"]
    assert (row["step"], row["a"], row["b"]) == (30, 1.2, 1.3)
    assert rep["warnings"][-1] == "rb: 4 of 7 metrics lines skipped (torn or not JSON)"
    (a / "metrics.jsonl").unlink()
    rep = report_of(str(a), str(b))
    assert rep["metrics"] == [] and "ra has no metrics.jsonl" in rep["warnings"]


def test_metric_and_step_options(tmp_path: Path) -> None:
    rows_a = [{"step": s, "loss": 1.0 / s, "acc": 0.1 * s, "time": 1e9 + s} for s in (1, 2, 3)]
    rows_b = [{"step": s, "loss": 2.0 / s, "acc": float("nan") if s == 3 else 0.2 * s} for s in (1, 2, 3)]
    a = make_run(tmp_path, "ra", TRAIN, metrics=rows_a)
    b = make_run(tmp_path, "rb", TRAIN, metrics=rows_b)
    rep = report_of(str(a), str(b))
    # time is no metric
    assert [(r["metric"], r["step"]) for r in rep["metrics"]] == [("acc", 3), ("loss", 3)]
    assert rep["metrics"][0]["b"] == "nan" and rep["metrics"][0]["diff"] is None
    rep = report_of(str(a), str(b), "--metric", "loss", "--step", "2")
    assert [(r["metric"], r["step"], r["a"], r["b"]) for r in rep["metrics"]] == [("loss", 2, 0.5, 1.0)]
    rep = report_of(str(a), str(b), "--metric", "bleu")
    assert rep["metrics"] == [] and any("'bleu' is not in both" in w for w in rep["warnings"])


def test_parse_metrics_drops_the_cut_first_line_of_a_tail() -> None:
    m = parse_metrics(b'ep": 1}\n{"step": 5, "loss": 0.5}\n{"step": 5.0, "loss": 0.4}\n', truncated=True)
    assert m.rows == {"loss": {5: 0.4}} and m.skipped == 0 and m.truncated


# ---- where runs come from -----------------------------------------------------------------------


def test_store_runs_on_host_local_with_a_store_seed_group(tmp_path: Path) -> None:
    runs = seed_runs(tmp_path / "box", b_loss=1.02)
    with Store.open() as s:
        for name, path in runs.items():
            s.upsert_run(f"run-{name}", host="", target="local", run_dir=str(path))
    rep = report_of("run-ra", "run-rb")
    assert rep["a"]["where"] == str(runs["ra"].resolve()) and rep["variables"] == ["seed"]
    assert rep["metrics"][0]["spread"]["groups"][0]["runs"] == 3


def test_a_store_run_without_a_run_directory_cannot_be_read(tmp_path: Path) -> None:
    a = make_run(tmp_path, "ra", TRAIN)
    with Store.open() as s:
        s.upsert_run("seen-only", host="box")
    res = rgt(str(a), "seen-only")
    assert res.exit_code == 1
    assert res.stderr.startswith("error: run seen-only was not launched through rgt")


def test_a_box_run_is_read_through_its_shell(tmp_path: Path) -> None:
    """The remote reader, over host local's shell: the same facts as reading the directory."""
    run_dir = make_run(tmp_path / "it's here", "ra", [*TRAIN, "c.toml"], files={"c.toml": "x = 1\n"})
    (run_dir / "rgt" / "preflight.json").write_text('{"gpu": {"available": false}}')
    remote = load_remote(LocalShell(), "box1", str(run_dir))
    local = load_dir(run_dir)
    assert remote.where == f"box1:{run_dir}"
    assert remote.run == local.run and remote.fingerprint == local.fingerprint
    assert remote.preflight == local.preflight == {"gpu": {"available": False}}
    assert remote.metrics().rows == local.metrics().rows == {"loss": {10: 2.0, 20: 1.5, 30: 1.2, 40: 1.0}}
    (run_dir / "rgt" / "fingerprint.json").unlink()
    shutil.move(str(run_dir / "metrics.jsonl"), str(tmp_path / "elsewhere.jsonl"))
    remote = load_remote(LocalShell(), "box1", str(run_dir))
    assert remote.fingerprint is None and remote.metrics().missing


def test_store_runs_on_a_box_are_read_over_ssh(sshbox: SshBox, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The runs and their seed group live on the box (a real sshd); nothing there is written."""
    monkeypatch.setenv("RGT_SSH_CONFIG", str(sshbox.config_file))
    runs = seed_runs(sshbox.home / "runs", b_loss=1.5)
    before = sorted((p, p.stat().st_mtime_ns) for p in (sshbox.home / "runs").rglob("*"))
    with Store.open() as s:
        s.add_host("gpu1", ssh=sshbox.alias)
        for name, path in runs.items():
            s.upsert_run(f"run-{name}", host="", target="gpu1", run_dir=str(path))
    rep = report_of("run-ra", "run-rb")
    assert rep["b"]["where"] == f"gpu1:{runs['rb']}" and rep["variables"] == ["seed"]
    (row,) = rep["metrics"]
    assert (row["a"], row["b"]) == (1.0, 1.5) and row["spread"]["groups"][0]["runs"] == 3
    assert row["spread"]["inside"] is False
    assert sorted((p, p.stat().st_mtime_ns) for p in (sshbox.home / "runs").rglob("*")) == before


@pytest.mark.parametrize("args", [["{dir}", "no/such/run"], ["{dir}", "{empty}"], ["{dir}", "no-such-run"]])
def test_a_run_that_cannot_be_read_exits_1(tmp_path: Path, args: List[str]) -> None:
    a = make_run(tmp_path, "ra", TRAIN)
    (tmp_path / "empty").mkdir()
    res = rgt(*(x.format(dir=a, empty=tmp_path / "empty") for x in args))
    assert res.exit_code == 1 and res.stderr.startswith("error: ")


@pytest.mark.parametrize("args", [[], ["one"], ["a", "b", "--step", "-1"], ["a", "b", "--bogus"]])
def test_usage_errors_exit_2(args: List[str]) -> None:
    assert rgt(*args).exit_code == 2


# ---- the pieces ---------------------------------------------------------------------------------


def test_command_items() -> None:
    argv = ["python", "-u", "train.py", "--lr", "0.1", "--amp", "--out=runs/r7", "data.n=5", "--tag", "x",
            "--tag", "y", "--", "--not-an-option"]
    assert command_items(argv, "r7") == {
        "program": "python", "-u": True, "#0": "train.py", "--lr": "0.1", "--amp": True,
        "--out": "runs/<run>", "data.n": "5", "--tag": ["x", "y"], "#1": "--not-an-option"}


def test_read_flat_yaml() -> None:
    text = ("---\nname: 'base run'   # quoted\nmodel:\n  depth: 4\n  heads: null\n  act: gelu\n"
            "optim:\n  lr: 1.0e-3\n  betas:\n    - 0.9\n    - 0.95\ntags:\n- a\n- b\nurl: http://x#frag\n")
    assert read_flat_yaml(text) == {"name": "base run", "model.depth": 4, "model.heads": None,
                                    "model.act": "gelu", "optim.lr": 0.001, "optim.betas": [0.9, 0.95],
                                    "tags": ["a", "b"], "url": "http://x#frag"}


def test_compare_is_callable_without_the_cli(tmp_path: Path) -> None:
    a = make_run(tmp_path, "ra", [*TRAIN, "--lr", "0.1"])
    b = make_run(tmp_path, "rb", [*TRAIN, "--lr", "0.1"])
    rep = compare(load_dir(a), load_dir(b))
    assert rep["variables"] == [] and rep["metrics"][0]["diff"] == 0.0
