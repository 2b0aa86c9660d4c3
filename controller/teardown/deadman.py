"""`rgt deadman HOST ...`: the box's dead-man lease, seen and kept from here.

    status(store, "box")                 # the lease, the daemon, what it would do now
    renew(store, "box", ttl="2h")        # push the expiry out (the watcher also does this, over ZeroMQ)
    disarm(store, "box")
    authorize(store, "box", "terminate", instance_id="i-1", typed="box")

Every call runs `rgt-onbox deadman <op> --json` on the box through the host's one shell (its ssh
master, or this machine for `local`) and returns the box's JSON answer. Disarming and renewing are
always allowed: they only make the dead-man less eager. Authorizing a destructive action is not: it
needs the teardown gate (controller/teardown/gate.py) OPEN for every run this controller launched on the
host, and the host's name typed, because once authorized the box may run the action with nobody
watching. The box itself re-checks that no checkpoint appeared after the authorization before it
acts (onbox/deadman/lease.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict, List, Optional, Sequence

from controller.box.handle import Box
from controller.box.ssh import SshError
from controller.output import error_tail
from controller.render import printable
from controller.runs import life
from controller.store.db import Store
from controller.teardown import gate as teardown

CALL_TIMEOUT_S = 120


class DeadmanError(Exception):
    """The box could not answer, or the request is refused; `hint` is the next step for a person."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


def box_call(store: Store, host: str, args: Sequence[str], box: Optional[Box] = None) -> Dict[str, Any]:
    """Run `rgt-onbox deadman ARGS --json` on HOST (through `box`: HOST's handle); its JSON answer
    (DeadmanError if none)."""
    try:
        done, answer = (box or Box.of(store, host)).run_onbox(["deadman", *args, "--json"], CALL_TIMEOUT_S)
    except SshError as e:
        raise DeadmanError(e.message, e.hint) from e
    if answer is None and done.returncode in (1, 2, 3):  # rgt-onbox ran and said no
        raise DeadmanError(f"{host} refused `deadman {args[0]}`: {error_tail(done.stderr)}")
    if answer is None:
        raise DeadmanError(f"`rgt-onbox deadman {args[0]}` failed on {host} (exit {done.returncode}): "
                           f"{error_tail(done.stderr)}",
                           hint=f"rgt install {host} puts a matching rgt-onbox there")
    if done.returncode != 0:
        raise DeadmanError(f"{host} refused `deadman {args[0]}`: {answer.get('error') or answer}")
    return answer


def status(store: Store, host: str) -> Dict[str, Any]:
    return box_call(store, host, ["status"])


def renew(store: Store, host: str, ttl: Optional[str] = None) -> Dict[str, Any]:
    return box_call(store, host, ["renew", *(["--ttl", ttl] if ttl else [])])


def arm(store: Store, host: str, ttl: str, idle: Optional[str] = None,
        max_hours: Optional[float] = None) -> Dict[str, Any]:
    args = ["arm", "--ttl", ttl]
    if idle:
        args += ["--idle", idle]
    if max_hours is not None:
        args += ["--max-hours", f"{max_hours:g}"]
    box = Box.of(store, host)
    if box.profile:
        args += ["--profile", box.profile]
    return box_call(store, host, args, box)


def disarm(store: Store, host: str) -> Dict[str, Any]:
    return box_call(store, host, ["disarm"])


@dataclasses.dataclass
class RunGate:
    run: str
    gate: teardown.Gate

    def to_dict(self) -> Dict[str, Any]:
        return {"run": self.run, **dataclasses.asdict(self.gate)}


def _viewer(store: Store, host: str, run_dir: str) -> teardown.ViewFn:
    return lambda: teardown.box_view(store, host, run_dir)


