"""`rgt watch`, `rgt status`, `rgt plot` and `rgt policy`: the commands that tell what a run does.

Thin commands over controller.wake.watch, .status, .plot and .wake. They are not
attached to the `rgt` group here; controller/cli/main.py adds them. `rgt watch`
prints exactly one JSON line on stdout whatever its exit code (usage errors it
detects itself included), always with exit, run, event, explain, next and entry,
so an agent that runs it in the background can always parse why it woke:

    10 something needs you   0 every watched run ended well (finished, or stopped by request)
     3 timeout               4 the link stayed down past its budget
     2 usage error           5 the store is damaged, locked, too new or holds a bad policy
     1 internal error      130 interrupted

`rgt status` starts a run's background watcher only while the run's life has not ended.
"""
from __future__ import annotations

import dataclasses
import logging
import shlex
from pathlib import Path
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence

import click
import protocol
from rgtlib.units import parse_duration

from controller import paths, render
from controller.cli.base import (
    CliError,
    RgtCommand,
    duration,
    emit_json,
    sigterm_as_interrupt,
)
from controller.errors import StoreCorrupt
from controller.insight.catalog import CatalogError
from controller.insight.explain import entry_for_event
from controller.render import printable
from controller.runs import group_status as status_group
from controller.runs import groups, life
from controller.runs import status as status_mod
from controller.runs.plot import PlotError, plot
from controller.store.db import AmbiguousRun, RunNotFound, Store, StoreError
from controller.wake import policy as wake
from controller.wake.ends import again_command
from controller.wake.watch import WatchResult, watch

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = "6h"


def needs_watcher(store: Store, run: str) -> bool:
    """A run whose life has not ended needs its background watcher; one that ended does not (a
    watcher started for it would only poll a box that has nothing more to say). A run whose
    sidecar stopped with no job exit stored ("lost") still gets one: the supervisor may restart
    the sidecar while the job trains, and only a watcher would hear of it."""
    lived = life.of_run(store, run)
    return not lived.ended or lived.state == life.LOST


def _watcher_starter(store: Store) -> Callable[[str], Any]:
    """The follower daemon's follow bound to this store: a run is followed again whenever it is
    watched (and the daemon started when none runs)."""
    from controller.follow.client import follow

    return lambda run: follow(store, run)


# ---- rgt watch --------------------------------------------------------------------


EXIT_USAGE = 2
EXIT_FAILED = 1        # rgt itself failed (an internal error): nothing judged
EXIT_STORE = 5         # rgt's store is damaged, locked, too new or holds a bad policy: nothing judged
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM before anything material happened: nothing judged


class _StoreUnusable(CliError):
    """The store could not be used; the watch's JSON line is printed before it."""

    exit_code = EXIT_STORE


class _Interrupted(CliError):
    """Ctrl-C or SIGTERM ended the watch; its JSON line is printed before it."""

    exit_code = EXIT_INTERRUPTED


def _no_verdict(code: int, message: str, explain: str, next_step: str, runs: Sequence[str] = (),
                **extra: Any) -> None:
    """The one JSON line of a watch that judged nothing: the keys every other line has, too."""
    emit_json({"exit": code, "run": runs[0] if len(runs) == 1 else None, "runs": list(runs), "event": None,
               "entry": None, "error": message, "explain": explain, "next": next_step, **extra})


def _usage(message: str, runs: Sequence[str] = ()) -> NoReturn:
    _no_verdict(EXIT_USAGE, message, f"usage error, nothing was watched: {message}", "rgt watch --help", runs)
    raise click.UsageError(message)


def _again(runs: Sequence[str], all_runs: bool) -> str:
    """This watch as a command to run again (every run name quoted: it may hold anything)."""
    return again_command(runs, all_runs)


def _move_aside(again: str) -> str:
    """A shell line that moves the damaged store (and its -wal and -shm files) aside, then watches
    again: what the store's recovery hint says, as a command."""
    db = shlex.quote(str(paths.db_path()))
    return (f'for f in {db} {db}-wal {db}-shm; do [ -e "$f" ] && mv "$f" "$f.damaged"; done; {again}')


