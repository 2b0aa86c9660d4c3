"""The per-run background watcher: keeps the store equal to the box's journal.

One process per run (a lock file under the state dir makes it one), started by
`rgt launch`, `rgt watch` or `rgt status` through ensure_watcher(). It reaches
the sidecar through a Link: for host `local` the run's own sockets, for an SSH
host two unix-socket forwards on the host's shared ControlMaster. A Subscriber
thread follows the sidecar; this module's loop supervises the link.

When the link breaks (the master is killed, the box freezes and ServerAlive
gives up, sshd stops), the loop records `link.lost` once, reconnects with
capped, jittered backoff, re-adds the forwards and records `link.restored`.
ZeroMQ reconnects by itself and the subscriber's `since` repair fetches what
was published meanwhile, so nothing is lost or stored twice. A broken link
says only that the transport is down: the events say so, never that the job
died. When the link is up but no event arrives for three heartbeat intervals,
`sidecar.silent` is recorded. A node stream of a multi-node run also checks its group's
verdicts (controller.groups) after each job event it stores, and every GROUP_RECHECK_S.

A run is over when its job's exit is stored: `sidecar.stopping` alone ends nothing (a supervisor
restarts a stopped sidecar while the job trains on). The run id names the watcher's files and the
tunnel sockets, so it is checked (controller.boxtrust) before any path is made of it, and the
subscriber refuses a sidecar that answers for another run or host.

    python -m controller.watcher RUN     (what ensure_watcher starts; logs to watchers/RUN.log)
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Dict, Optional, Protocol, Sequence

from protocol import Event, ProtocolError
from protocol.endpoints import Endpoints

from controller import boxtrust, groups, paths, pidlock
from controller.backoff import Backoff
from controller.ssh import Ssh, SshError, short_socket_path, ssh_config_file
from controller.store import Store, StoreError
from controller.subscriber import Subscriber, SubscriberError

log = logging.getLogger(__name__)

LOCAL = "local"
SUPERVISE_S = 1.0            # how often the link is checked (0.5 s cost 64 watchers 1.5 % of a core)
SILENT_INTERVALS = 3         # heartbeats missed before sidecar.silent
DEFAULT_HEARTBEAT_S = 30.0   # until the first heartbeat says otherwise
EXIT_QUIET_S = 30.0          # after job.exited, stop once nothing new came for this long
FULL_CHECK_S = 60.0          # how often `ssh -O check` confirms what /proc says of the master
                             # (6 ms of CPU each: every 10 s it was 3.5 % of a core over 64 runs)
STARTUP_GRACE_S = 10.0       # a link never up yet (sidecar starting) is not "lost" before this
LINK_NOTE = "only the transport is known to be down; this says nothing about the job"
RENEW_EVERY_S = 300.0        # the box's dead-man lease is renewed this often while a run is watched
GROUP_RECHECK_S = 30.0       # a node stream re-checks its group this often (a clean exit's grace)


def renew_every_s() -> float:
    """$RGT_DEADMAN_RENEW_S (tests make it short), else RENEW_EVERY_S."""
    try:
        value = float(os.environ.get("RGT_DEADMAN_RENEW_S", "") or RENEW_EVERY_S)
    except ValueError:
        return RENEW_EVERY_S
    return value if value > 0 else RENEW_EVERY_S


# ---- files and the one-per-run lock -------------------------------------------


@dataclasses.dataclass(frozen=True)
class WatcherFiles:
    lock: Path
    pid: Path
    log: Path


def watcher_dir() -> Path:
    d = paths.state_dir() / "watchers"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


class WatchRefused(StoreError):
    """A run rgt will not watch: its id is not a run id (a box chose it before rgt checked)."""


def files(run: str) -> WatcherFiles:
    """RUN's lock, pid and log file under watchers/; boxtrust.Untrusted for a run id that is not
    one (the paths are made of it, and must stay in watchers/)."""
    name = boxtrust.run_id(run)
    d = watcher_dir()
    return WatcherFiles(*(boxtrust.contained(d, f"{name}.{ext}") for ext in ("lock", "pid", "log")))


def running_pid(run: str) -> Optional[int]:
    """The pid of the watcher holding RUN's lock, or None when none does (none can for a run id
    that is not one)."""
    try:
        f = files(run)
    except boxtrust.Untrusted:
        return None
    return pidlock.holder(f.lock, f.pid)


def _exit_stored(store: Store, run: str) -> bool:
    """The job of the run's latest attempt has its `job.exited` stored (after its `job.started`:
    a run relaunched in place, `rgt queue`'s retry, has an earlier attempt's exit stored)."""
    exits = store.events(run, kind_prefix="job.exited")
    if not exits:
        return False
    starts = store.events(run, kind_prefix="job.started")
    return not starts or exits[-1].seq > starts[-1].seq


def _finished(store: Store, run: str) -> bool:
    """The run's latest attempt was followed to its end: its job's exit is stored and its sidecar
    was seen stopping after it. A `sidecar.stopping` alone is no end: the supervisor restarts the
    sidecar while the job may still train."""
    if not _exit_stored(store, run):
        return False
    exit_seq = store.events(run, kind_prefix="job.exited")[-1].seq
    return bool(store.events(run, since=exit_seq, kind_prefix="sidecar.stopping", limit=1))


def ensure_watcher(store: Store, run: str, wait_s: float = 5.0, launched: bool = False) -> Optional[int]:
    """Start RUN's background watcher unless one runs; its pid, or None when none is needed.

    No watcher is needed for a run with no rgt host (one only attached by hand) or one
    whose sidecar already stopped and was followed to the end. `launched`: the caller has
    just started a new attempt (the same run id again), whose events nobody has stored yet,
    so an earlier attempt's stop does not count.
    """
    info = store.run(run)
    run_id = str(info["run"])
    try:
        f = files(run_id)
    except boxtrust.Untrusted as e:
        raise WatchRefused(f"rgt does not watch {run_id[:80]!r}: {e}",
                           hint="a box chose that id before rgt checked run ids; launch the job "
                                "again") from None
    if not info["target"] or (not launched and _finished(store, run_id)):
        return None
    pid = running_pid(run_id)
    if pid:
        return pid
    return pidlock.start("controller.watcher", run_id, f.lock, f.pid, f.log, wait_s)


def stop_watcher(run: str, timeout_s: float = 10.0) -> bool:
    """SIGTERM RUN's watcher (only the pid its lock file names) and wait; True if one ran."""
    pid = running_pid(run)
    if not pid:
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while running_pid(run) == pid and time.monotonic() < deadline:
        time.sleep(0.02)
    return True


