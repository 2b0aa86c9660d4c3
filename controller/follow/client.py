"""How any `rgt` command reaches the follower daemon (controller.daemon): start it, ask it.

One daemon per user (per state dir) follows every run into the store and drives every queue. Any
`rgt` command that needs a run followed (`rgt launch`, `rgt watch`, `rgt status`, `rgt track`,
`rgt resume`, a queue's dispatch) calls follow(), which starts the daemon when none runs (the way
SkyPilot starts its local API server) and asks it to follow the run. The daemon holds daemon.lock
in the state dir with its pid in daemon.pid, logs to daemon.log, and answers on a unix socket
beside them (daemon.sock, or its short hashed name in rgt's private socket dir when that path is
too long), one JSON request at a time:

    {"op": "follow", "run": RUN}       follow RUN (again)        -> {"ok": true, "pid": PID}
    {"op": "unfollow", "run": RUN}     stop following RUN now    -> {"ok": true, "was": true|false}
    {"op": "list"}                     what it does              -> {"ok": true, "runs": [..], "queues": [..]}
    {"op": "check_group", "run": G}    record group G's verdicts -> {"ok": true, "recorded": N}
    {"op": "dispatch", "queue": Q}     drive queue Q             -> {"ok": true, "pid": PID}
    {"op": "undispatch", "queue": Q}   stop driving it           -> {"ok": true, "was": true|false}

A followed run has a marker, watchers/RUN.followed, from the request until its follow ends; a
daemon that starts (after a crash, a SIGKILL, a reboot) resumes every marked run and every queue
not over, so killing it loses nothing. With nothing to do for IDLE_EXIT_S it ends itself, and the
next command that needs it starts another.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from rgtlib.units import env_seconds

from controller import paths, pidlock
from controller import trust as boxtrust
from controller.box.ssh import short_socket_path
from controller.box.transport import ask
from controller.follow.watcher import WatchRefused, files, finished
from controller.store.db import Store, StoreError

__all__ = ["DaemonFiles", "ask_daemon", "check_group", "daemon_files", "daemon_pid", "ensure_daemon",
           "follow", "followed", "idle_exit_s", "marked", "running_pid", "stop_daemon", "unfollow"]

log = logging.getLogger(__name__)

IDLE_EXIT_S = 120.0      # nothing followed for this long: the daemon ends itself
ASK_TIMEOUT_MS = 3000    # a request unanswered this long: the daemon is ending, or stuck
ASK_TRIES = 3


@dataclasses.dataclass(frozen=True)
class DaemonFiles:
    lock: Path
    pid: Path
    log: Path
    sock: Path


def daemon_files() -> DaemonFiles:
    d = paths.private_dir(paths.state_dir())
    return DaemonFiles(lock=d / "daemon.lock", pid=d / "daemon.pid", log=d / "daemon.log",
                       sock=short_socket_path(d, "daemon.sock"))


def idle_exit_s() -> float:
    """$RGT_DAEMON_IDLE_S, else IDLE_EXIT_S."""
    return env_seconds("RGT_DAEMON_IDLE_S", IDLE_EXIT_S)


def daemon_pid() -> Optional[int]:
    """The pid of the daemon holding the lock, or None when none runs."""
    f = daemon_files()
    return pidlock.holder(f.lock, f.pid)


def ensure_daemon(wait_s: float = 5.0) -> Optional[int]:
    """The running daemon's pid; one is started (and waited for) when none runs."""
    pid = daemon_pid()
    if pid:
        return pid
    f = daemon_files()
    return pidlock.start("controller.daemon.server", "serve", f.lock, f.pid, f.log, wait_s)


