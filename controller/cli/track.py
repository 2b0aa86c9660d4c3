"""`rgt track HOST RUN`: follow a run that something else started on HOST.

sbatch, a Kubernetes pod or SkyPilot starts the job through `rgt-onbox launch` on the box, so rgt
never saw it launch. `rgt track` asks the box which runs it holds (`rgt-onbox ps --run RUN`),
records them in the store with the host and directory, and starts a watcher for each. A plain
run is one stream; a multi-node run (`--node`, onbox/launch/nodes.py) is one stream per node, RUN.NODE,
tied to a row for the group itself (controller.runs.groups). Tracking again picks up the nodes that
appeared since and leaves the rest as they are.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import click

from controller import render
from controller.box.handle import Box
from controller.box.ssh import SshError
from controller.cli.base import JSON_OPTION, CliError, RgtCommand, emit_json
from controller.output import error_tail
from controller.runs import groups, life
from controller.store.db import Store


@dataclasses.dataclass(frozen=True)
class Stream:
    """One run directory on the box that belongs to the tracked run."""

    run: str          # the stream's run id (RUN, or RUN.NODE)
    node: str         # "" for a plain run
    run_dir: str
    state: str        # as the box's `rgt-onbox ps` says (running, exited, ...)


def ask_box(store: Store, host: str, run: str, root: Optional[str],
            box: Optional[Box] = None) -> List[Stream]:
    """RUN's streams on HOST: `rgt-onbox ps --json --run RUN` there (through `box`: HOST's handle)."""
    args = ["ps", "--json", "--run", run] + (["--root", root] if root else [])
    try:
        done, answer = (box or Box.of(store, host)).run_onbox(args, timeout_s=60)
    except SshError as e:
        raise CliError(e.message, e.hint) from e
    if done.returncode != 0 or answer is None or not isinstance(answer.get("runs"), list):
        raise CliError(f"rgt-onbox ps failed on {host} (exit {done.returncode}): {error_tail(done.stderr)}",
                       hint=f"an older rgt-onbox has no `ps --run`: rgt install {host}")
    out = []
    for item in answer["runs"]:
        stream = str(item.get("run_id") or "")
        node = "" if stream == run else groups.node_of(run, stream)
        if node is None:  # not RUN's (the box answered more than it was asked)
            continue
        out.append(Stream(stream, node, str(item.get("run_dir") or ""), str(item.get("state") or "")))
    return sorted(out, key=lambda s: s.node)


def _record_group(store: Store, run: str) -> None:
    """The group's own row: no host and no directory, group_run = itself."""
    known = {str(r["run"]): r for r in store.runs()}
    mine = known.get(run)
    if mine is not None and not groups.is_group(mine) and (mine.get("target") or mine.get("run_dir")):
        raise CliError(f"{run} is recorded as a run of its own on {mine.get('target')}, not as a "
                       "multi-node group", hint="track its node streams by their ids (RUN.NODE)")
    store.upsert_run(run, host="")
    store.set_lineage(run, group_run=run)


def track(store: Store, host: str, run: str, *, root: Optional[str] = None,
          nodes: Sequence[str] = (), watch: bool = True) -> Dict[str, Any]:
    """Record RUN's streams on HOST and (with `watch`) start their watchers; what `rgt track
    --json` prints."""
    box = Box.of(store, host)
    streams = ask_box(store, host, run, root or (str(box.record.get("root") or "") or None), box)
    if nodes:
        streams = [s for s in streams if s.node in nodes]
    if not streams:
        where = (f" under {root}" if root else "") + (f" for node(s) {', '.join(nodes)}" if nodes else "")
        raise CliError(f"no run {run} on {host}{where}",
                       hint="`rgt-onbox ps` on the box lists its runs; is the root right? (--root DIR)")
    plain = [s for s in streams if not s.node]
    if plain and len(streams) > 1:
        raise CliError(f"{run} on {host} is both a run and a multi-node run's node streams",
                       hint="track one node stream by its id (RUN.NODE)")
    from controller.follow.client import follow

    before = {str(r["run"]) for r in store.runs()}
    if not plain:
        _record_group(store, run)
    rows = []
    for s in streams:
        store.upsert_run(s.run, host="", target=host, run_dir=s.run_dir)
        if s.node:
            store.set_lineage(s.run, group_run=run, node=s.node)
        # The box runs a stream whose stored life has ended: a new attempt under the same id (a
        # Slurm requeue ran the script again), which the follow waits for, its past notwithstanding.
        again = s.state == "running" and s.run in before and life.of_run(store, s.run).ended
        pid = follow(store, s.run, launched=again) if watch else None
        rows.append({"run": s.run, "node": s.node or None, "run_dir": s.run_dir, "state": s.state,
                     "new": s.run not in before, "new_attempt": again, "watcher_pid": pid})
    return {"run": run, "host": host, "group": not plain, "streams": rows}


@click.command("track", cls=RgtCommand)
@click.argument("host")
@click.argument("run", metavar="RUN")
@click.option("--root", default=None, metavar="DIR",
              help="Where runs live on the box (default: the host's, else $RGT_ROOT or ~/rgt-runs there).")
@click.option("--node", "nodes", multiple=True, metavar="NODE",
              help="Only this node's stream (repeatable): the others run where HOST cannot reach them.")
@click.option("--no-watch", is_flag=True, help="Record the streams; start no background watcher.")
@JSON_OPTION
def track_command(host: str, run: str, root: Optional[str], nodes: Sequence[str], no_watch: bool,
                  as_json: bool) -> None:
    """Follow RUN on HOST, started there without `rgt launch` (sbatch, a Kubernetes pod, SkyPilot).

    \b
      rgt track slurm-login train-81234 --root /scratch/me/rgt-runs
      rgt track gpu1 train-81234 --node n1          one node, through its own host
    A multi-node run (`rgt-onbox launch --run-id RUN --node auto`) is recorded as one stream
    per node under RUN: `rgt status RUN`, `rgt watch RUN` and `rgt runs` show them together.
    Run it again to pick up nodes that started since.
    """
    with Store.open() as store:
        answer = track(store, host, run, root=root, nodes=nodes, watch=not no_watch)
    if as_json:
        emit_json(answer)
        return
    rows = answer["streams"]
    kind = f"{len(rows)} node stream{'s' if len(rows) != 1 else ''}" if answer["group"] else "one run"
    fresh = sum(1 for r in rows if r["new"])
    click.echo(render.printable(f"tracking {run} on {host}: {kind}, {fresh} new"))
    for r in rows:
        click.echo(render.printable(f"  {r['node'] or '-':<8} {r['run']:<40} {r['state']:<10} "
                                    f"watcher {r['watcher_pid'] or '-'}"))
    click.echo(render.printable(f"next: rgt watch {run} --timeout 6h   (exits when something needs you)"),
               err=True)


__all__ = ["Stream", "ask_box", "track", "track_command"]
