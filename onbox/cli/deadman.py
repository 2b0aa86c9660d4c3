"""`rgt-onbox deadman ...`: the box's dead-man timer (onbox/deadman/lease.py, onbox/deadman/daemon.py).

Thin click commands, added to the `rgt-onbox` group by onbox/cli/main.py. Each prints a short table, or
with --json one JSON object (what the controller reads through ssh). Exit 0 ok, 1 refused or
failed, 2 bad usage.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import click

DURATION_HELP = "A duration: 90s, 30m, 2h, or plain seconds."


class Duration(click.ParamType):  # type: ignore[type-arg]
    """"30m", "2h", "90s" -> seconds (rgtlib.units.parse_duration); a bad one is a usage error."""

    name = "DURATION"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> float:
        from rgtlib.units import parse_duration

        if isinstance(value, float):
            return value
        try:
            seconds = parse_duration(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if seconds <= 0:
            self.fail("must be more than 0", param, ctx)
        return seconds


_json_option = click.option("--json", "as_json", is_flag=True, help="One JSON object instead of a table.")
_by_option = click.option("--by", type=click.Choice(["cli", "controller"]), default="cli", hidden=True,
                          help="Who asks (recorded): a person, or the controller on their behalf.")


def _fail(message: str, hint: str = "", code: int = 1) -> click.exceptions.Exit:
    click.echo(f"error: {message}", err=True)
    if hint:
        click.echo(f"hint: {hint}", err=True)
    return click.exceptions.Exit(code)


def _emit(doc: Dict[str, Any], as_json: bool, rows: List[List[str]]) -> None:
    if as_json:
        sys.stdout.write(json.dumps(doc, default=str) + "\n")
        return
    width = max((len(r[0]) for r in rows), default=0)
    for name, value in rows:
        click.echo(f"{name.ljust(width)}  {value}")


def _left(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    sign, s = ("-" if seconds < 0 else ""), abs(int(seconds))
    return f"{sign}{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def _lease_rows(doc: Optional[Dict[str, Any]], state: str, now: float,
                left: Optional[float] = None) -> List[List[str]]:
    """LEFT: the time left by the boot clock where the caller has it (a wall-clock step moves
    expires_at - now, never what the daemon judges by)."""
    if doc is None:
        return [["lease", state]]
    hours = doc.get("max_hours")
    budget = "-" if hours is None else f"{hours:g} h from {doc.get('budget_started_at') or 0:.0f}"
    if left is None:
        left = float(doc.get("expires_at") or 0.0) - now
    return [["lease", f"{state} (renewed by {doc.get('renewed_by')})"],
            ["expires in", _left(left)],
            ["ttl / idle", f"{_left(doc.get('ttl_s'))} / {_left(doc.get('idle_s'))}"],
            ["budget", budget], ["profile", str(doc.get("profile") or "- (notify only)")],
            ["roots", ", ".join(doc.get("roots") or []) or "-"]]


@click.group("deadman", context_settings={"help_option_names": ["-h", "--help"]})
def deadman_group() -> None:
    """The box's dead-man timer: a lease (~/.rgt/deadman.json) the controller keeps renewing.

    When nobody renewed it and no run on this box makes progress (or a --max-hours budget is
    spent), the daemon takes the profile's safe action once: notify by default, never a
    destructive one unless a person pre-authorized it. Test hooks for the daemon:
    RGT_DEADMAN_TIMESCALE (its clock runs K times faster) and RGT_DEADMAN_TICK_S.
    """


@deadman_group.command("arm")
@click.option("--ttl", type=Duration(), default="2h", show_default=True, help=DURATION_HELP)
@click.option("--idle", type=Duration(), default="30m", show_default=True,
              help="A run counts as making progress while its files changed within this window.")
@click.option("--max-hours", type=click.FloatRange(min=0, min_open=True), default=None,
              help="A hard budget: act after this many hours even while renewed and progressing.")
@click.option("--profile", default=None, help="The platform profile whose dead-man action applies.")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A runs root to watch (default: $RGT_ROOT, else ~/rgt-runs).")
@_by_option
@_json_option
def arm_command(ttl: float, idle: float, max_hours: Optional[float], profile: Optional[str],
                root: Optional[Path], by: str, as_json: bool) -> None:
    """Arm (or re-arm) the lease from now, and start the daemon."""
    import profiles

    from onbox.deadman.daemon import ensure_daemon
    from onbox.deadman.lease import arm, paths_for
    from onbox.runs import default_root

    if profile:
        try:
            profiles.load(profile, profiles.directory())
        except profiles.ProfileError as e:
            raise _fail(str(e), "rgt-onbox deadman arm --profile takes a name from profiles/", 2) from None
    paths = paths_for()
    where = str((root or default_root()).expanduser().resolve())
    lease = arm(paths, ttl_s=ttl, idle_s=idle, max_hours=max_hours, profile=profile, root=where, by=by,
                now=time.time())
    daemon = ensure_daemon(paths)
    doc = lease.to_doc()
    _emit({"state": lease.state, "lease": doc, "daemon": daemon}, as_json,
          [*_lease_rows(doc, lease.state, time.time()), ["daemon", _daemon_text(daemon)]])


def _daemon_text(daemon: Dict[str, Any]) -> str:
    if daemon.get("pid"):
        return f"pid {daemon['pid']} ({'started' if daemon.get('started') else 'running'})"
    return f"not running ({daemon.get('reason', '')})"


@deadman_group.command("renew")
@click.option("--ttl", type=Duration(), default=None,
              help="A new TTL (default: the lease's). " + DURATION_HELP)
@_by_option
@_json_option
def renew_command(ttl: Optional[float], by: str, as_json: bool) -> None:
    """Renew an armed lease from now (never arms one) and make sure the daemon runs."""
    from onbox.deadman.daemon import ensure_daemon
    from onbox.deadman.lease import paths_for, renew

    paths = paths_for()
    read = renew(paths, now=time.time(), by=by, ttl_s=ttl)
    daemon = ensure_daemon(paths)
    doc = read.lease.to_doc() if read.lease is not None else None
    _emit({"state": read.state, "armed": read.state in ("armed", "unreadable"),
           "expires_at": float(doc["expires_at"]) if doc else 0.0,
           "ttl_s": float(doc["ttl_s"]) if doc else 0.0,
           "problem": read.problem, "lease": doc, "daemon": daemon}, as_json,
          [*_lease_rows(doc, read.state, time.time()), ["daemon", _daemon_text(daemon)]])
    if read.state not in ("armed", "unreadable") and not as_json:
        click.echo(f"warning: nothing renewed: the lease is {read.state}", err=True)


@deadman_group.command("status")
@_json_option
def status_command(as_json: bool) -> None:
    """The lease, the daemon, the time left, the last records, and what it would do now and why."""
    from onbox.deadman.clock import SYSTEM, seconds_left
    from onbox.deadman.daemon import daemon_pid, plan_action
    from onbox.deadman.lease import collect_runs, decide, paths_for, read_events, read_lease

    paths = paths_for()
    read = read_lease(paths)
    now = time.time()
    lease = read.lease
    runs = collect_runs(lease.roots) if lease is not None else []
    decision = decide(lease, runs, now)
    plan = plan_action(lease, runs, dict(os.environ)) \
        if lease is not None and lease.armed and lease.fired is None else None
    pid = daemon_pid(paths)
    doc = lease.to_doc() if lease is not None else None
    events = read_events(paths)[-10:]
    out = {"state": read.state, "problem": read.problem, "lease": doc,
           "daemon": {"pid": pid, "alive": pid is not None},
           "seconds_left": decision.seconds_left, "budget_seconds_left": decision.budget_seconds_left,
           "decision": decision.to_dict(), "would": plan.to_dict() if plan else None, "events": events}
    left = seconds_left(lease, now, SYSTEM) if lease is not None and lease.armed else None
    if left is not None:
        out["seconds_left"] = left
    # A one-shot reading judged by the files' times now: the daemon judges by what it saw change.
    rows = [*_lease_rows(doc, read.state, now, left), ["daemon", f"pid {pid}" if pid else "not running"],
            ["now (estimate)", f"{decision.verdict}: {decision.reason}"]]
    if plan is not None:
        refused = f" ({plan.refused})" if plan.refused else ""
        rows.append(["would", f"{plan.action}: {plan.reason}{refused}"])
    rows += [["record", f"{r['seq']} {r['kind']}"] for r in events[-3:]]
    _emit(out, as_json, rows)
    if read.problem and not as_json:
        click.echo(f"warning: {read.problem}", err=True)


@deadman_group.command("disarm")
@_by_option
@_json_option
def disarm_command(by: str, as_json: bool) -> None:
    """Disarm the lease: the daemon stops and nothing will be done."""
    from onbox.deadman.lease import disarm, paths_for

    read = disarm(paths_for(), now=time.time(), by=by)
    doc = read.lease.to_doc() if read.lease is not None else None
    _emit({"state": read.state, "lease": doc}, as_json, [["lease", read.state]])


@deadman_group.command("authorize")
@click.argument("action")
@click.option("--instance-id", required=True, help="This box's instance id at its provider.")
@_by_option
@_json_option
def authorize_command(action: str, instance_id: str, by: str, as_json: bool) -> None:
    """Pre-authorize ACTION (one of the profile's deadman allow list) for this box.

    It is taken only while no checkpoint newer than this authorization exists; run it only after
    a verified pull (the controller's teardown gate)."""
    import profiles

    from onbox.deadman.lease import DeadmanError, authorize, paths_for, read_lease

    paths = paths_for()
    read = read_lease(paths)
    if read.lease is None or not read.lease.profile:
        raise _fail("the lease names no profile, so nothing can be authorized",
                    "arm it with --profile NAME first")
    try:
        allowed = profiles.load(read.lease.profile, profiles.directory()).deadman.allow
        lease = authorize(paths, action=action, instance_id=instance_id, allowed=allowed, now=time.time(),
                          by=by)
    except (profiles.ProfileError, DeadmanError) as e:
        raise _fail(str(e)) from None
    _emit({"state": lease.state, "authorized": lease.authorized, "lease": lease.to_doc()}, as_json,
          [["authorized", f"{action} for {instance_id}"], ["lease", lease.state]])


@deadman_group.command("run")
@click.option("--foreground", is_flag=True, help="Run in this process (logs to stderr) instead of detached.")
@_json_option
def run_command(foreground: bool, as_json: bool) -> None:
    """The daemon itself (launches, renewals and sidecars start it). Exits 0 at once when another
    daemon holds ~/.rgt/deadman.lock."""
    import logging

    from onbox.deadman.daemon import run_foreground, start_detached
    from onbox.deadman.lease import paths_for

    paths = paths_for()
    if foreground:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s rgt-deadman %(levelname)s: %(message)s")
        said: Dict[str, Any] = {}
        code = run_foreground(paths, ready=said.update)
        if not said.get("started"):
            _emit(said, as_json, [["daemon", f"not started: {said.get('reason')} (pid {said.get('pid')})"]])
        raise click.exceptions.Exit(code)
    answer = start_detached(paths)
    _emit(answer, as_json, [["daemon", _daemon_text(answer)]])


@deadman_group.command("events")
@click.option("--since", type=click.IntRange(min=0), default=0, help="Only records after this seq.")
@_json_option
def events_command(since: int, as_json: bool) -> None:
    """The dead-man's own log (~/.rgt/deadman.events.jsonl)."""
    from onbox.deadman.lease import paths_for, read_events

    records = read_events(paths_for(), since)
    last = records[-1]["seq"] if records else since
    if as_json:
        _emit({"events": records, "last_seq": last}, True, [])
        return
    for r in records:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(r.get("ts") or 0)))
        click.echo(f"{r['seq']:>5}  {stamp}  {r['kind']:<18} {json.dumps(r['data'], default=str)[:120]}")


__all__ = ["deadman_group"]
