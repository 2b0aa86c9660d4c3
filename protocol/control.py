"""Control requests (DEALER -> ROUTER) and their replies."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple, Union

from .envelope import Event


@dataclasses.dataclass(frozen=True)
class Hello:
    """First message of every connection; the reply says who is serving."""

    id: str
    client: str = ""


@dataclasses.dataclass(frozen=True)
class Since:
    """Replay: journaled events with seq > `seq`, at most `limit` of them."""

    id: str
    seq: int
    limit: int = 1000


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Build and write the run's rgt/PULL_MANIFEST.json (protocol.pull) and send it back.

    `includes` are extra glob patterns (relative to the run dir) on top of the sidecar's default
    includes; each must match at least one file, or the request is refused."""

    id: str
    includes: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Renew:
    """Renew the box's dead-man lease (~/.rgt/deadman.json) from now, for `ttl_s` seconds or, when
    None, for the lease's own TTL. A lease that is not armed stays so: a renewal never arms one."""

    id: str
    ttl_s: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class HelloReply:
    id: str
    protocol_version: int
    package_version: str
    boot_id: str          # new for every sidecar process; a change means it restarted
    host: str
    run: str
    run_meta: Mapping[str, Any]
    last_seq: int         # newest seq journaled (0 when none)
    oldest_seq: int       # oldest seq still replayable (0 when none)


@dataclasses.dataclass(frozen=True)
class SinceReply:
    id: str
    events: Tuple[Event, ...]
    more: bool            # True: ask again from the last event's seq
    last_seq: int
    oldest_seq: int
    # Why each event frame that did not decode was refused: one bad frame costs that event (a gap
    # for the reader), never the page around it (a refused page would be asked for again forever).
    refused: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ManifestReply:
    """The manifest as written; its header repeats the doc's sha256 and counts."""

    id: str
    path: str             # where it was written, relative to the run dir (rgt/PULL_MANIFEST.json)
    sha256: str           # the doc's own sha256 (protocol.pull.manifest_digest)
    files: int
    total_bytes: int
    doc: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class RenewReply:
    """The lease after the renewal. `state` is one of protocol.kinds.DEADMAN_STATES."""

    id: str
    armed: bool
    expires_at: float     # unix seconds; 0.0 when there is no armed lease
    ttl_s: float
    state: str


@dataclasses.dataclass(frozen=True)
class ErrorReply:
    id: str
    code: str             # one of protocol.kinds.ERROR_CODES
    message: str


Request = Union[Hello, Since, Manifest, Renew]
Reply = Union[HelloReply, SinceReply, ManifestReply, RenewReply, ErrorReply]
