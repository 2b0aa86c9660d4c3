"""Structural checks against real files written by torch and safetensors, and against the real loaders.

Every defect we plant in a safetensors file is one the safetensors loader itself refuses; every file
we call good it loads. Nothing here may be unpickled: a pickle that would leave a marker file when
run must leave none.
"""
from __future__ import annotations

import io
import json
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import numpy as np
import pytest
import safetensors.numpy

from onbox.custody import check, finite
from onbox.custody.check import BAD, OK, UNCHECKED, check_path
from rgtlib.safetensors_header import DTYPE_BITS

# The 3.9 run (make py39) has no torch wheel on this disk; there these modules skip.
torch = pytest.importorskip("torch")


def _write_st(path: Path, header: Dict[str, Any], data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _split(path: Path) -> tuple[Dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


@pytest.fixture
def st_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"w": np.arange(16, dtype=np.float32).reshape(4, 4),
                                 "b": np.ones(3, dtype=np.int64)}, str(path), metadata={"step": "100"})
    return path


def test_good_safetensors_passes_with_its_metadata(st_file: Path) -> None:
    result = check_path(st_file)
    assert (result.format, result.status, result.tensors) == ("safetensors", OK, 2)
    assert result.metadata == {"step": "100"}


def _lying_shape(h: Dict[str, Any], d: bytes) -> tuple[Dict[str, Any], bytes]:
    h["w"]["shape"] = [4, 5]
    return h, d


def _unknown_dtype(h: Dict[str, Any], d: bytes) -> tuple[Dict[str, Any], bytes]:
    h["w"]["dtype"] = "F128"
    return h, d


def _overlap(h: Dict[str, Any], d: bytes) -> tuple[Dict[str, Any], bytes]:
    h["w"]["data_offsets"] = [0, 64]
    h["b"]["data_offsets"] = [0, 24]
    return h, d[:64]


def _truncated(h: Dict[str, Any], d: bytes) -> tuple[Dict[str, Any], bytes]:
    return h, d[:-10]


def _trailing(h: Dict[str, Any], d: bytes) -> tuple[Dict[str, Any], bytes]:
    return h, d + b"\0" * 8


def _hole(h: Dict[str, Any], d: bytes) -> tuple[Dict[str, Any], bytes]:
    first, second = sorted(h[k]["data_offsets"] for k in ("w", "b"))
    for key in ("w", "b"):
        if h[key]["data_offsets"] == second:
            h[key]["data_offsets"] = [second[0] + 8, second[1] + 8]
    return h, d[:first[1]] + b"\0" * 8 + d[first[1]:]


@pytest.mark.parametrize("mutate, words", [
    (_lying_shape, "is 80 bytes but its span"),
    (_unknown_dtype, "unknown dtype 'F128'"),
    (_overlap, "overlaps"),
    (_truncated, "truncated"),
    (_trailing, "cover"),
    (_hole, "hole"),
])
def test_bad_safetensors_fail_here_and_in_the_real_loader(
        st_file: Path, mutate: Callable[..., Any], words: str) -> None:
    header, data = mutate(*_split(st_file))
    bad = _write_st(st_file.with_name("bad.safetensors"), header, data)
    result = check_path(bad)
    assert result.status == BAD and words in (result.reason or ""), result
    with pytest.raises(Exception):  # noqa: B017 - the loader's own error type varies by version
        safetensors.numpy.load_file(str(bad))


def test_header_length_past_the_end_is_truncated(tmp_path: Path) -> None:
    path = tmp_path / "cut.safetensors"
    path.write_bytes(struct.pack("<Q", 4096) + b'{"a": 1}')
    result = check_path(path)
    assert result.status == BAD and "runs past the end" in (result.reason or "")


def test_sub_byte_dtypes_must_end_on_a_byte(tmp_path: Path) -> None:
    good = _write_st(tmp_path / "f4.safetensors", {"q": {"dtype": "F4", "shape": [4],
                                                         "data_offsets": [0, 2]}}, b"\0\0")
    odd = _write_st(tmp_path / "f4odd.safetensors", {"q": {"dtype": "F4", "shape": [3],
                                                           "data_offsets": [0, 2]}}, b"\0\0")
    assert check_path(good).status == OK
    assert check_path(odd).status == BAD


def test_good_torch_zip_passes(tmp_path: Path) -> None:
    path = tmp_path / "step1.pt"
    torch.save({"w": torch.zeros(8, 8), "step": 1}, path)
    result = check_path(path)
    assert (result.format, result.status) == ("torch", OK)


def test_truncated_torch_zip_fails_here_and_in_torch(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.randn(64, 64)}, buf)
    path = tmp_path / "step2.pt"
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    result = check_path(path)
    assert result.status == BAD and "central directory" in (result.reason or ""), result
    with pytest.raises(Exception):  # noqa: B017
        torch.load(path, weights_only=True)


