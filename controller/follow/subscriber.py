"""Keep the store equal to a sidecar's journal: live events plus gap repair.

The ZeroMQ "clone" pattern: live events arrive on SUB; whenever the next
expected seq is not the one that arrives (a reconnect, a slow-joiner loss, a
restarted sidecar), the subscriber asks `since(cursor)` on the control socket
and pages through the journal until it is caught up. The store is idempotent
on (run, seq) and the cursor moves in the same transaction as the events, so
a subscriber killed at any point resumes exactly where the store says.

A transport failure proves only that the transport is down; nothing here
concludes anything about the job from it.

The box is not trusted with identities (controller.trust): a hello that names another run than
the one followed (`expect_run`), or another host than the one the run was first seen on, is
refused before anything is stored (SubscriberRefused), and events of other runs are dropped.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Callable, List, Optional, Sequence, Tuple

from protocol import (
    PACKAGE_VERSION,
    PROTOCOL_VERSION,
    ErrorReply,
    Event,
    Hello,
    HelloReply,
    ProtocolError,
    Renew,
    RenewReply,
    Since,
    SinceReply,
    decode_event,
    decode_reply,
    encode_request,
)
from protocol.endpoints import Endpoints

from controller import trust as boxtrust
from controller.box.transport import CurveClient, Hub, Link
from controller.store.db import AmbiguousRun, RunNotFound, Store

log = logging.getLogger(__name__)

EventsHook = Callable[[Sequence[Event]], None]


# Requests left unanswered in a row before the link is closed and opened again.
REOPEN_AFTER = 3


class SubscriberError(Exception):
    """The sidecar cannot be followed (e.g. it speaks another protocol version)."""


class SubscriberRefused(SubscriberError):
    """The sidecar's hello was refused (another run, another host, a malformed field): nothing of
    it was stored, and this link is not followed."""


MAX_HOST_CHARS = 256
MAX_VERSION_CHARS = 128


@dataclasses.dataclass
class _Pending:
    id: str
    op: str
    deadline: float


@dataclasses.dataclass
class SubscriberStats:
    live_applied: int = 0
    replayed: int = 0
    since_requests: int = 0
    bad_frames: int = 0
    resends: int = 0
    reopens: int = 0      # links opened afresh after REOPEN_AFTER unanswered requests
    gaps: int = 0
    renewals: int = 0     # dead-man lease renewals the sidecar confirmed
    refused: int = 0      # hellos refused (another run or host): nothing of them stored
    foreign: int = 0      # events of another run, dropped


class Subscriber:
    def __init__(self, store: Store, endpoints: Endpoints, *, curve: Optional[CurveClient] = None,
                 request_timeout_s: float = 2.0, resync_s: float = 5.0, page: int = 1000,
                 on_events: Optional[EventsHook] = None, renew_every_s: Optional[float] = None,
                 expect_run: Optional[str] = None, hub: Optional[Hub] = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        """`expect_run`: the run this link must be (the watcher always names it); None learns the
        run from the hello (`rgt track`, which attaches to whatever answers). `hub`: the follower
        daemon's, whose poll covers this link (then the daemon drives start/step/finish)."""
        self.store = store
        self.expect_run = None if expect_run is None else boxtrust.run_id(expect_run)
        self.link = Link(endpoints, curve, hub)
        self.request_timeout_s = request_timeout_s
        self.resync_s = resync_s
        self.page = page
        self.on_events = on_events
        self._mono = monotonic
        self.run: Optional[str] = None
        self.cursor = 0
        self.boot_id = ""
        self.remote_last_seq = 0
        self.caught_up = False
        self.stats = SubscriberStats()
        self._pending: Optional[_Pending] = None
        self._asking_since = 0.0      # when the request now pending was first sent (resends keep it)
        self._unanswered = 0
        self._last_activity = 0.0
        # The box's dead-man lease is renewed while someone follows the run (None: never).
        self.renew_every_s = renew_every_s
        self._next_renew = 0.0
        self._pending_op = ""
        self.lease: Optional[RenewReply] = None

    # ---- loop -------------------------------------------------------------

    def run_until(self, stop: threading.Event, until: Optional[Callable[[], bool]] = None) -> None:
        """Follow the sidecar until `stop` is set or `until()` is true."""
        self.start()
        try:
            while not stop.is_set():
                self._handle(*self.link.poll(self.wake_in_ms()))
                if until is not None and until():
                    return
        finally:
            self.finish()

    # The same loop, driven from outside (the follower daemon polls every link in one Hub):
    # start(), then step() whenever the hub named this link or wake_in_ms() has passed, finish().

    def start(self) -> None:
        self.link.open()
        self._request("hello")

    def step(self) -> None:
        """Take what arrived and run the timers; SubscriberError when the sidecar cannot be followed."""
        self._handle(*self.link.read())

    def finish(self) -> None:
        self.link.close()

    def _handle(self, live: List[bytes], replies: List[List[bytes]]) -> None:
        for frames in replies:
            self._on_reply(frames)
        if live:
            self._on_live(live)
        self._timers()

    def due_in_s(self) -> float:
        """In how many seconds the timers want the next step: a pending request's deadline, a
        renewal, or the quiet link's probe (0 when one is due now)."""
        now = self._mono()
        due = self._last_activity + self.resync_s
        if self._pending is not None:
            due = min(due, self._pending.deadline)
        elif self._renew_due(now):
            due = now
        elif self.renew_every_s is not None and self.run is not None:
            due = min(due, self._next_renew)
        return max(0.0, due - now)

    def wake_in_ms(self) -> int:
        """due_in_s() as a poll timeout, in ms: at least 1, and at most 1000 so that a loop of its own
        (run_until) sees stop and until() within a second. Events wake the poll at once (200 ms
        woke each of 64 watchers 5 times a second for nothing: bench/controller_scale.py)."""
        return max(1, min(1000, int(self.due_in_s() * 1000)))

    def _timers(self) -> None:
        now = self._mono()
        if self._pending is not None:
            if now >= self._pending.deadline:
                self.stats.resends += 1
                self._unanswered += 1
                if self._unanswered >= REOPEN_AFTER:
                    # libzmq drops a peer that sent a part over the size cap and never reconnects
                    # that socket: after a few unanswered requests, start the link afresh.
                    self._unanswered = 0
                    self.stats.reopens += 1
                    self.link.close()
                    self.link.open()
                self._request(self._pending.op)
        elif self._renew_due(now):
            self._request("renew")
        elif now - self._last_activity >= self.resync_s:
            # A quiet link may have lost the tail; a probe costs one round trip.
            self._request("hello" if self.run is None else "since")

    def _renew_due(self, now: float) -> bool:
        return self.renew_every_s is not None and self.run is not None and now >= self._next_renew

    # ---- requests ---------------------------------------------------------

    def _request(self, op: str) -> None:
        rid = uuid.uuid4().hex[:12]
        if op == "hello" or self.run is None:
            op, frames = "hello", encode_request(Hello(id=rid, client=f"rgt {PACKAGE_VERSION}"))
        elif op == "renew":
            assert self.renew_every_s is not None
            # Due again after one interval whatever the answer: a lost reply costs one renewal, and
            # a resend waits for the request timeout like any other.
            self._next_renew = self._mono() + self.renew_every_s
            frames = encode_request(Renew(id=rid))
        else:
            self.stats.since_requests += 1
            frames = encode_request(Since(id=rid, seq=self.cursor, limit=self.page))
        now = self._mono()
        self._last_activity = now
        # Not queued (no connection yet, or the link is down): retry soon, not at
        # the full timeout; connects are asynchronous and usually finish in ms.
        sent = self.link.send(frames)
        wait = self.request_timeout_s if sent else min(self.request_timeout_s, 0.05)
        if self._pending is None:
            self._asking_since = now
        self._pending = _Pending(rid, op, now + wait)

    def unanswered_s(self) -> float:
        """How long the sidecar has left a request unanswered (resends included); 0 when none is
        pending. A sidecar that ended leaves the first one unanswered for good."""
        return 0.0 if self._pending is None else max(0.0, self._mono() - self._asking_since)

    def level_with(self, cursor: int) -> None:
        """The store holds every seq up to `cursor` (read back from the journal by the watcher):
        what the sidecar sends at or below it later is not stored again."""
        self.cursor = max(self.cursor, cursor)

    def _on_reply(self, frames: List[bytes]) -> None:
        try:
            reply = decode_reply(frames)
        except ProtocolError as e:
            self.stats.bad_frames += 1
            log.warning("undecodable control reply: %s", e)
            return
        if self._pending is None or reply.id != self._pending.id:
            if isinstance(reply, ErrorReply) and reply.code == "version":
                raise SubscriberError(f"the sidecar refused us: {reply.message}")
            return  # an answer to a request we already gave up on
        self._pending_op = self._pending.op
        self._pending = None
        self._unanswered = 0
        self._last_activity = self._mono()
        if isinstance(reply, HelloReply):
            self._on_hello(reply)
        elif isinstance(reply, SinceReply):
            self._on_since(reply)
        elif isinstance(reply, RenewReply):
            self.stats.renewals += 1
            self.lease = reply
            log.debug("dead-man lease: %s, armed %s, expires at %.0f", reply.state, reply.armed,
                      reply.expires_at)
        elif isinstance(reply, ErrorReply):  # (a manifest reply: never asked for here)
            if reply.code == "version":
                raise SubscriberError(f"the sidecar refused us: {reply.message}")
            if self.renew_every_s is not None and self._pending_op == "renew":
                # An older sidecar, or a box without a lease file it can write: stop asking.
                log.info("the sidecar does not renew the dead-man lease (%s): %s", reply.code, reply.message)
                self.renew_every_s = None
                return
            log.warning("sidecar error reply %s: %s", reply.code, reply.message)

    def _on_hello(self, reply: HelloReply) -> None:
        if reply.protocol_version != PROTOCOL_VERSION:
            raise SubscriberError(
                f"the sidecar speaks protocol v{reply.protocol_version}, this rgt speaks "
                f"v{PROTOCOL_VERSION}: install the same version on both sides (sidecar "
                f"{str(reply.package_version)[:40]!r}, rgt {PACKAGE_VERSION})")
        run, host, boot_id, package = self._checked_hello(reply)
        if package != PACKAGE_VERSION:
            log.warning("sidecar package %r differs from rgt %s", package, PACKAGE_VERSION)
        self.run, self.boot_id = run, boot_id
        self.store.upsert_run(run, host=host, boot_id=boot_id, protocol_version=reply.protocol_version,
                              package_version=package, meta=dict(reply.run_meta),
                              endpoint=self.link.endpoints.ctl)
        self.cursor = self.store.cursor(run)
        self.remote_last_seq = reply.last_seq
        if self.cursor > reply.last_seq:
            log.warning("store holds seq %d but the sidecar's journal ends at %d (journal replaced?)",
                        self.cursor, reply.last_seq)
        self._request("since")

    def _checked_hello(self, reply: HelloReply) -> Tuple[str, str, str, str]:
        """(run, host, boot_id, package version) of a hello this link may follow; SubscriberRefused
        (counted, nothing stored) for another run, a run seen on another host, or a bad field."""
        try:
            if self.expect_run is not None:
                run = boxtrust.expect_run(reply.run, self.expect_run, "the sidecar")
            else:
                run = boxtrust.run_id(reply.run, "the sidecar's run id")
            if self.run is not None and run != self.run:
                raise boxtrust.Untrusted(f"the sidecar answered for run {run!r} after {self.run!r}")
            host = boxtrust.text(reply.host, "host name", MAX_HOST_CHARS)
            boot_id = boxtrust.text(reply.boot_id, "boot id", MAX_VERSION_CHARS)
            package = boxtrust.text(reply.package_version, "package version", MAX_VERSION_CHARS)
            bound = stored_host(self.store, run)
            if bound and host != bound:
                raise boxtrust.Untrusted(f"run {run!r} was first seen on host {bound[:80]!r}; the sidecar "
                                         f"now says {host[:80]!r} (a run is bound to its box)")
        except boxtrust.Untrusted as e:
            self.stats.refused += 1
            raise SubscriberRefused(f"refused the sidecar at {self.link.endpoints.ctl}: {e}") from None
        return run, host, boot_id, package

    def _on_since(self, reply: SinceReply) -> None:
        self.remote_last_seq = max(self.remote_last_seq, reply.last_seq)
        fresh = [ev for ev in reply.events if ev.seq > self.cursor and self._ours(ev)]
        missing = "not in the sidecar's journal"
        if reply.refused:
            self.stats.bad_frames += len(reply.refused)
            log.warning("run %s: refused %d event frame(s) of a since page: %s", self.run,
                        len(reply.refused), reply.refused[0])
            missing = f"refused at the boundary: {reply.refused[0][:200]}"
        expected = self.cursor + 1
        for ev in fresh:
            if ev.seq > expected:
                self._gap(expected, ev.seq - 1, missing)
            expected = ev.seq + 1
        if not fresh and not reply.more and reply.last_seq > self.cursor:
            self._gap(self.cursor + 1, reply.last_seq, missing)
            self._apply([], reply.last_seq)
        self.stats.replayed += len(fresh)
        if fresh:
            self._apply(fresh, fresh[-1].seq)
        if reply.more:
            self._request("since")
        else:
            self.caught_up = self.cursor >= reply.last_seq

    def _on_live(self, frames: List[bytes]) -> None:
        if self.run is None:
            return  # the hello reply sets the cursor; `since` then fetches these
        batch: List[Event] = []
        expected = self.cursor + 1
        gap = False
        for frame in frames:
            try:
                ev = decode_event(frame)
            except ProtocolError as e:
                self.stats.bad_frames += 1
                log.warning("undecodable event frame: %s", e)
                gap = True
                continue
            if not self._ours(ev) or ev.seq < expected:
                continue
            if ev.seq > expected or gap:
                gap = True
                continue
            batch.append(ev)
            expected += 1
        self.remote_last_seq = max(self.remote_last_seq, expected - 1)
        if batch:
            self.stats.live_applied += len(batch)
            self._apply(batch, batch[-1].seq)
        if gap:
            self.caught_up = False
            if self._pending is None:
                self._request("since")
        elif self._pending is None:
            self.caught_up = True
            self._last_activity = self._mono()

    def _ours(self, ev: Event) -> bool:
        """Whether EV belongs to the run followed; another run's event is counted and dropped."""
        if ev.run == self.run:
            return True
        self.stats.foreign += 1
        if self.stats.foreign == 1:
            log.warning("run %s: the sidecar sent an event of run %r; dropped (and any more)", self.run,
                        ev.run[:80])
        return False

    def _apply(self, events: Sequence[Event], cursor: int) -> None:
        assert self.run is not None
        self.store.apply(self.run, events, cursor)
        self.cursor = cursor
        for ev in events:
            if ev.kind == "sidecar.started" and ev.data.get("boot_id"):
                self.boot_id = str(ev.data["boot_id"])
        if events and self.on_events is not None:
            self.on_events(events)

    def _gap(self, first: int, last: int, reason: str) -> None:
        assert self.run is not None
        self.stats.gaps += 1
        log.warning("run %s: seqs %d..%d are missing (%s)", self.run, first, last, reason)
        self.store.record_gap(self.run, first, last, reason)


def stored_host(store: Store, run: str) -> str:
    """The host name the run was first seen on ("" when none is stored yet)."""
    try:
        info = store.run(run)
    except (RunNotFound, AmbiguousRun):
        return ""
    return str(info["host"] or "") if info["run"] == run else ""
