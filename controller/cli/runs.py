"""`rgt hosts`, `rgt launch`, `rgt runs`, `rgt stop`: boxes and the runs on them.

The lead's wiring in controller/cli/main.py adds these commands to the `rgt` group.
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import click
from rgtlib.units import parse_size

from controller import render
from controller.box import jobs as boxes
from controller.box.handle import Box, host_record
from controller.box.jobs import LOCAL, BoxError
from controller.box.ssh import Ssh, SshError
from controller.cli.base import JSON_OPTION, RUN_ARGUMENT, CliError, RgtCommand, RgtGroup, emit_json
from controller.runs.status import run_state
from controller.store.db import Store

_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _notice(store: Store, profile: str) -> None:
    """The platform's surface-to-the-user facts, the first time rgt meets it (stderr)."""
    from controller.runs.notices import first_contact

    text = first_contact(store, profile) if profile else None
    if text:
        click.echo("\n".join(render.printable(line) for line in text.splitlines()), err=True)


def _box_error(e: BoxError | SshError) -> CliError:
    return CliError(e.message, e.hint)


# ---- rgt hosts ----------------------------------------------------------------------


@click.group("hosts", cls=RgtGroup, invoke_without_command=True)
@JSON_OPTION
@click.pass_context
def hosts_group(ctx: click.Context, as_json: bool) -> None:
    """The boxes rgt reaches (`local` is this machine and always there).

    \b
      rgt hosts                                   list them
      rgt hosts add gpu1 --ssh autodl-a100 --profile autodl
      rgt hosts check gpu1                        connect once and say what is there
    """
    if ctx.invoked_subcommand is not None:
        return
    with Store.open() as store:
        rows = [host_record(store, LOCAL), *store.hosts()]
    if as_json:
        emit_json({"hosts": rows})
        return
    click.echo(f"{'NAME':<16} {'SSH':<24} {'PROFILE':<14} INSTALLED")
    for h in rows:
        installed = (h.get("installed") or {}).get("version", "-") if h["name"] != LOCAL else "(this rgt)"
        click.echo(render.printable(f"{h['name']:<16} {h['ssh'] or '-':<24} {h['profile'] or '-':<14} "
                                    f"{installed}"))


@hosts_group.command("add", cls=RgtCommand)
@click.argument("name")
@click.option("--ssh", "alias", required=True, metavar="ALIAS",
              help="How `ssh` reaches the box: a ~/.ssh/config alias (or user@host).")
@click.option("--profile", default="", metavar="P", help="Platform profile (profiles/P.toml).")
@click.option("--onbox", default="", metavar="CMD",
              help="How rgt-onbox runs there when `rgt install` did not put it there.")
@click.option("--root", default="", metavar="DIR", help="Where runs live on the box (default ~/rgt-runs).")
@click.option("--replace", is_flag=True, help="Change a host that exists.")
def hosts_add(name: str, alias: str, profile: str, onbox: str, root: str, replace: bool) -> None:
    """Record how to reach box NAME. Nothing connects yet (see `rgt hosts check`)."""
    if name == LOCAL:
        raise CliError("`local` is reserved: it is this machine, and needs no entry")
    if not _HOST_NAME.match(name):
        raise CliError(f"host name {name!r} must be 1-64 of A-Z a-z 0-9 . _ - (starting alphanumeric)")
    if alias.startswith("-"):
        raise CliError(f"--ssh {alias!r} looks like an option, not a host alias")
    if profile:
        import profiles

        try:
            profiles.load(profile, profiles.directory())
        except Exception as e:  # the loader's own errors name the file and line
            raise CliError(f"profile {profile!r}: {e}", hint="see the profiles/ directory") from e
    with Store.open() as store:
        store.add_host(name, ssh=alias, profile=profile, onbox=onbox, root=root, replace=replace)
        click.echo(f"host {name}: ssh {alias}" + (f", profile {profile}" if profile else ""), err=True)
        _notice(store, profile)


@hosts_group.command("check", cls=RgtCommand)
@click.argument("name")
@JSON_OPTION
@click.pass_context
def hosts_check(ctx: click.Context, name: str, as_json: bool) -> None:
    """Connect to NAME (starting its ControlMaster) and report the box and its rgt-onbox.

    With --json (here or on `rgt hosts`): one object, also when the box cannot be reached
    ("reachable": false, with the error and its hint; the exit is 1 then)."""
    as_json = as_json or bool(ctx.parent is not None and ctx.parent.params.get("as_json"))
    with Store.open() as store:
        box = Box.of(store, name)
        shell = box.shell
        try:
            if isinstance(shell, Ssh):
                shell.start_master()
            out = shell.run("uname -srm; command -v rsync >/dev/null && echo rsync=yes || echo rsync=no",
                            timeout_s=30)
            lines = out.stdout.decode(errors="replace").splitlines()
            try:
                version = box.check_version()
            except BoxError as e:
                version = f"not usable: {e.message}"
        except SshError as e:
            if as_json:
                emit_json({"host": name, "reachable": False, "error": e.message, "hint": e.hint})
            raise _box_error(e) from e
    report = {"host": name, "reachable": True, "system": lines[0] if lines else "",
              "rsync": "rsync=yes" in lines, "onbox_version": version}
    if as_json:
        emit_json(report)
        return
    rsync = "yes" if report["rsync"] else "MISSING"
    click.echo(render.printable(f"{name}: {report['system']}; rsync {rsync}; rgt-onbox {version}"))


