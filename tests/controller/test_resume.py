"""controller.resume.plan, `rgt resume` and the history in `rgt status`, against a real store and real files.

The new box is host `local` (this machine, no ssh), so the plan's questions to the box (where runs
live, whether the cwd and a durable copy exist) run for real; the push is tested through LocalShell
and through the test sshd (tests.sshbox). The whole path over ssh is tests/e2e/test_resume_e2e.py.
"""
from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pytest
from click.testing import CliRunner, Result

from controller.box.ssh import LocalShell
from controller.cli import main as cli
from controller.resume import plan as resume
from controller.resume.plan import Checkpoint, Finder, Options, ResumeError
from controller.runs import status
from controller.store.db import Store
from protocol import Event
from tests.sshbox import SshBox, sshbox

__all__ = ["sshbox"]

RUN = "20240601T000000Z-aaaaaa"
COMMAND = ["python", "train.py", "--lr", "3e-4"]


def payload(step: int) -> bytes:
    return f"weights at step {step:06d}\n".encode()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Old:
    """The run to resume: its events in the store, and (optionally) a pull of it on disk."""

    def __init__(self, tmp: Path, store: Store, steps: Sequence[int] = (20, 40, 60)) -> None:
        self.tmp, self.store = tmp, store
        self.cwd = tmp / "work"
        self.cwd.mkdir(exist_ok=True)
        self.pulled = tmp / "pulled" / RUN
        self.doc: Dict[str, Any] = {"id": RUN, "project": "p", "command": COMMAND, "cwd": str(self.cwd),
                                    "watch": {"scalars": ["loss", "acc"], "stall_floor_s": 60}}
        store.upsert_run(RUN, host="box1", target="gone", run_dir="/box/runs/p/active/" + RUN)
        # What the laptop recorded at launch: the command resume runs (the box's run.json is a claim).
        self.launch: Dict[str, Any] = {"command": COMMAND, "cwd": str(self.cwd), "python": None, "code": None,
                                       "profile": None, "onbox_args": [], "host": "gone"}
        store.record_launch(RUN, self.launch)
        self.events: List[Event] = []
        for step in steps:
            self.event("ckpt.saved", path=f"checkpoints/step{step:06d}.pt", size=len(payload(step)),
                       sha256=sha(payload(step)), step=step)

    def event(self, kind: str, run: str = RUN, **data: Any) -> None:
        seq = len(self.events) + 1
        self.events.append(Event(run=run, host="box1", seq=seq, ts=1.7e9 + seq, kind=kind, sev="info",
                                 data=data))
        self.store.apply(run, self.events[-1:], seq)

    def pull(self, steps: Sequence[int], bad: Sequence[int] = (),
             doc: Optional[Dict[str, Any]] = None) -> Path:
        self.pulled.mkdir(parents=True, exist_ok=True)
        for step in [*steps, *bad]:
            path = self.pulled / "checkpoints" / f"step{step:06d}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            data = payload(step)
            path.write_bytes(data if step not in bad else bytes(len(data)))  # same size, other bytes
        (self.pulled / "run.json").write_text(json.dumps(self.doc if doc is None else doc))
        self.store.add_local_event(RUN, "pull.done", "info", {"dest": str(self.pulled)})
        return self.pulled


@pytest.fixture
def store(home: Path) -> Any:
    with Store.open() as s:
        yield s


@pytest.fixture
def old(tmp_path: Path, store: Store) -> Old:
    return Old(tmp_path, store)


def plan(store: Store, **kw: Any) -> resume.Plan:
    return resume.make_plan(store, RUN, "local", Options(**kw))


