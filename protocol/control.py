"""Control requests (DEALER -> ROUTER) and their replies."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Tuple, Union

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


@dataclasses.dataclass(frozen=True)
class ErrorReply:
    id: str
    code: str             # one of protocol.kinds.ERROR_CODES
    message: str


Request = Union[Hello, Since]
Reply = Union[HelloReply, SinceReply, ErrorReply]