# ---- links ----------------------------------------------------------------------


class Link(Protocol):
    """How the sidecar's sockets are reached from here."""

    def connect(self) -> Endpoints: ...
    def alive(self) -> bool: ...
    def close(self) -> None: ...


class LocalLink:
    """Host `local`: the run's sockets are on this machine already."""

    def __init__(self, run_dir: str) -> None:
        self.rgt_dir = Path(boxtrust.box_path(run_dir)) / "rgt"

    def connect(self) -> Endpoints:
        try:
            return Endpoints.read(self.rgt_dir)
        except FileNotFoundError as e:
            raise SshError(f"no sidecar endpoints in {self.rgt_dir} yet") from e
        except ProtocolError as e:
            raise SshError(str(e)) from e

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


class SshLink:
    """An SSH host: the sidecar's two unix sockets forwarded onto the host's ControlMaster."""

    def __init__(self, ssh: Ssh, run: str, run_dir: str, sock_dir: Path) -> None:
        self.ssh = ssh
        self.run_dir = boxtrust.box_path(run_dir)
        name = boxtrust.run_id(run)
        for ext in ("pub", "ctl"):
            boxtrust.contained(sock_dir, f"{name}.{ext}")  # the socket stays in tunnels/ (or its hash does)
        self.local_pub = short_socket_path(sock_dir, f"{name}.pub")
        self.local_ctl = short_socket_path(sock_dir, f"{name}.ctl")
        self._remote: Optional[Endpoints] = None
        self._pid = 0
        self._checked = 0.0

    def connect(self) -> Endpoints:
        self._pid = self.ssh.start_master()
        self._checked = time.monotonic()
        out = self.ssh.run(f"cat {shlex.quote(self.run_dir + '/rgt/endpoints.json')}", timeout_s=20)
        try:
            obj = json.loads(out.stdout)
            remote = Endpoints(pub=str(obj["pub"]), ctl=str(obj["ctl"]), pid=int(obj.get("pid", 0)))
        except (ValueError, KeyError, TypeError) as e:
            raise SshError(f"the sidecar's endpoints.json on {self.ssh.alias} is not readable: {e}") from e
        for name, where in (("pub", remote.pub), ("ctl", remote.ctl)):
            if not where.startswith("ipc://"):
                raise SshError(f"the sidecar's {name} endpoint {where} is not a unix socket; over SSH "
                               "rgt forwards unix sockets only (launch without --tcp)")
        self.ssh.forward(self.local_pub, remote.pub[len("ipc://"):])
        self.ssh.forward(self.local_ctl, remote.ctl[len("ipc://"):])
        self._remote = remote
        return Endpoints(pub=f"ipc://{self.local_pub}", ctl=f"ipc://{self.local_ctl}")

    def alive(self) -> bool:
        """Whether the master still runs. This is asked every SUPERVISE_S, so it looks at the
        master's process in /proc, and asks ssh itself (`-O check`, a process spawn) only every
        FULL_CHECK_S or where /proc cannot tell."""
        quick = process_alive(self._pid) if self._pid else None
        if quick is False:
            return False
        if quick is None or time.monotonic() - self._checked >= FULL_CHECK_S:
            self._checked = time.monotonic()
            return self.ssh.master_pid() is not None
        return True

    def close(self) -> None:
        """Drop this run's forwards. The shared master ends itself once idle (ssh.MASTER_IDLE_S)."""
        if self._remote is not None and self.alive():
            for local, remote in ((self.local_pub, self._remote.pub), (self.local_ctl, self._remote.ctl)):
                try:
                    self.ssh.cancel_forward(local, remote[len("ipc://"):])
                except SshError as e:
                    log.debug("cancel forward %s: %s", local, e)
        for sock in (self.local_pub, self.local_ctl):
            try:
                sock.unlink()
            except FileNotFoundError:
                pass


