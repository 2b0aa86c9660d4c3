"""Reading a JSON-lines file a job or a sidecar writes (metrics.jsonl, events.jsonl).

    for line_no, row in objects(Path("metrics.jsonl")): ...

Only lines that parse as a JSON object count: a torn last line (the writer was killed mid-line)
or a stray print is skipped, never an error.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple


def objects(path: Path) -> Iterator[Tuple[int, Dict[str, Any]]]:
    """(line number from 1, the object) for each line of `path` that is a JSON object."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                row = json.loads(raw)
            except ValueError:
                continue
            if isinstance(row, dict):
                yield line_no, row
