"""Encode and decode every frame: events, control requests and replies.

Frames are UTF-8 JSON objects. A control message is a ZeroMQ multipart
message: one JSON header frame, and for a `since` reply one more frame per
event, each exactly as the sidecar journaled and published it. Keeping events
as their own frames means a reply never re-encodes them and every event passes
through the same limits as on the live stream. A `manifest` reply carries the
pull manifest (protocol.pull) as its second frame: the frame cap applies, the
key cap is relaxed (a manifest has six keys per file), and the decoder checks
the doc against its own sha256.

Non-finite floats (a NaN loss is exactly what we report) are not JSON; they
travel as the strings "nan", "inf" and "-inf".

The other side is not trusted (a rented box, or a controller speaking to one), so every decoder
raises ProtocolError and nothing else, whatever it is given, and every encoder too: integers
anywhere in a frame fit in 64 bits (signed or unsigned: what a C or SQL reader holds), times are
finite unix seconds, and no string holds a lone surrogate (a JSON `\\ud800` escape decodes to
one; UTF-8 cannot carry it, so re-encoding it would raise far from where it came in).
"""
from __future__ import annotations

import functools
import json
import math
import re
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple, TypeVar

from .control import (
    ErrorReply,
    Hello,
    HelloReply,
    Manifest,
    ManifestReply,
    Renew,
    RenewReply,
    Reply,
    Request,
    Since,
    SinceReply,
)
from .envelope import PROTOCOL_VERSION, SEVERITIES, Event
from .errors import ProtocolError
from .pull import check_manifest

MAX_FRAME_BYTES = 256 * 1024
MAX_DEPTH = 16
MAX_KEYS = 1000
# A single event stays well under the frame cap so a since page can hold many.
MAX_EVENT_BYTES = 64 * 1024
# A since reply packs events up to about this many bytes.
PAGE_BYTES = 192 * 1024
MAX_SINCE_LIMIT = 10_000
# A manifest request names at most this many extra include patterns, each at most this long.
MAX_INCLUDES = 64
MAX_INCLUDE_CHARS = 1024
# The manifest doc frame: the byte cap bounds it; keys are capped only loosely.
MAX_DOC_KEYS = MAX_FRAME_BYTES // 4
# A renew asks for at most this TTL (a week): a longer lease is no dead-man at all.
MAX_RENEW_TTL_S = 7 * 24 * 3600.0
# Integers anywhere in a frame: int64 or uint64.
MIN_INT = -(1 << 63)
MAX_INT = (1 << 64) - 1
# Times (ts, expires_at) and durations in replies: finite seconds in [0, MAX_SECONDS) (year 5138).
MAX_SECONDS = 1e11
# Request and reply ids: the controller's are 12 hex characters.
MAX_ID_CHARS = 256
# A reply has at most this many frames (a since reply: the header and one per event).
MAX_REPLY_FRAMES = MAX_SINCE_LIMIT + 1

SURROGATE_MESSAGE = "a string holds a lone surrogate (U+D800..U+DFFF), which UTF-8 cannot carry"

_NONFINITE = {math.inf: "inf", -math.inf: "-inf"}
# A JSON escape of a surrogate code point: the only way one gets into decoded text (raw UTF-8
# bytes of a surrogate are refused by the strict decode). A pair becomes one astral character.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


F = TypeVar("F", bound=Callable[..., Any])


