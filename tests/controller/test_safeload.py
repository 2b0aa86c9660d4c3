"""The torch seam (controller.verify.safeload) and our safetensors parser
(rgtlib.safetensors_header).

The seam's logic runs in-process here (torch is already imported by the fixtures); one test runs
the documented `python -m controller.verify.safeload` form as a child."""
from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from controller.verify import safeload
from rgtlib import safetensors_header
from tests.controller.verifykit import Evil

REPO = Path(__file__).resolve().parents[2]


# ---- the torch version gate ---------------------------------------------------------------------


@pytest.mark.parametrize("version, trust, allowed, note", [
    ("2.13.0+cpu", False, True, None),
    ("2.10.0", False, True, None),
    ("3.0.0", False, True, None),
    ("2.9.1", False, False, "refused"),
    ("1.13.1+cu117", False, False, "refused"),
    ("not-a-version", False, False, "refused"),
    (None, False, False, "not installed"),
    ("2.9.1", True, True, "anyway because of --trust-pickle"),
    (None, True, False, "not installed"),
])
def test_pickle_gate(version: Any, trust: bool, allowed: bool, note: Any) -> None:
    ok, text = safeload.pickle_gate(version, trust)
    assert ok is allowed
    assert (text is None) if note is None else (note in str(text))


def test_the_seam_refuses_pickle_under_an_old_torch_itself(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2)}, path)
    monkeypatch.setattr(torch, "__version__", "2.9.0")

    def no_load(*a: Any, **k: Any) -> None:
        raise AssertionError("torch.load ran under a refused torch")
    monkeypatch.setattr(torch, "load", no_load)
    out = safeload.run(path, "torch", finite=False, trust_pickle=False)
    assert out["ok"] is False and out["refused"] is True
    assert "torch 2.9.0 is older than 2.10" in out["error"]


def test_trust_pickle_still_loads_weights_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2)}, path)
    monkeypatch.setattr(torch, "__version__", "2.9.0")
    seen: Dict[str, Any] = {}
    real_load = torch.load

    def spy(*a: Any, **k: Any) -> Any:
        seen.update(k)
        return real_load(*a, **k)
    monkeypatch.setattr(torch, "load", spy)
    out = safeload.run(path, "torch", finite=False, trust_pickle=True)
    assert out["ok"] is True and "--trust-pickle" in out["note"]
    assert seen == {"weights_only": True, "mmap": True, "map_location": "cpu"}


# ---- loading --------------------------------------------------------------------------------------


