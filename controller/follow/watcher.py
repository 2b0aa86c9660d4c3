"""One run's follow: keeps the store equal to the box's journal.

The follower daemon (controller.follow.daemon) holds one Watcher per followed run and drives it
from its one loop (controller.follow.loop): tick() every SUPERVISE_S supervises the link, step()
lets the run's Subscriber take what the daemon's poll found. It reaches the sidecar through a
Link: for host `local` the run's own sockets, for an SSH host two unix-socket forwards on the
host's shared ControlMaster; in the daemon a connect runs on a small pool, never on the loop.

When the link breaks (the master is killed, the box freezes and ServerAlive gives up, sshd
stops), the watcher records `link.lost` once, reconnects with capped, jittered backoff, re-adds
the forwards and records `link.restored`. ZeroMQ reconnects by itself and the subscriber's `since`
repair fetches what was published meanwhile, so nothing is lost or stored twice. A broken link
says only that the transport is down: the events say so, never that the job died. When the link
is up but no event arrives for three heartbeat intervals, `sidecar.silent` is recorded. A node
stream of a multi-node run also has its group's verdicts (controller.runs.groups) checked after
each job event it stores, and every GROUP_RECHECK_S.

A run is over when its job's exit is stored: `sidecar.stopping` alone ends nothing (a supervisor
restarts a stopped sidecar while the job trains on). Once the exit is stored the watcher drains
what follows it (custody's last checkpoint, the sidecar's stop) and ends: at once on the
sidecar's stop, else after EXIT_SETTLE_S with nothing new, and at the latest EXIT_SETTLE_MAX_S
after the exit. A follow begun for a run that had ended already (controller.runs.life) only fetches
what the store lacks and ends, within CATCH_UP_S even when the box cannot be reached; `rgt launch`
of a new attempt under the same run id leaves a marker (watchers/RUN.launched) so that its
watcher waits for that attempt. The run id names these files and the tunnel sockets, so it is
checked (controller.trust) before any path is made of it, and the subscriber refuses a sidecar
that answers for another run or host.

A sidecar that leaves a request unanswered (it ended once its linger ran out while this laptop
slept, or between its last event and our last request) leaves its journal on the box: after
readback.READBACK_AFTER_S the watcher reads it back over the box's shell
(controller.follow.readback), off the loop, until the store is level with it, so an exit
journaled while nobody followed still ends the run here.
"""
from __future__ import annotations

import dataclasses
import logging
import subprocess
import threading
import time
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Tuple

from protocol import Event
from protocol.endpoints import Endpoints
from rgtlib.backoff import Backoff
from rgtlib.units import env_seconds

from controller import paths
from controller import trust as boxtrust
from controller.box.ssh import SshError
from controller.box.transport import Hub
from controller.follow import readback
from controller.follow.link import Link, LocalLink, SshLink, make_link, process_alive
from controller.follow.subscriber import Subscriber, SubscriberError, stored_host
from controller.runs import groups, life
from controller.store.db import Store, StoreError

__all__ = ["Link", "LocalLink", "SshLink", "WatchRefused", "Watcher", "WatcherFiles", "files",
           "finished", "make_link", "outage_s", "process_alive", "take_launch_mark"]

log = logging.getLogger(__name__)

SUPERVISE_S = 1.0            # how often the link is checked (0.5 s cost 64 watchers 1.5 % of a core)
SILENT_INTERVALS = 3         # heartbeats missed before sidecar.silent
DEFAULT_HEARTBEAT_S = 30.0   # until the first heartbeat says otherwise
EXIT_SETTLE_S = 5.0          # after job.exited, stop once nothing new came for this long
EXIT_SETTLE_MAX_S = 60.0     # and at the latest this long after it (a chatty sidecar that lingers)
CATCH_UP_S = 30.0            # a run that had ended: fetch what is missing within this, then stop
LAUNCHED_FRESH_S = 600.0     # a launch marker older than this is a leftover, not a new attempt
STARTUP_GRACE_S = 10.0       # a link never up yet (sidecar starting) is not "lost" before this
LINK_NOTE = "only the transport is known to be down; this says nothing about the job"
RENEW_EVERY_S = 300.0        # the box's dead-man lease is renewed this often while a run is watched
GROUP_RECHECK_S = 30.0       # a node stream re-checks its group this often (a clean exit's grace)


