"""The `renew` control op: the controller renews the box's dead-man lease through a sidecar."""
from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import (
    ErrorReply,
    ProtocolError,
    Renew,
    RenewReply,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    kinds,
)
from protocol.codec import MAX_RENEW_TTL_S


def raw(**fields: Any) -> list[bytes]:
    return [json.dumps({"v": 1, "id": "r", "op": "renew", **fields}).encode()]


def test_the_op_and_the_deadman_kinds_are_registered() -> None:
    assert "renew" in kinds.CONTROL_OPS
    assert {k: kinds.default_sev(k) for k in ("deadman.renewed", "deadman.held", "deadman.disarmed",
                                              "deadman.expiring", "deadman.firing", "deadman.fired")} == {
        "deadman.renewed": "info", "deadman.held": "info", "deadman.disarmed": "info",
        "deadman.expiring": "warn", "deadman.firing": "critical", "deadman.fired": "critical"}
    assert "unreadable" in kinds.DEADMAN_STATES and "armed" in kinds.DEADMAN_STATES


@pytest.mark.parametrize("req", [Renew(id="a"), Renew(id="b", ttl_s=600.0),
                                 Renew(id="c", ttl_s=MAX_RENEW_TTL_S)])
def test_request_round_trip(req: Renew) -> None:
    assert decode_request(encode_request(req)) == req


def test_an_integer_ttl_arrives_as_a_float() -> None:
    req = decode_request(raw(ttl_s=600))
    assert isinstance(req, Renew) and req.ttl_s == 600.0 and isinstance(req.ttl_s, float)


@pytest.mark.parametrize("ttl", [0, -5, True, "600", "inf", MAX_RENEW_TTL_S + 1, [600]])
def test_a_bad_ttl_is_a_bad_request(ttl: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_request(raw(ttl_s=ttl))
    assert info.value.code == "bad_request" and "ttl_s" in str(info.value)


def test_the_encoder_refuses_what_the_decoder_would() -> None:
    with pytest.raises(ProtocolError):
        encode_request(Renew(id="x", ttl_s=-1.0))


@pytest.mark.parametrize("reply", [
    RenewReply(id="r", armed=True, expires_at=1_790_000_600.5, ttl_s=600.0, state="armed"),
    RenewReply(id="r", armed=False, expires_at=0.0, ttl_s=0.0, state="absent"),
    RenewReply(id="r", armed=False, expires_at=0.0, ttl_s=7200.0, state="a-state-from-a-newer-box"),
])
def test_reply_round_trip(reply: RenewReply) -> None:
    assert decode_reply(encode_reply(reply)) == reply


@pytest.mark.parametrize("field, value", [("armed", "yes"), ("expires_at", None), ("ttl_s", "x"),
                                          ("state", 3)])
def test_a_malformed_reply_is_refused(field: str, value: Any) -> None:
    body = {"v": 1, "id": "r", "op": "renew", "armed": True, "expires_at": 1.0, "ttl_s": 1.0,
            "state": "armed"}
    body[field] = value
    with pytest.raises(ProtocolError):
        decode_reply([json.dumps(body).encode()])


def test_errors_still_travel_for_renew() -> None:
    reply = ErrorReply(id="r", code="internal", message="renew: disk full")
    assert decode_reply(encode_reply(reply)) == reply


@given(st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(),
                 st.text(max_size=5), st.booleans()))
def test_fuzz_renew_decoding_raises_only_protocol_error(ttl: Any) -> None:
    try:
        frames = [json.dumps({"v": 1, "id": "r", "op": "renew", "ttl_s": ttl}).encode()]
    except ValueError:
        return
    try:
        req = decode_request(frames)
    except ProtocolError:
        return
    assert isinstance(req, Renew) and (req.ttl_s is None or 0 < req.ttl_s <= MAX_RENEW_TTL_S)
