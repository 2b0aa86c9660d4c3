"""Filling an action's command template (`command`, `box_command`) into an argv.

    profiles.command_fields("runpodctl stop pod {instance_id}")         # ["instance_id"]
    profiles.fill_command("runpodctl stop pod {instance_id}", {"instance_id": "p-1"})

A template splits like a shell line and is never run by one; a value fills part of one word and
can never become a second word. The loader (profiles/schema.py) has already refused any field
that is not one of PLACEHOLDERS. Used by the controller's teardown and the box's dead-man alike.
"""
from __future__ import annotations

import shlex
import string
from typing import List, Mapping


def command_fields(template: str) -> List[str]:
    """The placeholders the template names, in order (repeats kept once)."""
    found: List[str] = []
    for word in shlex.split(template):
        for _, field, _, _ in string.Formatter().parse(word):
            if field is not None and field not in found:
                found.append(field)
    return found


def fill_command(template: str, values: Mapping[str, str]) -> List[str]:
    """The template's words with its placeholders filled; ValueError names a missing one."""
    missing = [f for f in command_fields(template) if f not in values]
    if missing:
        raise ValueError(f"no value for {{{missing[0]}}}")
    return [word.format(**values) for word in shlex.split(template)]
