"""`rgt resume` runs only what the laptop knows, never the command the old box reports.

The old box's run.json (in a pull, in its hello, or read from the box) may be rewritten by whoever
holds that box; the new box runs the resumed command with its own secrets. These tests rewrite
that record into a command that copies HF_TOKEN, and check that the laptop's command is the one
that runs, that the difference is shown (escaped), that nothing runs unasked, and that a run
with no laptop record needs its command given.

The new box is host `local` with a stand-in rgt-onbox (a real executable): it answers --version,
records what it was asked to launch, runs that command in its working directory as the real
launcher would start it, and answers like `rgt-onbox launch --json`.
"""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
from click.testing import CliRunner, Result
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.cli import main as cli
from controller.cli import resume as cli_resume
from controller.resume import command as resume_command
from controller.resume import plan as resume
from controller.resume.plan import Options, ResumeError
from controller.store.db import Store
from onbox.launch.redact import redact_argv
from protocol import PACKAGE_VERSION
from tests.controller.test_resume import RUN, Old, store

__all__ = ["store"]

LAPTOP = [sys.executable, "-c", "open('ran.txt', 'w').write('the laptop command')"]
EVIL = [sys.executable, "-c", "import os; open('stolen.txt', 'w').write(os.environ.get('HF_TOKEN', 'none'))"]
TOKEN = "hf_not_a_real_token_0123456789"

FAKE_ONBOX = '''import json, os, subprocess, sys
from pathlib import Path

here = Path({here!r})
args = sys.argv[1:]
if args == ["--version"]:
    print("rgt-onbox, version {version}")
    sys.exit(0)
cut = args.index("--")
opts, command = args[:cut], args[cut + 1:]
with open(here / "asked.jsonl", "a") as f:
    f.write(json.dumps({{"opts": opts, "command": command, "cwd": os.getcwd()}}) + "\\n")
subprocess.run(command, check=False)
run_id = opts[opts.index("--run-id") + 1]
root, project = opts[opts.index("--root") + 1], opts[opts.index("--project") + 1]
answer = {{"run_id": run_id, "run_dir": root + "/" + project + "/active/" + run_id, "pid": os.getpid()}}
if (here / "answer.json").exists():
    answer.update(json.loads((here / "answer.json").read_text()))
print(json.dumps(answer))
'''


