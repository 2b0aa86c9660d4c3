from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    MAX_DEPTH,
    MAX_EVENT_BYTES,
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
    codec,
    decode_event,
    decode_json,
    decode_reply,
    decode_request,
    encode_event,
    encode_reply,
    encode_request,
    kinds,
)

# The default Hypothesis profile (tests/conftest.py) takes the same 1000 inputs every run;
# HYPOTHESIS_PROFILE=explore takes 5000 new ones each run.
FUZZ_EXAMPLES = 5000 if settings.get_current_profile_name() == "explore" else 1000


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


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
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


# ---- the box is untrusted: numbers, strings and sizes -------------------------------------------


def raw_event(**fields: bytes) -> bytes:
    """An event frame with some fields written as raw JSON text (what json.dumps would not write)."""
    base = {"v": b"1", "run": b'"r"', "host": b'"h"', "seq": b"1", "ts": b"1.0", "kind": b'"heartbeat"',
            "sev": b'"info"', "data": b"{}"}
    base.update(fields)
    return b"{" + b",".join(b'"%s":%s' % (k.encode(), v) for k, v in base.items()) + b"}"


INT_OUT_OF_RANGE = r"^integer out of range \(.* bits\): integers in a frame fit in 64 bits$"


@pytest.mark.parametrize("fields", [
    {"ts": b"9" * 400},                     # was OverflowError from float(ts)
    {"seq": b"9" * 400},
    {"data": b'{"x":' + b"9" * 400 + b"}"},  # was stored, then broke wake.explain
    {"data": b'{"x":[1,{"y":-' + b"9" * 30 + b"}]}"},
    {"data": b'{"x":' + b"9" * 5000 + b"}"},  # over Python's own 4300-digit limit
    {"data": b'{"x":%d}' % (1 << 64)},
    {"data": b'{"x":%d}' % (-(1 << 63) - 1)},
])
def test_integers_past_64_bits_are_refused_anywhere_in_a_frame(fields: dict) -> None:
    with pytest.raises(ProtocolError, match=INT_OUT_OF_RANGE):
        decode_event(raw_event(**fields))


def test_integers_at_the_64_bit_edges_are_kept() -> None:
    got = decode_event(raw_event(data=b'{"u":%d,"s":%d}' % ((1 << 64) - 1, -(1 << 63))))
    assert got.data == {"u": (1 << 64) - 1, "s": -(1 << 63)}
    assert decode_event(encode_event(got)) == got
    with pytest.raises(ProtocolError, match=INT_OUT_OF_RANGE):
        encode_event(ev(big=1 << 64))


@pytest.mark.parametrize("ts", [b"1e400", b"-1e400", b"-1.0", b"1e11", b"true", b'"1"'])
def test_ts_must_be_finite_unix_seconds(ts: bytes) -> None:
    with pytest.raises(ProtocolError, match="'ts'"):
        decode_event(raw_event(ts=ts))


def test_encoder_refuses_a_ts_the_decoder_would() -> None:
    for bad in (math.inf, math.nan, -1.0, 1e12):
        with pytest.raises(ProtocolError, match=r"^field 'ts' must be seconds in \[0, 1e\+11\)"):
            encode_event(Event(run="r", host="h", seq=1, ts=bad, kind="k", sev="info"))


SURROGATE = r"^a string holds a lone surrogate \(U\+D800\.\.U\+DFFF\), which UTF-8 cannot carry$"


@pytest.mark.parametrize("raw", [
    raw_event(data=b'{"x":"\\ud800"}'),
    raw_event(data=b'{"x":["a", {"y":"b\\uDFFF"}]}'),
    raw_event(data=b'{"lo\\udc80ss":1}'),          # a key
    raw_event(run=b'"\\ud83d"'),                   # half a pair
    raw_event(host=b'"\\ude00\\ud83d"'),           # a pair in the wrong order
])
def test_lone_surrogates_are_refused_by_the_decoder(raw: bytes) -> None:
    with pytest.raises(ProtocolError, match=SURROGATE):
        decode_event(raw)


def test_surrogate_pairs_and_escaped_backslashes_are_fine() -> None:
    got = decode_event(raw_event(data=b'{"emoji":"\\ud83d\\ude00","text":"\\\\ud800"}'))
    assert got.data == {"emoji": "\U0001f600", "text": "\\ud800"}
    assert decode_event(encode_event(got)) == got


def test_encoders_raise_only_protocol_error_for_a_lone_surrogate() -> None:
    with pytest.raises(ProtocolError, match=SURROGATE):
        encode_event(ev(path="ckpt-\udcff.pt"))
    with pytest.raises(ProtocolError, match=SURROGATE):
        encode_reply(ErrorReply(id="\ud800", code="bad_request", message="x"))
    with pytest.raises(ProtocolError, match=SURROGATE):
        encode_request(Hello(id="a", client="\udfff"))


def test_a_lone_surrogate_id_is_refused_and_has_no_id_to_echo() -> None:
    frames = [b'{"v":1,"id":"\\ud800","op":"nope"}']
    with pytest.raises(ProtocolError, match=SURROGATE):
        decode_request(frames)
    assert codec.request_id_of(frames) == ""