def process_alive(pid: int) -> Optional[bool]:
    """Whether pid runs (a zombie does not count); None where /proc cannot say (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False if os.path.isdir("/proc/self") else None
    except OSError:
        return None
    state = stat[stat.rfind(b")") + 2:][:1]
    return state not in (b"Z", b"X", b"")


def make_link(store: Store, run: Dict[str, Any]) -> Link:
    target = str(run["target"])
    if target == LOCAL:
        return LocalLink(str(run["run_dir"]))
    host = store.host(target)
    ssh = Ssh(str(host["ssh"]), control_dir=paths.state_dir() / "ssh", config_file=ssh_config_file(),
              alive_interval_s=int(os.environ.get("RGT_SSH_ALIVE_INTERVAL", "5")),
              alive_count=int(os.environ.get("RGT_SSH_ALIVE_COUNT", "3")))
    return SshLink(ssh, str(run["run"]), str(run["run_dir"]), paths.state_dir() / "tunnels")


# ---- the watcher ------------------------------------------------------------------


class Watcher:
    """Supervise one run's link and follow its sidecar into the store until the run is over."""

    def __init__(self, run: str, link: Link, *, monotonic: Callable[[], float] = time.monotonic,
                 backoff: Optional[Backoff] = None) -> None:
        self.run = run
        self.link = link
        self._mono = monotonic
        self._started = monotonic()
        self._ever_up = False
        self.backoff = backoff or Backoff()
        self.stop = threading.Event()
        self.link_up = False
        self._down_since: Optional[float] = None
        self._down_wall: Optional[float] = None
        self._lost_recorded = False
        self._next_try = 0.0
        self._last_event = monotonic()
        self._heartbeat_s = DEFAULT_HEARTBEAT_S
        self._silent = False
        self._exited_at: Optional[float] = None   # when this attempt's job.exited was stored
        self._stopping = False                     # its sidecar stopped since
        self._look_for_exit = False                # a stop came with no exit seen: is one stored?
        self._group: Optional[str] = None        # its multi-node group; "" when it has none
        self._group_due = False                  # a job event arrived since the last check
        self._group_next: Optional[float] = None
        self._lock = threading.Lock()

    # called from the subscriber thread
    def on_events(self, events: Sequence[Event]) -> None:
        with self._lock:
            self._last_event = self._mono()
            for ev in events:
                self._group_due = self._group_due or groups.is_trigger(ev.kind)
                if ev.kind == "heartbeat":
                    interval = ev.data.get("interval_s")
                    if isinstance(interval, (int, float)) and interval > 0:
                        self._heartbeat_s = float(interval)
                elif ev.kind == "job.started":       # a new attempt: what was seen before is its past
                    self._exited_at, self._stopping = None, False
                elif ev.kind == "job.exited":
                    self._exited_at, self._stopping = self._mono(), False
                elif ev.kind == "sidecar.stopping":
                    self._stopping = True
                    self._look_for_exit = self._exited_at is None

    def done(self, sub: Subscriber) -> bool:
        """Caught up, and the job's exit is stored: at once when the sidecar then stopped, else once
        nothing came for EXIT_QUIET_S. A sidecar that stops while the job may live ends nothing."""
        with self._lock:
            if not sub.caught_up or self._exited_at is None:
                return False
            if self._stopping:
                return True
            return self._mono() - self._last_event >= EXIT_QUIET_S

    def _exit_from_store(self, store: Store) -> None:
        """The sidecar stopped but no exit came while this watcher followed: the exit may be stored
        from before (a watcher restarted between the two). Asked once per stop, on this (the main)
        thread's store; when none is stored the job may live, and the watcher goes on."""
        with self._lock:
            look, self._look_for_exit = self._look_for_exit, False
        if look and _exit_stored(store, self.run):
            with self._lock:
                if self._exited_at is None:
                    self._exited_at = self._mono()

    def serve(self, store: Store, sub_store: Store) -> int:
        """Run until the run is over or stop is set; 0 normally, 1 when the sidecar refuses us."""
        sub: Optional[Subscriber] = None
        thread: Optional[threading.Thread] = None
        failure: Dict[str, str] = {}
        try:
            while not self.stop.is_set():
                endpoints = self._supervise(store)
                if endpoints is not None and sub is None:
                    sub = Subscriber(sub_store, endpoints, on_events=self.on_events,
                                     renew_every_s=renew_every_s(), expect_run=self.run)
                    thread = threading.Thread(target=self._follow, args=(sub, failure),
                                              name=f"subscriber-{self.run}", daemon=True)
                    thread.start()
                if sub is not None:
                    self._exit_from_store(store)
                    self._check_silence(store)
                    self._check_group(store)
                    if self.done(sub) or (thread is not None and not thread.is_alive()):
                        break
                self.stop.wait(SUPERVISE_S)
        finally:
            self.stop.set()
            if thread is not None:
                thread.join(10.0)
        if failure:
            store.add_local_event(self.run, "sidecar.degraded", "warn",
                                  {"source": "controller", "error": failure["error"]})
            return 1
        return 0

    def _follow(self, sub: Subscriber, failure: Dict[str, str]) -> None:
        try:
            sub.run_until(self.stop, lambda: self.done(sub))
        except SubscriberError as e:
            log.error("%s", e)
            failure["error"] = str(e)
        except Exception as e:  # whatever a box sent: the run's record says the follow broke
            log.exception("following %s failed", self.run)
            failure["error"] = f"rgt could not follow the sidecar: {type(e).__name__}: {str(e)[:300]}"
        finally:
            self.stop.set()

    def _supervise(self, store: Store) -> Optional[Endpoints]:
        """Check the link; reconnect when due. Endpoints after each (re)connect, else None."""
        now = self._mono()
        if self.link_up and self.link.alive():
            return None
        if self.link_up:
            self._went_down(store, "the SSH connection to the box closed")
        if now < self._next_try:
            return None
        try:
            endpoints = self.link.connect()
        except (SshError, OSError, subprocess.TimeoutExpired) as e:
            if self._ever_up or now - self._started >= STARTUP_GRACE_S:
                self._went_down(store, str(e))
            self._next_try = now + self.backoff.next()
            log.info("run %s: link down (%s); next try in %.1fs", self.run, e, self._next_try - now)
            return None
        self.backoff.reset()
        self.link_up = True
        self._ever_up = True
        if self._lost_recorded and self._down_since is not None:
            store.add_local_event(self.run, "link.restored", "info",
                                  {"down_s": round(now - self._down_since, 3),
                                   "attempts": self.backoff.attempts})
            log.info("run %s: link restored after %.1fs", self.run, now - self._down_since)
        self._down_since = None
        self._lost_recorded = False
        with self._lock:
            self._last_event = now  # silence is counted from a working link
        return endpoints

    def _went_down(self, store: Store, why: str) -> None:
        self.link_up = False
        if self._down_since is None:
            self._down_since = self._mono()
        if not self._lost_recorded:
            self._lost_recorded = True
            store.add_local_event(self.run, "link.lost", "warn", {"reason": why, "note": LINK_NOTE})
            log.warning("run %s: link lost: %s (%s)", self.run, why, LINK_NOTE)

    def _check_group(self, store: Store) -> None:
        """Multi-node: record the group's verdicts (controller.groups.check) once a job event of
        this stream is stored, and every GROUP_RECHECK_S. Its failure never stops the watcher."""
        with self._lock:
            due, self._group_due = self._group_due, False
        now = self._mono()
        first = self._group_next is None
        if not (first or due or (self._group and self._group_next is not None and now >= self._group_next)):
            return
        self._group_next = now + GROUP_RECHECK_S
        try:
            if self._group is None or (due and not self._group):
                self._group = groups.group_of(store, self.run) or ""
            if self._group:
                groups.check(store, self._group)
        except Exception:  # a verdict about the group must never cost this stream its watcher
            log.exception("run %s: checking its group %s failed", self.run, self._group)

    def _check_silence(self, store: Store) -> None:
        if not self.link_up:
            return
        with self._lock:
            silent_s = self._mono() - self._last_event
            budget = SILENT_INTERVALS * self._heartbeat_s
        if silent_s >= budget and not self._silent:
            self._silent = True
            store.add_local_event(self.run, "sidecar.silent", "warn",
                                  {"state": "onset", "silent_s": round(silent_s, 1),
                                   "heartbeat_interval_s": self._heartbeat_s})
        elif silent_s < budget and self._silent:
            self._silent = False
            store.add_local_event(self.run, "sidecar.silent", "info", {"state": "cleared"})


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m controller.watcher RUN", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        f = files(args[0])
    except boxtrust.Untrusted as e:
        print(f"controller.watcher: refused: {e}", file=sys.stderr)
        return 2
    fd = os.open(f.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.info("another watcher follows %s", args[0])
        return 0
    f.pid.write_text(f"{os.getpid()}\n")
    with Store.open() as store, Store.open() as sub_store:
        info = store.run(args[0])
        run = str(info["run"])
        try:
            watcher = Watcher(boxtrust.run_id(run), make_link(store, info))
        except boxtrust.Untrusted as e:
            log.error("refused to watch %r: %s", run[:80], e)
            f.pid.unlink(missing_ok=True)
            return 2

        def stop(signum: int, frame: Optional[FrameType]) -> None:
            watcher.stop.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        log.info("watching %s on %s (%s)", run, info["target"], info["run_dir"])
        try:
            code = watcher.serve(store, sub_store)
        finally:
            watcher.link.close()
            f.pid.unlink(missing_ok=True)
        log.info("stopped watching %s", run)
        return code


if __name__ == "__main__":
    sys.exit(main())