def run_cli(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


# ---- which checkpoint -------------------------------------------------------------------------------


def test_the_newest_hashed_and_present_one_wins_and_a_copy_with_other_bytes_is_skipped(
        old: Old, store: Store, home: Path) -> None:
    pulled = old.pull([20, 40], bad=[60])
    p = plan(store)
    assert (p.checkpoint.step, p.checkpoint.sha256, p.source) == (40, sha(payload(40)), "local")
    assert p.local_path == str(pulled / "checkpoints" / "step000040.pt") and p.push_bytes == len(payload(40))
    assert p.root == str(home.parent / "user" / "rgt-runs") and p.project == "p" and p.cwd == str(old.cwd)
    assert p.resume_from == f"{p.root}/p/active/{p.run_id}/checkpoints/step000040.pt"
    assert p.command == COMMAND and any("step000060.pt" in n and "not the" in n for n in p.notes)
    # The old run's watch settings go with it; a flag the user gives wins.
    assert p.onbox_args == ["--watch-scalar=loss", "--watch-scalar=acc", "--stall-floor=60"]
    assert plan(store, onbox_args=["--stall-floor=5"]).onbox_args == [
        "--watch-scalar=loss", "--watch-scalar=acc", "--stall-floor=5"]


def test_a_checkpoint_verify_found_nonfinite_is_never_picked_without_allow_nonfinite(
        old: Old, store: Store) -> None:
    old.pull([20, 40, 60])
    store.add_local_event(RUN, "verify.done", "warn", {
        "dest": str(old.pulled), "ok": False,
        "nonfinite": [{"path": "checkpoints/step000060.pt", "unit": "checkpoints/step000060.pt",
                       "step": 60}]})
    p = plan(store)
    assert p.checkpoint.step == 40
    assert any("skipped checkpoints/step000060.pt" in n and "--allow-nonfinite" in n for n in p.notes)
    assert plan(store, allow_nonfinite=True).checkpoint.step == 60
    text = status.render(status.summarize(store, RUN))
    assert "NON-FINITE: checkpoints/step000060.pt (step 60) holds NaN/Inf weights" in text


def test_a_nonfinite_unit_outside_the_run_dir_is_matched_by_its_pull_path(store: Store) -> None:
    # HF's default output_dir lies outside the run dir: custody records an absolute path, and verify
    # names the unit by where it lies in the pull (rgt/external/...).
    store.add_local_event(RUN, "verify.done", "warn", {
        "ok": False, "nonfinite": [{"path": "rgt/external/out-1a2b3c4d/checkpoint-60/model.safetensors",
                                    "unit": "rgt/external/out-1a2b3c4d/checkpoint-60", "step": 60}]})
    bad = Checkpoint(rel="/work/out/checkpoint-60", sha256="a" * 64, size=1, step=60, ts=2.0, kind="dir",
                     pull_path="rgt/external/out-1a2b3c4d/checkpoint-60")
    good = Checkpoint(rel="/work/out/checkpoint-40", sha256="b" * 64, size=1, step=40, ts=1.0, kind="dir",
                      pull_path="rgt/external/out-1a2b3c4d/checkpoint-40")
    kept, notes = resume.without_nonfinite(store, RUN, [bad, good], allow=False)
    assert kept == [good] and any("checkpoint-60" in n for n in notes)
    assert resume.without_nonfinite(store, RUN, [bad, good], allow=True)[0] == [bad, good]


def test_a_durable_copy_the_new_box_sees_needs_no_push(old: Old, store: Store, tmp_path: Path) -> None:
    durable = tmp_path / "vol"
    old.pull([40], doc={**old.doc, "durable_dir": str(durable)})
    copy = durable / "checkpoints" / "step000060.pt"
    copy.parent.mkdir(parents=True)
    copy.write_bytes(payload(60))
    old.event("ckpt.durable", path="checkpoints/step000060.pt", durable_path=str(copy),
              sha256=sha(payload(60)))
    p = plan(store)
    assert (p.checkpoint.step, p.source, p.resume_from, p.push_bytes, p.local_path) == (
        60, "durable", str(copy), 0, None)
    copy.write_bytes(payload(60) + b"more")  # the new box sees a file of another size: not that one
    assert (plan(store).checkpoint.step, plan(store).source) == (40, "local")


def test_a_durable_path_outside_the_named_durable_dirs_is_not_taken(old: Old, store: Store,
                                                                    tmp_path: Path) -> None:
    old.pull([40])
    copy = tmp_path / "elsewhere" / "step000060.pt"
    copy.parent.mkdir()
    copy.write_bytes(payload(60))
    old.event("ckpt.durable", path="checkpoints/step000060.pt", durable_path=str(copy),
              sha256=sha(payload(60)))
    assert plan(store).checkpoint.step == 40


def test_a_pulled_custody_manifest_counts_without_events(tmp_path: Path, store: Store) -> None:
    old = Old(tmp_path, store, steps=())
    pulled = old.pull([20, 40])
    lines = [{"v": 1, "path": f"checkpoints/step{s:06d}.pt", "size": len(payload(s)),
              "sha256": sha(payload(s)), "mtime_ns": 1, "inode": 2, "step": s, "format": "unknown",
              "ts": 1.7e9 + s} for s in (20, 40)]
    (pulled / "rgt").mkdir()
    (pulled / "rgt" / "manifest.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + "{torn")
    found = resume.custody(store, RUN, [pulled])
    assert [(c.rel, c.step) for c in found] == [("checkpoints/step000040.pt", 40),
                                                ("checkpoints/step000020.pt", 20)]
    assert plan(store).checkpoint.step == 40


def test_choose_prefers_newer_over_present_and_names_a_chosen_one() -> None:
    cks = [Checkpoint(f"checkpoints/s{s}.pt", sha(payload(s)), len(payload(s)), s, float(s))
           for s in (60, 40)]
    finder = Finder([], [], lambda path, size: False)
    with pytest.raises(ResumeError) as e:
        resume.choose(cks, finder, RUN)
    assert e.value.hint == f"rgt pull {RUN} first, then rgt resume again"
    with pytest.raises(ResumeError) as e:
        resume.choose(cks, finder, RUN, "s99.pt")
    assert "no such checkpoint" in e.value.message and "checkpoints/s60.pt" in str(e.value.hint)


def test_a_checkpoint_named_by_path_or_given_as_a_local_file(old: Old, store: Store, tmp_path: Path) -> None:
    old.pull([20, 40, 60])
    assert plan(store, checkpoint="step000020.pt").checkpoint.step == 20
    assert plan(store, checkpoint="checkpoints/step000040.pt").checkpoint.step == 40
    mine = tmp_path / "copy.pt"
    mine.write_bytes(payload(20))
    p = plan(store, checkpoint=str(mine))
    assert (p.checkpoint.step, p.local_path) == (20, str(mine))
    mine.write_bytes(b"something else")
    with pytest.raises(ResumeError, match="no checkpoint custody hashed"):
        plan(store, checkpoint=str(mine))


# ---- refusals ---------------------------------------------------------------------------------------


def test_without_a_local_copy_or_a_durable_one_the_hint_is_to_pull(tmp_path: Path, store: Store) -> None:
    Old(tmp_path, store)
    store.upsert_run(RUN, host="box1", meta={"command": COMMAND, "cwd": str(tmp_path / "work")})
    out = run_cli("resume", RUN, "--on", "local")
    assert out.exit_code == 1
    assert "error: none of the 3 checkpoints" in out.output and f"hint: rgt pull {RUN} first" in out.output


@pytest.mark.parametrize("launch, says, hint", [
    # The laptop's launch record decides (the box's run.json does not: tests/controller/test_resume_trust.py).
    ({"command": None}, "the laptop has no record of the command",
     f"rgt resume {RUN} --on local --cwd DIR --"),
    ({"cwd": "/nowhere/at/all"}, "does not exist on local", "--code DIR"),
])
def test_a_command_that_cannot_run_again_is_refused(old: Old, store: Store, launch: Dict[str, Any], says: str,
                                                    hint: str) -> None:
    old.pull([40])
    store.record_launch(RUN, {**old.launch, **launch})
    with pytest.raises(ResumeError) as e:
        plan(store)
    assert says in e.value.message and hint in str(e.value.hint)


def test_no_checkpoint_at_all_and_a_taken_run_id_are_refused(tmp_path: Path, store: Store) -> None:
    old = Old(tmp_path, store, steps=())
    old.pull([])
    with pytest.raises(ResumeError, match="nothing to resume from"):
        plan(store)
    with pytest.raises(ResumeError, match="exists already"):
        plan(store, run_id=RUN)
    with pytest.raises(ResumeError, match="is not a run id"):
        plan(store, run_id="../x")


# ---- the plan, the launch line, the CLI ------------------------------------------------------------


def test_dry_run_prints_the_plan_and_does_nothing(old: Old, store: Store) -> None:
    old.pull([40])
    out = run_cli("resume", RUN, "--on", "local", "--dry-run", "--json", "--run-id", "next-1")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output.strip().splitlines()[-1])
    assert doc["dry_run"] is True and doc["plan"]["run_id"] == "next-1"
    assert (doc["plan"]["checkpoint"]["step"], doc["plan"]["push_bytes"]) == (40, len(payload(40)))
    assert doc["plan"]["command_line"] == shlex.join(COMMAND)
    assert not Path(doc["plan"]["run_dir"]).exists() and "next-1" not in {r["run"] for r in store.runs()}
    text = run_cli("resume", RUN, "--on", "local", "--dry-run")
    assert "would resume" in text.output and "step 40" in text.output


def test_the_launch_line_runs_the_same_command_in_its_cwd_with_the_resume_flags(old: Old, store: Store,
                                                                                  home: Path) -> None:
    old.pull([40])
    (home.parent / "user" / "my code").mkdir(parents=True)  # HOME is tmp_path/user here
    p = plan(store, run_id="next-2", cwd="~/my code", onbox_args=["--no-preflight"])
    line = resume.launch_line(p, "rgt-onbox", {"profile": "local"})
    assert line.startswith("cd -- \"$HOME\"/'my code' && rgt-onbox launch --json --run-id next-2 --project p")
    words = shlex.split(line.split(" && ", 1)[1])
    at = words.index("--resume-from")
    assert words[at:at + 8] == ["--resume-from", p.resume_from, "--resume-sha256", sha(payload(40)),
                                "--resume-step", "40", "--resumes", RUN]
    assert "--no-preflight" in words and words[words.index("--") + 1:] == COMMAND
    assert words[words.index("--deadman") + 1] == "off"


def test_code_excludes_leave_out_pulled_runs_under_the_code_dir(old: Old, store: Store,
                                                                 tmp_path: Path) -> None:
    old.pull([40])
    assert resume.code_excludes(store, tmp_path) == [".git", "__pycache__", f"/pulled/{RUN}",
                                                      f"/pulled/{RUN}.partial"]
    assert resume.code_excludes(store, old.cwd) == [".git", "__pycache__"]


# ---- the push ----------------------------------------------------------------------------------------


def tree(root: Path) -> List[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def code_dir(tmp: Path) -> Path:
    code = tmp / "code"
    for rel in ("train.py", "pkg/model.py", ".git/HEAD", "pkg/__pycache__/m.pyc", "runs/r1/ck.pt",
                "x/runs/r1/k"):
        (code / rel).parent.mkdir(parents=True, exist_ok=True)
        (code / rel).write_text(rel)
    return code


def test_local_push_renames_a_file_into_place_and_copies_a_tree_without_the_excluded(tmp_path: Path) -> None:
    shell = LocalShell()
    src = tmp_path / "ck.pt"
    src.write_bytes(payload(1))
    dest = shell.push(src, str(tmp_path / "there" / "checkpoints" / "step1.pt"))
    assert Path(dest).read_bytes() == payload(1) and tree(tmp_path / "there") == ["checkpoints/step1.pt"]
    shell.push(code_dir(tmp_path), str(tmp_path / "cwd"), excludes=[".git", "__pycache__", "/runs/r1"])
    assert tree(tmp_path / "cwd") == ["pkg/model.py", "train.py", "x/runs/r1/k"]


def test_ssh_push_goes_over_rsync_to_the_exact_path(sshbox: SshBox, tmp_path: Path) -> None:
    ssh = sshbox.ssh(tmp_path / "ctl")
    ssh.start_master()
    src = tmp_path / "ck.pt"
    src.write_bytes(payload(7))
    dest = ssh.push(src, "~/runs/p/active/r/checkpoints/step7.pt")
    assert dest == str(sshbox.home / "runs/p/active/r/checkpoints/step7.pt")
    assert Path(dest).read_bytes() == payload(7)
    where = ssh.push(code_dir(tmp_path), "~/code dir", excludes=[".git", "__pycache__", "/runs/r1"])
    assert where == str(sshbox.home / "code dir")
    assert tree(sshbox.home / "code dir") == ["pkg/model.py", "train.py", "x/runs/r1/k"]


# ---- one history in `rgt status` -------------------------------------------------------------------


def progress(seq: int, run: str, step: int) -> Event:
    return Event(run=run, host="b", seq=seq, ts=1.7e9 + seq, kind="train.progress", sev="info",
                 data={"step": step, "scalars": {"loss": 1.0}})


def test_status_shows_one_history_from_either_end(store: Store) -> None:
    store.upsert_run("a", host="b1", target="h1")
    store.apply("a", [progress(1, "a", 10), progress(2, "a", 40),
                      Event(run="a", host="b1", seq=3, ts=1.7e9 + 3, kind="job.exited", sev="warn",
                            data={"code": None, "signal": 15, "preempted": True})], 3)
    store.upsert_run("b", host="b2", target="h2")
    store.set_lineage("b", resumed_from="a")
    store.apply("b", [progress(1, "b", 45), progress(2, "b", 80)], 2)
    store.upsert_run("alone", host="b3")
    hist = status.summarize(store, "b")["history"]
    rows = [(h["run"], h["host"], h["state"], h["first_step"], h["last_step"], h["current"]) for h in hist]
    assert rows == [("a", "h1", "preempted", 10, 40, False), ("b", "h2", "running", 45, 80, True)]
    assert [h["run"] for h in status.summarize(store, "a")["history"]] == ["a", "b"]
    assert status.summarize(store, "alone")["history"] == []
    text = status.render(status.summarize(store, "b"))
    assert "history   a (h1, preempted, step 40) -> b (h2, running, step 80) *" in text
    assert "history" not in status.render(status.summarize(store, "alone"))


def test_runs_marks_a_resumed_run(store: Store) -> None:
    from click.testing import CliRunner

    from controller.cli import runs as cli_runs

    store.upsert_run("a", host="b1", target="h1")
    store.upsert_run("b", host="b2", target="h2")
    store.set_lineage("b", resumed_from="a")
    store.close()  # the command opens the store itself
    out = CliRunner().invoke(cli_runs.runs_command, ["--json"], catch_exceptions=False).output
    rows = {r["run"]: r["resumed_from"] for r in json.loads(out)["runs"]}
    assert rows == {"a": None, "b": "a"}
    text = CliRunner().invoke(cli_runs.runs_command, [], catch_exceptions=False).output
    assert "b (<- a)" in text
