"""The dead-man daemon: one small process per box that acts when nobody renews the lease.

    python -m onbox.deadman.daemon [--foreground]      (also `rgt-onbox deadman run`)

It takes an flock on ~/.rgt/deadman.lock (a second daemon finds it held and exits 0 at once),
writes ~/.rgt/deadman.pid, and every tick reads the lease and the runs under its roots and asks
`onbox.deadman.lease.decide` what to do, judged on the boot clock and on file changes it saw itself, never
on the wall clock (onbox/deadman/clock.py): say a warning (deadman.expiring, 30 then 5 minutes before
an end) or that it holds (deadman.held), each once per lease period, or fire. It ends when the lease is
disarmed, gone or fired. Launches, `deadman renew` and every sidecar start it again while the lease
is armed (`ensure_daemon`), so a killed daemon comes back.

Firing (`Daemon.fire`): the action is the one a person pre-authorized (only an action in the
profile's deadman.allow, and only while the teardown gate still holds: no checkpoint in any run's
custody manifest is newer than the authorization), else the profile's deadman.action, else notify.
A command action falls back to notify, saying why, when its program is not on PATH, when it needs an
instance id nobody knows, or when a run keeps files on a storage tier that a stop wipes. "fired" in
state firing is written to the lease (fsync'd) and deadman.firing to the log (fsync'd) before the
command runs, so a daemon restarted in the middle never runs it again. The command runs without a
shell, with only PATH, HOME, LANG and the profile's credentials_env names (from the daemon's
environment, else the box's secrets), for at most 120 s. notify writes ~/.rgt/DEADMAN_FIRED.txt and
the deadman.fired record and touches nothing else.

Test hooks (documented, never for real use): RGT_DEADMAN_TIMESCALE=K makes the daemon's boot clock
run K times faster than real time from its start (the lease's boot stamps are read through the same
frame); RGT_DEADMAN_TICK_S sets the tick in real seconds (default 10).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import profiles
from rgtlib import lockfile

import onbox
from onbox.deadman.clock import Activity, LeaseTimer, Timebase, newer_checkpoints
from onbox.deadman.lease import (
    NOTIFY,
    DeadmanPaths,
    Decision,
    Lease,
    LeaseRead,
    RunActivity,
    append_event,
    collect_runs,
    decide,
    fired_since_armed,
    paths_for,
    read_events,
    read_lease,
    update_lease,
)
from onbox.fsutil import write_atomic
from onbox.launch.redact import is_secret_name, redact_text
from onbox.launch.secrets import read_secrets
from onbox.runs import ProcRef, read_json, write_json_atomic

log = logging.getLogger(__name__)

TICK_S = 10.0
ACTION_TIMEOUT_S = 120.0
SPAWN_TIMEOUT_S = 15.0
KEEP_ENV = ("PATH", "HOME", "LANG")


# ---- time ---------------------------------------------------------------------------------------


def hooks(environ: Mapping[str, str]) -> Tuple[float, float]:
    """(timescale, tick seconds) from the test hooks; (1, TICK_S) without them."""
    def number(name: str, default: float) -> float:
        try:
            value = float(environ.get(name) or default)
        except ValueError:
            return default
        return value if value > 0 else default

    return number("RGT_DEADMAN_TIMESCALE", 1.0), number("RGT_DEADMAN_TICK_S", TICK_S)


# ---- the action ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    """What firing now would run, and why."""

    action: str                                   # NOTIFY or an [actions.<name>] of the profile
    reason: str                                   # why this action
    argv: List[str] = dataclasses.field(default_factory=list)
    env: Dict[str, str] = dataclasses.field(default_factory=dict, repr=False)  # never printed
    why: str = ""                                 # the profile's deadman.why
    refused: Optional[str] = None                 # why a command action fell back to notify
    wanted: Optional[str] = None                  # the action that was refused
    still_bills: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return {"action": self.action, "reason": self.reason, "argv": self.argv, "why": self.why,
                "refused": self.refused, "wanted": self.wanted, "still_bills": self.still_bills}


def _pid1_env(name: str, proc: Path = Path("/proc")) -> Optional[str]:
    """A variable of the container's first process (where rentals put their instance ids)."""
    try:
        raw = (proc / "1" / "environ").read_bytes()
    except OSError:
        return None
    for item in raw.split(b"\0"):
        key, eq, value = item.partition(b"=")
        if eq and key.decode(errors="replace") == name:
            return value.decode(errors="replace")
    return None


