"""The `manifest` control op: request and reply on the wire, the pull manifest's own checks, fuzz."""
from __future__ import annotations

import copy
import hashlib
import json
from typing import Any, Dict, List

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    MAX_FRAME_BYTES,
    MAX_KEYS,
    ErrorReply,
    Manifest,
    ManifestReply,
    ProtocolError,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    kinds,
)
from protocol.codec import MAX_INCLUDE_CHARS, MAX_INCLUDES, decode_json
from protocol.pull import SCHEMA, canonical_bytes, check_manifest, manifest_digest

# The default Hypothesis profile (tests/conftest.py) takes the same 1000 inputs every run;
# HYPOTHESIS_PROFILE=explore takes 3000 new ones each run.
FUZZ_EXAMPLES = 3000 if settings.get_current_profile_name() == "explore" else 1000


def entry(path: str, data: bytes = b"x", kind: str = "include", **extra: Any) -> Dict[str, Any]:
    e: Dict[str, Any] = {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                         "kind": kind, "hashed": "now"}
    e.update(extra)
    return e


def make_doc(files: List[Dict[str, Any]]) -> Dict[str, Any]:
    doc: Dict[str, Any] = {"schema": SCHEMA, "version": 1, "run_id": "run-1", "host": "box",
                           "created_at": "2024-06-01T12:00:00+00:00", "files": files,
                           "total_bytes": sum(f["size"] for f in files)}
    doc["sha256"] = manifest_digest(doc)
    return doc


def reply_of(doc: Dict[str, Any], rid: str = "m") -> ManifestReply:
    return ManifestReply(id=rid, path="rgt/PULL_MANIFEST.json", sha256=doc["sha256"], files=len(doc["files"]),
                         total_bytes=doc["total_bytes"], doc=doc)


DOC = make_doc([entry("checkpoints/step000010.pt", b"weights", "checkpoint", step=10, hashed="custody"),
                entry("metrics.jsonl", b'{"step":10}\n')])


def test_the_op_is_registered() -> None:
    assert "manifest" in kinds.CONTROL_OPS and "refused" in kinds.ERROR_CODES


def test_request_round_trip_with_and_without_includes() -> None:
    req = Manifest(id="a", includes=("eval/**", "results/*.csv"))
    frames = encode_request(req)
    assert json.loads(frames[0]) == {"v": 1, "id": "a", "op": "manifest",
                                     "includes": ["eval/**", "results/*.csv"]}
    assert decode_request(frames) == req
    assert decode_request([b'{"v":1,"id":"b","op":"manifest"}']) == Manifest(id="b", includes=())


@pytest.mark.parametrize("includes", [
    "eval/**", {"a": 1}, [1], [""], ["a\x00b"], ["x" * (MAX_INCLUDE_CHARS + 1)],
    ["p"] * (MAX_INCLUDES + 1), [None],
])
def test_bad_includes_are_refused_as_bad_requests(includes: object) -> None:
    frame = json.dumps({"v": 1, "id": "c", "op": "manifest", "includes": includes}).encode()
    with pytest.raises(ProtocolError) as info:
        decode_request([frame])
    assert info.value.code == "bad_request"
    with pytest.raises(ProtocolError):  # the encoder refuses what the decoder would
        encode_request(Manifest(id="c", includes=includes))  # type: ignore[arg-type]


def test_reply_round_trip_carries_the_doc_in_its_own_frame() -> None:
    frames = encode_reply(reply_of(DOC))
    assert len(frames) == 2
    header = json.loads(frames[0])
    assert header["op"] == "manifest" and header["sha256"] == DOC["sha256"] and header["files"] == 2
    back = decode_reply(frames)
    assert isinstance(back, ManifestReply) and back == reply_of(DOC)
    assert dict(back.doc) == DOC


def test_reply_decoder_checks_the_doc_against_its_sha256_and_header() -> None:
    tampered = copy.deepcopy(DOC)
    tampered["files"][0]["size"] += 1
    tampered["total_bytes"] += 1  # consistent totals, but the sha256 no longer matches
    frames = encode_reply(reply_of(DOC))
    with pytest.raises(ProtocolError, match="sha256"):
        decode_reply([frames[0], json.dumps(tampered).encode()])
    other = make_doc([entry("metrics.jsonl")])
    with pytest.raises(ProtocolError, match="header"):
        decode_reply([frames[0], encode_reply(reply_of(other))[1]])
    with pytest.raises(ProtocolError, match="two frames"):
        decode_reply(frames[:1])


