"""The queue dispatcher: places a queue's cells on its hosts until every cell is done or failed.

The follower daemon drives each queue on a thread of its own (controller.daemon.queues), asked
by `rgt queue FILE` and again by `rgt queue status` / `rgt queue resume` through
ensure_dispatcher(); or `rgt queue FILE --foreground` drives it in the terminal. The queue's lock
file under the state dir keeps it to one driver (its pid file names the process: the daemon's, or
the terminal's). It keeps no state of its own that matters: each tick reads the cells from the
store, judges the running ones from the events their follows stored (controller.queue.model.classify),
and launches waiting cells on free hosts. Killing the daemon loses nothing; the next one carries
on from the rows.

Placement: a host runs one cell of the queue at a time. A cell whose last attempt may be retried
(preempted, link lost, launch failed) goes back to its own host under the same run id, which
the box resumes in place from its newest good checkpoint, when that host is free and answers;
otherwise it starts under a new run id on another free host, linked to the old run
(Store.set_lineage resumed_from). A host whose launch failed rests a while before the next one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from rgtlib import lockfile

from controller import paths, pidlock
from controller.queue import model as q
from controller.store.db import Store, StoreError

log = logging.getLogger(__name__)

POLL_S = 0.5            # how often the cells are judged and placed
WATCH_CHECK_S = 10.0    # how often a running cell's watcher is confirmed
REST_S = (30.0, 600.0)  # a host whose launch failed rests this long, doubling up to the cap
PROBE_TIMEOUT_S = 20.0
ERROR_PAUSE_S = 5.0     # after a dispatch round that raised

Launch = Callable[[Store, str, Sequence[str], str, str, Sequence[str]], Mapping[str, Any]]
Probe = Callable[[Store, str], bool]
Watch = Callable[[Store, str, int], Optional[int]]
OnChange = Callable[[q.Change], None]


# ---- files and the one-per-queue lock ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DispatcherFiles:
    lock: Path
    pid: Path


def files(name: str) -> DispatcherFiles:
    d = paths.state_dir() / "queues"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return DispatcherFiles(lock=d / f"{name}.lock", pid=d / f"{name}.pid")


def running_pid(name: str) -> Optional[int]:
    """The pid of the process driving NAME (holding its lock: the daemon, or a terminal's
    `rgt queue --foreground`), or None when none does."""
    f = files(name)
    return pidlock.holder(f.lock, f.pid)


class Busy(Exception):
    """Another dispatcher drives the queue."""


@contextlib.contextmanager
def holding(name: str) -> Iterator[None]:
    """Hold NAME's dispatcher lock (and its pid file) for the duration; Busy when taken."""
    f = files(name)
    try:
        fd = lockfile.lock_with_pid(f.lock, f.pid)
    except lockfile.Held:
        raise Busy(name) from None
    try:
        try:
            yield
        finally:
            f.pid.unlink(missing_ok=True)
    finally:
        os.close(fd)


def ensure_dispatcher(store: Store, name: str) -> Optional[int]:
    """Have the follower daemon drive NAME unless something drives it, or the queue is over or
    cancelled; the driver's pid, or None when none is needed (or none could start: the daemon's
    log says why)."""
    from controller.follow import client

    queue = q.load(store, name)
    if queue.options.cancelled or q.finished(q.cells(store, name)):
        return None
    pid = running_pid(name)
    if pid:
        return pid
    answer = client.ask_daemon({"op": "dispatch", "queue": name}, start=True)
    if answer is None or not answer.get("ok"):
        log.warning("the follower daemon does not drive queue %s: %s", name,
                    (answer or {}).get("error", "no answer"))
    return running_pid(name)


def stop_dispatcher(name: str, timeout_s: float = 10.0) -> Optional[int]:
    """Stop whatever drives NAME and wait for its lock: the daemon is asked (it stops only that
    queue), a terminal's `rgt queue --foreground` gets SIGTERM (the pid its lock file names);
    that pid, or None when nothing drove it."""
    from controller.follow import client

    pid = running_pid(name)
    if not pid:
        return None
    if pid == client.daemon_pid():
        client.ask_daemon({"op": "undispatch", "queue": name}, start=False)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while running_pid(name) == pid and time.monotonic() < deadline:
        time.sleep(0.02)
    return pid


# ---- what the dispatcher does to boxes (real by default; tests pass their own) -------------


def launch_on_box(store: Store, host: str, command: Sequence[str], run_id: str, project: str,
                  onbox_args: Sequence[str]) -> Mapping[str, Any]:
    """`rgt launch` for one cell: boxes.launch; BoxError/SshError when the box cannot.

    The cell's run id is the laptop's (queue.new_run_id). One already recorded is the cell's own
    earlier attempt, resumed in place: boxes.launch relaunches it only on the host it is bound to."""
    from controller.box import jobs as boxes

    return boxes.launch(store, host, command, run_id=run_id, project=project, onbox_args=onbox_args,
                        relaunch=boxes.recorded(store, run_id) is not None)