def _wiped_by_stop(profile: profiles.Profile, runs: Sequence[RunActivity],
                   environ: Mapping[str, str]) -> Optional[str]:
    """Why a stop could lose a run's files: one of them lies on a tier that does not survive it,
    or on storage the profile does not describe (unknown is not safe)."""
    for run in runs:
        for path in filter(None, (run.run_dir, run.ckpt_dir)):
            tier = profile.tier_of(os.path.realpath(path), environ)
            if tier is None:
                return (f"run {run.run_id} keeps files at {path}, on storage the {profile.name} profile "
                        "does not describe, so a stop might wipe them")
            if not tier.survives_stop:
                return (f"run {run.run_id} keeps files at {path}, on the {tier.name} storage, "
                        "which a stop wipes")
    return None


def _action_env(names: Sequence[str], environ: Mapping[str, str]) -> Dict[str, str]:
    env = {k: environ[k] for k in KEEP_ENV if environ.get(k)}
    missing = [n for n in names if not environ.get(n)]
    found = read_secrets(environ=environ) if missing else {}
    for name in names:
        value = environ.get(name) or found.get(name)
        if value:
            env[name] = value
    return env


def _choose(profile: profiles.Profile, lease: Lease, runs: Sequence[RunActivity]) -> Tuple[str, str]:
    """(action name, why it is the one): the authorized one while it holds, else the default."""
    auth = lease.authorized
    default = profile.deadman.action
    if auth is None:
        return default, f"the {profile.name} profile's dead-man action"
    if auth["action"] not in profile.deadman.allow:
        return default, (f"{auth['action']!r} was authorized but the {profile.name} profile does not allow "
                         f"it; the profile's dead-man action instead")
    newer = newer_checkpoints([r.run_dir for r in runs], float(auth["at"]), auth.get("covered"))
    if newer:
        return default, (f"{auth['action']!r} was authorized, but {len(newer)} checkpoint(s) are newer than "
                         f"the authorization ({newer[0]} ...): the teardown gate no longer holds")
    by = auth.get("by", "?")
    return auth["action"], f"{auth['action']!r} was pre-authorized by {by} and the gate holds"


def plan_action(lease: Lease, runs: Sequence[RunActivity], environ: Mapping[str, str], *,
                which: Callable[..., Optional[str]] = shutil.which,
                pid1_env: Callable[[str], Optional[str]] = _pid1_env) -> Plan:
    """The action firing now would take (see the module doc); runs nothing."""
    if not lease.profile:
        return Plan(NOTIFY, "no profile was named for this box: notify only")
    try:
        profile = profiles.load(lease.profile, profiles.directory(environ))
    except profiles.ProfileError as e:
        return Plan(NOTIFY, "the profile cannot be read: notify only", refused=str(e), wanted=lease.profile)
    name, reason = _choose(profile, lease, runs)
    why = profile.deadman.why
    if name == NOTIFY:
        return Plan(NOTIFY, reason, why=why)
    action = profile.actions[name]
    template = action.box_command or ""

    def refuse(text: str) -> Plan:
        return Plan(NOTIFY, f"{reason}, refused: notify instead", why=why, refused=text, wanted=name)

    needed = set(profiles.command_fields(template))
    instance = None
    if profile.deadman.instance_id_env:
        env_name = profile.deadman.instance_id_env
        instance = environ.get(env_name) or pid1_env(env_name)
    if not instance and lease.authorized:
        instance = lease.authorized.get("instance_id")
    if "instance_id" in needed and not instance:
        return refuse(f"{name} needs the instance id, and neither ${profile.deadman.instance_id_env or '?'} "
                      "nor an authorization gives it")
    values = {"instance_id": instance or "", "host": os.uname().nodename.split(".")[0],
              "run_id": max((r.run_id for r in runs), default="")}
    argv = profiles.fill_command(template, values)
    if argv[:1] == ["python3"] and argv[1:2] == ["-m"] and argv[2:3] and argv[2].startswith("onbox."):
        argv[0] = sys.executable  # our own module: the interpreter rgt-onbox is installed in
    env = _action_env(action.credentials_env, environ)
    if not argv or which(argv[0], path=env.get("PATH", "")) is None:
        return refuse(f"the program {argv[0] if argv else '?'!r} of {name} is not on PATH")
    # A stop must not wipe a run's files. An irreversible action ran only past the teardown gate
    # (a person authorized it after a verified pull), which is its guard instead.
    wiped = _wiped_by_stop(profile, runs, environ) if action.reversible else None
    if wiped:
        return refuse(wiped)
    return Plan(name, reason, argv=argv, env=env, why=why, still_bills=action.still_bills)


# ---- the daemon ---------------------------------------------------------------------------------


Runner = Callable[..., "subprocess.CompletedProcess[bytes]"]


