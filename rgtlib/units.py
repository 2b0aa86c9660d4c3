"""Durations and sizes as people type them, and bytes as people read them: one grammar for every
command on both sides (`rgt watch --timeout 6h`, `rgt-onbox launch --deadman-ttl 30m`,
`--code-limit 200MiB`, `--disk-budget 1GiB`)."""
from __future__ import annotations

import os
import re
from typing import Mapping, Optional

_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*")
_SECONDS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """"90", "90s", "250ms", "15m", "1.5h", "1d" as seconds; ValueError otherwise (a sign too)."""
    m = _DURATION.fullmatch(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a duration (like 90, 90s, 15m, 6h, 1d, 250ms)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def env_seconds(name: str, default: float, env: Optional[Mapping[str, str]] = None) -> float:
    """$NAME as a duration ("0.3", "30s", "5m"), or `default` when it is unset, unreadable or not
    above zero: the knobs tests turn to make a long wait short."""
    text = (os.environ if env is None else env).get(name, "")
    try:
        value = parse_duration(text) if text else default
    except ValueError:
        return default
    return value if value > 0 else default


def parse_size(text: str) -> int:
    """"1GiB", "500M", "2g", "1.5K", "1048576" as bytes (K/M/G/T are binary); ValueError otherwise."""
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (like 200MiB, 1GiB, 500M)")
    power = " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * (1 << (10 * power)))


def human_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"; whole bytes below 1 KiB, one decimal above, up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} TiB"


__all__ = ["env_seconds", "human_bytes", "parse_duration", "parse_size"]