def test_a_doc_over_the_frame_cap_is_too_large_but_many_keys_are_fine() -> None:
    many = make_doc([entry(f"eval/sample_{i:05d}.json") for i in range(400)])  # 2400+ keys
    assert len(json.dumps(many)) < MAX_FRAME_BYTES and 6 * 400 > MAX_KEYS
    back = decode_reply(encode_reply(reply_of(many)))
    assert isinstance(back, ManifestReply) and back.files == 400
    huge = make_doc([entry(f"eval/{'d' * 80}/sample_{i:05d}.json") for i in range(2000)])
    with pytest.raises(ProtocolError) as info:
        encode_reply(reply_of(huge))
    assert info.value.code == "too_large"
    err = ErrorReply(id="m", code="refused", message="2 checkpoints missing")
    assert decode_reply(encode_reply(err)) == err


def test_canonical_bytes_leave_out_only_the_sha256() -> None:
    body = json.loads(canonical_bytes(DOC))
    assert "sha256" not in body and body["files"] == DOC["files"]
    assert canonical_bytes(DOC) == json.dumps({k: v for k, v in DOC.items() if k != "sha256"},
                                              sort_keys=True, separators=(",", ":")).encode()
    # formatting of the file does not matter: re-serialised, the digest is the same
    assert manifest_digest(json.loads(json.dumps(DOC, indent=4))) == DOC["sha256"]


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d["files"].append(entry("../escape")), "bad manifest path"),
    (lambda d: d["files"].append(entry("/abs/path")), "bad manifest path"),
    (lambda d: d["files"].append(entry("a//b")), "bad manifest path"),
    (lambda d: d["files"].append(entry("a/./b")), "bad manifest path"),
    (lambda d: d["files"].append(dict(DOC["files"][1])), "twice"),
    (lambda d: d["files"][0].update(sha256="ABC"), "sha256"),
    (lambda d: d["files"][0].update(size=-1), "size"),
    (lambda d: d["files"][0].update(size=True), "size"),
    (lambda d: d["files"][0].update(kind="weights"), "kind"),
    (lambda d: d["files"][0].update(step="10"), "step"),
    (lambda d: d.update(schema="remote-gpu-trainer/PULL/v1"), "not a"),
    (lambda d: d.update(run_id=None), "run_id"),
])
def test_check_manifest_refuses_malformed_docs(mutate: Any, needle: str) -> None:
    doc = copy.deepcopy(DOC)
    mutate(doc)
    doc["total_bytes"] = sum(f["size"] for f in doc["files"] if isinstance(f.get("size"), int))
    doc["sha256"] = manifest_digest(doc)  # internally consistent: only the named rule can fail
    with pytest.raises(ProtocolError, match=needle):
        check_manifest(doc)


def test_check_manifest_refuses_a_wrong_total_or_digest() -> None:
    check_manifest(DOC)
    with pytest.raises(ProtocolError, match="total_bytes"):
        check_manifest({**DOC, "total_bytes": DOC["total_bytes"] + 1})
    with pytest.raises(ProtocolError, match="sha256"):
        check_manifest({**DOC, "host": "other"})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _mutate(draw: st.DrawFn, raw: bytes) -> bytes:
    buf = bytearray(raw)
    for _ in range(draw(st.integers(0, 4))):
        buf[draw(st.integers(0, len(buf) - 1))] = draw(st.integers(0, 255))
    return bytes(buf)


@st.composite
def near_miss_requests(draw: st.DrawFn) -> bytes:
    includes = draw(st.one_of(st.lists(st.text(max_size=10), max_size=4), json_values))
    raw = json.dumps({"v": 1, "id": "q", "op": "manifest", "includes": includes}).encode()
    return _mutate(draw, raw)


@st.composite
def near_miss_replies(draw: st.DrawFn) -> List[bytes]:
    frames = encode_reply(reply_of(DOC))
    which = draw(st.integers(0, 1))
    frames[which] = _mutate(draw, frames[which])
    if draw(st.booleans()):  # a structurally different doc: keys dropped or retyped
        doc = copy.deepcopy(DOC)
        key = draw(st.sampled_from(sorted(doc) + ["files.0.path", "files.0.size", "files.1.step"]))
        if key.startswith("files."):
            _, idx, name = key.split(".")
            doc["files"][int(idx)][name] = draw(json_values)
        else:
            doc[key] = draw(json_values)
        frames[1] = json.dumps(doc).encode()
    return frames


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(near_miss_requests(), st.binary(max_size=200)), near_miss_replies())
def test_fuzz_manifest_decoders_raise_only_protocol_error(request: bytes, reply: List[bytes]) -> None:
    for decode in (lambda: decode_request([request]), lambda: decode_reply(reply),
                   lambda: decode_reply([reply[0], request]), lambda: check_manifest(decode_json(reply[1]))):
        try:
            decode()
        except ProtocolError:
            pass