def test_ids_are_bounded() -> None:
    rid = "x" * (codec.MAX_ID_CHARS + 1)
    frames = [json.dumps({"v": 1, "id": rid, "op": "hello"}).encode()]
    with pytest.raises(ProtocolError, match=r"^field 'id' is longer than 256 characters$"):
        decode_request(frames)
    assert codec.request_id_of(frames) == ""
    with pytest.raises(ProtocolError, match="longer than"):
        decode_reply([json.dumps({"v": 1, "id": rid, "op": "error", "code": "x", "message": ""}).encode()])


def test_event_frames_are_capped_at_the_event_size() -> None:
    big = frame(data={"blob": "x" * MAX_EVENT_BYTES})
    assert len(big) < MAX_FRAME_BYTES
    with pytest.raises(ProtocolError, match=r"^event frame of \d+ bytes is over the 65536 byte cap$") as info:
        decode_event(big)
    assert info.value.code == "too_large"


def test_replies_are_capped_in_frames() -> None:
    header = encode_reply(SinceReply(id="s", events=(), more=False, last_seq=1, oldest_seq=1))[0]
    frames = [header] + [encode_event(ev(1))] * codec.MAX_REPLY_FRAMES
    with pytest.raises(ProtocolError, match=r"^a reply of 10002 frames is over the 10001 frame cap$") as info:
        decode_reply(frames)
    assert info.value.code == "too_large"
    hello = encode_reply(HelloReply(id="1", protocol_version=1, package_version="0", boot_id="b", host="h",
                                    run="r", run_meta={}, last_seq=0, oldest_seq=0))
    with pytest.raises(ProtocolError, match=r"^a 'hello' reply is one frame, got 2$"):
        decode_reply(hello + hello)
    with pytest.raises(ProtocolError, match="at most 10000 events"):
        encode_reply(SinceReply(id="s", events=(), more=False, last_seq=1, oldest_seq=1),
                     [b"{}"] * (codec.MAX_SINCE_LIMIT + 1))


@pytest.mark.parametrize("field, value", [
    ("expires_at", b"9" * 400), ("expires_at", b"1e400"), ("ttl_s", b"-5"), ("expires_at", b"1e12"),
])
def test_renew_reply_times_are_bounded(field: str, value: bytes) -> None:
    body = {"v": b"1", "id": b'"r"', "op": b'"renew"', "armed": b"true", "expires_at": b"1.0",
            "ttl_s": b"60", "state": b'"armed"'}
    body[field] = value
    raw = b"{" + b",".join(b'"%s":%s' % (k.encode(), v) for k, v in body.items()) + b"}"
    with pytest.raises(ProtocolError, match=f"'{field}'|^integer out of range"):
        decode_reply([raw])


def test_reply_counts_are_not_negative() -> None:
    hello = {"v": 1, "id": "1", "op": "hello", "protocol_version": 1, "package_version": "0", "boot_id": "b",
             "host": "h", "run": "r", "last_seq": -1, "oldest_seq": 0}
    with pytest.raises(ProtocolError, match=r"^field 'last_seq' must not be negative, got -1$"):
        decode_reply([json.dumps(hello).encode()])


@pytest.mark.parametrize("obj", [
    None, [], "x", {"v": 1, "seq": 10 ** 400}, {1: 2}, {"v": 1, "data": {"x": "\ud800"}},
    {"v": 1, "run": "r", "host": "h", "seq": 1, "ts": 10 ** 30, "kind": "k", "sev": "info", "data": {}},
])
def test_event_from_dict_raises_only_protocol_error(obj: object) -> None:
    with pytest.raises(ProtocolError):
        codec.event_from_dict(obj)  # type: ignore[arg-type]


@pytest.mark.parametrize("encode", [
    lambda: encode_reply(HelloReply(id="h", protocol_version=1, package_version="x", boot_id="b", host="h",
                                    run="r", run_meta=None, last_seq=0, oldest_seq=0)),  # type: ignore[arg-type]
    lambda: encode_reply(ErrorReply(id="a", code="x", message=None)),  # type: ignore[arg-type]
    lambda: encode_event(Event(run="r", host="h", seq=1, ts=1.0, kind="k", sev="info", data=None)),  # type: ignore[arg-type]
    lambda: encode_request(Since(id=None, seq=1)),  # type: ignore[arg-type]
    lambda: encode_event(ev(deep=json.loads("[" * 100 + "]" * 100))),
])
def test_encoders_raise_only_protocol_error_for_objects_of_the_wrong_shape(encode: object) -> None:
    with pytest.raises(ProtocolError):
        encode()  # type: ignore[operator]


def test_a_since_page_keeps_its_good_events_and_names_the_refused_one() -> None:
    """One bad event frame costs that event, never the page: a refused page would be asked for forever."""
    from protocol import SinceReply, decode_reply, encode_event, encode_reply
    good = [encode_event(Event(run="r", host="h", seq=s, ts=1.0, kind="sidecar.heartbeat", sev="info"))
            for s in (1, 3)]
    bad = good[0].replace(b'"seq":1', b'"seq":2').replace(b'"ts":1.0', b'"ts":' + b"9" * 400)
    frames = encode_reply(SinceReply(id="x", events=(), more=False, last_seq=3, oldest_seq=1),
                          [good[0], bad, good[1]])
    reply = decode_reply(frames)
    assert isinstance(reply, SinceReply)
    assert [e.seq for e in reply.events] == [1, 3]
    assert len(reply.refused) == 1 and "integer out of range" in reply.refused[0]
