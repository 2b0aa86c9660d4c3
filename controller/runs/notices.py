"""First-contact notices: what a person must hear the first time rgt meets a platform.

The facts come from the profile's `[surface]` table (what really stops the meter, the danger
clocks, short notes). They are shown once per platform per store: the store remembers the topic
`profile:<name>` (Store.mark_shown). `rgt hosts add` and `rgt launch` print the text on stderr.
"""
from __future__ import annotations

from typing import List, Optional

import profiles

from controller.store.db import Store


def topic(profile_name: str) -> str:
    """The store's key for "this platform's facts were shown"."""
    return f"profile:{profile_name}"


def render(profile: profiles.Profile) -> Optional[str]:
    """The notice for a profile, or None when its [surface] says nothing."""
    s = profile.surface
    if not s:
        return None
    lines: List[str] = [f"first time on {profile.name}: before you rent, know this (shown once)"]
    if s.meter_stop:
        lines.append(f"  stops the meter: {s.meter_stop}")
    lines += [f"  danger clock:    {clock}" for clock in s.danger_clocks]
    lines += [f"  note:            {note}" for note in s.notes]
    return "\n".join(lines)


def first_contact(store: Store, profile_name: str) -> Optional[str]:
    """The notice to print now, or None when it was shown before or the profile has nothing to say.

    Marks the notice shown when it returns text. A profile that does not load raises
    profiles.ProfileError (the caller has usually checked the name already).
    """
    text = render(profiles.load(profile_name, profiles.directory()))
    if text is None or not store.mark_shown(topic(profile_name)):
        return None
    return text


__all__ = ["first_contact", "render", "topic"]
