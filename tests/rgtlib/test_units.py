"""rgtlib.units: one grammar for durations and sizes on both sides, and bytes as people read them."""
from __future__ import annotations

import pytest

from rgtlib import units
from rgtlib.units import human_bytes, parse_duration, parse_size


@pytest.mark.parametrize("text, seconds", [
    ("90", 90), ("90s", 90), ("250ms", 0.25), ("15m", 900), ("6h", 21600), ("1d", 86400), ("1.5h", 5400),
    (" 2m ", 120), ("5.", 5), (".5s", 0.5), ("0", 0),
])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["soon", "-5m", "5x", "", "1e3", "2 hours", "5M", "m"])
def test_what_is_not_a_duration_says_what_is(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a duration \(like 90, 90s, 15m, 6h, 1d, 250ms\)"):
        parse_duration(text)


@pytest.mark.parametrize("text, size", [
    ("1GiB", 1 << 30), ("500M", 500 << 20), ("2g", 2 << 30), ("1048576", 1 << 20), ("1.5K", 1536),
    ("200MiB", 200 << 20), ("1G", 1 << 30), ("3kb", 3072), ("1T", 1 << 40),
])
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "-1G", "1P", "1 GB extra", ""])
def test_what_is_not_a_size_says_what_is(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a size \(like 200MiB, 1GiB, 500M\)"):
        parse_size(text)


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (3 << 20, "3.0 MiB"), (5 << 30, "5.0 GiB"),
    (2 << 40, "2.0 TiB"), (-2048, "-2.0 KiB"),
])
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text


def test_env_seconds_reads_a_duration_and_falls_back_on_anything_else() -> None:
    assert units.env_seconds("T", 120.0, {"T": "0.3"}) == 0.3
    assert units.env_seconds("T", 120.0, {"T": "5m"}) == 300.0
    for bad in ({}, {"T": ""}, {"T": "soon"}, {"T": "0"}, {"T": "-1"}):
        assert units.env_seconds("T", 120.0, bad) == 120.0