def ask_daemon(request: Dict[str, Any], start: bool, wait_s: float = 5.0) -> Optional[Dict[str, Any]]:
    """Send one request (controller.daemon's ops, above) to the daemon, started first when
    `start`; its answer, or None when no daemon answered in ASK_TRIES tries (one that was ending
    is replaced by a new one)."""
    body = json.dumps(request).encode()
    for _ in range(ASK_TRIES):
        pid = ensure_daemon(wait_s) if start else daemon_pid()
        if not pid:
            return None
        reply = ask(str(daemon_files().sock), body, ASK_TIMEOUT_MS)
        if reply is not None:
            try:
                answer = json.loads(reply)
            except ValueError:
                return None
            return answer if isinstance(answer, dict) else None
    log.warning("the follower daemon did not answer %s; see %s", request.get("op"), daemon_files().log)
    return None


def follow(store: Store, run: str, wait_s: float = 5.0, launched: bool = False) -> Optional[int]:
    """Have the daemon follow RUN (starting it if need be); its pid, or None when no follow is
    needed: a run with no rgt host (one only attached by hand), or one whose sidecar stopped
    and was followed to the end. `launched`: the caller has just started a new attempt (the
    same run id again), whose events nobody has stored yet, so an earlier attempt's stop does not
    count. WatchRefused for a stored run id that is not one."""
    info = store.run(run)
    run_id = str(info["run"])
    try:
        f = files(run_id)
    except boxtrust.Untrusted as e:
        raise WatchRefused(f"rgt does not watch {run_id[:80]!r}: {e}",
                           hint="a box chose that id before rgt checked run ids; launch the job "
                                "again") from None
    if not info["target"] or (not launched and finished(store, run_id)):
        return None
    if launched:  # before asking: a watcher already following the run takes it too
        f.launched.write_text(f"{time.time():.3f}\n")
    f.followed.touch()   # should this daemon die before it answers, the next one resumes the run
    answer = ask_daemon({"op": "follow", "run": run_id}, start=True, wait_s=wait_s)
    if answer is None or not answer.get("ok"):
        log.warning("the follower daemon did not take %s: %s", run_id,
                    (answer or {}).get("error", "no answer"))
    return daemon_pid()


def marked(run: str) -> bool:
    """Whether RUN is to be followed (its marker is there): by the daemon now, or by the next."""
    try:
        return files(run).followed.exists()
    except boxtrust.Untrusted:
        return False


def running_pid(run: str) -> Optional[int]:
    """The daemon's pid when it follows RUN (or has been asked to), else None."""
    return daemon_pid() if marked(run) else None


def unfollow(run: str) -> bool:
    """Have the daemon stop following RUN now (it ends the follow before it answers), and drop
    the run's marker so no later daemon resumes it; whether a follow was running."""
    try:
        marker = files(run).followed
    except boxtrust.Untrusted:
        return False
    answer = ask_daemon({"op": "unfollow", "run": run}, start=False)
    marker.unlink(missing_ok=True)
    return bool(answer and answer.get("was"))


def check_group(group: str) -> int:
    """Have the daemon record multi-node group GROUP's verdicts now (starting it if need be);
    how many it recorded. It answers once they are in the store."""
    answer = ask_daemon({"op": "check_group", "run": group}, start=True)
    if answer is None or not answer.get("ok"):
        raise StoreError(f"the follower daemon did not check group {group[:80]!r}: "
                         f"{(answer or {}).get('error', 'no answer')}")
    return int(answer.get("recorded") or 0)


def followed() -> List[str]:
    """The runs the daemon follows now (none when it does not run)."""
    answer = ask_daemon({"op": "list"}, start=False)
    runs = (answer or {}).get("runs")
    return [str(r) for r in runs] if isinstance(runs, list) else []


def stop_daemon(timeout_s: float = 10.0) -> Optional[int]:
    """SIGTERM the daemon (only the pid its lock file names) and wait for its lock; that pid, or
    None when none ran. The runs it followed keep their markers: the next daemon resumes them."""
    pid = daemon_pid()
    if not pid:
        return None
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return None
    deadline = time.monotonic() + timeout_s
    while daemon_pid() == pid and time.monotonic() < deadline:
        time.sleep(0.02)   # waiting on another process's lock: nothing to block on
    return pid