def test_a_malicious_pickle_never_runs_in_the_seam(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    for legacy in (False, True):
        path = tmp_path / f"evil{int(legacy)}.pt"
        torch.save({"x": Evil(marker)}, path, _use_new_zipfile_serialization=not legacy)
        out = safeload.run(path, "torch", finite=False, trust_pickle=False)
        assert out["ok"] is False and out["error_type"] == "UnpicklingError"
        assert out["error"].startswith("weights_only=True refused it: ")
        assert "weights_only` set to `False`" not in out["error"]
        assert not marker.exists()


def test_a_refused_global_is_named_without_the_advice(tmp_path: Path) -> None:
    path = tmp_path / "rng_state.pth"  # what an HF Trainer checkpoint holds: numpy RNG state
    torch.save({"numpy": np.random.RandomState(0).get_state(), "cpu": torch.random.get_rng_state()}, path)
    out = safeload.run(path, "torch", finite=False, trust_pickle=False)
    assert out["ok"] is False
    assert out["error"].startswith("weights_only=True refused it: Unsupported global: GLOBAL numpy")
    assert "was not an allowed global by default" in out["error"]
    assert "Please use" not in out["error"] and "\x1b" not in out["error"]


def test_weights_only_reason_keeps_the_refusal_not_the_advice() -> None:
    msg = ("Weights only load failed. In PyTorch 2.6, we changed ... Re-running `torch.load` with "
           "`weights_only` set to `False` will likely succeed\n\n\nTrying to load unsupported GLOBAL "
           "posix.system whose module posix is blocked.\n\nCheck the documentation of torch.load ...")
    assert safeload.weights_only_reason(msg) == \
        "Trying to load unsupported GLOBAL posix.system whose module posix is blocked."


def test_counts_tensors_and_non_finite_values_in_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    w = torch.zeros(3, 3)
    w[1, 1] = float("nan")
    state = {"model": {"w": w, "b": torch.ones(3, dtype=torch.bfloat16)},
             "opt": [torch.tensor([float("inf"), 1.0])], "step": 7, "ints": torch.arange(4)}
    state["self"] = state["opt"]  # shared reference: counted once per occurrence path, no loop
    torch.save(state, path, _use_new_zipfile_serialization=False)  # legacy format: no mmap
    out = safeload.run(path, "torch", finite=True, trust_pickle=False)
    assert out["ok"] is True, out
    assert out["nonfinite"] == 1  # the weights ("model") only: the inf in "opt" is not weights
    assert out["nonfinite_names"] == ["model.w"]
    assert out["dtypes"] == {"float32": 2, "bfloat16": 1, "int64": 1}
    assert out["tensors"] == 4 and out["elements"] == 9 + 3 + 2 + 4


def test_callback_state_with_inf_is_not_weights(tmp_path: Path) -> None:
    """Lightning's ModelCheckpoint keeps kth_value = inf in a healthy .ckpt: only state_dict counts."""
    path = tmp_path / "epoch=0-step=40.ckpt"
    state = {"state_dict": {"net.weight": torch.ones(2, 2)}, "global_step": 40,
             "callbacks": {"ModelCheckpoint{}": {"kth_value": torch.tensor(float("inf")),
                                                 "current_score": torch.tensor(float("inf"))}},
             "optimizer_states": [{"state": {0: {"exp_avg": torch.tensor([float("nan")])}}}]}
    torch.save(state, path)
    out = safeload.run(path, "torch", finite=True, trust_pickle=False)
    assert out["ok"] is True and out["nonfinite"] == 0 and out["tensors"] == 4, out
    state["state_dict"]["net.weight"][0, 0] = float("nan")
    torch.save(state, path)
    out = safeload.run(path, "torch", finite=True, trust_pickle=False)
    assert out["nonfinite"] == 1 and out["nonfinite_names"] == ["state_dict.net.weight"]


def test_counts_non_finite_values_in_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.tensor([1.0, float("-inf")], dtype=torch.float16),
               "b": torch.tensor([float("nan")] * 3, dtype=torch.float8_e4m3fn),
               "c": torch.ones(5), "i": torch.arange(3)}, str(path))
    out = safeload.run(path, "safetensors", finite=True, trust_pickle=False)
    assert out["ok"] is True, out
    assert out["nonfinite"] == 4 and out["nonfinite_names"] == ["a", "b"]
    assert out["dtypes"] == {"F16": 1, "F8_E4M3": 1, "F32": 1, "I64": 1}