def probe_box(store: Store, host: str) -> bool:
    """Whether HOST answers a trivial command now."""
    from controller.box import jobs as boxes
    from controller.box.ssh import SshError

    try:
        boxes.shell_for(store, host).run("true", timeout_s=PROBE_TIMEOUT_S)
    except (SshError, StoreError, OSError) as e:
        log.info("host %s does not answer: %s", host, e)
        return False
    return True


def watch_run(store: Store, run: str, since_seq: int) -> Optional[int]:
    """Make sure RUN's attempt that began after seq since_seq has its background watcher; its pid.
    A run resumed in place has its earlier attempt's exit and stop stored and the new attempt's
    events are stored by the very watcher started here: `launched` says so, until this attempt's
    own exit and stop are stored (a stop alone ends nothing: the job may live on)."""
    from controller.follow import client

    start = q.attempt_start(store, run, since_seq) if since_seq > 0 else None
    ended = start is not None and all(store.events(run, since=start, kind_prefix=kind, limit=1)
                                      for kind in ("job.exited", "sidecar.stopping"))
    return client.follow(store, run, launched=since_seq > 0 and not ended)


def stop_old_watcher(run: str) -> None:
    """Before a run is resumed in place: its earlier attempt's watcher ends on that attempt's
    exit and stop, so it must not be the one left to follow the new attempt."""
    from controller.follow import client

    client.unfollow(run)


# ---- the dispatcher ----------------------------------------------------------------------