def _encoder(fn: F) -> F:
    """An encoder raises ProtocolError and nothing else, whatever object it is handed (a reply
    whose fields are of the wrong type included)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ProtocolError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError,
                RecursionError) as e:
            raise ProtocolError(f"cannot encode: {type(e).__name__}: {str(e)[:120]}") from e
    return wrapper  # type: ignore[return-value]


def _plain(value: Any, depth: int = 0) -> Any:
    """Make value JSON-safe: tuples to lists, non-finite floats to strings."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"nesting deeper than {MAX_DEPTH}")
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return _NONFINITE.get(value, value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        return int(value)  # an int subclass (IntEnum) as a plain int: the shape check sees every int
    raise ProtocolError(f"cannot encode a {type(value).__name__}")


@_encoder
def encode_json(obj: Mapping[str, Any], max_bytes: int = MAX_FRAME_BYTES,
                max_keys: int = MAX_KEYS) -> bytes:
    """One frame from a mapping; ProtocolError when it breaks a limit."""
    plain = _plain(obj)
    _check_shape(plain, max_keys)
    try:
        frame = json.dumps(
            plain, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ProtocolError(SURROGATE_MESSAGE) from e
    if len(frame) > max_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes is over the {max_bytes} byte cap",
                            code="too_large")
    return frame


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not JSON")


# One decoder for every frame: json.loads with a keyword builds a new decoder on each call.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def decode_json(frame: bytes, max_keys: int = MAX_KEYS) -> Dict[str, Any]:
    """A frame to a dict, enforcing size, depth, key, integer and string limits."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"a frame is bytes, not {type(frame).__name__}")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"frame of {len(frame)} bytes is over the {MAX_FRAME_BYTES} byte cap", code="too_large"
        )
    try:
        text = (frame if type(frame) is bytes else bytes(frame)).decode("utf-8")
        obj = _DECODER.decode(text)
    except ProtocolError:
        raise
    except (ValueError, RecursionError) as e:
        if "integer string conversion" in str(e):  # Python >= 3.11 refuses over 4300 digits itself
            raise ProtocolError(_INT_MESSAGE.format(bits="over 14,000")) from e
        raise ProtocolError(f"not a JSON frame: {str(e)[:120]}") from e
    if type(obj) is not dict:
        raise ProtocolError(f"a frame is a JSON object, not {type(obj).__name__}")
    _check_shape(obj, max_keys, "\\u" in text and _SURROGATE_ESCAPE.search(text) is not None)
    return obj


_INT_MESSAGE = "integer out of range ({bits} bits): integers in a frame fit in 64 bits"


def _check_shape(obj: Any, max_keys: int = MAX_KEYS, strings: bool = False) -> None:
    """Depth, key count and integer range of a decoded (or about to be encoded) JSON tree; with
    `strings`, every key and string is searched for a lone surrogate too (the decoder asks only
    when the raw text holds a surrogate escape, so the common frame pays nothing for it)."""
    keys = 0
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ProtocolError(f"nesting deeper than {MAX_DEPTH}")
        if type(node) is dict:
            keys += len(node)
            if keys > max_keys:
                raise ProtocolError(f"more than {max_keys} keys")
            if strings and any(_SURROGATE.search(k) for k in node):
                raise ProtocolError(SURROGATE_MESSAGE)
            values: Any = node.values()
        else:
            values = node
        for value in values:
            kind = type(value)
            if kind is dict or kind is list:
                stack.append((value, depth + 1))
            elif kind is int:
                if not MIN_INT <= value <= MAX_INT:
                    raise ProtocolError(_INT_MESSAGE.format(bits=f"{value.bit_length():,}"))
            elif strings and kind is str and _SURROGATE.search(value):
                raise ProtocolError(SURROGATE_MESSAGE)


def has_lone_surrogate(value: Any, depth: int = 0) -> bool:
    """Whether a string, key or value anywhere in `value` holds a lone surrogate (box text that
    came in through os.fsdecode or a JSON escape): the journal repairs such data before it
    encodes it."""
    if isinstance(value, str):
        return _SURROGATE.search(value) is not None
    if depth > MAX_DEPTH:
        return False
    if isinstance(value, Mapping):
        return any(has_lone_surrogate(k, depth + 1) or has_lone_surrogate(v, depth + 1)
                   for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(has_lone_surrogate(v, depth + 1) for v in value)
    return False


def without_surrogates(value: Any, depth: int = 0) -> Any:
    """A copy of `value` whose strings and keys have each lone surrogate replaced by U+FFFD."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if depth > MAX_DEPTH:
        return value
    if isinstance(value, Mapping):
        return {without_surrogates(str(k), depth + 1): without_surrogates(v, depth + 1)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_surrogates(v, depth + 1) for v in value]
    return value


def _check_version(obj: Mapping[str, Any]) -> None:
    v = obj.get("v")
    if v is None:
        raise ProtocolError("missing field 'v' (protocol version)")
    if not _is_int(v):
        raise ProtocolError(f"field 'v' must be an integer, got {v!r}")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {v} is not supported: this side speaks version {PROTOCOL_VERSION}",
            code="version",
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(obj: Mapping[str, Any], name: str, kind: type, what: str = "") -> Any:
    if name not in obj:
        raise ProtocolError(f"missing field {name!r}{what}")
    value = obj[name]
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if kind is float:
        ok = _is_number(value) and _finite(value)
    if not ok:
        raise ProtocolError(f"field {name!r}{what} has the wrong type: {_short(value)}")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    """math.isfinite without its OverflowError for an int too large for a float."""
    if isinstance(value, int):
        return MIN_INT <= value <= MAX_INT
    return math.isfinite(value)


def _short(value: Any) -> str:
    """A value for an error message, at most 60 characters, whatever it is."""
    if isinstance(value, int) and not MIN_INT <= value <= MAX_INT:
        return f"an integer of {value.bit_length():,} bits"
    return f"{value!r:.60}"


def _seconds(obj: Mapping[str, Any], name: str) -> float:
    """A time or duration field: finite seconds in [0, MAX_SECONDS)."""
    value = _field(obj, name, float)
    if not 0 <= value < MAX_SECONDS:
        raise ProtocolError(f"field {name!r} must be seconds in [0, {MAX_SECONDS:g}), got {_short(value)}")
    return float(value)


def _count(obj: Mapping[str, Any], name: str) -> int:
    """A sequence number or count in a reply: a non-negative integer."""
    value = _field(obj, name, int)
    if value < 0:
        raise ProtocolError(f"field {name!r} must not be negative, got {value}")
    return int(value)


def _id(obj: Mapping[str, Any]) -> str:
    return _check_id(_field(obj, "id", str))


def _check_id(value: str) -> str:
    if len(value) > MAX_ID_CHARS:
        raise ProtocolError(f"field 'id' is longer than {MAX_ID_CHARS} characters")
    return str(value)


# ---- events ---------------------------------------------------------------


@_encoder
def encode_event(event: Event) -> bytes:
    if event.sev not in SEVERITIES:
        raise ProtocolError(f"unknown severity {_short(event.sev)}")
    ts = event.ts
    if not (_is_number(ts) and _finite(ts) and 0 <= ts < MAX_SECONDS):
        raise ProtocolError(f"field 'ts' must be seconds in [0, {MAX_SECONDS:g}), got {_short(ts)}")
    return encode_json(event.to_dict(), max_bytes=MAX_EVENT_BYTES)


def event_from_dict(obj: Mapping[str, Any]) -> Event:
    """An Event from an already parsed mapping, checked exactly as the frame it would travel as."""
    if not isinstance(obj, Mapping):
        raise ProtocolError(f"an event is a JSON object, not {type(obj).__name__}")
    return _event(decode_json(encode_json(obj)))


def _event(obj: Mapping[str, Any]) -> Event:
    _check_version(obj)
    seq = _field(obj, "seq", int)
    if seq < 1:
        raise ProtocolError(f"seq must be positive, got {seq}")
    sev = _field(obj, "sev", str)
    if sev not in SEVERITIES:
        raise ProtocolError(f"unknown severity {_short(sev)}")
    kind = _field(obj, "kind", str)
    if not kind:
        raise ProtocolError("empty kind")
    return Event(
        run=_field(obj, "run", str),
        host=_field(obj, "host", str),
        seq=seq,
        ts=_seconds(obj, "ts"),
        kind=kind,
        sev=sev,
        data=_field(obj, "data", dict),
    )


def decode_event(frame: bytes) -> Event:
    """One event frame (at most MAX_EVENT_BYTES: the encoder's cap) to an Event."""
    if isinstance(frame, (bytes, bytearray, memoryview)) and len(frame) > MAX_EVENT_BYTES:
        raise ProtocolError(f"event frame of {len(frame)} bytes is over the {MAX_EVENT_BYTES} byte cap",
                            code="too_large")
    return _event(decode_json(frame))


# ---- control --------------------------------------------------------------


@_encoder
def encode_request(req: Request) -> List[bytes]:
    body: Dict[str, Any] = {"v": PROTOCOL_VERSION, "id": _check_id(req.id)}
    if isinstance(req, Hello):
        body.update(op="hello", client=req.client)
    elif isinstance(req, Since):
        body.update(op="since", seq=req.seq, limit=req.limit)
    elif isinstance(req, Manifest):
        body.update(op="manifest", includes=list(_includes(req.includes)))
    elif isinstance(req, Renew):
        body.update(op="renew", ttl_s=_renew_ttl(req.ttl_s))
    else:  # pragma: no cover - a new Request type without a table entry
        raise ProtocolError(f"no encoding for {type(req).__name__}")
    return [encode_json(body)]


def decode_request(frames: Sequence[bytes]) -> Request:
    """A request; ProtocolError(code=...) says what to answer instead."""
    if not isinstance(frames, (list, tuple)):
        raise ProtocolError(f"a request is a list of frames, not {type(frames).__name__}")
    if len(frames) != 1:
        raise ProtocolError(f"a request is one frame, got {len(frames)}")
    obj = decode_json(frames[0])
    _check_version(obj)
    req_id = _id(obj)
    op = _field(obj, "op", str)
    if op == "hello":
        client = obj.get("client", "")
        return Hello(id=req_id, client=client if isinstance(client, str) else "")
    if op == "since":
        seq = _field(obj, "seq", int)
        limit = obj.get("limit", 1000)
        if seq < 0 or not _is_int(limit) or not 1 <= limit <= MAX_SINCE_LIMIT:
            raise ProtocolError(f"since needs seq >= 0 and 1 <= limit <= {MAX_SINCE_LIMIT}")
        return Since(id=req_id, seq=seq, limit=limit)
    if op == "manifest":
        return Manifest(id=req_id, includes=_includes(obj.get("includes", [])))
    if op == "renew":
        return Renew(id=req_id, ttl_s=_renew_ttl(obj.get("ttl_s")))
    raise ProtocolError(f"unknown op {_short(op)}", code="unknown_op")


def _renew_ttl(value: Any) -> Any:
    """None (the lease's own TTL) or a finite number of seconds in (0, MAX_RENEW_TTL_S]."""
    if value is None:
        return None
    if not _is_number(value) or not _finite(value) or not 0 < value <= MAX_RENEW_TTL_S:
        raise ProtocolError(f"renew ttl_s must be null or seconds in (0, {MAX_RENEW_TTL_S:g}], "
                            f"got {_short(value)}")
    return float(value)


def _includes(value: Any) -> Tuple[str, ...]:
    """A manifest request's include patterns, checked the same way on both sides."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_INCLUDES:
        raise ProtocolError(f"manifest includes must be a list of at most {MAX_INCLUDES} patterns")
    for pattern in value:
        if (not isinstance(pattern, str) or not pattern or len(pattern) > MAX_INCLUDE_CHARS
                or "\x00" in pattern):
            raise ProtocolError(f"bad include pattern {_short(pattern)}")
    return tuple(value)


def request_id_of(frames: Sequence[bytes]) -> str:
    """Best-effort id of a request that failed to decode, for the error reply."""
    if not isinstance(frames, (list, tuple)) or not frames:
        return ""
    try:
        obj = decode_json(frames[0])
    except ProtocolError:
        return ""
    rid = obj.get("id")
    return rid if isinstance(rid, str) and len(rid) <= MAX_ID_CHARS else ""


@_encoder
def encode_reply(reply: Reply, event_frames: Sequence[bytes] = ()) -> List[bytes]:
    body: Dict[str, Any] = {"v": PROTOCOL_VERSION, "id": _check_id(reply.id)}
    if isinstance(reply, HelloReply):
        body.update(
            op="hello", protocol_version=reply.protocol_version,
            package_version=reply.package_version, boot_id=reply.boot_id, host=reply.host,
            run=reply.run, run_meta=dict(reply.run_meta), last_seq=reply.last_seq,
            oldest_seq=reply.oldest_seq,
        )
        return [encode_json(body)]
    if isinstance(reply, SinceReply):
        if len(event_frames) > MAX_SINCE_LIMIT:
            raise ProtocolError(f"a since reply carries at most {MAX_SINCE_LIMIT} events", code="too_large")
        body.update(op="since", count=len(event_frames), more=reply.more,
                    last_seq=reply.last_seq, oldest_seq=reply.oldest_seq)
        return [encode_json(body), *event_frames]
    if isinstance(reply, ManifestReply):
        doc = encode_json(reply.doc, max_keys=MAX_DOC_KEYS)  # too_large when over the frame cap
        body.update(op="manifest", path=reply.path, sha256=reply.sha256, files=reply.files,
                    total_bytes=reply.total_bytes)
        return [encode_json(body), doc]
    if isinstance(reply, RenewReply):
        body.update(op="renew", armed=reply.armed, expires_at=reply.expires_at, ttl_s=reply.ttl_s,
                    state=reply.state)
        return [encode_json(body)]
    if isinstance(reply, ErrorReply):
        body.update(op="error", code=reply.code, message=reply.message[:2000])
        return [encode_json(body)]
    raise ProtocolError(f"no encoding for {type(reply).__name__}")  # pragma: no cover


def decode_reply(frames: Sequence[bytes]) -> Reply:
    """A reply; a since reply has at most MAX_REPLY_FRAMES frames, a manifest reply two, others one."""
    if not isinstance(frames, (list, tuple)):
        raise ProtocolError(f"a reply is a list of frames, not {type(frames).__name__}")
    if not frames:
        raise ProtocolError("empty reply")
    if len(frames) > MAX_REPLY_FRAMES:
        raise ProtocolError(f"a reply of {len(frames)} frames is over the {MAX_REPLY_FRAMES} frame cap",
                            code="too_large")
    obj = decode_json(frames[0])
    _check_version(obj)
    rid = _id(obj)
    op = _field(obj, "op", str)
    if op == "since":
        count = _field(obj, "count", int)
        if count != len(frames) - 1:
            raise ProtocolError(f"since reply says {count} events but carries {len(frames) - 1}")
        events: List[Event] = []
        refused: List[str] = []
        for frame in frames[1:]:
            try:
                events.append(decode_event(frame))
            except ProtocolError as e:
                refused.append(str(e)[:300])
        return SinceReply(
            id=rid,
            events=tuple(events),
            more=bool(obj.get("more", False)),
            last_seq=_count(obj, "last_seq"),
            oldest_seq=_count(obj, "oldest_seq"),
            refused=tuple(refused),
        )
    if op == "manifest":
        return _manifest_reply(rid, obj, frames)
    if len(frames) != 1:
        raise ProtocolError(f"a {_short(op)} reply is one frame, got {len(frames)}")
    if op == "error":
        return ErrorReply(id=rid, code=_field(obj, "code", str), message=_field(obj, "message", str))
    if op == "hello":
        meta = obj.get("run_meta", {})
        return HelloReply(
            id=rid,
            protocol_version=_field(obj, "protocol_version", int),
            package_version=_field(obj, "package_version", str),
            boot_id=_field(obj, "boot_id", str),
            host=_field(obj, "host", str),
            run=_field(obj, "run", str),
            run_meta=meta if isinstance(meta, dict) else {},
            last_seq=_count(obj, "last_seq"),
            oldest_seq=_count(obj, "oldest_seq"),
        )
    if op == "renew":
        return _renew_reply(rid, obj)
    raise ProtocolError(f"unknown reply op {_short(op)}")


def _renew_reply(rid: str, obj: Mapping[str, Any]) -> RenewReply:
    """A state this side does not know (a newer box) is kept as it came, like an unknown kind."""
    return RenewReply(id=rid, armed=_field(obj, "armed", bool), expires_at=_seconds(obj, "expires_at"),
                      ttl_s=_seconds(obj, "ttl_s"), state=_field(obj, "state", str))


def _manifest_reply(rid: str, obj: Mapping[str, Any], frames: Sequence[bytes]) -> ManifestReply:
    if len(frames) != 2:
        raise ProtocolError(f"a manifest reply is two frames, got {len(frames)}")
    doc = decode_json(frames[1], max_keys=MAX_DOC_KEYS)
    check_manifest(doc)
    reply = ManifestReply(id=rid, path=_field(obj, "path", str), sha256=_field(obj, "sha256", str),
                          files=_count(obj, "files"), total_bytes=_count(obj, "total_bytes"), doc=doc)
    if (reply.sha256, reply.files, reply.total_bytes) != (doc["sha256"], len(doc["files"]),
                                                          doc["total_bytes"]):
        raise ProtocolError("manifest reply header does not match its manifest")
    return reply
