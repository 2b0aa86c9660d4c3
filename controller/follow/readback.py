"""The journal read back over the box's shell, for a run whose sidecar does not answer.

A sidecar serves its run's journal for a linger after the job's exit (5 min by default) and then
ends. A laptop that slept through that, or a daemon started afterwards, finds the endpoints file
but no one behind the sockets: its hello is never answered, and the store would never learn how
the run ended (nor when the sidecar went between its last event and a request that was pending).
So a watcher whose subscriber has left a request unanswered for READBACK_AFTER_S asks the box
for the journal itself (`rgt-onbox journal RUN_DIR --since CURSOR --json`, on the host's shared
ControlMaster, or this machine's shell for host `local`), page by page, until the store is level
with it; while the sidecar stays away it asks again every READBACK_EVERY_S. The journal is the
run's source of truth either way, so the events stored are the ones the sidecar would have sent.

The page is the box's claim (controller.trust): each event is decoded by the protocol with its
own checks, an event of another run is dropped, an event naming another host than the run's is
refused with the whole page, seqs must rise, and the page is bounded in events.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Tuple

from protocol import Event, ProtocolError, decode_event

from controller import trust as boxtrust

READBACK_AFTER_S = 5.0       # a request unanswered this long: read the journal instead
READBACK_EVERY_S = 30.0      # and again this often while the sidecar stays away (at once when `more`)
MAX_PAGE_EVENTS = 1000       # what `rgt-onbox journal` sends at most in one page
MAX_LINE_CHARS = 256 * 1024  # an event line longer than this is no event the protocol would take
TIMEOUT_S = 60.0


@dataclasses.dataclass
class Page:
    """A checked page: the events to store (seq order), and what was left out."""
    events: List[Event]
    more: bool
    refused: List[str]         # why each undecodable line was refused (its seqs become a gap)
    foreign: int = 0           # events of another run, dropped


def checked(doc: Any, run: str, host: str, since: int) -> Page:
    """The page `rgt-onbox journal --json` answered for `run` after seq `since`; Untrusted when
    it is not a page, or its events name another host than `host` (the run's, "" when unknown)
    or do not rise."""
    if not isinstance(doc, dict) or not isinstance(doc.get("events"), list):
        raise boxtrust.Untrusted("the box's journal page is not an object with an events list")
    lines, more = doc["events"], doc.get("more")
    if not isinstance(more, bool):
        raise boxtrust.Untrusted("the box's journal page has no boolean `more`")
    if len(lines) > MAX_PAGE_EVENTS:
        raise boxtrust.Untrusted(f"the box's journal page holds {len(lines)} events, over {MAX_PAGE_EVENTS}")
    page = Page([], more, [])
    last = since
    for line in lines:
        if not isinstance(line, str) or len(line) > MAX_LINE_CHARS:
            page.refused.append("a journal line that is not a string of bounded length")
            continue
        try:
            ev = decode_event(line.encode("utf-8", "surrogatepass"))
        except (ProtocolError, UnicodeError) as e:
            page.refused.append(str(e)[:200])
            continue
        if ev.run != run:
            page.foreign += 1
            continue
        if host and ev.host != host:
            raise boxtrust.Untrusted(f"the journal of run {run!r} holds an event of host {ev.host[:80]!r}, "
                                     f"not {host[:80]!r} (a run is bound to its box)")
        if ev.seq <= last:
            raise boxtrust.Untrusted(f"the box's journal page goes from seq {last} to {ev.seq}: "
                                     "seqs must rise")
        last = ev.seq
        page.events.append(ev)
    return page


def gaps(page: Page, since: int) -> List[Tuple[int, int]]:
    """(first, last) seq ranges the page skipped after `since` (lines the journal lost or that
    were refused): recorded in the store as gaps, as the subscriber does."""
    out = []
    expected = since + 1
    for ev in page.events:
        if ev.seq > expected:
            out.append((expected, ev.seq - 1))
        expected = ev.seq + 1
    return out


def reason(page: Page) -> str:
    """Why the seqs of a gap are missing, as the store records it."""
    return (f"refused at the boundary: {page.refused[0][:200]}" if page.refused
            else "not in the box's journal (read back with rgt-onbox journal)")


__all__ = ["MAX_PAGE_EVENTS", "Page", "READBACK_AFTER_S", "READBACK_EVERY_S", "TIMEOUT_S", "checked",
           "gaps", "reason"]
