"""The sampled NaN/Inf check of safetensors weights (onbox.custody.finite), against torch's own isfinite."""
from __future__ import annotations

import io
import struct
from pathlib import Path

import pytest

from onbox.custody import check
from onbox.custody.finite import FILE_BUDGET_BYTES, SAMPLE_BYTES, chunk_has_nonfinite, sample_nonfinite
from rgtlib.safetensors_header import parse_path

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
INTS = {"F32": torch.int32, "F16": torch.int16, "BF16": torch.int16, "F64": torch.int64}


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_bit_pattern_class_agrees_with_torch(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    width = torch.empty(0, dtype=DTYPES[name]).element_size()
    for trial in range(400):
        n = int(torch.randint(1, 40, (1,), generator=g))
        raw = torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g)
        t = raw.view(DTYPES[name]).clone()
        if trial % 3 == 0:  # mostly ordinary numbers, sometimes one special value
            t = torch.randn(n, generator=g).to(DTYPES[name])
            if trial % 2:
                t[int(torch.randint(0, n, (1,), generator=g))] = [float("nan"), float("inf"),
                                                                 float("-inf")][trial % 3]
        want = not bool(torch.isfinite(t).all())
        assert chunk_has_nonfinite(t.view(INTS[name]).numpy().tobytes(), name) is want, (name, t)


def test_a_partial_trailing_element_and_an_empty_chunk_are_not_nonfinite() -> None:
    nan32 = struct.pack("<f", float("nan"))
    assert chunk_has_nonfinite(nan32, "F32") and not chunk_has_nonfinite(nan32[:3], "F32")
    assert not chunk_has_nonfinite(b"", "F16")


def _file(path: Path, tensors: dict) -> Path:
    st.save_file(tensors, str(path))
    return path


def test_a_poisoned_model_is_named_and_a_healthy_one_is_not(tmp_path: Path) -> None:
    good = {"a.weight": torch.randn(64, 64), "b.bias": torch.zeros(64, dtype=torch.bfloat16),
            "steps": torch.arange(10)}
    bad = {**good, "b.bias": torch.full((64,), float("inf"), dtype=torch.bfloat16)}
    ok = check.check_path(_file(tmp_path / "good.safetensors", good))
    nan = check.check_path(_file(tmp_path / "bad.safetensors", bad))
    assert ok.status == nan.status == check.OK
    assert ok.nonfinite == () and nan.nonfinite == ("b.bias",)


def test_reads_only_the_head_of_each_tensor_within_the_file_budget(tmp_path: Path) -> None:
    big = torch.randn(2 * SAMPLE_BYTES // 4)   # twice a sample
    big[-1] = float("nan")                      # past the sampled head: not seen (verify sees it)
    path = _file(tmp_path / "m.safetensors", {"w": big})
    layout = parse_path(path)
    names, read = sample_nonfinite(io.BytesIO(path.read_bytes()), layout.data_start, layout.tensors)
    assert names == [] and read == SAMPLE_BYTES
    many = {f"t{i}": torch.randn(SAMPLE_BYTES // 4) for i in range(FILE_BUDGET_BYTES // SAMPLE_BYTES + 4)}
    path = _file(tmp_path / "many.safetensors", many)
    layout = parse_path(path)
    _, read = sample_nonfinite(io.BytesIO(path.read_bytes()), layout.data_start, layout.tensors)
    assert read == FILE_BUDGET_BYTES
