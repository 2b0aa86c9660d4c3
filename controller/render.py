"""Events for people (one short table line each) and for programs (one JSON object per line).

Event contents come from a remote box: every character that could move the
cursor or recolour a terminal is escaped before it is printed.
"""
from __future__ import annotations

import json
import math
import re
import sys
import time
from typing import Any, Mapping

import protocol

SUMMARY_WIDTH = 72
_ELLIPSIS = "..."
_KIND_WIDTH = 20
_SEQ_WIDTH = 7
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_BARE = re.compile(r"[^\s=\"']+")


def _escape(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()):02x}"


def printable(text: str) -> str:
    """text with control characters (C0, DEL, C1) shown as \\xNN."""
    return _UNSAFE.sub(_escape, text)


def local_time(ts: float) -> str:
    """HH:MM:SS in local time; ??:??:?? for a timestamp the platform cannot show."""
    try:
        return time.strftime("%H:%M:%S", time.localtime(ts))
    except (OverflowError, OSError, ValueError):
        return "??:??:??"


def _value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value if _BARE.fullmatch(value) else json.dumps(value, ensure_ascii=False)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def summarize(data: Mapping[str, Any], width: int = SUMMARY_WIDTH) -> str:
    """key=value pairs in the event's order, cut to width characters."""
    text = printable(" ".join(f"{k}={_value(v)}" for k, v in data.items()))
    if len(text) > width:
        text = text[: max(width - len(_ELLIPSIS), 0)] + _ELLIPSIS
    return text


def table_header() -> str:
    return f"{'SEQ':>{_SEQ_WIDTH}}  {'TIME':<8}  {'SEV':<8}  {'KIND':<{_KIND_WIDTH}}  DATA"


def table_row(event: protocol.Event, width: int = SUMMARY_WIDTH) -> str:
    """`SEQ  TIME  SEV  KIND  key=value ...` for one event."""
    kind = printable(event.kind)
    line = (f"{event.seq:>{_SEQ_WIDTH}}  {local_time(event.ts)}  {printable(event.sev):<8}  "
            f"{kind:<{_KIND_WIDTH}}  {summarize(event.data, width)}")
    return line.rstrip()


def json_line(event: protocol.Event) -> str:
    """event.to_dict() as one line of JSON (non-finite floats as "nan"/"inf", as on the wire)."""
    return protocol.encode_json(event.to_dict(), max_bytes=sys.maxsize).decode("utf-8")
