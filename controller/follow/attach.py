"""Follow a sidecar on this machine (host `local`) into the store.

`rgt attach RUN_DIR` finds the sockets through <run>/rgt/endpoints.json and
runs a Subscriber in the foreground. Later the per-run background watcher and
the SSH tunnel reuse the same Subscriber; only how the endpoints are reached
differs.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from protocol import Event, ProtocolError
from protocol.endpoints import Endpoints

from controller.follow.subscriber import EventsHook, Subscriber
from controller.runs import life
from controller.store.db import Store

log = logging.getLogger(__name__)


class AttachError(Exception):
    """The run cannot be attached (no sidecar endpoints appeared)."""


def wait_for_endpoints(rgt_dir: Path, timeout_s: float, stop: threading.Event,
                       monotonic: Callable[[], float] = time.monotonic) -> Endpoints:
    """The sidecar's endpoints, waiting for a sidecar that is still starting."""
    deadline = monotonic() + timeout_s
    while True:
        try:
            return Endpoints.read(rgt_dir)
        except FileNotFoundError:
            pass
        except ProtocolError as e:  # a torn write of the file: read again
            log.debug("endpoints not readable yet: %s", e)
        if monotonic() >= deadline or stop.wait(0.05):
            raise AttachError(f"no sidecar endpoints in {rgt_dir} after {timeout_s:g}s "
                              "(is `rgt-onbox serve` running for this run?)")


def attach(run_dir: Path, store: Store, *, on_events: Optional[EventsHook] = None,
           until_exit: bool = False, timeout_s: Optional[float] = None,
           wait_s: float = 30.0, stop: Optional[threading.Event] = None) -> Subscriber:
    """Follow the run until stopped, the timeout, or (until_exit) the job's exit is stored."""
    stop = stop or threading.Event()
    endpoints = wait_for_endpoints(Path(run_dir) / "rgt", wait_s, stop)
    sub = Subscriber(store, endpoints, on_events=on_events)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    exited = threading.Event() if until_exit else None
    if exited is not None:
        sub.on_events = _watch_exit(on_events, exited)

    def until() -> bool:
        if deadline is not None and time.monotonic() >= deadline:
            return True
        return exited is not None and exited.is_set() and sub.caught_up

    sub.run_until(stop, until)
    return sub


def _watch_exit(inner: Optional[EventsHook], flag: threading.Event) -> EventsHook:
    """Pass events on, and set `flag` once the run ended (its run.closed, or a job.exited with no
    close-out after it) or the sidecar stopped."""
    def hook(events: Sequence[Event]) -> None:
        if any((ev.kind in life.END_KINDS and not life.closes(ev)) or ev.kind == "sidecar.stopping"
               for ev in events):
            flag.set()
        if inner is not None:
            inner(events)
    return hook