def test_the_seam_runs_as_a_module_and_prints_one_json_line(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2, 2)}, path)
    proc = subprocess.run([sys.executable, "-m", "controller.verify.safeload", str(path), "--finite"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    [line] = proc.stdout.splitlines()
    out = json.loads(line)
    assert (out["ok"], out["tensors"], out["nonfinite"], out["torch"]) == (True, 1, 0, torch.__version__)


# ---- our safetensors header parser -------------------------------------------------------------


def st_bytes(header: Dict[str, Any], data: bytes, raw_header: bytes = b"") -> io.BytesIO:
    blob = raw_header or json.dumps(header).encode()
    return io.BytesIO(struct.pack("<Q", len(blob)) + blob + data)


def parse(buf: io.BytesIO) -> safetensors_header.Layout:
    return safetensors_header.parse(buf, len(buf.getvalue()))


def test_parses_what_safetensors_writes(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    tensors = {"a": torch.ones(3, 2, dtype=torch.bfloat16), "b": torch.zeros(0), "c": torch.ones(1, 1),
               "d": torch.arange(5, dtype=torch.int8), "e": torch.ones(2, dtype=torch.float8_e5m2),
               "f": torch.tensor(True)}
    save_file(tensors, str(path), metadata={"step": "100"})
    layout = safetensors_header.parse_path(path)
    assert layout.metadata == {"step": "100"}
    with safe_open(str(path), framework="pt") as f:
        assert sorted(t.name for t in layout.tensors) == sorted(f.keys())
        for t in layout.tensors:
            assert list(t.shape) == list(f.get_slice(t.name).get_shape())
    assert layout.data_start + layout.data_len == path.stat().st_size


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("header, data, reason", [
    ({"a": F32x2, "b": {**F32x2, "data_offsets": [8, 16]}}, b"\0" * 12, "ends beyond the 12-byte data area"),
    ({"a": F32x2, "b": {**F32x2, "data_offsets": [4, 12]}}, b"\0" * 12, "overlaps the tensor before it"),
    ({"a": {**F32x2, "data_offsets": [4, 12]}}, b"\0" * 12, "leaving a hole [0, 4]"),
    ({"a": {**F32x2, "shape": [3]}}, b"\0" * 8, "shape [3] x F32 is 12 bytes but its span [0, 8] holds 8"),
    ({"a": F32x2}, b"\0" * 9, "tensors cover 8 of the 9-byte data area"),
    ({"a": {**F32x2, "dtype": "F33"}}, b"\0" * 8, "unknown dtype 'F33'"),
    ({"a": {**F32x2, "shape": [-2]}}, b"\0" * 8, "not a list of non-negative ints"),
    ({"a": {**F32x2, "shape": [True, 2]}}, b"\0" * 8, "not a list of non-negative ints"),
    ({"a": {**F32x2, "data_offsets": [8, 0]}}, b"\0" * 8, "end 0 is before begin 8"),
    ({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, b"\0", "is 1.5 bytes"),
    ({"__metadata__": {"step": 1}}, b"", "__metadata__['step'] is not a string"),
    ({"a": [1, 2]}, b"", "entry is not an object"),
])
def test_rejects_a_lying_header(header: Dict[str, Any], data: bytes, reason: str) -> None:
    with pytest.raises(safetensors_header.HeaderError) as e:
        parse(st_bytes(header, data))
    assert reason in str(e.value)


@pytest.mark.parametrize("raw, reason", [
    (b'{"a": 1, "a": 2}', "appears twice"),
    (b"[1, 2]", "not an object"),
    (b"{nope", "not JSON"),
    (b'{"a": "\xff"}', "not UTF-8"),
])
def test_rejects_a_broken_header(raw: bytes, reason: str) -> None:
    with pytest.raises(safetensors_header.HeaderError, match=reason):
        parse(st_bytes({}, b"", raw_header=raw))


def test_rejects_impossible_header_lengths() -> None:
    with pytest.raises(safetensors_header.HeaderError, match="exceeds the 100000000-byte limit"):
        parse(io.BytesIO(struct.pack("<Q", 100_000_001) + b"{}"))
    with pytest.raises(safetensors_header.HeaderError, match="runs past the end of the 12-byte file"):
        parse(io.BytesIO(struct.pack("<Q", 5) + b"{}  "))
    with pytest.raises(safetensors_header.HeaderError, match="shorter than the 8-byte header length"):
        parse(io.BytesIO(b"\x02\0\0"))


def test_accepts_sub_byte_and_empty_tensors() -> None:
    layout = parse(st_bytes({"p": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]},
                             "z": {"dtype": "F32", "shape": [0, 5], "data_offsets": [3, 3]},
                             "__metadata__": {"format": "pt"}}, b"\0\0\0"))
    assert layout.dtypes() == {"F4": 1, "F32": 1} and layout.metadata == {"format": "pt"}
