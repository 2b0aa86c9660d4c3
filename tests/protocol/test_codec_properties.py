"""Properties of the codec against an untrusted peer.

Whatever bytes or JSON-ish structures arrive (huge integers, deep nesting, lone surrogates, NaN
constants, wrong types, wrong frame counts), decode_json / decode_event / decode_request /
decode_reply raise ProtocolError and nothing else; what they accept holds only 64-bit integers
and UTF-8-encodable strings, and re-encodes without error to the same value. The encoders raise
only ProtocolError too, and never write a frame the decoders would refuse.

Fixed budgets and derandomize=True: the same examples on every run (about 10 s on two cores).
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable, Dict, List

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    ErrorReply,
    Event,
    HelloReply,
    ManifestReply,
    ProtocolError,
    SinceReply,
    codec,
    decode_event,
    decode_json,
    decode_reply,
    decode_request,
    encode_event,
    encode_reply,
    encode_request,
)

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SMALL = settings(SETTINGS, max_examples=150)

EDGE_INTS = [0, 1, -1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 1 << 64, -(1 << 63), -(1 << 63) - 1,
             10 ** 30, -(10 ** 30), 10 ** 400, -(10 ** 400)]
ODD_STRINGS = ["\ud800", "a\udfffb", "\ud83d", "\ude00\ud83d", "\ud83d\ude00", "\\ud800", "\x00", "\u202e",
               "", "x" * 300, "nan", "inf"]

ints = st.one_of(st.integers(), st.integers(-(10 ** 40), 10 ** 40), st.sampled_from(EDGE_INTS))
strings = st.one_of(st.text(max_size=12), st.sampled_from(ODD_STRINGS))
# floats() holds NaN and +-Infinity: json.dumps writes them as the NaN / Infinity constants.
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), strings)
json_ish = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(strings, inner, max_size=4),
    max_leaves=25)


def nested(depth: int) -> Any:
    out: Any = 0
    for _ in range(depth):
        out = [out]
    return out


deep = st.integers(1, 40).map(nested)
anything = st.one_of(json_ish, deep)


def either(*valid: Any) -> st.SearchStrategy[Any]:
    """A field that is usually right and often anything at all."""
    return st.one_of(st.sampled_from(valid), anything)


EVENT_FIELDS = {
    "v": either(1, 2), "run": either("run-1"), "host": either("box"), "seq": either(1, 7, 0),
    "ts": either(1700000000.5, 0, 1e11), "kind": either("heartbeat", "future.kind", ""),
    "sev": either("info", "warn", "critical"), "data": either({}, {"loss": 0.5}),
}
REQUEST_FIELDS = {
    "v": either(1), "id": either("a1", ""), "op": either("hello", "since", "manifest", "renew", "format"),
    "client": either("rgt"), "seq": either(0, 5), "limit": either(1, 1000, 10_000, 10_001),
    "includes": either([], ["*.log"]), "ttl_s": either(None, 60.0, 0),
}
REPLY_FIELDS = {
    "v": either(1), "id": either("a1"), "op": either("hello", "since", "renew", "error", "manifest"),
    "protocol_version": either(1), "package_version": either("0.1.0"), "boot_id": either("b"),
    "host": either("box"), "run": either("run-1"), "run_meta": either({}, {"project": "p"}),
    "last_seq": either(0, 9), "oldest_seq": either(0, 1), "count": either(0, 1, 2), "more": either(False),
    "armed": either(True), "expires_at": either(0.0, 1700000000.0), "ttl_s": either(60.0),
    "state": either("armed"), "code": either("bad_request"), "message": either("no"),
}


def shaped(fields: Dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


def dumps(obj: Any) -> bytes:
    """JSON text as a hostile peer may write it: NaN constants allowed, surrogates as \\u escapes."""
    return json.dumps(obj, ensure_ascii=True, allow_nan=True).encode()


frames = st.one_of(
    st.binary(max_size=300),
    anything.map(dumps),
    shaped(EVENT_FIELDS).map(dumps),
    shaped(REQUEST_FIELDS).map(dumps),
    shaped(REPLY_FIELDS).map(dumps),
    st.sampled_from([b'{"v":1,"x":' + b"9" * 5000 + b"}", b"[" * 100_000, b'{"a":NaN}',
                     b'{"a":-Infinity}', b'{"a":1e999}', b'{"a":"\xed\xa0\x80"}', b"\xef\xbb\xbf{}"]),
)


def only_protocol_error(decode: Callable[[], Any]) -> Any:
    """decode()'s value, or None when it raised ProtocolError; anything else fails the test."""
    try:
        return decode()
    except ProtocolError as e:
        assert e.code in ("bad_request", "unknown_op", "version", "too_large"), e.code
        assert str(e)
        return None


