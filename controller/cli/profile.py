"""`rgt profile list|show|stale`: the platform facts rgt acts on, and how old they are.

Thin commands over the `profiles` package, reading profiles.directory() ($RGT_PROFILES_DIR when
set, else the packaged profiles). People get short tables; `--json` gives one JSON object.

    rgt profile list            every profile: kind, meter-stop action, dead-man action, oldest stamp
                                (a profile that does not load is listed as broken; exit 1)
    rgt profile show NAME       what to know before renting first, then storage, actions, ssh,
                                spot, dead-man and script overrides
    rgt profile stale           the `verified` stamps older than --months (6); exit 1 when any is

Exit codes: 0 fine, 1 a broken profile or a stale stamp, 2 usage (an unknown NAME, a bad --today).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import click
import profiles

from controller import render
from controller.cli.base import JSON_OPTION, CliError, RgtGroup, emit_json

_PASSING = "passing does not verify the facts: it only says each was checked within {months} months"


def _echo(line: str = "") -> None:
    click.echo(render.printable(line))


def _yes(value: Optional[bool]) -> str:
    return "?" if value is None else ("yes" if value else "no")


def _known(where: Path) -> List[str]:
    found = profiles.names(where)
    if not found:
        raise CliError(f"no profiles in {where}", hint="RGT_PROFILES_DIR names a folder of <name>.toml "
                                                       "files; unset it for the packaged ones")
    return found


@click.group("profile", cls=RgtGroup)
def profile_group() -> None:
    """Platform facts: what stops the meter, what each action deletes, how old each fact is.

    \b
    rgt profile list
    rgt profile show runpod
    rgt profile stale --months 6
    """


# ---- rgt profile list ------------------------------------------------------------------------------


def _summary(name: str, loaded: Union[profiles.Profile, profiles.ProfileError]) -> Dict[str, Any]:
    if isinstance(loaded, profiles.ProfileError):
        return {"name": name, "ok": False, "error": str(loaded)}
    oldest = min((s.verified for s in loaded.stamps), default=None)
    return {"name": name, "ok": True, "kind": loaded.kind, "meter_stop_action": loaded.meter_stop_action,
            "deadman": loaded.deadman.action, "oldest_stamp": oldest, "path": str(loaded.path)}


@profile_group.command("list")
@JSON_OPTION
def list_command(as_json: bool) -> None:
    """Every profile, with its oldest stamp.

    Shows each profile's kind, the action that really stops the meter, the dead-man's action and
    its oldest `verified` month. A profile that does not load is listed as BROKEN (exit 1)."""
    where = profiles.directory()
    _known(where)
    rows = [_summary(name, loaded) for name, loaded in profiles.load_all(where).items()]
    broken = [r for r in rows if not r["ok"]]
    if as_json:
        emit_json({"directory": str(where), "profiles": rows, "broken": len(broken)})
    else:
        table: List[Tuple[str, ...]] = [(r["name"], r["kind"], r["meter_stop_action"] or "-", r["deadman"],
                                         r["oldest_stamp"] or "-") for r in rows if r["ok"]]
        table += [(r["name"], "BROKEN", "-", "-", r["error"]) for r in broken]
        click.echo(render.table(("NAME", "KIND", "METER STOP", "DEAD-MAN", "OLDEST STAMP"), table))
    if broken:
        raise CliError(f"{len(broken)} of {len(rows)} profiles in {where} do not load",
                       hint="each broken one names its file, line and key; fix it, or remove the file")


# ---- rgt profile show NAME -------------------------------------------------------------------------


def _load(name: str) -> profiles.Profile:
    where = profiles.directory()
    if name not in _known(where):
        known = ", ".join(profiles.names(where))
        raise click.BadParameter(f"no profile {name!r} in {where} (known: {known})", param_hint="NAME")
    try:
        return profiles.load(name, where)
    except profiles.ProfileError as e:
        raise CliError(str(e), hint="fix the line it names; `rgt profile list` shows every broken one") from e


def to_dict(p: profiles.Profile) -> Dict[str, Any]:
    """A profile as plain JSON data, the what-to-know-before-renting block first."""
    def plain(obj: Any) -> Any:
        return dataclasses.asdict(obj)

    return {
        "name": p.name, "kind": p.kind, "path": str(p.path),
        "surface": plain(p.surface),
        "storage": [plain(t) for t in p.storage.values()],
        "meter_stop_action": p.meter_stop_action,
        "actions": [plain(a) for a in p.actions.values()],
        "ssh": plain(p.ssh), "spot": plain(p.spot), "deadman": plain(p.deadman),
        "scripts": {**plain(p.scripts), "env": dict(p.scripts.env)},
        "stamps": [s._asdict() for s in p.stamps],
    }


def _show_surface(p: profiles.Profile) -> None:
    _echo(f"{p.name} ({p.kind}): know this before you rent")
    s = p.surface
    if not s:
        _echo("  (the profile says nothing here)")
    if s.meter_stop:
        _echo(f"  stops the meter: {s.meter_stop}")
    for clock in s.danger_clocks:
        _echo(f"  danger clock:    {clock}")
    for note in s.notes:
        _echo(f"  note:            {note}")


def _show_storage(p: profiles.Profile) -> None:
    _echo()
    if not p.storage:
        _echo("storage: none described")
        return
    _echo("storage: what survives a stop and a release (release = terminate / destroy)")
    rows = [(t.name, t.path or "(chosen at create)", "kept" if t.survives_stop else "LOST",
             "kept" if t.survives_release else "LOST", t.verified, t.bills_while_stopped or "-")
            for t in p.storage.values()]
    click.echo(render.table(("TIER", "PATH", "STOP", "RELEASE", "VERIFIED", "BILLS WHILE STOPPED"), rows,
                            indent="  "))
    for t in p.storage.values():
        extra = "; ".join(x for x in (t.note.rstrip("."), f"cap: {t.cap}" if t.cap else "") if x)
        if extra:
            _echo(f"  {t.name}: {extra}")


def _show_action(a: profiles.Action, meter_stop: bool) -> None:
    flags = [f"stops the meter: {_yes(a.stops_meter)}", f"reversible: {_yes(a.reversible)}",
             f"verified {a.verified}"]
    _echo(f"  {a.name}{' (the meter stop)' if meter_stop else ''}: {', '.join(flags)}")
    _echo(f"    deletes:     {a.deletes}")
    if a.still_bills:
        _echo(f"    still bills: {a.still_bills}")
    if a.command:
        _echo(f"    command:     {a.command}")
    if a.box_command:
        _echo(f"    on the box:  {a.box_command}")
    if a.credentials_env:
        _echo(f"    credentials: from ${', $'.join(a.credentials_env)}")
    for step in a.console:
        _echo(f"    console:     {step}")
    if a.source:
        _echo(f"    source:      {a.source}")


def _show_actions(p: profiles.Profile) -> None:
    _echo()
    if not p.actions:
        _echo("actions: none (nothing to stop or release)")
        return
    _echo(f"actions (the one that really stops the meter: {p.meter_stop_action or 'none named'})")
    for a in p.actions.values():
        _show_action(a, a.name == p.meter_stop_action)


def _stamp(verified: Optional[str], source: str) -> str:
    when = f"verified {verified}" if verified else "no stamp"
    return f"{when}; {source}" if source else when


def _show_ssh_spot(p: profiles.Profile) -> None:
    h, s = p.ssh, p.spot
    _echo()
    _echo(f"ssh: user {h.user or '?'}, port changes on restart: {_yes(h.port_changes_on_restart)}, "
          f"rsync works: {_yes(h.rsync_works)}")
    for note in h.notes:
        _echo(f"  {note}")
    if h != profiles.Ssh():
        _echo(f"  ({_stamp(h.verified, h.source)})")
    _echo()
    if s.available:
        grace = "?" if s.grace_s is None else f"{s.grace_s:g} s"
        _echo(f"spot: available; notice: {s.signal or '?'}; grace: {grace}")
    else:
        _echo(f"spot: {'not available' if s.available is False else 'not described'}")
    for note in s.notes:
        _echo(f"  {note}")
    if s != profiles.Spot():
        _echo(f"  ({_stamp(s.verified, s.source)})")


def _show_deadman(p: profiles.Profile) -> None:
    d = p.deadman
    _echo()
    chosen = p.actions.get(d.action)
    how = f" (runs: {chosen.box_command})" if chosen is not None and chosen.box_command else ""
    _echo(f"dead-man: {d.action}{how}")
    if d.allow:
        _echo(f"  a person may pre-authorize: {', '.join(d.allow)}")
    if d.instance_id_env:
        _echo(f"  the instance id comes from ${d.instance_id_env} on the box")
    if d.why:
        _echo(f"  why: {d.why}")
    if d.verified:
        _echo(f"  ({_stamp(d.verified, d.source)})")


def _show_scripts(p: profiles.Profile) -> None:
    s = p.scripts
    pairs = [("python", s.python), ("proxy hook", s.proxy_hook), ("data dir", s.data_dir),
             ("durable dir", s.durable_dir)]
    lines = [f"  {k}: {v}" for k, v in pairs if v] + [f"  env {k}={v}" for k, v in s.env.items()]
    _echo()
    _echo("script overrides:" if lines else "script overrides: none")
    for line in lines:
        _echo(line)


@profile_group.command("show")
@click.argument("name", metavar="NAME")
@JSON_OPTION
def show_command(name: str, as_json: bool) -> None:
    """One profile, what to know before renting first.

    Then the storage tiers as a survival matrix, the actions with what they delete and still
    bill, ssh, spot, the dead-man and the script overrides."""
    p = _load(name)
    if as_json:
        emit_json(to_dict(p))
        return
    _show_surface(p)
    _show_storage(p)
    _show_actions(p)
    _show_ssh_spot(p)
    _show_deadman(p)
    _show_scripts(p)
    _echo()
    _echo(f"file: {p.path}")


# ---- rgt profile stale -----------------------------------------------------------------------------


def _month(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[str]:
    if value is not None and not profiles.is_month(value):
        raise click.BadParameter(f"{value!r} is not a YYYY-MM month")
    return value


@profile_group.command("stale")
@click.option("--months", type=click.IntRange(min=0), default=profiles.STALE_MONTHS, show_default=True,
              help="A stamp older than this many months is stale.")
@click.option("--today", metavar="YYYY-MM", default=None, callback=_month,
              help="Count ages to this month instead of the current one.")
@JSON_OPTION
def stale_command(months: int, today: Optional[str], as_json: bool) -> None:
    """Stamps older than --months (exit 1 if any).

    Lists FILE:LINE, key, stamp and age of each stale `verified` month. Passing only says every
    fact was checked recently, never that it is still true."""
    where = profiles.directory()
    _known(where)
    now = today or profiles.this_month()
    try:
        aged = profiles.ages(now, where)
        old = profiles.stale(now, months, where)
    except profiles.ProfileError as e:
        raise CliError(str(e), hint="`rgt profile list` shows every broken profile") from e
    if not aged:
        raise CliError(f"no verified stamps in {where}",
                       hint="wrong RGT_PROFILES_DIR, or the stamps were dropped")
    if as_json:
        emit_json({"directory": str(where), "today": now, "months": months, "scanned": len(aged),
                   "stale": [{**dataclasses.asdict(a), "path": str(a.path)} for a in old],
                   "note": _PASSING.format(months=months)})
    elif old:
        click.echo(render.table(("FILE:LINE", "KEY", "VERIFIED", "AGE"),
                                [(a.where, a.key, a.verified, f"{a.age_months} months") for a in old]))
    else:
        _echo(f"{len(aged)} stamps in {len({a.profile for a in aged})} profiles, none older than "
              f"{months} months on {now}")
        _echo(_PASSING.format(months=months))
    if old:
        raise CliError(f"{len(old)} of {len(aged)} stamps are older than {months} months on {now}",
                       hint="check each fact against the provider's current page, then update its stamp")
