"""Every event the laptop knows of one run, in one ordered stream: what `rgt events` prints.

Two sources: the box's journal ("box": protocol.Event, stored by the subscriber, ordered by seq)
and what the controller recorded itself ("controller": store.LocalEvent, such as link.lost and
link.restored, sidecar.silent, sidecar.degraded, run.stop_requested, verification results,
job.rank_failed). They are merged by time; each source keeps its own order (box seqs, the store's
ids), so a gap repaired late or a box clock set differently never reorders one source's events,
and on equal times the box event comes first.

Filters hold for both: a kind prefix; `since` (a box seq) keeps box events after it and the
controller events recorded after that event's time; a limit counts both.
"""
from __future__ import annotations

import heapq
import sys
import threading
from typing import Any, Dict, Iterable, Iterator, List, Optional, Union

import protocol

from controller import render
from controller.store.db import LocalEvent, Store
from controller.store.events import PAGE, POLL_S, BoxReader, wait_for_change

BOX, CONTROLLER = "box", "controller"
Item = Union[protocol.Event, LocalEvent]
_SEQ_WIDTH, _SOURCE_WIDTH, _KIND_WIDTH = 7, 10, 20


def source_of(item: Item) -> str:
    return BOX if isinstance(item, protocol.Event) else CONTROLLER


def _ts(item: Item) -> float:
    return item.ts


def _flat(pages: Iterable[List[protocol.Event]]) -> Iterator[Item]:
    for page in pages:
        yield from page


def _local(events: Iterable[LocalEvent]) -> Iterator[Item]:
    yield from events


def since_ts(store: Store, run: str, since: int) -> Optional[float]:
    """The time after which controller events count for `since` box seq SEQ: that event's ts (or
    the newest stored one below it, looked for within one page); None when nothing bounds them."""
    if since <= 0:
        return None
    near = [e for e in store.events(run, since=max(0, since - PAGE), limit=PAGE) if e.seq <= since]
    return near[-1].ts if near else None


class _LocalReader:
    """The controller events of one run not read yet (ids only grow: one writer at a time)."""

    def __init__(self, store: Store, run: str, kind_prefix: Optional[str], after_ts: Optional[float]) -> None:
        self.store, self.run, self.kind_prefix, self.after_ts = store, run, kind_prefix, after_ts
        self.last_id = 0

    def read(self) -> List[LocalEvent]:
        got = self.store.local_events(self.run, since_id=self.last_id)
        if got:
            self.last_id = got[-1].id
        after, self.after_ts = self.after_ts, None   # the cut holds for what was there at the start
        return [e for e in got if (not self.kind_prefix or e.kind.startswith(self.kind_prefix))
                and (after is None or e.ts > after)]


def iter_stream(store: Store, run: str, *, since: int = 0, kind_prefix: Optional[str] = None,
                limit: Optional[int] = None, follow: bool = False,
                stop: Optional[threading.Event] = None, poll_s: float = POLL_S,
                page: int = PAGE) -> Iterator[List[Item]]:
    """Non-empty batches of the run's box and controller events, merged by time, at most `limit`
    in all. Without follow: what is stored now. With follow: then what lands, until `stop` is set
    (each round's new events are merged among themselves, after what was shown)."""
    stop = threading.Event() if stop is None else stop
    remaining = limit
    box = BoxReader(store, run, since=since, kind_prefix=kind_prefix, follow=follow, page=page)
    local = _LocalReader(store, run, kind_prefix, since_ts(store, run, since))
    while True:
        version = store.data_version()
        merged = heapq.merge(_flat(box.read()), _local(local.read()), key=_ts)
        batch: List[Item] = []
        for item in merged:
            batch.append(item)
            if remaining is not None:
                remaining -= 1
            if len(batch) >= page or remaining == 0:
                yield batch
                batch = []
            if remaining == 0:
                return
        if batch:
            yield batch
        if not follow or not wait_for_change(store, version, stop, poll_s):
            return


# ---- rendering -------------------------------------------------------------------


def table_header() -> str:
    return (f"{'SEQ':>{_SEQ_WIDTH}}  {'TIME':<8}  {'SOURCE':<{_SOURCE_WIDTH}}  {'SEV':<8}  "
            f"{'KIND':<{_KIND_WIDTH}}  DATA")


def table_row(item: Item, width: int = render.SUMMARY_WIDTH) -> str:
    """`SEQ  TIME  SOURCE  SEV  KIND  key=value ...`; a controller event has no seq ("-")."""
    seq = str(item.seq) if isinstance(item, protocol.Event) else "-"
    line = (f"{seq:>{_SEQ_WIDTH}}  {render.local_time(item.ts)}  {source_of(item):<{_SOURCE_WIDTH}}  "
            f"{render.printable(item.sev):<8}  {render.printable(item.kind):<{_KIND_WIDTH}}  "
            f"{render.summarize(item.data, width)}")
    return line.rstrip()


def to_dict(item: Item) -> Dict[str, Any]:
    """A box event as on the wire (Event.to_dict) plus "source"; a controller event with the same
    keys where they mean something ("seq" null, "id" its store id) and "source"."""
    if isinstance(item, protocol.Event):
        return {**item.to_dict(), "source": BOX}
    return {"run": item.run, "seq": None, "id": item.id, "ts": item.ts, "kind": item.kind, "sev": item.sev,
            "data": dict(item.data), "source": CONTROLLER}


def json_line(item: Item) -> str:
    """One line of JSON (non-finite floats as "nan"/"inf", as on the wire), terminal-safe."""
    return render.json_safe(protocol.encode_json(to_dict(item), max_bytes=sys.maxsize).decode("utf-8"))


__all__ = ["BOX", "CONTROLLER", "Item", "iter_stream", "json_line", "since_ts", "source_of",
           "table_header", "table_row", "to_dict"]
