"""The boundary: every value a box sends is checked here before anything on the laptop uses it.

A rented box is someone else's machine. Its `rgt-onbox` answers, its sidecar's hello, events,
replies and manifests, its run.json and its dead-man answers are all claims. This module turns
a claim into a value the rest of the controller may use, or refuses it with `Untrusted`:

- identities are the laptop's: a run id follows protocol.ids' grammar and must equal the one
  the laptop asked for; the host a run was launched on is fixed when it is first recorded;
- a laptop path is never built from a box's string without `contained()`: one safe component
  or relative path, resolved, and still under its root;
- a box path (a run dir) is an absolute POSIX path with no control characters, bounded;
- numbers are bounded and finite; text is bounded (and escaped by render.printable before any
  terminal sees it).
"""
from __future__ import annotations

import math
import posixpath
import re
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from protocol.errors import ProtocolError
from protocol.ids import MAX_RUN_ID_CHARS, check_run_id, is_run_id

__all__ = ["MAX_BOX_PATH_CHARS", "MAX_RUN_ID_CHARS", "Untrusted", "box_path", "contained", "expect_run",
           "is_run_id", "launch_answer", "number", "run_id", "text"]

MAX_BOX_PATH_CHARS = 4096
MAX_TEXT_CHARS = 64 * 1024
# Integers a box may send where a count, a pid or a size is meant: far past any real one.
MAX_INT = 2 ** 63 - 1
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class Untrusted(ValueError):
    """A box sent a value that is refused; the message says which and why."""


def run_id(value: Any, what: str = "run id") -> str:
    """VALUE when it is a run id by the one grammar (protocol.ids); Untrusted otherwise."""
    try:
        return check_run_id(value, what)
    except ProtocolError as e:
        raise Untrusted(str(e)) from None


def expect_run(value: Any, asked: str, what: str = "the box") -> str:
    """The run id a box answered with, which must be the one the laptop asked for."""
    got = run_id(value, f"{what}'s run id")
    if got != asked:
        raise Untrusted(f"{what} answered for run {got!r}, not the {asked!r} that was asked for")
    return got


def box_path(value: Any, what: str = "run directory") -> str:
    """An absolute POSIX path on the box: no control characters, no `..`, at most 4096 characters."""
    if not isinstance(value, str) or not value.startswith("/") or len(value) > MAX_BOX_PATH_CHARS:
        raise Untrusted(f"the box's {what} {repr(value)[:80]} is not an absolute path of at most "
                        f"{MAX_BOX_PATH_CHARS} characters")
    if _CONTROL.search(value) or ".." in value.split("/"):
        raise Untrusted(f"the box's {what} {repr(value)[:80]} holds control characters or '..'")
    return posixpath.normpath(value) if value != "/" else value


def contained(root: Path, *parts: str) -> Path:
    """ROOT joined with PARTS, refused unless every part is relative, free of `..` and control
    characters, and the resolved result stays under ROOT (a symlink out of it is refused too)."""
    for part in parts:
        if (not isinstance(part, str) or not part or part.startswith("/") or "\x00" in part
                or _CONTROL.search(part) or ".." in part.replace("\\", "/").split("/")):
            raise Untrusted(f"{repr(part)[:80]} is not a relative path that stays under {root}")
    base = root.resolve()
    path = base.joinpath(*parts).resolve()
    if path != base and base not in path.parents:
        raise Untrusted(f"{'/'.join(parts)[:80]!r} leads out of {root}")
    return path


def number(value: Any, what: str, *, lo: float = -math.inf, hi: float = math.inf,
           integer: bool = False) -> Any:
    """A finite number in [lo, hi] (an int within ±2**63 when INTEGER); Untrusted otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Untrusted(f"the box's {what} {repr(value)[:40]} is not a number")
    if integer and not isinstance(value, int):
        raise Untrusted(f"the box's {what} {repr(value)[:40]} is not an integer")
    if isinstance(value, int) and abs(value) > MAX_INT:
        raise Untrusted(f"the box's {what} is an integer of {len(str(abs(value)))} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise Untrusted(f"the box's {what} {value!r} is not finite")
    if not lo <= value <= hi:
        raise Untrusted(f"the box's {what} {value!r} is outside [{lo:g}, {hi:g}]")
    return value


def text(value: Any, what: str, max_chars: int = MAX_TEXT_CHARS) -> str:
    """A string of at most MAX_CHARS characters (escape it with render.printable to show it)."""
    if not isinstance(value, str) or len(value) > max_chars:
        raise Untrusted(f"the box's {what} is not a string of at most {max_chars} characters")
    return value


def launch_answer(obj: Mapping[str, Any], asked: str) -> Dict[str, Any]:
    """`rgt-onbox launch --json`'s answer, checked: its run id is the one asked for, its run dir a
    box path and its pids real pids. Other keys pass as they came (they are shown, not used)."""
    answer = dict(obj)
    node = obj.get("node")
    if node is not None and obj.get("group") == asked:
        # One node of a multi-node run (onbox/launch/nodes.py): its stream is `<run>.<node>`.
        answer["run_id"] = expect_run(obj.get("run_id"), f"{asked}.{run_id(node, 'node name')}",
                                      "the box's launch")
    else:
        answer["run_id"] = expect_run(obj.get("run_id"), asked, "the box's launch")
    asked = answer["run_id"]
    answer["run_dir"] = box_path(obj.get("run_dir"), "run directory")
    if posixpath.basename(answer["run_dir"]) != asked:
        raise Untrusted(f"the box's run directory {answer['run_dir'][:200]!r} is not named after run "
                        f"{asked!r}")
    for key in ("pid", "sidecar_pid", "supervisor_pid"):
        if obj.get(key) is not None:
            answer[key] = number(obj[key], key, lo=1, hi=2 ** 31, integer=True)
    return answer


def optional_run_id(value: Optional[str]) -> Optional[str]:
    """A run id a person typed (None passes): the same grammar, so the laptop never makes a bad one."""
    return None if value is None else run_id(value)