class Dispatcher:
    """Judge running cells, place waiting ones; one tick at a time, from the store's rows."""

    def __init__(self, store: Store, name: str, *, launch: Launch = launch_on_box, probe: Probe = probe_box,
                 watch: Watch = watch_run, before_in_place: Callable[[str], None] = stop_old_watcher,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.name = name
        self._launch = launch
        self._probe = probe
        self._watch = watch
        self._before_in_place = before_in_place
        self._clock = clock
        self._mono = monotonic
        self._rest_until: Dict[str, float] = {}
        self._rest_s: Dict[str, float] = {}
        self._watched: Dict[str, float] = {}
        self.stop = threading.Event()

    def tick(self) -> List[q.Change]:
        changes = q.refresh(self.store, self.name, self._clock())
        queue = q.load(self.store, self.name)
        if queue.options.cancelled:
            return changes
        cells = q.cells(self.store, self.name)
        for cell in cells:
            if cell.state == q.LAUNCHING:
                changes += self._recover(queue, cell)
            elif cell.state == q.RUNNING:
                self._keep_watched(cell)
        changes += self._place(queue, q.cells(self.store, self.name))
        return changes

    def serve(self, on_change: Optional[OnChange] = None) -> int:
        """Tick until every cell ended, the queue is cancelled, or stop is set; queue.exit_code."""
        while not self.stop.is_set():
            try:
                changes = self.tick()
            except Exception:  # one tick's failure (a busy store, a bug) must not end the queue
                log.exception("queue %s: a dispatch round failed; again in %gs", self.name, ERROR_PAUSE_S)
                self.stop.wait(ERROR_PAUSE_S)
                continue
            for change in changes:
                log.info("cell %d: %s -> %s %s", change.cell.idx, change.before, change.cell.state,
                         change.cell.reason)
                if on_change is not None:
                    on_change(change)
            cells = q.cells(self.store, self.name)
            if q.finished(cells) or q.load(self.store, self.name).options.cancelled:
                break
            self.stop.wait(POLL_S)
        return q.exit_code(q.cells(self.store, self.name))

    # -- placing -------------------------------------------------------------------------

    def _free_hosts(self, queue: q.Queue, cells: Sequence[q.Cell]) -> List[str]:
        busy = {c.host for c in cells if c.state in q.ACTIVE}
        now = self._mono()
        return [h for h in queue.hosts if h not in busy and self._rest_until.get(h, 0.0) <= now]

    def _place(self, queue: q.Queue, cells: Sequence[q.Cell]) -> List[q.Change]:
        free = self._free_hosts(queue, cells)
        waiting = [c for c in cells if c.state == q.RETRYING] + [c for c in cells if c.state == q.PENDING]
        changes: List[q.Change] = []
        for cell in waiting:
            if not free:
                break
            host, in_place = self._choose(cell, free)
            if host is None:
                continue
            free.remove(host)
            changes += self._start(queue, cell, host, in_place)
        return changes

    def _choose(self, cell: q.Cell, free: List[str]) -> Tuple[Optional[str], bool]:
        """(host, in place): the cell's own host when its attempt may resume there, else another."""
        if cell.state == q.PENDING or not cell.run:
            return free[0], False
        own = cell.host
        if own in free and cell.last.get("outcome") == "preempted":
            if self._probe(self.store, own):
                return own, True
            self._rest(own, "it does not answer")
            free.remove(own)
        others = [h for h in free if h != own]
        if others:
            return others[0], False
        if own in free:
            if self._probe(self.store, own):
                return own, True
            self._rest(own, "it does not answer")
        return None, False

    def _start(self, queue: q.Queue, cell: q.Cell, host: str, in_place: bool) -> List[q.Change]:
        now = self._clock()
        run = cell.run if in_place else q.new_run_id(queue.name, cell.idx)
        since_seq = int(cell.last.get("at_seq") or self.store.cursor(run)) if in_place else 0
        since_local = self._newest_local(run) if in_place else 0
        begun = q.begin_attempt(self.store, cell, host=host, run=run, in_place=in_place, since_seq=since_seq,
                                since_local=since_local, now=now)
        if begun is None:
            return []
        return [q.Change(cell.state, begun), *self._launch_cell(queue, begun, resumed_from=cell.run)]

    def _launch_cell(self, queue: q.Queue, cell: q.Cell, resumed_from: str) -> List[q.Change]:
        """Ask the box to run a `launching` cell; running, or the launch's failure recorded."""
        from controller.box.jobs import BoxError
        from controller.box.ssh import SshError

        in_place = bool(cell.last.get("in_place"))
        if in_place:
            self._before_in_place(cell.run)
        try:
            answer = self._launch(self.store, cell.host, cell.command, cell.run, queue.name,
                                  queue.options.onbox_args)
        except Exception as e:  # the launch is this round's boundary: any failure is the launch's
            if not isinstance(e, (BoxError, SshError, StoreError)):
                log.exception("launching cell %d of %s on %s", cell.idx, queue.name, cell.host)
            message = getattr(e, "message", None) or str(e)
            self._rest(cell.host, message)
            outcome = q.Outcome("launch", f"the launch on {cell.host} failed: {message}")
            ended = q.end_attempt(self.store, cell, outcome, queue.options.max_attempts, self._clock())
            return [q.Change(cell.state, ended)] if ended is not None else []
        self._rest_s.pop(cell.host, None)
        if resumed_from and resumed_from != cell.run and self._known(resumed_from) is not None:
            self.store.set_lineage(cell.run, resumed_from=resumed_from)
        running = q.launched(self.store, cell, answer, self._clock())
        if running is None:
            return []
        self._keep_watched(running, force=True)
        return [q.Change(cell.state, running)]

    def _recover(self, queue: q.Queue, cell: q.Cell) -> List[q.Change]:
        """A cell left `launching` by a dispatcher that died: running when the store recorded its
        run after the attempt began (boxes.launch does once the box answered), else launched again
        under the same run id."""
        info = self._known(cell.run)
        if info is not None and float(info["last_seen"]) >= float(cell.last.get("started_at") or 0.0):
            running = q.launched(self.store, cell, {}, self._clock())
            if running is None:
                return []
            self._keep_watched(running, force=True)
            return [q.Change(cell.state, running)]
        previous = cell.history[-2]["run"] if len(cell.history) > 1 else ""
        return self._launch_cell(queue, cell, resumed_from=str(previous))

    def _known(self, run: str) -> Optional[Dict[str, Any]]:
        return next((r for r in self.store.runs() if r["run"] == run), None)

    # -- hosts and watchers -----------------------------------------------------------------

    def _rest(self, host: str, why: str) -> None:
        rest = min(REST_S[1], self._rest_s.get(host, REST_S[0] / 2) * 2)
        self._rest_s[host] = rest
        self._rest_until[host] = self._mono() + rest
        log.warning("host %s rests %.0fs: %s", host, rest, why)

    def _newest_local(self, run: str) -> int:
        local = self.store.local_events(run)
        return local[-1].id if local else 0

    def _keep_watched(self, cell: q.Cell, force: bool = False) -> None:
        now = self._mono()
        if not force and now - self._watched.get(cell.run, -WATCH_CHECK_S) < WATCH_CHECK_S:
            return
        self._watched[cell.run] = now
        since = int(cell.last.get("since_seq") or 0) if cell.last.get("in_place") else 0
        try:
            self._watch(self.store, cell.run, since)
        except (StoreError, OSError) as e:
            log.warning("could not start the watcher of %s: %s", cell.run, e)