def _overrides(min_sev: Optional[str], add: Sequence[str], mute: Sequence[str],
               link_budget: Optional[str]) -> Dict[str, Any]:
    layer: Dict[str, Any] = {}
    if min_sev is not None:
        layer["min_sev"] = min_sev
    if add:
        layer["add"] = list(add)
    if mute:
        layer["mute"] = list(mute)
    if link_budget is not None:
        layer["link_budget_s"] = parse_duration(link_budget)
    return wake.check_layer(layer)


def with_entry(record: Dict[str, Any]) -> Dict[str, Any]:
    """The record plus "entry" (the id of the catalog entry that best explains its event, or of
    its "cause" when it has one; null when it has no event or no entry fits) and "see"
    (`rgt explain <id>`) when there is one."""
    out = {**record, "entry": None}
    event = record.get("cause") if isinstance(record.get("cause"), dict) else record.get("event")
    if not isinstance(event, dict) or not isinstance(event.get("kind"), str):
        return out
    data = event.get("data")
    try:
        entry = entry_for_event(event["kind"], data if isinstance(data, dict) else {})
    except CatalogError as e:  # a broken catalog must not cost the one JSON line
        log.warning("no catalog entry for %s: %s", event["kind"], e)
        return out
    return {**out, "entry": entry, "see": f"rgt explain {shlex.quote(entry)}"} if entry else out


def _sentence(result: WatchResult) -> str:
    r = result.record
    if result.exit_code == 3:
        return f"timeout: {r.get('explain', '')}. next: {r.get('next', '')}"
    if r.get("event") is not None or r.get("ended"):
        head = {0: "finished", 4: "link down", 10: "woke"}.get(result.exit_code, "ended")
        head = "stopped by request" if result.exit_code == 0 and r.get("stopped_by") else head
        head += " (reported before)" if r.get("already_reported") else ""
        why = f"; why: {r['see']}" if r.get("see") else ""
        return f"{head}: {r.get('explain')} (run {r.get('run')}). next: {r.get('next')}{why}"
    return f"{r.get('explain', '')}. next: {r.get('next', '')}"


_WATCH_HELP = """Wait until something material happens to RUN, then exit with a code that says what.

\b
Exit codes:
   10  something needs you: a warn/critical state change, a failed job
       exit (a preemption too: a SIGTERM nobody asked rgt for), the
       sidecar silent, or what the policy adds (`rgt policy`); also at
       once when RUN had already ended badly ("already_reported")
    0  every watched run ended well: finished cleanly, or stopped by
       request (`rgt stop`: "stopped_by" in the line); with --all, or
       several runs, only once every run (and every queue cell not
       launched yet) has ended; "ended" says how each one did. A run
       ends on run.closed: its checkpoints are committed and the line
       names the final manifest, so a pull right after holds them all
    3  --timeout passed with nothing material
    4  the link stayed down past the link budget (this says nothing
       about the job: check the box)
    2  usage error: nothing was watched
    5  rgt's store is damaged, locked, too new or holds a bad policy:
       nothing was judged ("next" says how to recover)
    1  rgt itself failed (an internal error): nothing was judged
  130  interrupted (Ctrl-C, SIGTERM): nothing was judged

Exactly one JSON line goes to stdout at the end, whatever the code, with
at least {"exit", "run", "event", "explain", "next", "entry"}: "event" is
the event that woke it (null when none), "entry" the catalog entry that
explains it (`rgt explain <entry>`, also in "see"; null when none fits),
"next" one shell line to run next (run ids quoted). A 0 or 10 on a job
exit adds "life" and "ended" (run -> how it ended); 3 adds "status".
A condition that woke once wakes again only when it re-opens after a
clear (and not inside the flap window) or escalates; one made moot by a
graver event (memory pressure by the OOM kill, a failed `rgt verify` by
a pass) never does. Without --from-now, events stored earlier that woke
nobody yet are judged first.

\b
Examples:
  rgt watch train-7f3a --timeout 6h &      # a coding agent: woken by the exit
  rgt watch --all --timeout 30m --json
  rgt watch train-7f3a --add ckpt.saved --mute gpu.throttle
"""