@hosts_group.command("rm", cls=RgtCommand)
@click.argument("name")
def hosts_rm(name: str) -> None:
    """Forget host NAME (its runs stay in the store). Nothing on the box changes."""
    with Store.open() as store:
        store.host(name)
        store.remove_host(name)
    click.echo(f"forgot host {name}", err=True)


# ---- rgt launch ---------------------------------------------------------------------


@click.command("launch", cls=RgtCommand)
@click.argument("host")
@click.argument("command", nargs=-1, required=True)
@click.option("--profile", default=None, metavar="P", help="Platform profile (default: the host's).")
@click.option("--run-id", default=None, metavar="ID",
              help="Run id: letters, digits, . _ - (default: UTC time + random); a recorded one is refused.")
@click.option("--project", default=None, help="Project name on the box.")
@click.option("--root", default=None, metavar="DIR", help="Where runs live on the box.")
@click.option("--onbox-arg", "onbox_args", multiple=True, metavar="ARG",
              help="Extra `rgt-onbox launch` argument, repeatable (--onbox-arg=--env=WANDB_API_KEY).")
@click.option("--no-watch", is_flag=True, help="Do not start the background watcher.")
@click.option("--code", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              metavar="DIR", help="Sync this working tree to <root>/<project>/code on HOST first (rsync; "
                                  ".gitignore and .rgtignore respected); the job runs there.")
@click.option("--cwd", default=None, metavar="PATH",
              help="The job's working directory on HOST (relative: from the synced code).")
@click.option("--python", "python", default=None, metavar="PATH",
              help="The job's Python on HOST (default: the profile's, else python3 on PATH).")
@click.option("--code-limit", default="200MiB", show_default=True, metavar="SIZE",
              help="Refuse a --code tree bigger than this (naming its biggest entries).")
@click.option("--yes", is_flag=True, help="Sync a --code tree whatever its size.")
@JSON_OPTION
def launch_command(host: str, command: Sequence[str], profile: Optional[str], run_id: Optional[str],
                   project: Optional[str], root: Optional[str], onbox_args: Sequence[str],
                   no_watch: bool, code: Optional[Path], cwd: Optional[str], python: Optional[str],
                   code_limit: str, yes: bool, as_json: bool) -> None:
    """Run COMMAND on HOST under rgt-onbox, and start watching it.

    \b
      rgt launch gpu1 -- python train.py --lr 3e-4
      rgt launch local --json -- python scripts/train_tiny.py
    Never put a secret in COMMAND: push it once with `rgt secret push HOST NAME`.
      rgt launch gpu1 --code . -- python train.py   (the tree to <root>/<project>/code, run there)
    With --json: one object with run_id, run_dir, host, pid, watcher_pid and daemon_pid (both the
    follower daemon's pid: one process follows every run).
    """
    try:
        limit = None if yes else parse_size(code_limit)
    except ValueError as e:
        raise CliError(f"--code-limit: {e}") from e
    with Store.open() as store:
        host_profile = Box.of(store, host).profile
        try:
            answer = boxes.launch(store, host, command, run_id=run_id, profile=profile, root=root,
                                  project=project, onbox_args=onbox_args,
                                  code=boxes.Code(code=code, cwd=cwd, python=python, limit_bytes=limit),
                                  progress=lambda line: click.echo(render.printable(line), err=True))
        except (BoxError, SshError) as e:
            raise _box_error(e) from e
        _notice(store, profile or host_profile)
        watcher_pid = None
        if not no_watch:
            from controller.follow.client import follow

            watcher_pid = follow(store, str(answer["run_id"]), launched=True)
    # The follower daemon follows the run: watcher_pid (what scripts read since rgt 0.1) is its pid.
    answer["watcher_pid"] = answer["daemon_pid"] = watcher_pid
    if as_json:
        emit_json(answer)
        return
    click.echo(render.printable(f"launched {answer['run_id']} on {host} ({answer['run_dir']})"))
    click.echo(f"next: rgt watch {answer['run_id']} --timeout 6h   (exits when something needs you)",
               err=True)


# ---- rgt runs / rgt stop ------------------------------------------------------------