def renew_every_s() -> float:
    """$RGT_DEADMAN_RENEW_S (tests make it short), else RENEW_EVERY_S."""
    return env_seconds("RGT_DEADMAN_RENEW_S", RENEW_EVERY_S)


# ---- a run's files ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WatcherFiles:
    followed: Path   # the daemon follows this run (it holds the daemon's pid); a restarted one resumes it
    launched: Path   # a new attempt was launched under this run id: its watcher waits for it


def watcher_dir() -> Path:
    d = paths.state_dir() / "watchers"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


class WatchRefused(StoreError):
    """A run rgt will not watch: its id is not a run id (a box chose it before rgt checked)."""


def files(run: str) -> WatcherFiles:
    """RUN's files under watchers/; boxtrust.Untrusted for a run id that is not one (the paths
    are made of it, and must stay in watchers/)."""
    name = boxtrust.run_id(run)
    d = watcher_dir()
    return WatcherFiles(*(boxtrust.contained(d, f"{name}.{ext}") for ext in ("followed", "launched")))


def take_launch_mark(path: Path, now: Optional[float] = None) -> bool:
    """Whether follow(launched=True) left a fresh marker at `path` (it is removed, so one
    launch is taken once): a new attempt is on its way, and the stored end is the last one's."""
    try:
        text = path.read_text()
        path.unlink()
    except OSError:   # none (or another watcher took it)
        return False
    try:
        age = (time.time() if now is None else now) - float(text.strip())
    except ValueError:
        return False
    return -LAUNCHED_FRESH_S <= age <= LAUNCHED_FRESH_S


def _exit_stored(store: Store, run: str) -> bool:
    """The run's latest attempt has its end stored (controller.runs.life.end_of: its run.closed, or
    a job.exited with no close-out after it), after its `job.started`: a run relaunched in place,
    `rgt queue`'s retry, has an earlier attempt's exit stored."""
    return life.end_of(store, run)[0] is not None


def finished(store: Store, run: str) -> bool:
    """The run's latest attempt was followed to its end: its job's exit is stored and its sidecar
    was seen stopping after it. A `sidecar.stopping` alone is no end: the supervisor restarts the
    sidecar while the job may still train."""
    end = life.end_of(store, run)[0]
    if end is None:
        return False
    return bool(store.events(run, since=end.seq, kind_prefix="sidecar.stopping", limit=1))


def outage_s(down_since: float, restored_at: float) -> float:
    """How long the link was down, in seconds (3 decimals), both ends read from one monotonic
    clock; never negative (a loss seen and mended within one check is 0.0, not -0.0)."""
    return max(0.0, round(restored_at - down_since, 3)) + 0.0


# ---- the watcher ------------------------------------------------------------------