def check_tree(obj: Any) -> None:
    """What a decoder accepted: 64-bit integers, finite floats, UTF-8-encodable strings."""
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, bool) or node is None:
            pass
        elif isinstance(node, int):
            assert codec.MIN_INT <= node <= codec.MAX_INT
        elif isinstance(node, float):
            assert math.isfinite(node) or math.isinf(node)  # 1e999 is inf; NaN never decodes
        else:
            assert isinstance(node, str)
            node.encode("utf-8")


def event_round_trip(event: Event) -> None:
    check_tree(event.to_dict())
    assert decode_event(encode_event(event)) == event


def reply_round_trip(reply: Any) -> None:
    if isinstance(reply, SinceReply):
        events = [encode_event(e) for e in reply.events]
        assert decode_reply(encode_reply(reply, events)) == reply
    elif isinstance(reply, ManifestReply):
        encode_reply(reply)
    else:
        assert decode_reply(encode_reply(reply)) == reply


@SETTINGS
@given(frames)
def test_each_decoder_raises_only_protocol_error_and_what_decodes_re_encodes(raw: bytes) -> None:
    obj = only_protocol_error(lambda: decode_json(raw))
    if obj is not None:
        check_tree(obj)
    event = only_protocol_error(lambda: decode_event(raw))
    if event is not None:
        event_round_trip(event)
    request = only_protocol_error(lambda: decode_request([raw]))
    if request is not None:
        assert decode_request(encode_request(request)) == request
    reply = only_protocol_error(lambda: decode_reply([raw]))
    if reply is not None:
        reply_round_trip(reply)


@SMALL
@given(shaped(REPLY_FIELDS), st.lists(st.one_of(shaped(EVENT_FIELDS).map(dumps), frames), max_size=4))
def test_multipart_replies_raise_only_protocol_error(header: Dict[str, Any], parts: List[bytes]) -> None:
    reply = only_protocol_error(lambda: decode_reply([dumps(header), *parts]))
    if reply is not None:
        reply_round_trip(reply)


@SETTINGS
@given(st.sampled_from(sorted(EVENT_FIELDS)), ints)
def test_integers_are_bounded_in_every_field(field: str, value: int) -> None:
    raw = dumps({"v": 1, "run": "r", "host": "h", "seq": 1, "ts": 1.0, "kind": "k", "sev": "info",
                 "data": {}, field: value})
    event = only_protocol_error(lambda: decode_event(raw))
    if not codec.MIN_INT <= value <= codec.MAX_INT:
        assert event is None
    if event is not None:
        event_round_trip(event)


@SMALL
@given(st.dictionaries(strings, json_ish, max_size=5), st.floats(), strings)
def test_encoders_raise_only_protocol_error_and_never_write_what_decoders_refuse(
        data: Dict[str, Any], ts: float, text: str) -> None:
    frame = only_protocol_error(lambda: encode_event(
        Event(run="r", host=text, seq=1, ts=ts, kind="k", sev="info", data=data)))
    if frame is not None:
        event = decode_event(frame)
        assert decode_event(encode_event(event)) == event
    for reply in (ErrorReply(id=text, code="bad_request", message=text),
                  HelloReply(id="h", protocol_version=1, package_version=text, boot_id="b", host="h",
                             run="r", run_meta=data, last_seq=0, oldest_seq=0)):
        out = only_protocol_error(lambda: encode_reply(reply))  # noqa: B023 - called at once
        if out is not None:
            decode_reply(out)


@pytest.mark.parametrize("decode", [decode_json, decode_event, lambda f: decode_request(f),
                                    lambda f: decode_reply(f)])
def test_decoders_raise_only_protocol_error_for_values_that_are_not_frames(decode: Any) -> None:
    for value in (None, 7, "text", [None], [7], ["{}"], (b"{}",) * 3, b"", [b""], {"v": 1}):
        only_protocol_error(lambda: decode(value))  # noqa: B023 - called at once