class Box:
    """The stand-in launcher of host `local`, and what it was asked."""

    def __init__(self, where: Path, store: Store) -> None:
        self.where = where
        where.mkdir(parents=True, exist_ok=True)
        self.script = where / "rgt-onbox"
        self.script.write_text(FAKE_ONBOX.format(here=str(where), version=PACKAGE_VERSION))
        # Run by this Python, by name (a #! line cannot hold a path with a space).
        store.add_host("local", ssh="", onbox=shlex.join([sys.executable, str(self.script)]))

    def asked(self) -> List[Dict[str, Any]]:
        path = self.where / "asked.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def old(tmp_path: Path, store: Store, monkeypatch: pytest.MonkeyPatch) -> Old:
    """The run to resume: launched from this laptop with LAPTOP, and its box's run.json rewritten
    to EVIL; HF_TOKEN is a secret of the new box's environment."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    found = Old(tmp_path, store)
    store.record_launch(RUN, {**found.launch, "command": LAPTOP})
    found.doc["command"] = EVIL
    return found


@pytest.fixture
def box(tmp_path: Path, store: Store) -> Box:
    return Box(tmp_path / "newbox", store)


def plan(store: Store, **kw: Any) -> resume.Plan:
    return resume.make_plan(store, RUN, "local", Options(**kw))


def run_cli(*args: str, stdin: str = "") -> Result:
    return CliRunner().invoke(cli.main, ["resume", RUN, "--on", "local", "--no-watch", *args], input=stdin,
                              catch_exceptions=False)


def nothing_ran(old: Old, box: Box) -> None:
    assert box.asked() == [] and not (old.cwd / "ran.txt").exists() and not (old.cwd / "stolen.txt").exists()


# ---- the plan: what runs -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["pull", "hello", "old box"])
def test_a_rewritten_box_record_is_shown_as_a_difference_and_the_laptop_command_is_planned(
        old: Old, store: Store, tmp_path: Path, where: str) -> None:
    old.pull([40], doc=old.doc if where == "pull" else {**old.doc, "command": LAPTOP})
    if where == "pull":
        pass
    elif where == "hello":
        (old.pulled / "run.json").unlink()
        store.upsert_run(RUN, host="box1", meta=old.doc)
    else:
        (old.pulled / "run.json").unlink()
        run_dir = tmp_path / "oldbox" / RUN
        run_dir.mkdir(parents=True)
        (run_dir / "run.json").write_text(json.dumps(old.doc))
        store.upsert_run(RUN, host="box1", target="local", run_dir=str(run_dir))
    p = plan(store)
    assert (p.command, p.command_source, p.box_command) == (LAPTOP, "launch", EVIL)
    assert p.notes[0] == (f"the box says the command was {shlex.join(EVIL)}; "
                          "rgt will run the one recorded at launch")
    assert p.to_dict()["command_line"] == shlex.join(LAPTOP)


def test_the_box_showing_the_laptop_command_redacted_is_no_difference(old: Old, store: Store) -> None:
    secret = ["python", "train.py", "--hf-token", TOKEN, f"--api_key={TOKEN}"]
    shown = redact_argv(secret)
    assert shown != secret and "***" in " ".join(shown)  # what the box's launcher writes in run.json
    store.record_launch(RUN, {**old.launch, "command": secret})
    old.pull([40], doc={**old.doc, "command": shown})
    p = plan(store)
    assert (p.command, p.box_command) == (secret, None)
    assert not any("the box says" in n for n in p.notes)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(box_command=st.one_of(st.none(), st.text(max_size=20), st.lists(st.text(max_size=12), max_size=5),
                             st.dictionaries(st.text(), st.text())),
       cwd=st.one_of(st.none(), st.text(max_size=20)))
def test_whatever_the_box_says_the_laptop_command_and_cwd_are_decided(box_command: Any, cwd: Any) -> None:
    info = {"run": RUN, "launch": {"command": LAPTOP, "cwd": "/work/here", "host": "gpu1"}}
    what = resume_command.decide(info, {"command": box_command, "cwd": cwd}, "gpu2")
    assert (what.command, what.cwd, what.source, what.in_root) == (LAPTOP, "/work/here", "launch", False)
    argv = isinstance(box_command, list) and bool(box_command)
    assert (what.box_command is not None) == (argv and not resume_command.same_command(box_command, LAPTOP))
    assert what.box_command is None or what.notes[0].startswith("the box says the command was")


def test_where_the_laptop_says_the_launch_ran(old: Old, store: Store, home: Path) -> None:
    old.pull([40])
    # `rgt launch gpu1 --code DIR --cwd sub`: the record names where the code went on gpu1.
    code_launch = {**old.launch, "cwd": "sub", "code": "/old/box/rgt-runs/myproj/code", "host": "gpu1"}
    store.record_launch(RUN, code_launch)
    root = home.parent / "user" / "rgt-runs"
    (root / "myproj" / "code" / "sub").mkdir(parents=True)
    p = plan(store, code=old.tmp)
    assert (p.cwd, p.code_to, p.project) == (f"{root}/myproj/code/sub", f"{root}/myproj/code", "myproj")
    with pytest.raises(ResumeError) as e:  # the code is not on the new box, and no --code
        store.record_launch(RUN, {**code_launch, "code": "/old/box/rgt-runs/other/code"})
        plan(store)
    assert e.value.message == f"the command's directory {root}/other/code/sub does not exist on local"
    assert e.value.hint == ("push the code there with --code DIR (the tree rgt launch --code synced), or run "
                            "elsewhere with --cwd DIR")
    info = {"run": RUN, "launch": {"command": LAPTOP, "cwd": None, "host": "gpu1"}}
    assert resume_command.decide(info, {"cwd": "/evil"}, "gpu2").cwd == "~"  # the login dir, as at launch
    with pytest.raises(ResumeError, match="names no working directory") as e:
        resume_command.decide({**info, "launch": {"command": LAPTOP, "host": "local"}}, {"cwd": "/evil"},
                              "gpu2")
    assert e.value.hint == "name it with --cwd DIR"


def test_box_watch_settings_are_carried_only_as_plain_values() -> None:
    doc = {"watch": {"scalars": ["loss", "a\nb", {"x": 1}, True], "log_regex": "step (\\d+)",
                     "stall_floor_s": 60, "stale_after_s": "x" * 5000}}
    assert resume_command.carried_args(doc, []) == ["--watch-scalar=loss", "--log-regex=step (\\d+)",
                                                    "--stall-floor=60"]


def test_a_pulled_checkpoint_that_is_a_symlink_out_of_the_pull_is_not_taken(old: Old, store: Store,
                                                                            tmp_path: Path) -> None:
    old.pull([])
    outside = tmp_path / "laptop-file.pt"
    outside.write_bytes(b"weights at step 000040\n")
    (old.pulled / "checkpoints").mkdir()
    (old.pulled / "checkpoints" / "step000040.pt").symlink_to(outside)
    with pytest.raises(ResumeError, match="none of the 3 checkpoints"):
        plan(store)


# ---- the CLI: shown, asked, run ------------------------------------------------------------------------


def test_with_yes_the_laptop_command_runs_and_the_box_command_does_not(old: Old, store: Store,
                                                                       box: Box) -> None:
    old.pull([40])
    out = run_cli("--yes", "--run-id", "next-1")
    assert out.exit_code == 0, out.output
    assert (old.cwd / "ran.txt").read_text() == "the laptop command" and not (old.cwd / "stolen.txt").exists()
    [asked] = box.asked()
    assert (asked["command"], asked["cwd"]) == (LAPTOP, str(old.cwd.resolve()))
    assert f"warning: the box says the command was {shlex.join(EVIL)}; rgt will run the one recorded at " \
           "launch" in out.output
    assert f"command    {shlex.join(LAPTOP)}  (as recorded on this laptop at launch)" in out.output
    new = store.run("next-1")
    launch = new["launch"]
    assert (new["resumed_from"], launch["command"], launch["cwd"]) == (RUN, LAPTOP, str(old.cwd))


def test_without_a_terminal_or_yes_nothing_runs(old: Old, store: Store, box: Box, home: Path) -> None:
    old.pull([40])
    out = run_cli("--run-id", "next-1")
    assert out.exit_code == 1
    assert ("error: no terminal to ask on: rgt resume runs a command on local (with local's secrets) "
            "only when confirmed or given --yes; nothing was pushed or started") in out.output
    assert f"hint: check the plan with `rgt resume {RUN} --on local --dry-run`, then add --yes" in out.output
    assert "will resume" in out.output and "warning: the box says" in out.output  # the plan was shown
    nothing_ran(old, box)
    assert not any((home.parent / "user" / "rgt-runs").glob("*/active/next-1"))  # nothing pushed either


def test_json_needs_yes_and_refuses_before_asking_the_box(old: Old, store: Store, box: Box) -> None:
    old.pull([40])
    out = run_cli("--json")
    assert out.exit_code == 1 and out.stdout == ""
    assert ("error: rgt resume --json needs --yes: it runs a command on local (with local's secrets) and "
            "cannot ask first; nothing was pushed or started") in out.output
    nothing_ran(old, box)
    answer = json.loads(run_cli("--json", "--yes").stdout.strip().splitlines()[-1])
    assert answer["plan"]["command"] == LAPTOP and answer["plan"]["box_command"] == EVIL
    assert (old.cwd / "ran.txt").exists() and not (old.cwd / "stolen.txt").exists()


@pytest.mark.parametrize("answer, ran", [("n\n", False), ("\n", False), ("", False), ("y\n", True)])
def test_on_a_terminal_it_asks_first(old: Old, store: Store, box: Box, monkeypatch: pytest.MonkeyPatch,
                                     answer: str, ran: bool) -> None:
    old.pull([40])
    monkeypatch.setattr(cli_resume, "can_ask", lambda: True)
    out = run_cli(stdin=answer)
    assert "run this command on local? [y/N]" in out.output
    assert out.exit_code == (0 if ran else 1), out.output
    if ran:
        assert [a["command"] for a in box.asked()] == [LAPTOP] and not (old.cwd / "stolen.txt").exists()
    else:
        assert "error: not confirmed: nothing was pushed or started" in out.output
        nothing_ran(old, box)


def test_a_run_without_a_laptop_record_needs_its_command_given(old: Old, store: Store, box: Box) -> None:
    old.pull([40])
    store.record_launch(RUN, {})  # launched before rgt kept the record, or tracked
    out = run_cli("--yes")
    assert out.exit_code == 1
    assert (f"error: the laptop has no record of the command {RUN} was launched with (a run launched "
            f"before rgt kept one, or one rgt did not launch); the box says it was {shlex.join(EVIL)}, which "
            "rgt does not run") in out.output
    hint = f"hint: give it after --: rgt resume {RUN} --on local --cwd DIR -- python train.py ..."
    assert hint in out.output
    out = run_cli("--yes", "--", *LAPTOP)
    assert out.exit_code == 1 and ("error: no working directory is known on the laptop for "
                                   f"{RUN} (the box says {old.cwd})") in out.output
    assert "hint: name it with --cwd DIR" in out.output
    nothing_ran(old, box)
    out = run_cli("--yes", "--cwd", str(old.cwd), "--", *LAPTOP)
    assert out.exit_code == 0, out.output
    assert [a["command"] for a in box.asked()] == [LAPTOP] and (old.cwd / "ran.txt").exists()
    assert "(as given after --)" in out.output and "rgt will run the one you gave" in out.output


def test_a_command_given_wins_over_the_laptop_record(old: Old, store: Store, box: Box) -> None:
    old.pull([40])
    mine = [sys.executable, "-c", "open('mine.txt', 'w').write('given')"]
    out = run_cli("--yes", "--", *mine)
    assert out.exit_code == 0, out.output
    assert [(a["command"], a["cwd"]) for a in box.asked()] == [(mine, str(old.cwd.resolve()))]
    assert (old.cwd / "mine.txt").exists() and not (old.cwd / "ran.txt").exists()
    assert f"note: at launch the command was {shlex.join(LAPTOP)}; rgt runs the one you gave" in out.output


def test_box_strings_are_escaped_when_shown(old: Old, store: Store, box: Box) -> None:
    old.pull([40], doc={**old.doc, "command": ["python", "\x1b]0;owned\x07\x1b[2Jtrain.py"]})
    out = run_cli("--dry-run")
    assert out.exit_code == 0 and "\x1b" not in out.output and "\\x1b]0;owned\\x07\\x1b[2J" in out.output
    store.record_launch(RUN, {})
    out = run_cli("--yes")
    assert out.exit_code == 1 and "\x1b" not in out.output and "\\x1b[2Jtrain.py" in out.output
    nothing_ran(old, box)


def test_a_launch_answer_for_another_run_is_refused_and_not_recorded(old: Old, store: Store,
                                                                     box: Box) -> None:
    old.pull([40])
    lie = {"run_id": "someone-else", "run_dir": "/x/someone-else"}
    (box.where / "answer.json").write_text(json.dumps(lie))
    out = run_cli("--yes", "--run-id", "next-1")
    assert out.exit_code == 1
    assert ("error: local's answer to the resumed launch is refused: the box's launch answered for run "
            "'someone-else', not the 'next-1' that was asked for") in out.output
    assert ("hint: the job may be running there untracked: look with `rgt-onbox ps` on local and stop "
            "it with `rgt-onbox stop next-1`") in out.output
    assert {r["run"] for r in store.runs()} == {RUN}