def _age(ts: Optional[float]) -> str:
    if ts is None:
        return "-"
    s = max(0.0, time.time() - ts)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


def _group_state(nodes: Sequence[Dict[str, Any]]) -> str:
    """A multi-node run's state from its nodes' lives, cheaply (`rgt status RUN` says more): a node
    stopped by request, or one that ended after a stop was asked for another, is no failed rank."""
    from controller.runs.group_status import bad_nodes

    if not nodes:
        return "launched"
    ended = [bool(n["life"]["ended"]) for n in nodes]
    if bad_nodes(nodes):
        return "rank_failed" if not all(ended) else "failed"
    states = [n["state"] for n in nodes]
    if all(s == "finished" for s in states):
        return "finished"
    if all(ended) and "stopped" in states:
        return "stopped"
    if not all(ended):
        return "running"
    return str(next(s for s in states if s != "finished"))


def _run_rows(store: Store, only: Optional[str]) -> List[Dict[str, Any]]:
    """One row per run, newest first; a multi-node group's row followed by its node streams'."""
    from controller.follow import client
    from controller.runs import groups

    infos = store.runs()
    chosen = store.resolve_run(only) if only else None
    now = time.time()
    daemon = client.daemon_pid()   # once: every followed run's row names the same process

    def row(r: Dict[str, Any]) -> Dict[str, Any]:
        run = str(r["run"])
        return {"run": run, "host": r["target"] or r["host"], "run_dir": r["run_dir"],
                "last_seq": r["last_seq"], "watcher_pid": daemon if client.marked(run) else None,
                "group": r["group_run"] or None,
                "node": r["node"] or None, "resumed_from": r["resumed_from"] or None,
                **run_state(store, run, now)}

    rows: List[Dict[str, Any]] = []
    for r in infos:
        if chosen is not None and r["run"] != chosen:
            continue
        if groups.is_group(r):
            nodes = [row(m) for m in groups.members(store, str(r["run"]), infos)]
            hosts = sorted({str(n["host"]) for n in nodes if n["host"]})
            rows.append({"run": r["run"], "host": ",".join(hosts), "run_dir": "", "last_seq": None,
                         "watcher_pid": None, "group": r["run"], "node": None,
                         "nodes": [n["node"] for n in nodes], "state": _group_state(nodes),
                         "last_event_ts": max((n.get("last_event_ts") or 0.0 for n in nodes), default=None)
                         or None, "link": "-"})
            rows += nodes
        elif chosen is not None or not r["group_run"]:
            rows.append(row(r))
    return rows


@click.command("runs", cls=RgtCommand)
@click.argument("run", required=False, metavar="[RUN]")
@JSON_OPTION
def runs_command(run: Optional[str], as_json: bool) -> None:
    """The runs rgt knows, newest first: host, state, last event, watcher.

    A multi-node run shows as its group, then one line per node. With RUN: only that run.
    """
    with Store.open() as store:
        rows = _run_rows(store, run)
    if as_json:
        emit_json({"runs": rows})
        return
    click.echo(f"{'RUN':<34} {'HOST':<12} {'STATE':<11} {'LINK':<8} {'LAST':>6} {'SEQ':>7} WATCHER")
    for row in rows:
        code = row.get("code")
        shown = code not in (None, 0) and row["state"] not in ("stopped", "preempted")
        state = row["state"] + (f" {code}" if shown else "")
        name = f"{row['run']} ({len(row['nodes'])} nodes)" if "nodes" in row else (
            f"  {row['node']}: {row['run']}" if row.get("node") else row["run"])
        name += f" (<- {row['resumed_from']})" if row.get("resumed_from") else ""
        seq = "-" if row["last_seq"] is None else row["last_seq"]
        click.echo(render.printable(
            f"{name:<34} {row['host'] or '-':<12} {state:<11} {row['link']:<8} "
            f"{_age(row.get('last_event_ts')):>6} {seq:>7} {row['watcher_pid'] or '-'}"))


@click.command("stop", cls=RgtCommand)
@RUN_ARGUMENT
@click.option("--grace", default="30s", show_default=True, help="Time between SIGTERM and SIGKILL.")
@JSON_OPTION
def stop_command(run: str, grace: str, as_json: bool) -> None:
    """Stop RUN's job on its box (the box and its files stay; nothing is deleted)."""
    with Store.open() as store:
        try:
            answer = boxes.stop(store, run, grace)
        except (BoxError, SshError) as e:
            raise _box_error(e) from e
    if as_json:
        emit_json(answer)
    else:
        click.echo(render.printable(f"{answer['run']}: {answer.get('outcome', answer)}"))
    if answer["exit"] != 0:
        raise CliError(f"the box could not stop {answer['run']}", hint=f"see 'rgt status {answer['run']}'")