class Watcher:
    """Supervise one run's link and follow its sidecar into the store until the run is over."""

    def __init__(self, run: str, link: Link, *, monotonic: Callable[[], float] = time.monotonic,
                 backoff: Optional[Backoff] = None, launch_mark: Optional[Path] = None,
                 connects: Optional[Executor] = None,
                 check_group: Callable[[Store, str], Any] = groups.check) -> None:
        """launch_mark: where follow(launched=True) marks a new attempt (files(run).launched).
        connects: where link connects run (the daemon's pool), else in the caller's thread.
        check_group: records a group's verdicts (the daemon's checks each group once a round)."""
        self.run = run
        self.connects = connects
        self.group_check = check_group
        self.sub: Optional[Subscriber] = None
        self.failure: Optional[str] = None      # why the sidecar could not be followed
        self._connecting: Optional[Future[Endpoints]] = None
        self._renew_off = False
        self._began = False
        self.link = link
        self.launch_mark = launch_mark
        self._mono = monotonic
        self._started = monotonic()
        self._ever_up = False
        self.backoff = backoff or Backoff()
        self.stop = threading.Event()
        self.link_up = False
        self._down_since: Optional[float] = None   # when the link was seen down (monotonic)
        self._lost_recorded = False
        self._next_try = 0.0
        self._last_event = monotonic()
        self._heartbeat_s = DEFAULT_HEARTBEAT_S
        self._silent = False
        self._exited_at: Optional[float] = None   # when this attempt's job.exited was stored
        self._stopping = False                     # its sidecar stopped since
        self._closing = False                      # its job exited; its run.closed has not come yet
        self._look_for_exit = False                # a stop came with no exit seen: is one stored?
        self._catch_up = False                     # the run had ended: fetch what is missing, then stop
        self._catch_up_lost = False                # ... as "lost": a sidecar that comes back ends that
        self._fresh_attempt = False                # a new attempt was launched: wait for it
        self._group: Optional[str] = None        # its multi-node group; "" when it has none
        self._group_due = False                  # a job event arrived since the last check
        self._group_next: Optional[float] = None
        self._readback: Optional[Future[Any]] = None
        self._readback_since = 0                   # the cursor the pending read-back asked from
        self._readback_next = 0.0
        self._readback_level = False               # the store was level with the journal read back
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
                    self._exited_at, self._stopping, self._catch_up = None, False, False
                    self._closing = False
                elif ev.kind == "sidecar.started" and self._catch_up_lost:
                    self._catch_up = False           # the sidecar came back: the job may live
                elif ev.kind == "job.exited" and life.closes(ev):
                    self._closing, self._stopping = True, False   # run.closed is the end
                elif ev.kind in life.END_KINDS:
                    self._exited_at, self._stopping, self._closing = self._mono(), False, False
                elif ev.kind == "sidecar.stopping":
                    self._stopping = True
                    if self._closing:    # stopped mid close-out: the exit is the end
                        self._exited_at, self._closing = self._mono(), False
                    self._look_for_exit = self._exited_at is None

    def done(self, sub: Subscriber) -> bool:
        """Caught up, and either the run had ended before this watcher began (catch-up), or the
        job's exit is stored and what follows it drained: at once when the sidecar then stopped,
        else once nothing came for EXIT_SETTLE_S, and EXIT_SETTLE_MAX_S after the exit at the
        latest. A sidecar that stops while the job may live ends nothing."""
        with self._lock:
            if not (sub.caught_up or (self._readback_level and sub.unanswered_s() > 0)):
                return False
            if self._catch_up:
                return True
            if self._exited_at is None:
                return False
            if self._stopping:
                return True
            now = self._mono()
            return now - self._last_event >= EXIT_SETTLE_S or now - self._exited_at >= EXIT_SETTLE_MAX_S

    def begin(self, store: Store) -> None:
        """Where the run stands as this watcher starts: a run that had ended (controller.runs.life) is
        only caught up; a stored exit of this attempt starts the settle. A fresh launch marker
        (a new attempt under this run id) makes both the last attempt's past."""
        self._take_launch_mark()
        if self._fresh_attempt:
            return
        now = life.of_run(store, self.run)
        with self._lock:
            if now.ended:
                self._catch_up, self._catch_up_lost = True, now.state == life.LOST
                log.info("run %s had ended (%s): fetching what is missing, then stopping", self.run,
                         now.state)
            if _exit_stored(store, self.run) and self._exited_at is None:
                self._exited_at = self._mono()

    def _take_launch_mark(self) -> None:
        if self.launch_mark is None or not take_launch_mark(self.launch_mark):
            return
        log.info("run %s: a new attempt was launched; watching it", self.run)
        with self._lock:
            self._fresh_attempt = True
            self._catch_up = self._catch_up_lost = self._stopping = False
            self._exited_at = None

    def _catching_up(self) -> bool:
        with self._lock:
            return self._catch_up

    def caught_up_too_long(self) -> bool:
        """A catch-up that could not finish within CATCH_UP_S (the box is gone): stop anyway."""
        with self._lock:
            return self._catch_up and self._mono() - self._started >= CATCH_UP_S

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

    # ---- driven by a loop (controller.follow.loop): tick, step, end --------------------------

    def tick(self, store: Store, hub: Optional[Hub] = None) -> bool:
        """One round of supervision (every SUPERVISE_S): the link, the subscriber once there are
        endpoints, silence and the group. True once the follow is over (then call end())."""
        if not self._began:
            self._began = True
            self.begin(store)
        if self.stop.is_set() or self.failure is not None:
            return True
        self._take_launch_mark()
        if self.caught_up_too_long():
            log.warning("run %s had ended and its sidecar could not be reached within %gs: "
                        "stopping; the next `rgt watch` or `rgt status` tries again", self.run, CATCH_UP_S)
            return True
        endpoints = self._supervise(store)
        if endpoints is not None and self.sub is None:
            # A run that had ended keeps no box alive: its catch-up renews no dead-man lease.
            self._renew_off = self._catching_up()
            self.sub = Subscriber(store, endpoints, on_events=self.on_events,
                                  renew_every_s=None if self._renew_off else renew_every_s(),
                                  expect_run=self.run, hub=hub)
            self.sub.start()
        if self.sub is None:
            return False
        self._read_back(store)
        if self._renew_off and not self._catching_up():   # it came back to life: renew
            self._renew_off, self.sub.renew_every_s = False, renew_every_s()
        self._exit_from_store(store)
        self._check_silence(store)
        self._check_group(store)
        return self.done(self.sub)

    def step(self) -> None:
        """Let the subscriber take what arrived and run its timers. A sidecar that cannot be
        followed (it refused us, or sent what broke the follow) ends this follow only."""
        if self.sub is None or self.failure is not None:
            return
        try:
            self.sub.step()
        except SubscriberError as e:
            log.error("%s", e)
            self.failure = str(e)
        except Exception as e:  # whatever a box sent: the run's record says the follow broke
            log.exception("following %s failed", self.run)
            self.failure = f"rgt could not follow the sidecar: {type(e).__name__}: {str(e)[:300]}"

    def wake_in_s(self) -> Optional[float]:
        """In how many seconds the subscriber's timers want a step (no cap: in the loop, events and
        the tick wake it anyway); None before it exists."""
        if self.sub is None or self.failure is not None:
            return None
        return self.sub.due_in_s()

    def end(self, store: Store) -> int:
        """Close the subscriber and the link; 0, or 1 (recorded as sidecar.degraded) when the
        sidecar could not be followed."""
        self.stop.set()
        try:
            if self.sub is not None:
                self.sub.finish()
        finally:
            self.link.close()
        if self.failure is not None:
            store.add_local_event(self.run, "sidecar.degraded", "warn",
                                  {"source": "controller", "error": self.failure})
            return 1
        return 0

    def serve(self, store: Store) -> int:
        """Follow this one run in the calling thread until it is over or stop is set (what the
        follower daemon does for every run at once); 0 normally, 1 when the sidecar refuses us."""
        from controller.follow.loop import Loop

        loop = Loop(store, stop=self.stop)
        try:
            loop.add(self.run, self)
            loop.run(until_empty=True)
        finally:
            loop.close()
        return loop.codes.get(self.run, 0)

    def _supervise(self, store: Store) -> Optional[Endpoints]:
        """Check the link; reconnect when due (on the connects pool when there is one, so a slow
        box holds up no other run). Endpoints after each (re)connect, else None."""
        if self._connecting is not None:
            if not self._connecting.done():
                return None
            pending, self._connecting = self._connecting, None
            try:
                return self._connected(store, pending.result())
            except (SshError, OSError, subprocess.TimeoutExpired) as e:
                self._connect_failed(store, e)
                return None
        if self.link_up and self.link.alive():
            return None
        if self.link_up:
            self._went_down(store, "the SSH connection to the box closed")
        if self._mono() < self._next_try:
            return None
        if self.connects is not None:
            self._connecting = self.connects.submit(self.link.connect)
            return None
        try:
            endpoints = self.link.connect()
        except (SshError, OSError, subprocess.TimeoutExpired) as e:
            self._connect_failed(store, e)
            return None
        return self._connected(store, endpoints)

    def _read_back(self, store: Store) -> None:
        """While the sidecar leaves a request unanswered (it ended, or does not serve yet), read the
        journal back over the box's shell (see the module doc), off the loop when there is a pool;
        a page is applied here, on the loop's thread, as the subscriber's events are."""
        assert self.sub is not None
        if self._readback is not None:
            if not self._readback.done():
                return
            pending, self._readback = self._readback, None
            try:
                self._apply_page(store, pending.result())
            except (SshError, OSError, subprocess.TimeoutExpired) as e:
                self._readback_next = self._mono() + readback.READBACK_EVERY_S
                log.info("run %s: reading the journal back failed: %s", self.run, e)
            return
        unanswered = self.sub.unanswered_s()
        if unanswered == 0:
            with self._lock:
                self._readback_level = False        # it answers: its own replies say what is new
            return
        if unanswered < readback.READBACK_AFTER_S or self._mono() < self._readback_next:
            return
        self._readback_since = store.cursor(self.run)
        if self.connects is not None:
            self._readback = self.connects.submit(self.link.read_journal, self._readback_since)
            return
        try:
            self._apply_page(store, self.link.read_journal(self._readback_since))
        except (SshError, OSError, subprocess.TimeoutExpired) as e:
            self._readback_next = self._mono() + readback.READBACK_EVERY_S
            log.info("run %s: reading the journal back failed: %s", self.run, e)

    def _apply_page(self, store: Store, doc: Any) -> None:
        """Store what a page adds above the store's cursor now (the subscriber may have stored some
        of it meanwhile); the cursor never goes back, and the subscriber skips what is stored."""
        assert self.sub is not None
        try:
            page = readback.checked(doc, self.run, stored_host(store, self.run), self._readback_since)
        except boxtrust.Untrusted as e:
            self.failure = f"refused the journal read back from the box: {e}"
            log.error("run %s: %s", self.run, self.failure)
            return
        more = page.more and bool(page.events)   # a `more` that brings nothing is not asked at once again
        cursor = store.cursor(self.run)
        page.events = [ev for ev in page.events if ev.seq > cursor]
        for first, last in readback.gaps(page, cursor):
            store.record_gap(self.run, first, last, readback.reason(page))
        if page.events:
            cursor = page.events[-1].seq
            store.apply(self.run, page.events, cursor)
            self.sub.level_with(cursor)
            log.info("run %s: %d events read back from the journal (the sidecar does not answer)",
                     self.run, len(page.events))
            self.on_events(page.events)
        with self._lock:
            self._readback_level = not page.more
        self._readback_next = self._mono() + (0.0 if more else readback.READBACK_EVERY_S)

    def _connect_failed(self, store: Store, e: BaseException) -> None:
        now = self._mono()   # a connect can take long (ssh's timeouts): count from its end
        if self._ever_up or now - self._started >= STARTUP_GRACE_S:
            self._went_down(store, str(e))
        self._next_try = now + self.backoff.next()
        log.info("run %s: link down (%s); next try in %.1fs", self.run, e, self._next_try - now)

    def _connected(self, store: Store, endpoints: Endpoints) -> Endpoints:
        now = self._mono()   # after the connect, on the clock _down_since was read from
        attempts = self.backoff.attempts   # the failed tries before this one
        self.backoff.reset()
        self.link_up = True
        self._ever_up = True
        if self._lost_recorded and self._down_since is not None:
            down_s = outage_s(self._down_since, now)
            store.add_local_event(self.run, "link.restored", "info",
                                  {"down_s": down_s, "attempts": attempts})
            log.info("run %s: link restored after %.1fs", self.run, down_s)
        self._down_since = None
        self._lost_recorded = False
        with self._lock:
            self._last_event = now  # silence is counted from a working link
        return endpoints

    def _went_down(self, store: Store, why: str) -> None:
        self.link_up = False
        if self._down_since is None:
            self._down_since = self._mono()
        if not self._lost_recorded and not self._catching_up():   # an ended run's link tells nothing
            self._lost_recorded = True
            store.add_local_event(self.run, "link.lost", "warn", {"reason": why, "note": LINK_NOTE})
            log.warning("run %s: link lost: %s (%s)", self.run, why, LINK_NOTE)

    def _check_group(self, store: Store) -> None:
        """Multi-node: record the group's verdicts (controller.runs.groups.check) once a job event of
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
                self.group_check(store, self._group)
        except Exception:  # a verdict about the group must never cost this stream its watcher
            log.exception("run %s: checking its group %s failed", self.run, self._group)

    def _silent_s(self) -> Tuple[float, float]:
        with self._lock:
            return self._mono() - self._last_event, SILENT_INTERVALS * self._heartbeat_s

    def _check_silence(self, store: Store) -> None:
        if not self.link_up:
            return
        silent_s, budget = self._silent_s()
        if silent_s >= budget and not self._silent and self.sub is not None:
            # What arrived while this process was not scheduled (a busy laptop, another run's long
            # step) is not silence: take it first, then judge.
            self.step()
            silent_s, budget = self._silent_s()
        if silent_s >= budget and not self._silent:
            self._silent = True
            store.add_local_event(self.run, "sidecar.silent", "warn",
                                  {"state": "onset", "silent_s": round(silent_s, 1),
                                   "heartbeat_interval_s": self._heartbeat_s})
        elif silent_s < budget and self._silent:
            self._silent = False
            store.add_local_event(self.run, "sidecar.silent", "info", {"state": "cleared"})