def host_gates(store: Store, host: str) -> List[RunGate]:
    """The teardown gate of every run launched on HOST through this controller."""
    gates = []
    for info in store.runs():
        if info.get("target") != host or not info.get("run_dir"):
            continue
        run = str(info["run"])
        gates.append(RunGate(run, teardown.judge(run, teardown.pulled_dir_of(store, run),
                                                 _viewer(store, host, str(info["run_dir"])),
                                                 job=life.of_run(store, run))))
    return gates


def authorize(store: Store, host: str, action: str, *, instance_id: str,
              typed: Optional[str]) -> Dict[str, Any]:
    """Let the box's dead-man run ACTION (one of its profile's `allow`) when it fires."""
    gates = host_gates(store, host)
    if not gates:
        raise DeadmanError(f"no run launched on {host} through rgt is known: nothing proves its "
                           "checkpoints are safe here",
                           hint=f"rgt launch {host} ..., then rgt pull and rgt verify")
    closed = [g for g in gates if not g.gate.open]
    if closed:
        first = closed[0]
        raise DeadmanError(f"the teardown gate of run {first.run} is closed: {first.gate.reason}",
                           hint=f"rgt pull {first.run}, then rgt verify {first.run}; "
                                f"rgt teardown {first.run} --plan shows every rule")
    if typed is None or typed.strip() != host:
        raise DeadmanError(f"the typed host name does not match {host}: nothing was authorized",
                           hint=f"pass --yes {host} to confirm")
    answer = box_call(store, host, ["authorize", action, "--instance-id", instance_id])
    return {**answer, "gates": [g.to_dict() for g in gates]}


# ---- rendering ------------------------------------------------------------------------------------


def _left(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds):  # the box's JSON may say NaN
        return "-"
    s = int(seconds)
    sign = "-" if s < 0 else ""
    s = abs(s)
    return f"{sign}{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{sign}{s // 60}m{s % 60:02d}s"


def render(host: str, answer: Dict[str, Any]) -> str:
    """A few lines a person reads: armed or not, time left, the daemon, what it would do now.
    Every value is the box's, so each line is escaped (render.printable): a newline or an escape
    sequence in the answer shows as \\x0a or \\x1b, never as a line or a cleared screen."""
    found = answer.get("lease")
    lease: Dict[str, Any] = found if isinstance(found, dict) else answer
    lines = [f"dead-man on {host}: " + ("armed" if lease.get("armed") else "disarmed")]
    if lease.get("armed"):
        lines.append(f"  expires in   {_left(answer.get('seconds_left', lease.get('seconds_left')))} "
                     f"(ttl {_left(lease.get('ttl_s'))}, renewed by {lease.get('renewed_by') or '-'})")
        budget = lease.get("max_hours")
        if budget:
            lines.append(f"  hard budget  {budget:g} h" if isinstance(budget, (int, float))
                         else f"  hard budget  {budget}")
    daemon = answer.get("daemon")
    if isinstance(daemon, dict):
        alive = f"pid {daemon.get('pid')}" if daemon.get("alive") else "not running"
        lines.append(f"  daemon       {alive}")
    decision = answer.get("decision")
    if isinstance(decision, dict) and decision.get("reason"):
        lines.append(f"  now          {decision.get('verdict', '-')}: {decision['reason']}")
    would = answer.get("would")
    if isinstance(would, dict):
        refused = f" (refused: {would['refused']})" if would.get("refused") else ""
        lines.append(f"  when it fires {would.get('action', '-')}: {would.get('reason', '')}{refused}")
        if would.get("still_bills"):
            lines.append(f"  still bills  {would['still_bills']}")
    fired = lease.get("fired")
    if isinstance(fired, dict):
        lines.append(f"  fired        {fired.get('action')} ({fired.get('state')}, "
                     f"exit {fired.get('exit_code')})")
    auth = lease.get("authorized")
    if isinstance(auth, dict):
        lines.append(f"  authorized   {auth.get('action')} for instance {auth.get('instance_id')}")
    return "\n".join(printable(line) for line in lines)


def dumps(answer: Dict[str, Any]) -> str:
    return json.dumps(answer, sort_keys=True)