@click.command("watch", cls=RgtCommand, help=_WATCH_HELP)
@click.argument("runs", nargs=-1, metavar="[RUN]...")
@click.option("--all", "all_runs", is_flag=True,
              help="Every run in the store that has not ended, and queue cells still to launch.")
@click.option("--timeout", "timeout", metavar="DUR", default=DEFAULT_TIMEOUT, show_default=True,
              help="End with exit 3 after DUR: 90, 90s, 15m, 6h, 1d.")
@click.option("--json", "as_json", is_flag=True, help="Only the JSON line; no sentence on stderr.")
@click.option("--from-now", is_flag=True, help="Only events that arrive after the watch starts.")
@click.option("--min-sev", metavar="SEV", help="Lowest severity that wakes: info, warn (default), critical.")
@click.option("--add", multiple=True, metavar="KIND",
              help="Also wake on KIND (a kind, or a prefix like ckpt.). Repeatable.")
@click.option("--mute", multiple=True, metavar="KIND", help="Never wake on KIND. Repeatable.")
@click.option("--link-budget", metavar="DUR", help="How long the link may stay down before exit 4.")
def watch_command(runs: Sequence[str], all_runs: bool, timeout: str, as_json: bool, from_now: bool,
                  min_sev: Optional[str], add: Sequence[str], mute: Sequence[str],
                  link_budget: Optional[str]) -> None:
    if not runs and not all_runs:
        _usage("give a run id, or --all")
    if runs and all_runs:
        _usage("give run ids or --all, not both", runs)
    try:
        timeout_s = parse_duration(timeout)
        overrides = _overrides(min_sev, add, mute, link_budget)
    except ValueError as e:
        _usage(str(e), runs)
    again = _again(runs, all_runs)
    try:
        with Store.open() as store, sigterm_as_interrupt():
            starter = _watcher_starter(store)
            from controller.follow.client import check_group

            try:
                result = watch(store, runs, all_runs=all_runs, timeout_s=timeout_s,
                               policy_overrides=overrides, from_now=from_now, ensure_watcher=starter,
                               check_group=check_group)
            except (RunNotFound, AmbiguousRun) as e:
                _usage(f"{e}" + (f" ({e.hint})" if e.hint else ""), runs)
    except (click.ClickException, click.exceptions.Exit, click.Abort):
        raise
    except KeyboardInterrupt:
        _no_verdict(EXIT_INTERRUPTED, "interrupted", "the watch was interrupted (Ctrl-C or SIGTERM) before "
                    "anything material happened; nothing was judged", again, runs)
        raise _Interrupted("interrupted", f"watch again: {again}") from None
    except StoreError as e:  # the store is damaged, locked or unreadable: say so, and how to recover
        next_step = _move_aside(again) if isinstance(e, StoreCorrupt) else again
        _no_verdict(EXIT_STORE, str(e), f"rgt could not use its store, so nothing was judged: {e}",
                    next_step, runs, hint=e.hint)
        raise _StoreUnusable(str(e), e.hint) from e
    except ValueError as e:  # the overrides were checked above: this is what the store holds (a policy)
        hint = ("`rgt policy --default` and `rgt policy RUN` show the stored wake policies; --reset "
                "forgets one")
        _no_verdict(EXIT_STORE, str(e), f"rgt could not judge: a stored wake policy is bad: {e}", again, runs,
                    hint=hint)
        raise _StoreUnusable(str(e), hint) from e
    except Exception as e:  # a bug: rgt's command boundary reports it; the JSON line comes first
        _no_verdict(EXIT_FAILED, f"internal error: {type(e).__name__}: {e}",
                    "rgt failed, so nothing was judged; `rgt --debug` shows the traceback, please report it",
                    "rgt --debug " + again[len("rgt "):], runs)
        raise
    result = dataclasses.replace(result, record=with_entry(result.record))
    emit_json(result.record)
    if not as_json:
        click.echo(printable(_sentence(result)), err=True)
    raise click.exceptions.Exit(result.exit_code)


# ---- rgt status -------------------------------------------------------------------


@click.command("status", cls=RgtCommand)
@click.argument("run", required=False, metavar="[RUN]")
@click.option("--json", "as_json", is_flag=True,
              help="A JSON object (with RUN) or {\"runs\": [...]} (without) instead of text.")
