"""Filling a command template: the one mechanism teardown and the dead-man both use."""
from __future__ import annotations

import pytest

import profiles


def test_fields_in_order_and_a_value_stays_inside_its_word() -> None:
    template = "tool stop {instance_id} --tag {run_id}@{host} --again {instance_id}"
    assert profiles.command_fields(template) == ["instance_id", "run_id", "host"]
    argv = profiles.fill_command(template, {"instance_id": "a b; rm -rf /", "run_id": "r1", "host": "h"})
    assert argv == ["tool", "stop", "a b; rm -rf /", "--tag", "r1@h", "--again", "a b; rm -rf /"]


def test_a_missing_value_is_named() -> None:
    with pytest.raises(ValueError, match=r"no value for \{instance_id\}"):
        profiles.fill_command("tool stop {instance_id}", {"host": "h"})
