"""Reading a run's events from the store, once or following new ones.

Shared by `rgt events` and, later, `rgt watch` and `rgt status`.
"""
from __future__ import annotations

import logging
import threading
from typing import Iterator, List, Optional, Set

import protocol

from controller.store import Store

log = logging.getLogger(__name__)

POLL_S = 0.2      # how often --follow looks for commits by other processes
PAGE = 1000       # events read per query
# --follow remembers which events above the run's cursor it has shown (they can
# land out of order while the subscriber repairs a gap). Past this many it
# stops waiting for the gap below them to fill.
MAX_PENDING = 50_000


def _wait_for_change(store: Store, version: int, stop: threading.Event, poll_s: float) -> bool:
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


def iter_events(store: Store, run: str, *, since: int = 0, kind_prefix: Optional[str] = None,
                limit: Optional[int] = None, follow: bool = False,
                stop: Optional[threading.Event] = None, poll_s: float = POLL_S,
                page: int = PAGE) -> Iterator[List[protocol.Event]]:
    """Non-empty batches of a run's events (seq > since), at most `limit` in all.

    Without follow: what is stored now, in seq order. With follow: then every
    event as it lands, until `stop` is set. Events at or below the run's
    cursor are final (Store.apply's contract), so the events a gap repair
    brings in later, below ones already shown, are still shown, once each.
    """
    stop = threading.Event() if stop is None else stop
    remaining = limit
    floor = since                 # every event <= floor has been considered
    shown: Optional[Set[int]] = set() if follow else None   # shown seqs above floor
    while True:
        version = store.data_version()
        settled = store.cursor(run)   # read before scanning: all events <= it are visible
        for batch in _scan(store, run, floor, kind_prefix, page, shown):
            if remaining is not None:
                batch = batch[:remaining]
                remaining -= len(batch)
            yield batch
            if remaining == 0:
                return
        if shown is None:
            return
        floor = max(floor, settled)
        shown = {seq for seq in shown if seq > floor}
        if len(shown) > MAX_PENDING:
            log.warning("run %s: %d events above its cursor %d; no longer waiting for the gap "
                        "below them", run, len(shown), floor)
            floor, shown = max(shown), set()
        if not _wait_for_change(store, version, stop, poll_s):
            return
