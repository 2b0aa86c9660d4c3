"""Reading what a command printed: rgt-onbox and eval scripts answer with a JSON line.

Commands may print other lines first (warnings, progress), so the answer is the LAST line
that parses as a JSON object.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Optional, Union


def _text(data: Union[str, bytes]) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


def last_json_object(data: Union[str, bytes]) -> Optional[Dict[str, Any]]:
    """The last line of `data` that is a JSON object, or None."""
    for line in reversed(_text(data).splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def error_tail(data: Union[str, bytes], lines: int = 3, limit: int = 600) -> str:
    """The last few non-empty lines of a command's stderr, joined with ' / ' for one message."""
    kept = [ln.strip() for ln in _text(data).splitlines() if ln.strip()]
    return " / ".join(kept[-lines:])[-limit:] or "no output"
