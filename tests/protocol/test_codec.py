from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    MAX_DEPTH,
    MAX_FRAME_BYTES,
    MAX_KEYS,
    PROTOCOL_VERSION,
    ErrorReply,
    Event,
    Hello,
    HelloReply,
    ProtocolError,
    Since,
    SinceReply,
    decode_event,
    decode_json,
    decode_reply,
    decode_request,
    encode_event,
    encode_reply,
    encode_request,
    kinds,
)


def ev(seq: int = 1, **data: object) -> Event:
    return Event(run="run-1", host="box", seq=seq, ts=1700000000.25, kind="train.progress",
                 sev="info", data=data)


def frame(**fields: object) -> bytes:
    base = {"v": 1, "run": "r", "host": "h", "seq": 1, "ts": 1.0, "kind": "heartbeat", "sev": "info",
            "data": {}}
    base.update(fields)
    return json.dumps(base).encode()


def test_event_round_trip_keeps_every_field() -> None:
    original = ev(7, step=100, loss=0.25, tags=["a", "b"], nested={"gpu": {"mem_used_bytes": 3}})
    assert decode_event(encode_event(original)) == original


def test_nonfinite_floats_travel_as_strings_and_frames_stay_json() -> None:
    frame_ = encode_event(ev(loss=math.nan, grad=math.inf, low=-math.inf))
    assert b"NaN" not in frame_ and b"Infinity" not in frame_
    assert decode_event(frame_).data == {"loss": "nan", "grad": "inf", "low": "-inf"}


def test_unknown_fields_are_ignored() -> None:
    assert decode_event(frame(extra_field=1, another={"x": 2})).seq == 1


def test_unknown_kind_is_kept_not_refused() -> None:
    assert decode_event(frame(kind="future.thing", sev="warn")).kind == "future.thing"


def test_unknown_major_version_names_both_versions() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_event(frame(v=2))
    assert "2" in str(info.value) and str(PROTOCOL_VERSION) in str(info.value)
    assert info.value.code == "version"


@pytest.mark.parametrize("bad, needle", [
    (frame(seq=0), "seq"),
    (frame(seq="1"), "seq"),
    (frame(seq=True), "seq"),
    (frame(sev="fatal"), "severity"),
    (frame(kind=""), "kind"),
    (frame(data=[]), "data"),
    (frame(ts="now"), "ts"),
    (b'{"run": "r"}', "'v'"),
    (b"[1,2]", "object"),
    (b"\xff\xfe", "JSON"),
    (b'{"v":1,"x":NaN}', "NaN"),
])
def test_malformed_frames_raise_protocol_error(bad: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle):
        decode_event(bad)


def test_frame_over_cap_is_refused_as_too_large() -> None:
    big = frame(data={"blob": "x" * MAX_FRAME_BYTES})
    with pytest.raises(ProtocolError) as info:
        decode_event(big)
    assert info.value.code == "too_large"


def test_nesting_limit() -> None:
    ok: object = 0
    for _ in range(MAX_DEPTH - 2):  # envelope and data take two levels
        ok = [ok]
    decode_event(frame(data={"x": ok}))
    with pytest.raises(ProtocolError, match="nesting"):
        decode_event(frame(data={"x": [ok]}))
    with pytest.raises(ProtocolError):
        decode_json(b"[" * 200_000 + b"]" * 200_000)


def test_key_limit() -> None:
    keys = MAX_KEYS - 8  # the envelope's own keys count too
    decode_event(frame(data={f"k{i}": i for i in range(keys)}))
    with pytest.raises(ProtocolError, match="keys"):
        decode_event(frame(data={f"k{i}": i for i in range(keys + 1)}))


def test_encoder_refuses_what_the_decoder_would() -> None:
    with pytest.raises(ProtocolError):
        encode_event(ev(blob="x" * (70 * 1024)))
    with pytest.raises(ProtocolError):
        encode_event(ev(obj=object()))


def test_requests_round_trip_and_unknown_op() -> None:
    assert decode_request(encode_request(Hello(id="a", client="rgt"))) == Hello(id="a", client="rgt")
    assert decode_request(encode_request(Since(id="b", seq=5, limit=10))) == Since(id="b", seq=5, limit=10)
    with pytest.raises(ProtocolError) as info:
        decode_request([b'{"v":1,"id":"c","op":"reboot"}'])
    assert info.value.code == "unknown_op"
    with pytest.raises(ProtocolError):
        decode_request([b'{"v":1,"id":"c","op":"since","seq":-1}'])
    with pytest.raises(ProtocolError):
        decode_request([b"{}", b"{}"])


def test_replies_round_trip() -> None:
    hello = HelloReply(id="1", protocol_version=1, package_version="0.1.0", boot_id="b", host="h",
                       run="r", run_meta={"project": "p"}, last_seq=9, oldest_seq=1)
    assert decode_reply(encode_reply(hello)) == hello
    events = [encode_event(ev(i)) for i in (3, 4)]
    since = decode_reply(encode_reply(SinceReply(id="2", events=(), more=True, last_seq=9, oldest_seq=1),
                                      events))
    assert isinstance(since, SinceReply) and [e.seq for e in since.events] == [3, 4] and since.more
    err = ErrorReply(id="3", code="bad_request", message="no")
    assert decode_reply(encode_reply(err)) == err


def test_since_reply_count_must_match_frames() -> None:
    frames = encode_reply(SinceReply(id="2", events=(), more=False, last_seq=1, oldest_seq=1),
                          [encode_event(ev(1))])
    with pytest.raises(ProtocolError, match="carries"):
        decode_reply(frames[:1])


def test_registry_defaults() -> None:
    assert kinds.default_sev("train.nonfinite") == "critical"
    assert kinds.is_telemetry("heartbeat") and not kinds.is_telemetry("job.exited")
    assert kinds.default_sev("never.heard.of") == "info" and kinds.spec("never.heard.of") is None
    for name, spec in kinds.all_kinds().items():
        assert spec.name == name and spec.default_sev in ("info", "warn", "critical")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    """A valid event frame with a few bytes changed: near-misses reach deep code paths."""
    raw = bytearray(frame(data=draw(st.dictionaries(st.text(max_size=5), json_values, max_size=3))))
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, len(raw) - 1))
        raw[i] = draw(st.integers(0, 255))
    return bytes(raw)


@settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["v", "run", "host", "seq", "ts", "kind", "sev", "data", "op", "id"]),
                    json_values, max_size=9).map(lambda d: json.dumps(d).encode()),
    mutated_frames(),
))
def test_fuzz_decoders_raise_only_protocol_error(raw: bytes) -> None:
    for decode in (decode_event, lambda f: decode_request([f]), lambda f: decode_reply([f, f])):
        try:
            decode(raw)
        except ProtocolError:
            pass