def test_zip_without_data_pkl(tmp_path: Path) -> None:
    for name in ("notes.pt", "bundle.zip"):
        with zipfile.ZipFile(tmp_path / name, "w") as zf:
            zf.writestr("readme.txt", "hello")
    assert check_path(tmp_path / "notes.pt").status == BAD
    assert (check_path(tmp_path / "bundle.zip").status, check_path(tmp_path / "bundle.zip").format) \
        == (UNCHECKED, "other")


def test_a_zip_member_past_the_end_is_caught(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.randn(32, 32)}, buf)
    raw = bytearray(buf.getvalue())
    eocd = raw.rfind(b"PK\x05\x06")
    cd_start = struct.unpack("<I", raw[eocd + 16:eocd + 20])[0]
    entry = raw.find(b"PK\x01\x02", cd_start)  # first central entry: inflate its compressed size
    struct.pack_into("<I", raw, entry + 20, 10_000_000)
    path = tmp_path / "lies.pt"
    path.write_bytes(bytes(raw))
    result = check_path(path)
    assert result.status == BAD and "past the end" in (result.reason or ""), result


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (self.marker,))


def test_legacy_pickle_is_unchecked_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    legacy = tmp_path / "old.pt"
    torch.save({"w": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps(_Evil(marker), protocol=2))
    for path in (legacy, evil):
        result = check_path(path)
        assert (result.format, result.status) == ("pickle", UNCHECKED)
    assert not marker.exists()
    pickle.loads(evil.read_bytes())  # control: the payload works when someone does unpickle it
    assert marker.exists()


def test_names_and_bytes_decide_the_format(tmp_path: Path) -> None:
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all")
    (tmp_path / "trainer_state.json").write_text('{"global_step": 5}')
    (tmp_path / "weights.bin").write_bytes(b"\x01\x02\x03")
    assert check_path(tmp_path / "garbage.pt").status == BAD
    assert check_path(tmp_path / "trainer_state.json").format == "other"
    assert check_path(tmp_path / "weights.bin").status == UNCHECKED
    assert check_path(tmp_path / "trainer_state.json").status == UNCHECKED


def test_every_dtype_torch_writes_is_known_with_its_size(tmp_path: Path) -> None:
    """Each dtype the installed safetensors maps for torch, written for real, passes (sizes agree)."""
    import safetensors.torch as sttorch

    types: Dict[str, Any] = sttorch._TYPES
    assert len(types) >= 13
    for name, dtype in types.items():
        path = tmp_path / f"{name}.safetensors"
        sttorch.save_file({"t": torch.zeros(3, 5, dtype=dtype)}, str(path))
        result = check_path(path)
        assert result.status == OK, (name, result)
        assert _split(path)[0]["t"]["dtype"] == name
        assert name in DTYPE_BITS


@pytest.mark.parametrize("name, step", [
    ("step000100.pt", 100), ("checkpoint-500/model.safetensors", 500), ("epoch_3.pt", 3),
    ("epoch=3-step=90.ckpt", 90), ("global_step7/mp_rank_00_model_states.pt", 7),
    ("iter_0001000/model.pt", 1000), ("best.pt", None), ("model-00001-of-00002.safetensors", None),
])
def test_step_of_a_name(name: str, step: Optional[int]) -> None:
    assert check.step_of(name) == step


def test_step_from_metadata_when_the_name_has_none() -> None:
    assert check.step_of("model.safetensors", {"step": "42"}) == 42
    assert check.step_of("step7.safetensors", {"step": "42"}) == 7
    assert check.step_of("model.safetensors", {"step": "n/a"}) is None


HOSTILE_HEADERS = {
    "nested 100000 deep": (b"[" * 100_000 + b"]" * 100_000, "header nests 100000 levels deep (limit 64)"),
    "nested inside a tensor entry": (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": '
                                     + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}}",
                                     "header nests 100002 levels deep"),
    "a 5000-digit number": (b'{"n": ' + b"9" * 5000 + b"}", "header does not parse: ValueError"),
    "a dtype that is a list": (b'{"w": {"dtype": [1], "shape": [1], "data_offsets": [0, 4]}}',
                               "unknown dtype [1]"),
    "rank 65": (b'{"w": {"dtype": "U8", "shape": [' + b"1, " * 64 + b'1], "data_offsets": [0, 4]}}',
                "has more than 64 dimensions"),
    "a size that overflows": (b'{"w": {"dtype": "F32", "shape": [4294967296, 4294967296], '
                              b'"data_offsets": [0, 4]}}', "overflows 64 bits"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_HEADERS))
def test_a_hostile_header_is_bad_never_a_raise(tmp_path: Path, name: str) -> None:
    header, text = HOSTILE_HEADERS[name]
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    result = check_path(path)
    assert result.status == BAD and text in (result.reason or ""), result


def test_a_check_that_raises_is_bad_with_its_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any) -> Any:
        raise RecursionError("maximum recursion depth exceeded")
    monkeypatch.setattr(finite, "sample_nonfinite", boom)
    path = _write_st(tmp_path / "m.safetensors", {"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}},
                     b"\0")
    result = check_path(path)
    assert result.status == BAD
    assert result.reason == "safetensors: checking it raised RecursionError: maximum recursion depth exceeded"