class Daemon:
    """The decisions and the firing; `serve` loops `tick` until the lease says stop."""

    def __init__(self, paths: DeadmanPaths, environ: Optional[Mapping[str, str]] = None, *,
                 clock: Optional[Timebase] = None, tick_s: float = TICK_S, runner: Runner = subprocess.run,
                 which: Callable[..., Optional[str]] = shutil.which) -> None:
        self.paths = paths
        self.environ = dict(os.environ if environ is None else environ)
        self.clock = clock or Timebase()
        self.timer = LeaseTimer(self.clock)   # where lease periods start in the daemon's time
        self.activity = Activity()            # the runs' file changes it saw
        self.tick_s = tick_s
        self._runner = runner
        self._which = which
        self._said: Set[str] = set()
        for record in read_events(paths):  # a restarted daemon does not repeat itself
            if record["kind"] in ("deadman.expiring", "deadman.held"):
                self._said.add(str(record["data"].get("key")))

    def _event(self, kind: str, data: Mapping[str, Any]) -> Dict[str, Any]:
        record = append_event(self.paths, kind, data, now=self.clock.wall())
        log.info("%s %s", kind, json.dumps(record["data"], default=str)[:400])
        return record

    def tick(self) -> bool:
        """One look at the lease and the runs; False when the daemon has nothing left to do."""
        read = read_lease(self.paths, self.environ)
        lease = read.lease
        if lease is None or not lease.armed:
            log.info("lease %s: nothing to watch", read.state)
            return False
        if lease.fired is not None:
            if lease.fired.get("state") == "firing":
                self._interrupted(lease)
            return False
        now = self.clock.now()
        runs = collect_runs(lease.roots, self.activity, now)
        decision = decide(lease, runs, now, self.timer.anchors(lease, now))
        self._warn(lease, decision)
        if decision.verdict == "held" and decision.key not in self._said:
            self._said.add(decision.key)
            self._event("deadman.held", {"key": decision.key, "reason": decision.reason,
                                         "progressing": list(decision.progressing), "idle_s": lease.idle_s,
                                         "expired_s": round(-(decision.seconds_left or 0.0), 1)})
        if decision.verdict == "fire":
            return not self.fire(read, decision, runs)
        return True

    def _warn(self, lease: Lease, decision: Decision) -> None:
        for due in decision.warnings:
            if due.key in self._said:
                continue
            self._said.add(due.key)
            ends = self.clock.wall() + due.seconds_left / self.clock.scale  # by the boot clock
            self._event("deadman.expiring", {"key": due.key, "minutes_left": due.minutes_left,
                                             "seconds_left": round(due.seconds_left, 1),
                                             "trigger": due.trigger, "ends_at": ends})

    def _interrupted(self, lease: Lease) -> None:
        """A daemon died while its action ran: record that, and never run it again."""
        fired = dict(lease.fired or {})

        def change(read: LeaseRead) -> Optional[Lease]:
            now_fired = read.lease.fired if read.lease is not None else None
            if read.lease is None or now_fired is None or now_fired.get("state") != "firing":
                return None
            return dataclasses.replace(read.lease, fired={**now_fired, "state": "failed"})

        _, written = update_lease(self.paths, change, self.environ)
        if written is not None:
            self._event("deadman.fired", {"action": fired.get("action"), "outcome": "interrupted",
                                          "exit_code": None, "argv": fired.get("argv") or [],
                                          "reason": "the daemon stopped while the action ran; it is not "
                                                    "run again"})

    def fire(self, read: LeaseRead, decision: Decision, runs: Sequence[RunActivity]) -> bool:
        """Take the action once; False when it did not fire after all (renewed meanwhile)."""
        lease = read.lease
        assert lease is not None
        if fired_since_armed(read_events(self.paths)):
            log.warning("the log shows a firing since the lease was armed: not again")
            return True
        plan = plan_action(lease, runs, self.environ, which=self._which)
        state = "done" if plan.action == NOTIFY else "firing"
        record = {"at": self.clock.wall(), "boottime": self.clock.clocks.boot(), "action": plan.action,
                  "argv": plan.argv, "state": state, "exit_code": None}

        def change(now_read: LeaseRead) -> Optional[Lease]:
            now = now_read.lease
            same = (now is not None and now.armed and now.fired is None and now.renewed_at == lease.renewed_at
                    and now.renewed_boottime == lease.renewed_boottime
                    and now.budget_started_at == lease.budget_started_at)
            return dataclasses.replace(now, fired=record) if same and now is not None else None

        _, written = update_lease(self.paths, change, self.environ)
        if written is None:
            log.info("the lease changed before firing (renewed or disarmed): not firing")
            return False
        base = {"trigger": decision.trigger, "reason": decision.reason, "why": plan.why,
                "choice": plan.reason, "refused": plan.refused, "wanted": plan.wanted}
        if plan.action == NOTIFY:
            self._event("deadman.fired", {**base, "action": NOTIFY, "outcome": "notified", "exit_code": None,
                                          "argv": []})
            self._explain(decision, plan, "notified: nothing on this box was touched")
            return True
        self._event("deadman.firing", {**base, "action": plan.action, "argv": plan.argv,
                                       "still_bills": plan.still_bills})
        outcome, code, tail = self._run(plan)
        final = {**record, "state": "done" if outcome == "done" else "failed", "exit_code": code}

        def finish(now_read: LeaseRead) -> Optional[Lease]:
            now = now_read.lease
            return dataclasses.replace(now, fired=final) if now is not None and now.fired == record else None

        update_lease(self.paths, finish, self.environ)
        self._event("deadman.fired", {**base, "action": plan.action, "outcome": outcome, "exit_code": code,
                                      "argv": plan.argv, "output": tail, "still_bills": plan.still_bills})
        self._explain(decision, plan, f"{outcome} (exit code {code})")
        return True

    def _run(self, plan: Plan) -> Tuple[str, Optional[int], str]:
        """(outcome done | failed | timeout | error, exit code, the output's tail, secrets masked)."""
        secrets = [v for k, v in plan.env.items() if k not in KEEP_ENV]
        try:
            done = self._runner(plan.argv, env=plan.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, timeout=ACTION_TIMEOUT_S, check=False,
                                cwd=self.environ.get("HOME") or "/")
        except subprocess.TimeoutExpired as e:
            out = e.output or b""
            return "timeout", None, redact_text(out.decode(errors="replace")[-500:], secrets)
        except OSError as e:
            return "error", None, f"{type(e).__name__}: {e.strerror or e}"
        out = (done.stdout or b"").decode(errors="replace")[-500:]
        return ("done" if done.returncode == 0 else "failed"), done.returncode, redact_text(out, secrets)

    def _explain(self, decision: Decision, plan: Plan, outcome: str) -> None:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.clock.wall()))
        refused = f" The action {plan.wanted} was not taken: {plan.refused}." if plan.refused else ""
        text = (f"The rgt dead-man timer of this box fired at {when}: {decision.reason}. It chose "
                f"{plan.action} ({plan.reason}) and the outcome was {outcome}.{refused} "
                f"{plan.why + ' ' if plan.why else ''}"
                "It acts once per lease: `rgt-onbox deadman status` shows the lease and its log, "
                "`rgt-onbox deadman arm --ttl 2h` (or a new launch) arms it again, and "
                "`rgt-onbox deadman disarm` turns it off. Pull and verify your checkpoints before "
                "anything else is done to this machine.\n")
        try:
            write_atomic(self.paths.fired_txt, text, mode=0o644)
        except OSError:
            log.exception("cannot write %s", self.paths.fired_txt)

    def serve(self, stop: threading.Event) -> int:
        """Tick until the lease says stop or `stop` is set; a tick that raises is logged and retried."""
        while not stop.is_set():
            try:
                go = self.tick()
            except Exception:  # a job boundary: log it and try again next tick
                log.exception("dead-man tick failed")
                go = True
            if not go:
                break
            stop.wait(self.tick_s)
        return 0


