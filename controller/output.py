"""Reading what a command printed: rgt-onbox and eval scripts answer with a JSON line.

Commands may print other lines first (warnings, progress), so the answer is the LAST line
that parses as a JSON object.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Optional, Union

from controller.render import printable


def _text(data: Union[str, bytes]) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


def last_json_object(data: Union[str, bytes]) -> Optional[Dict[str, Any]]:
    """The last line of `data` that is a JSON object, or None. Lines end at \\n only: a JSON
    line may hold a raw U+2028 or \\x85 (json.dumps with ensure_ascii=False), which
    str.splitlines would take for line breaks."""
    for line in reversed(_text(data).split("\n")):
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
    """The last few non-empty lines of a command's stderr, joined with ' / ' for one message,
    each escaped by render.printable (the stderr is the box's: it may hold terminal controls)."""
    kept = [ln.strip() for ln in _text(data).split("\n") if ln.strip()]
    return " / ".join(printable(ln) for ln in kept[-lines:])[-limit:] or "no output"
