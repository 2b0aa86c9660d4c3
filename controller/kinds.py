"""What event kinds mean on the laptop: which kinds end a condition another kind began, which
fields tell two conditions of one kind apart, what makes a condition graver, and how severities
rank. The wake policy (controller.wake.policy) judges with it and the run's status
(controller.runs.status) reads conditions with it; the kinds themselves are protocol.kinds'.
See docs/ARCHITECTURE.md §3.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Protocol, Tuple

import protocol

from controller.render import text_of


class EventLike(Protocol):
    """A sidecar's event (protocol.Event) or one the controller recorded (store LocalEvent)."""

    @property
    def kind(self) -> str: ...

    @property
    def data(self) -> Mapping[str, Any]: ...

# Kinds whose every event is the end of a condition (their onsets are other kinds).
CLEAR_KINDS: Dict[str, str] = {
    "gpu.throttle_cleared": "gpu.throttle",
    "gpu.foreign_memory_cleared": "gpu.foreign_memory",
    "disk.ok": "disk.low",
    "mem.ok": "mem.pressure",
    "job.progressing": "job.stalled",
    "sidecar.recovered": "sidecar.degraded",
    "link.restored": "link.lost",
}
# Judged by the watch's link budget instead (exit 4), never as a wake of their own.
LINK_KINDS = ("link.lost", "link.restored")
# Fields that tell two conditions of one kind apart, in this order (all present ones count).
IDENT_FIELDS = ("gpu", "name", "path", "resource", "part", "code")
ESCALATING_STATES = ("escalated", "oom_kill")   # data.state values that make a condition graver
DEADMAN = "deadman."
# Kinds that end what another kind warned of (see superseded): the warning never wakes after them.
SUPERSEDED_BY: Dict[str, Tuple[str, ...]] = {
    "mem.pressure": ("job.exited",),
    "train.nonfinite": ("job.exited",),
    "deadman.expiring": ("deadman.firing", "deadman.fired"),
}


def deadman_scope(event: EventLike, lease: Optional[str]) -> str:
    """The lease a dead-man event is about: its trigger (lease or budget) and the arm the watch
    found before it, never the renewal time (each renewal moves it, and a key made of it would
    wake again at every late renewal)."""
    trigger = event.data.get("trigger")
    return f"{trigger if trigger in ('lease', 'budget') else 'lease'}/{lease or 'arm:?'}"


def identity(event: EventLike, lease: Optional[str] = None) -> str:
    """What tells two conditions of one kind apart: IDENT_FIELDS, or for the dead-man its lease."""
    if event.kind.startswith(DEADMAN):
        return deadman_scope(event, lease)
    parts = []
    for name in IDENT_FIELDS:
        value = event.data.get(name)
        if value is not None and not isinstance(value, (dict, list)):
            parts.append(text_of(value))
    return "/".join(parts)


def escalation(event: EventLike) -> Optional[str]:
    """How an event makes its condition graver ("escalated", "oom_kill"), None for an onset or a
    clear. The dead-man's 5-minute warning escalates its 30-minute one."""
    state = event.data.get("state")
    if state in ESCALATING_STATES:
        return str(state)
    if event.kind == "deadman.expiring" and event.data.get("minutes_left") == 5:
        return "escalated"
    return None


def base_condition(event: EventLike, lease: Optional[str] = None) -> str:
    """cond:<kind>:<identity>, whatever the grade (an onset, its escalations and its clears share it)."""
    return f"cond:{CLEAR_KINDS.get(event.kind, event.kind)}:{identity(event, lease)}"


def condition_key(event: EventLike, lease: Optional[str] = None) -> str:
    """cond:<kind>:<identity>; an escalation (warn -> critical, an OOM kill) is a condition of its own."""
    grade = escalation(event)
    key = base_condition(event, lease)
    return f"{key}:{grade}" if grade else key


def is_clear(event: EventLike) -> bool:
    return event.kind in CLEAR_KINDS or event.data.get("state") == "cleared"


def condition_kinds(kind: str) -> Tuple[str, ...]:
    """The kinds one condition's events come in: its onset kind, then its clear kinds."""
    base = CLEAR_KINDS.get(kind, kind)
    return (base, *sorted(k for k, b in CLEAR_KINDS.items() if b == base))


def severity(sev: str) -> int:
    try:
        return protocol.severity_rank(sev)
    except KeyError:
        return 0  # an unknown severity from a newer sidecar: treated as info


__all__ = ["CLEAR_KINDS", "DEADMAN", "ESCALATING_STATES", "IDENT_FIELDS", "LINK_KINDS", "SUPERSEDED_BY",
           "EventLike",
           "base_condition", "condition_key", "condition_kinds", "deadman_scope", "escalation", "identity",
           "is_clear", "severity"]
