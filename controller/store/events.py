"""Reading a run's box events from the store, once or following new ones.

`BoxReader` is what a follower has considered so far; `iter_events` pages through it. The merged
stream of `rgt events` (box and controller events together) is controller.runs.eventlog.
"""
from __future__ import annotations

import logging
import threading
from typing import Iterator, List, Optional, Set

import protocol

from controller.store.db import Store

log = logging.getLogger(__name__)

POLL_S = 0.2      # how often --follow looks for commits by other processes
PAGE = 1000       # events read per query
# --follow remembers which events above the run's cursor it has shown (they can
# land out of order while the subscriber repairs a gap). Past this many it
# stops waiting for the gap below them to fill.
MAX_PENDING = 50_000


def wait_for_change(store: Store, version: int, stop: threading.Event, poll_s: float) -> bool:
    """Block until another connection commits (True) or stop is set (False)."""
    while not stop.wait(poll_s):
        if store.data_version() != version:
            return True
    return False


def _scan(store: Store, run: str, since: int, kind_prefix: Optional[str], page: int,
          shown: Optional[Set[int]]) -> Iterator[List[protocol.Event]]:
    """Pages of events with seq > since, skipping (and then recording) seqs in shown."""
    pos = since
    while True:
        batch = store.events(run, since=pos, kind_prefix=kind_prefix, limit=page)
        fresh = batch if shown is None else [e for e in batch if e.seq not in shown]
        if shown is not None:
            shown.update(e.seq for e in fresh)
        if fresh:
            yield fresh
        if len(batch) < page:
            return
        pos = batch[-1].seq


class BoxReader:
    """The box events of one run not read yet (seq > since), read again after each commit.

    Events at or below the run's cursor are final (Store.apply's contract), so a follower keeps
    a floor (every seq <= it considered) and the seqs it showed above it: the events a gap
    repair brings in later, below ones already shown, are still shown, once each.
    """

    def __init__(self, store: Store, run: str, *, since: int = 0, kind_prefix: Optional[str] = None,
                 follow: bool = False, page: int = PAGE) -> None:
        self.store, self.run, self.kind_prefix, self.page = store, run, kind_prefix, page
        self.floor = since                                              # every seq <= it considered
        self.shown: Optional[Set[int]] = set() if follow else None     # shown seqs above floor

    def read(self) -> Iterator[List[protocol.Event]]:
        """Non-empty pages of what was not read yet, in seq order (without follow: what is stored)."""
        settled = self.store.cursor(self.run)   # read before scanning: all events <= it are visible
        yield from _scan(self.store, self.run, self.floor, self.kind_prefix, self.page, self.shown)
        if self.shown is None:   # not following: one read
            return
        self.floor = max(self.floor, settled)
        self.shown = {seq for seq in self.shown if seq > self.floor}
        if len(self.shown) > MAX_PENDING:
            log.warning("run %s: %d events above its cursor %d; no longer waiting for the gap "
                        "below them", self.run, len(self.shown), self.floor)
            self.floor, self.shown = max(self.shown), set()


def iter_events(store: Store, run: str, *, since: int = 0, kind_prefix: Optional[str] = None,
                limit: Optional[int] = None, follow: bool = False,
                stop: Optional[threading.Event] = None, poll_s: float = POLL_S,
                page: int = PAGE) -> Iterator[List[protocol.Event]]:
    """Non-empty batches of a run's box events (seq > since), at most `limit` in all.

    Without follow: what is stored now, in seq order. With follow: then every
    event as it lands (BoxReader), until `stop` is set.
    """
    stop = threading.Event() if stop is None else stop
    remaining = limit
    reader = BoxReader(store, run, since=since, kind_prefix=kind_prefix, follow=follow, page=page)
    while True:
        version = store.data_version()
        for batch in reader.read():
            if remaining is not None:
                batch = batch[:remaining]
                remaining -= len(batch)
            yield batch
            if remaining == 0:
                return
        if not follow or not wait_for_change(store, version, stop, poll_s):
            return
