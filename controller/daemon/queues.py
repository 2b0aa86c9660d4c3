"""The daemon's queues: each queue's Dispatcher on a thread of its own.

A dispatch round launches on boxes (seconds of SSH), so it never runs on the follower's loop:
each queue being driven has a thread with its own store connection, which holds the queue's lock
(controller.queue.dispatch.holding) while it drives, so one queue has one driver, this daemon's
or a `rgt queue --foreground` in a terminal. Its cells' runs are followed through the daemon's
own control socket (controller.follow.client.follow, from this thread), like any command's.
"""
from __future__ import annotations

import logging
import threading
from typing import Dict, List

from controller.queue import dispatch
from controller.queue import model as q
from controller.store.db import Store, StoreError

log = logging.getLogger(__name__)

TAKE_WAIT_S = 5.0    # how long a dispatch request waits for its thread to hold the queue's lock


class Queues:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._driving: Dict[str, dispatch.Dispatcher] = {}
        self._threads: Dict[str, threading.Thread] = {}

    def names(self) -> List[str]:
        with self._lock:
            return sorted(self._threads)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._threads)

    def start(self, name: str) -> str:
        """Drive queue NAME unless this daemon does already; "" once its thread holds the
        queue's lock (or has found nothing to do), else why not."""
        try:
            name = q.check_name(name)
        except q.QueueError as e:
            return str(e)
        with self._lock:
            if name in self._threads:
                return ""
            outcome: Dict[str, str] = {}
            taken = threading.Event()
            thread = threading.Thread(target=self._drive, args=(name, taken, outcome),
                                      name=f"queue-{name}", daemon=True)
            self._threads[name] = thread
        thread.start()
        taken.wait(TAKE_WAIT_S)
        return outcome.get("error", "")

    def stop(self, name: str) -> bool:
        """Stop driving NAME (its thread ends after the round in progress); whether it was driven."""
        with self._lock:
            d = self._driving.get(name)
        if d is None:
            return False
        d.stop.set()
        return True

    def resume(self, store: Store) -> None:
        """Drive every queue in the store that is neither over nor cancelled."""
        for name in q.names(store):
            try:
                queue = q.load(store, name)
                if queue.options.cancelled or q.finished(q.cells(store, name)):
                    continue
            except StoreError:
                log.exception("queue %s cannot be read; not driven", name)
                continue
            error = self.start(name)
            if error:
                log.info("queue %s not driven here: %s", name, error)

    def close(self, timeout_s: float = 15.0) -> None:
        with self._lock:
            driving, threads = list(self._driving.values()), list(self._threads.values())
        for d in driving:
            d.stop.set()
        for t in threads:
            t.join(timeout_s)

    def _drive(self, name: str, taken: threading.Event, outcome: Dict[str, str]) -> None:
        try:
            with dispatch.holding(name), Store.open() as store:
                d = dispatch.Dispatcher(store, name)
                with self._lock:
                    self._driving[name] = d
                taken.set()
                log.info("dispatching queue %s", name)
                code = d.serve()
                log.info("stopped dispatching queue %s (exit %d)", name, code)
        except dispatch.Busy:
            outcome["error"] = f"another dispatcher drives queue {name}"
        except Exception as e:   # one queue's failure never costs the daemon the others
            log.exception("queue %s: its dispatcher failed", name)
            outcome["error"] = f"its dispatcher failed: {type(e).__name__}: {str(e)[:200]}"
        finally:
            with self._lock:
                self._driving.pop(name, None)
                self._threads.pop(name, None)
            taken.set()