@click.option("--ref", metavar="OTHER_RUN",
              help="Compare each metric with OTHER_RUN's value at the same step (or epoch).")
def status_command(run: Optional[str], as_json: bool, ref: Optional[str]) -> None:
    """Where RUN stands: state, progress and ETA, metrics and their age, GPUs, newest checkpoint,
    disk, open conditions, link. Without RUN: every run, newest first.

    A multi-node run (`rgt track`) shows one line per node and the group's verdict.

    \b
    Examples:
      rgt status train-7f3a
      rgt status train-7f3a --ref train-baseline --json
    """
    with Store.open() as store:
        ids = _status_ids(store, run)
        ref_id = store.resolve_run(ref) if ref else None
        if ref_id and any(nodes is not None for nodes in ids.values()):
            raise CliError("--ref compares one run with another: give one node stream of the group",
                           hint="rgt runs lists them")
        starter = _watcher_starter(store)
        for run_id, nodes in ids.items():
            for stream in nodes if nodes is not None else [run_id]:
                try:
                    if needs_watcher(store, stream):
                        starter(stream)
                except Exception:  # status shows what is stored even when the watcher cannot start
                    log.warning("could not start the background watcher of %s", stream, exc_info=True)
        summaries = [status_group.summarize(store, run_id) if nodes is not None else
                     status_mod.summarize(store, run_id, ref_id if ref_id != run_id else None)
                     for run_id, nodes in ids.items()]
    if as_json:
        emit_json(summaries[0] if run else {"runs": summaries})
    elif not summaries:
        click.echo("no runs stored yet (`rgt launch`, `rgt track` or `rgt attach` records them)")
    else:
        click.echo("\n\n".join(status_group.render(s) if s.get("group") else status_mod.render(s)
                                for s in summaries))


def _status_ids(store: Store, run: Optional[str]) -> Dict[str, Optional[List[str]]]:
    """Run id -> the node streams of a multi-node group, or None for a plain run. Without RUN,
    every run newest first, with a group's node streams shown within the group, not alone."""
    infos = store.runs()
    chosen = [store.resolve_run(run)] if run else None
    out: Dict[str, Optional[List[str]]] = {}
    for info in infos:
        run_id = str(info["run"])
        if chosen is not None and run_id not in chosen:
            continue
        if groups.is_group(info):
            out[run_id] = [str(m["run"]) for m in groups.members(store, run_id, infos)]
        elif chosen is not None or not info.get("group_run"):
            out[run_id] = None
    return out


# ---- rgt plot ---------------------------------------------------------------------


@click.command("plot", cls=RgtCommand)
@click.argument("run", metavar="RUN")
@click.option("--ref", metavar="OTHER_RUN", help="Draw OTHER_RUN's curves too (dashed).")
@click.option("-o", "--output", "output", required=True, metavar="FILE.png",
              type=click.Path(dir_okay=False, path_type=Path), help="Where to write the image.")
@click.option("--metric", "metrics", multiple=True, metavar="NAME",
              help="A metric to draw (repeatable); default: the first few, losses first.")
def plot_command(run: str, ref: Optional[str], output: Path, metrics: Sequence[str]) -> None:
    """Draw RUN's loss and metric curves (every logged point) into FILE.png.

    \b
    Examples:
      rgt plot train-7f3a -o loss.png
      rgt plot train-7f3a --ref train-baseline --metric loss --metric acc -o cmp.png
    """
    with Store.open() as store:
        try:
            written = plot(store, run, ref, output, metrics)
        except PlotError as e:
            raise CliError(str(e), e.hint) from e
    click.echo(f"wrote {printable(str(written))}")


# ---- rgt policy -------------------------------------------------------------------


