"""The follower's one loop: every followed run's Watcher, one poll over every link.

One thread does all of it (docs/ARCHITECTURE.md, "The process model"): one Hub (one ZeroMQ
context and one poller over every run's two sockets, and the daemon's control socket), one Store
(the one writer of what the sidecars send), and, in the daemon, a small pool where link connects
run, so that an SSH master's start or a box that does not answer holds up no other run. A round:

- poll until a link has something, a request waits, a subscriber's timer is due or a tick is;
- step the subscribers whose links the poll named or whose timers are due (each one's events
  go to the store in one transaction per batch);
- every SUPERVISE_S, tick every watcher (its link, silence, whether its follow is over), then
  record the verdicts of each multi-node group that is due once, however many of its streams
  asked;
- end and drop each watcher whose follow is over.

Each run is behind its own exception boundary: whatever one run's tick or step raises ends that
run's follow (recorded as `sidecar.degraded`), never the loop or another run's follow.
"""
from __future__ import annotations

import functools
import heapq
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from controller.box.transport import Hub, Link
from controller.follow.watcher import SUPERVISE_S, Watcher
from controller.runs import groups
from controller.store.db import Store

log = logging.getLogger(__name__)

Answer = Callable[[bytes], bytes]
OnEnd = Callable[[str, int], Any]
OnTick = Callable[[], Any]


class Loop:
    def __init__(self, store: Store, *, stop: Optional[threading.Event] = None,
                 connect_workers: int = 0, answer: Optional[Answer] = None,
                 on_end: Optional[OnEnd] = None, on_tick: Optional[OnTick] = None,
                 tick_s: float = SUPERVISE_S, monotonic: Callable[[], float] = time.monotonic) -> None:
        """connect_workers: threads for link connects (0: connect in the loop's own thread, as a
        one-run serve does). answer: the control socket's requests (the daemon binds one)."""
        self.store = store
        self.stop = stop or threading.Event()
        self.hub = Hub()
        self.follows: Dict[str, Watcher] = {}
        self.codes: Dict[str, int] = {}   # how each ended follow ended (Watcher.end)
        self.answer = answer
        self.on_end = on_end
        self.on_tick = on_tick
        self.tick_s = tick_s
        self._mono = monotonic
        self._pool = (ThreadPoolExecutor(connect_workers, thread_name_prefix="rgt-connect")
                      if connect_workers else None)
        self._due: Dict[str, float] = {}                 # when each run's subscriber wants a step
        self._due_heap: List[Tuple[float, str]] = []     # the same, soonest first (stale entries skipped)
        self._by_link: Dict[Link, str] = {}
        self._groups_due: Set[str] = set()

    def check_group(self, store: Store, group: str) -> None:
        """A Watcher's check_group: the group's verdicts are recorded once, after the tick round."""
        self._groups_due.add(group)

    def add(self, run: str, watcher: Watcher) -> None:
        watcher.connects = self._pool
        watcher.group_check = self.check_group
        self.follows[run] = watcher
        self._due[run] = math.inf

    def drop(self, run: str) -> bool:
        """End RUN's follow now (`rgt stop`'s unfollow); whether it was followed."""
        if run not in self.follows:
            return False
        self.follows[run].stop.set()
        self._end(run)
        return True

    def run(self, until_empty: bool = False) -> None:
        """Until stop is set (or, until_empty, no follow is left)."""
        next_tick = self._mono()
        while not self.stop.is_set():
            now = self._mono()
            if now >= next_tick:
                self._tick_all()
                next_tick = self._mono() + self.tick_s
                if until_empty and not self.follows:
                    return
                now = self._mono()
            wake = min(next_tick, self._due_heap[0][0] if self._due_heap else math.inf)
            links, asked = self.hub.poll(max(0, min(1000, math.ceil((wake - now) * 1000))))
            if asked:
                self._answer_requests()
            now = self._mono()
            runs = {self._by_link[link] for link in links if link in self._by_link}
            while self._due_heap and self._due_heap[0][0] <= now:
                due, run = heapq.heappop(self._due_heap)
                if self._due.get(run) == due:   # else a later step moved it: a stale entry
                    runs.add(run)
            for run in sorted(runs):
                w = self.follows.get(run)
                if w is not None and w.sub is not None:
                    self._guarded(run, w.step)
                    if run in self.follows:
                        self._due_again(run, w)

    def close(self) -> None:
        """End every follow that is left (their markers stay: a daemon that starts resumes them)."""
        try:
            for run in list(self.follows):
                self._end(run)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
            self.hub.close()

    # ----

    def _answer_requests(self) -> None:
        for who, body in self.hub.requests():
            try:
                reply = self.answer(body) if self.answer is not None else b'{"ok": false}'
            except Exception:   # a bad request costs its asker an error, never the loop
                log.exception("answering a control request failed")
                reply = b'{"ok": false, "error": "the daemon failed to answer; see daemon.log"}'
            self.hub.answer(who, reply)

    def _tick_all(self) -> None:
        for run, w in list(self.follows.items()):
            had_sub = w.sub is not None
            over = self._guarded(run, functools.partial(w.tick, self.store, self.hub))
            if run not in self.follows:
                continue
            if over or w.failure is not None:
                self._end(run)
            elif w.sub is not None and not had_sub:
                self._due_again(run, w)
        due, self._groups_due = self._groups_due, set()
        for group in sorted(due):
            try:
                groups.check(self.store, group)
            except Exception:  # a verdict about a group never costs its streams their follow
                log.exception("checking group %s failed", group)
        if self.on_tick is not None:
            self.on_tick()

    def _due_again(self, run: str, w: Watcher) -> None:
        """When RUN's subscriber next wants a step (and, the first time, which link is RUN's)."""
        if w.sub is not None:
            self._by_link[w.sub.link] = run
        wake = w.wake_in_s()
        due = math.inf if wake is None else self._mono() + wake
        self._due[run] = due
        if due < math.inf:
            heapq.heappush(self._due_heap, (due, run))

    def _guarded(self, run: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:   # this run's follow ends; the others go on
            log.exception("run %s: its follow failed", run)
            w = self.follows.get(run)
            if w is not None and w.failure is None:
                w.failure = f"rgt's follow of this run failed: {type(e).__name__}: {str(e)[:300]}"
            return True

    def _end(self, run: str) -> None:
        w = self.follows.pop(run)
        self._due.pop(run, None)
        if w.sub is not None:
            self._by_link.pop(w.sub.link, None)
        try:
            code = w.end(self.store)
        except Exception:
            log.exception("run %s: ending its follow failed", run)
            code = 1
        self.codes[run] = code
        log.info("stopped following %s (%d)", run, code)
        if self.on_end is not None:
            self.on_end(run, code)
