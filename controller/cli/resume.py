"""`rgt resume RUN --on HOST`: continue a run (preempted, or its box gone) on another box.

A thin command over controller.resume.plan: plan, print the plan (and stop there with --dry-run), ask
(the command, its cwd and its Python run on HOST with HOST's secrets: `--yes` answers for scripts,
and without a terminal or with --json nothing runs without it), push and launch, start the watcher
as `rgt launch` does.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import click

from controller import render
from controller.box.ssh import SshError
from controller.cli.base import JSON_OPTION, RUN_ARGUMENT, CliError, RgtCommand, emit_json
from controller.render import number, size
from controller.resume import plan as resume
from controller.store.db import Store


def _plan_rows(plan: resume.Plan) -> List[Tuple[str, str]]:
    ck = plan.checkpoint
    where = (f"durable copy {plan.resume_from} (seen on {plan.host}; nothing to push)"
             if plan.source == "durable" else f"{plan.local_path} -> {plan.resume_from}")
    code = f" + code {plan.code} -> {plan.code_to or plan.cwd}" if plan.code else ""
    rows = [("checkpoint", f"{ck.rel}  step {number(ck.step)}  {size(ck.size)}  sha256 {ck.sha256[:12]}"),
            ("from", where), ("push", size(plan.push_bytes) + code),
            ("new run", f"{plan.run_id} in {plan.run_dir}"), ("cwd", plan.cwd),
            ("python", plan.python or f"{plan.host}'s own (the profile's, else python3 on PATH)"),
            ("command", f"{shlex.join(plan.command)}  ({SOURCES.get(plan.command_source, '?')})")]
    if plan.onbox_args:
        rows.append(("launch", " ".join(plan.onbox_args)))
    return rows


SOURCES = {"launch": "as recorded on this laptop at launch", "given": "as given after --"}


def _print_plan(plan: resume.Plan, dry_run: bool) -> None:
    head = "would resume" if dry_run else "will resume"
    click.echo(render.printable(f"{head} {plan.run} on {plan.host}"))
    for name, value in _plan_rows(plan):
        click.echo(render.printable(f"  {name:<10} {value}"))
    for note in plan.notes:
        word = "warning" if note.startswith("the box says") else "note"
        click.echo(render.printable(f"{word}: {note}"), err=True)


def can_ask() -> bool:
    """A person is there to answer the prompt (stdin is a terminal)."""
    return sys.stdin.isatty()


def _refuse_unasked(run: str, host: str, as_json: bool) -> None:
    """Without --yes, --json and a missing terminal refuse before anything runs (never a hang)."""
    hint = f"check the plan with `rgt resume {run} --on {host} --dry-run`, then add --yes"
    if as_json:
        raise CliError(f"rgt resume --json needs --yes: it runs a command on {host} (with {host}'s secrets) "
                       "and cannot ask first; nothing was pushed or started", hint=hint)
    if not can_ask():
        raise CliError(f"no terminal to ask on: rgt resume runs a command on {host} (with {host}'s secrets) "
                       "only when confirmed or given --yes; nothing was pushed or started", hint=hint)


def _confirm(plan: resume.Plan) -> None:
    try:
        ok = click.confirm(render.printable(f"run this command on {plan.host}?"), default=False, err=True)
    except click.Abort:
        ok = False
    if not ok:
        raise CliError("not confirmed: nothing was pushed or started",
                       hint="--cwd DIR and a command after -- change what runs")


@click.command("resume", cls=RgtCommand)
@RUN_ARGUMENT
@click.option("--on", "host", required=True, metavar="HOST",
              help="The box to continue on (a name from `rgt hosts`).")
@click.option("--checkpoint", default=None, metavar="PATH",
              help="Resume from this one: a local file, or a checkpoint's path or name in the run "
                   "(default: the newest one custody hashed that is here or durable).")
@click.option("--run-id", default=None, metavar="ID", help="The new run's id (default: UTC time + random).")
@click.option("--root", default=None, metavar="DIR", help="Where runs live on HOST (default: the host's).")
@click.option("--cwd", default=None, metavar="DIR",
              help="Where the command runs on HOST (default: where the launch ran it, as this laptop "
                   "recorded; never the old box's claim).")
@click.option("--code", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              metavar="DIR", help="Push this directory's contents to that working directory first.")
@click.option("--onbox-arg", "onbox_args", multiple=True, metavar="ARG",
              help="Extra `rgt-onbox launch` argument, repeatable (--onbox-arg=--env=WANDB_API_KEY).")
@click.option("--allow-nonfinite", is_flag=True,
              help="May resume from a checkpoint `rgt verify` found NaN/Inf weights in (skipped by default).")
@click.option("--no-watch", is_flag=True, help="Do not start the background watcher.")
@click.option("--dry-run", is_flag=True,
              help="Print the plan (checkpoint, bytes to push, command) and stop; HOST is asked where "
                   "runs live, nothing changes there.")
@click.option("--yes", is_flag=True, help="Run it without asking (for scripts; needed with --json).")
@JSON_OPTION
@click.argument("command", nargs=-1, metavar="[-- COMMAND...]")
def resume_command(run: str, host: str, checkpoint: Optional[str], run_id: Optional[str], root: Optional[str],
                   cwd: Optional[str], code: Optional[Path], onbox_args: Sequence[str], allow_nonfinite: bool,
                   no_watch: bool, dry_run: bool, yes: bool, as_json: bool, command: Sequence[str]) -> None:
    """Continue RUN on HOST from its newest checkpoint that custody hashed.

    \b
      rgt pull RUN                       bring its checkpoints home first (unless they are durable)
      rgt resume RUN --on gpu2 --dry-run
      rgt resume RUN --on gpu2           push the checkpoint, run the launch's command there
      rgt resume RUN --on gpu2 --cwd DIR -- python train.py ...   run this command instead
    What runs is the command this laptop recorded at launch, or the one given after --; never
    the one the old box reports. rgt shows it and asks first (--yes: without asking).
    The new run gets RGT_RESUME_FROM; a job that starts from step 0 anyway is reported
    (train.restarted_from_zero). `rgt status NEW` shows both runs as one history.
    """
    opts = resume.Options(checkpoint=checkpoint, run_id=run_id, root=root, cwd=cwd, code=code,
                          onbox_args=list(onbox_args), allow_nonfinite=allow_nonfinite, command=list(command))
    if as_json and not dry_run and not yes:
        _refuse_unasked(run, host, as_json)
    with Store.open() as store:
        try:
            plan = resume.make_plan(store, run, host, opts)
            if dry_run:
                _done(plan, None, as_json)
                return
            if not as_json:
                _print_plan(plan, False)
            if not yes:
                _refuse_unasked(plan.run, host, as_json)
                _confirm(plan)
            answer = resume.execute(store, plan)
        except (resume.ResumeError, SshError) as e:
            raise CliError(e.message, e.hint) from e
        if not no_watch:
            from controller.follow.client import follow

            answer["watcher_pid"] = answer["daemon_pid"] = follow(store, str(answer["run_id"]),
                                                                 launched=True)
    _done(plan, answer, as_json)


def _done(plan: resume.Plan, answer: Optional[Dict[str, Any]], as_json: bool) -> None:
    if as_json:
        emit_json({"dry_run": True, "plan": plan.to_dict()} if answer is None
                  else {**answer, "dry_run": False, "plan": plan.to_dict()})
        return
    if answer is None:
        _print_plan(plan, True)
        return
    click.echo(render.printable(f"resumed {plan.run} as {answer['run_id']} on {plan.host} from step "
                                f"{number(plan.checkpoint.step)} ({answer['run_dir']})"))
    click.echo(f"next: rgt watch {answer['run_id']} --timeout 6h   (exits when something needs you)",
               err=True)