def _edit(layer: Dict[str, Any], add: Sequence[str], mute: Sequence[str], min_sev: Optional[str],
          quiet: Sequence[str], flap_window: Optional[float], link_budget: Optional[float]) -> Dict[str, Any]:
    out = dict(layer)
    for key, other, kinds in (("add", "mute", add), ("mute", "add", mute)):
        for kind in wake.parse_kinds(list(kinds), key):
            out[key] = [k for k in out.get(key, []) if k != kind] + [kind]
            out[other] = [k for k in out.get(other, []) if k != kind]
    if min_sev is not None:
        out["min_sev"] = min_sev
    if quiet:
        out["quiet"] = [] if list(quiet) == ["off"] else list(quiet)
    if flap_window is not None:
        out["flap_window_s"] = flap_window
    if link_budget is not None:
        out["link_budget_s"] = link_budget
    # an empty add/mute list says nothing; an empty quiet list turns inherited quiet hours off
    return wake.check_layer({k: v for k, v in out.items() if v != [] or k == "quiet"})


def _show(scope: str, stored: Dict[str, Any], effective: wake.Policy) -> str:
    e = effective
    lines = [f"policy for {'every run (default)' if scope == '*' else scope}",
             f"  stored     {stored or 'nothing (inherits)'}",
             f"  min_sev    {e.min_sev}", f"  add        {', '.join(e.add) or '-'}",
             f"  mute       {', '.join(e.mute) or '-'}", f"  quiet      {', '.join(e.quiet) or '-'}",
             f"  flap       {render.seconds(e.flap_window_s)}",
             f"  link       {render.seconds(e.link_budget_s)}"]
    return "\n".join(printable(line) for line in lines)


@click.command("policy", cls=RgtCommand)
@click.argument("run", required=False, metavar="[RUN]")
@click.option("--default", "default", is_flag=True, help="The default for every run (also without RUN).")
@click.option("--add", multiple=True, metavar="KIND", help="Always wake on KIND (or a prefix like ckpt.).")
@click.option("--mute", multiple=True, metavar="KIND", help="Never wake on KIND (job.exited cannot be).")
@click.option("--min-sev", type=click.Choice(protocol.SEVERITIES), help="Lowest severity that wakes.")
@click.option("--quiet", multiple=True, metavar="HH:MM-HH:MM",
              help="Local-time quiet hours (only critical events and job exits wake); 'off' clears.")
@click.option("--flap-window", callback=duration, metavar="DUR",
              help="A condition that woke does not wake again within DUR.")
@click.option("--link-budget", callback=duration, metavar="DUR",
              help="How long the link may stay down before `rgt watch` exits 4.")
@click.option("--reset", is_flag=True, help="Forget the stored policy first.")
@click.option("--json", "as_json", is_flag=True, help="{\"scope\", \"stored\", \"effective\"} as JSON.")
def policy_command(run: Optional[str], default: bool, add: Sequence[str], mute: Sequence[str],
                   min_sev: Optional[str], quiet: Sequence[str], flap_window: Optional[float],
                   link_budget: Optional[float], reset: bool, as_json: bool) -> None:
    """Show, or change and show, the wake policy of RUN or the default of every run.

    A run's policy is the default's with the run's own on top, and `rgt watch`
    options on top of both.

    \b
    Examples:
      rgt policy --default --quiet 23:00-07:00 --mute gpu.throttle
      rgt policy train-7f3a --add ckpt.saved --min-sev critical
      rgt policy train-7f3a --reset
    """
    if run and default:
        raise click.UsageError("give RUN or --default, not both")
    with Store.open() as store:
        scope = "*"
        if run:
            try:
                scope = store.resolve_run(run)
            except RunNotFound:  # a policy may be set before the run is launched
                scope = run
                click.echo(f"warning: no run {printable(run)} stored yet; the policy waits for it", err=True)
        stored = {} if reset else store.policy(scope)
        changing = reset or any((add, mute, min_sev, quiet, flap_window is not None, link_budget is not None))
        try:
            layer = _edit(stored, add, mute, min_sev, quiet, flap_window, link_budget)
            effective = wake.merged(layer) if scope == "*" else wake.merged(store.policy("*"), layer)
        except ValueError as e:
            raise click.UsageError(str(e)) from e
        if changing:
            store.set_policy(scope, layer)
    if as_json:
        emit_json({"scope": scope, "stored": layer, "effective": effective.to_dict()})
    else:
        click.echo(_show(scope, layer, effective))


__all__ = ["needs_watcher", "plot_command", "policy_command", "status_command",
           "watch_command"]
