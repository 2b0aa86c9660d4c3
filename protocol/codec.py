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
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, List, Mapping, Sequence, Tuple

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

_NONFINITE = {math.inf: "inf", -math.inf: "-inf"}


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
    if value is None or isinstance(value, (str, int, bool)):
        return value
    raise ProtocolError(f"cannot encode a {type(value).__name__}")


def encode_json(obj: Mapping[str, Any], max_bytes: int = MAX_FRAME_BYTES,
                max_keys: int = MAX_KEYS) -> bytes:
    """One frame from a mapping; ProtocolError when it breaks a limit."""
    plain = _plain(obj)
    _check_shape(plain, max_keys)
    frame = json.dumps(
        plain, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")
    if len(frame) > max_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes is over the {max_bytes} byte cap",
                            code="too_large")
    return frame


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not JSON")


def decode_json(frame: bytes, max_keys: int = MAX_KEYS) -> Dict[str, Any]:
    """A frame to a dict, enforcing size, depth and key limits."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"a frame is bytes, not {type(frame).__name__}")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"frame of {len(frame)} bytes is over the {MAX_FRAME_BYTES} byte cap", code="too_large"
        )
    try:
        text = bytes(frame).decode("utf-8")
        obj = json.loads(text, parse_constant=_reject_constant)
    except ProtocolError:
        raise
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"not a JSON frame: {str(e)[:120]}") from e
    if not isinstance(obj, dict):
        raise ProtocolError(f"a frame is a JSON object, not {type(obj).__name__}")
    _check_shape(obj, max_keys)
    return obj


def _check_shape(obj: Any, max_keys: int = MAX_KEYS) -> None:
    keys = 0
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)) and depth > MAX_DEPTH:
            raise ProtocolError(f"nesting deeper than {MAX_DEPTH}")
        if isinstance(node, dict):
            keys += len(node)
            if keys > max_keys:
                raise ProtocolError(f"more than {max_keys} keys")
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


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
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value))
    if not ok:
        raise ProtocolError(f"field {name!r}{what} has the wrong type: {value!r:.60}")
    return value


# ---- events ---------------------------------------------------------------


def encode_event(event: Event) -> bytes:
    if event.sev not in SEVERITIES:
        raise ProtocolError(f"unknown severity {event.sev!r}")
    return encode_json(event.to_dict(), max_bytes=MAX_EVENT_BYTES)


def event_from_dict(obj: Mapping[str, Any]) -> Event:
    _check_version(obj)
    seq = _field(obj, "seq", int)
    if seq < 1:
        raise ProtocolError(f"seq must be positive, got {seq}")
    sev = _field(obj, "sev", str)
    if sev not in SEVERITIES:
        raise ProtocolError(f"unknown severity {sev!r}")
    kind = _field(obj, "kind", str)
    if not kind:
        raise ProtocolError("empty kind")
    return Event(
        run=_field(obj, "run", str),
        host=_field(obj, "host", str),
        seq=seq,
        ts=float(_field(obj, "ts", float)),
        kind=kind,
        sev=sev,
        data=_field(obj, "data", dict),
    )


def decode_event(frame: bytes) -> Event:
    return event_from_dict(decode_json(frame))


# ---- control --------------------------------------------------------------


def encode_request(req: Request) -> List[bytes]:
    body: Dict[str, Any] = {"v": PROTOCOL_VERSION, "id": req.id}
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
    if len(frames) != 1:
        raise ProtocolError(f"a request is one frame, got {len(frames)}")
    obj = decode_json(frames[0])
    _check_version(obj)
    req_id = _field(obj, "id", str)
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
    raise ProtocolError(f"unknown op {op!r}", code="unknown_op")


def _renew_ttl(value: Any) -> Any:
    """None (the lease's own TTL) or a finite number of seconds in (0, MAX_RENEW_TTL_S]."""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 0 < value <= MAX_RENEW_TTL_S):
        raise ProtocolError(f"renew ttl_s must be null or seconds in (0, {MAX_RENEW_TTL_S:g}], "
                            f"got {value!r:.40}")
    return float(value)


def _includes(value: Any) -> Tuple[str, ...]:
    """A manifest request's include patterns, checked the same way on both sides."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_INCLUDES:
        raise ProtocolError(f"manifest includes must be a list of at most {MAX_INCLUDES} patterns")
    for pattern in value:
        if (not isinstance(pattern, str) or not pattern or len(pattern) > MAX_INCLUDE_CHARS
                or "\x00" in pattern):
            raise ProtocolError(f"bad include pattern {pattern!r:.80}")
    return tuple(value)


def request_id_of(frames: Sequence[bytes]) -> str:
    """Best-effort id of a request that failed to decode, for the error reply."""
    try:
        obj = decode_json(frames[0]) if frames else {}
    except ProtocolError:
        return ""
    rid = obj.get("id")
    return rid if isinstance(rid, str) else ""


def encode_reply(reply: Reply, event_frames: Sequence[bytes] = ()) -> List[bytes]:
    body: Dict[str, Any] = {"v": PROTOCOL_VERSION, "id": reply.id}
    if isinstance(reply, HelloReply):
        body.update(
            op="hello", protocol_version=reply.protocol_version,
            package_version=reply.package_version, boot_id=reply.boot_id, host=reply.host,
            run=reply.run, run_meta=dict(reply.run_meta), last_seq=reply.last_seq,
            oldest_seq=reply.oldest_seq,
        )
        return [encode_json(body)]
    if isinstance(reply, SinceReply):
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
    if not frames:
        raise ProtocolError("empty reply")
    obj = decode_json(frames[0])
    _check_version(obj)
    rid = _field(obj, "id", str)
    op = _field(obj, "op", str)
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
            last_seq=_field(obj, "last_seq", int),
            oldest_seq=_field(obj, "oldest_seq", int),
        )
    if op == "since":
        count = _field(obj, "count", int)
        if count != len(frames) - 1:
            raise ProtocolError(f"since reply says {count} events but carries {len(frames) - 1}")
        return SinceReply(
            id=rid,
            events=tuple(decode_event(f) for f in frames[1:]),
            more=bool(obj.get("more", False)),
            last_seq=_field(obj, "last_seq", int),
            oldest_seq=_field(obj, "oldest_seq", int),
        )
    if op == "manifest":
        return _manifest_reply(rid, obj, frames)
    if op == "renew":
        return _renew_reply(rid, obj)
    raise ProtocolError(f"unknown reply op {op!r}")


def _renew_reply(rid: str, obj: Mapping[str, Any]) -> RenewReply:
    """A state this side does not know (a newer box) is kept as it came, like an unknown kind."""
    return RenewReply(id=rid, armed=_field(obj, "armed", bool),
                      expires_at=float(_field(obj, "expires_at", float)),
                      ttl_s=float(_field(obj, "ttl_s", float)), state=_field(obj, "state", str))


def _manifest_reply(rid: str, obj: Mapping[str, Any], frames: Sequence[bytes]) -> ManifestReply:
    if len(frames) != 2:
        raise ProtocolError(f"a manifest reply is two frames, got {len(frames)}")
    doc = decode_json(frames[1], max_keys=MAX_DOC_KEYS)
    check_manifest(doc)
    reply = ManifestReply(id=rid, path=_field(obj, "path", str), sha256=_field(obj, "sha256", str),
                          files=_field(obj, "files", int), total_bytes=_field(obj, "total_bytes", int),
                          doc=doc)
    if (reply.sha256, reply.files, reply.total_bytes) != (doc["sha256"], len(doc["files"]),
                                                          doc["total_bytes"]):
        raise ProtocolError("manifest reply header does not match its manifest")
    return reply