# ---- the process --------------------------------------------------------------------------------


def take_lock(paths: DeadmanPaths) -> Optional[int]:
    """The daemon's singleton lock, or None when another process holds it."""
    paths.ensure_dir()
    return lockfile.try_lock(paths.lock)


def daemon_pid(paths: DeadmanPaths) -> Optional[int]:
    """The running daemon's pid: its lock is held and its pid file names a live process."""
    if not paths.lock.exists():
        return None
    fd = take_lock(paths)
    if fd is not None:
        os.close(fd)
        return None
    ref = ProcRef.from_dict(read_json(paths.pid))
    return ref.pid if ref is not None and ref.alive() else None


def wanted(read: LeaseRead) -> bool:
    """A daemon should run: the lease is armed and has not fired."""
    return read.lease is not None and read.lease.armed and read.lease.fired is None


def _spawn_env(environ: Mapping[str, str]) -> Dict[str, str]:
    env = {k: v for k, v in environ.items() if not is_secret_name(k)}
    here = str(Path(onbox.__file__).resolve().parent.parent)  # where `import onbox` finds this one
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [environ.get("PYTHONPATH")])])
    return env


def ensure_daemon(paths: DeadmanPaths, environ: Optional[Mapping[str, str]] = None,
                  python: str = sys.executable) -> Dict[str, Any]:
    """Start the daemon (detached, through `python -m onbox.deadman.daemon`) when the lease wants one and
    none runs. Returns {"running", "pid", "started", "reason"}; never raises for a failed start."""
    env = dict(os.environ if environ is None else environ)
    read = read_lease(paths, env)
    if not wanted(read):
        return {"running": False, "pid": None, "started": False, "reason": f"lease {read.state}"}
    pid = daemon_pid(paths)
    if pid is not None:
        return {"running": True, "pid": pid, "started": False, "reason": "already running"}
    try:
        done = subprocess.run([python, "-m", "onbox.deadman.daemon"], env=_spawn_env(env), cwd=str(paths.dir),
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=SPAWN_TIMEOUT_S,
                              check=False)
        answer = json.loads(done.stdout.decode(errors="replace").strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return {"running": False, "pid": None, "started": False, "reason": f"could not start it: {e}"}
    return {"running": bool(answer.get("pid")), "pid": answer.get("pid"),
            "started": bool(answer.get("started")), "reason": str(answer.get("reason", ""))}


def run_foreground(paths: DeadmanPaths, environ: Optional[Mapping[str, str]] = None,
                   ready: Optional[Callable[[Dict[str, Any]], None]] = None) -> int:
    """The daemon in this process; returns at once (0) when another daemon holds the lock."""
    env = dict(os.environ if environ is None else environ)
    say = ready or (lambda _msg: None)
    fd = take_lock(paths)
    if fd is None:
        say({"started": False, "pid": daemon_pid(paths), "reason": "another daemon holds the lock"})
        return 0
    me = ProcRef.of(os.getpid())
    write_json_atomic(paths.pid, me.to_dict() if me else {"pid": os.getpid()})
    stop = threading.Event()
    _install_signals(stop)
    scale, tick_s = hooks(env)
    try:
        daemon = Daemon(paths, env, clock=Timebase(scale=scale), tick_s=tick_s)
        say({"started": True, "pid": os.getpid(), "reason": "started"})
        log.info("dead-man daemon %d watching %s (tick %g s, timescale %g)", os.getpid(), paths.lease,
                 tick_s, scale)
        return daemon.serve(stop)
    finally:
        if ProcRef.from_dict(read_json(paths.pid)) == me:
            paths.pid.unlink(missing_ok=True)
        os.close(fd)


def _install_signals(stop: threading.Event) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def start_detached(paths: DeadmanPaths, environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Fork the daemon into its own session (stdio to /dev/null and ~/.rgt/deadman.log) and wait
    until it holds the lock or found it held. Call only from a single-threaded process."""
    paths.ensure_dir()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; its work is checked through its files and log
        code = 1
        try:
            os.close(r)
            os.setsid()
            _redirect(paths)
            logging.basicConfig(level=logging.INFO, force=True,
                                format="%(asctime)s rgt-deadman %(levelname)s: %(message)s")
            code = run_foreground(paths, environ, lambda msg: _tell(w, msg))
        finally:
            logging.shutdown()
            os._exit(code)
    os.close(w)
    try:
        return _hear(r, pid)
    finally:
        os.close(r)


def _redirect(paths: DeadmanPaths) -> None:  # pragma: no cover - in the forked child
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)


def _tell(fd: int, msg: Mapping[str, Any]) -> None:  # pragma: no cover - in the forked child
    try:
        os.write(fd, (json.dumps(msg) + "\n").encode())
        os.close(fd)
    except OSError:
        pass


def _hear(fd: int, pid: int) -> Dict[str, Any]:
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return {"started": False, "pid": None, "reason": f"the daemon (pid {pid}) did not answer"}
        chunk = os.read(fd, 4096)
        if not chunk:
            return {"started": False, "pid": None, "reason": f"the daemon (pid {pid}) exited at once"}
        data += chunk
    try:
        answer = json.loads(data.split(b"\n")[0])
    except ValueError:
        answer = None
    return answer if isinstance(answer, dict) else {"started": False, "pid": None, "reason": "no answer"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onbox.deadman.daemon",
                                     description="The box's dead-man daemon (see onbox/deadman/daemon.py).")
    parser.add_argument("--foreground", action="store_true", help="Run in this process, logging to stderr.")
    args = parser.parse_args(argv)
    paths = paths_for()
    if args.foreground:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s rgt-deadman %(levelname)s: %(message)s")
        return run_foreground(paths)
    sys.stdout.write(json.dumps(start_detached(paths)) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
