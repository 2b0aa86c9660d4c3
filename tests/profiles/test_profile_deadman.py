"""The profiles' [deadman] table: what a forgotten box does to itself, never destructive by default."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import profiles

HEAD = 'name = "x"\nkind = "ssh"\n'
STOP = ('\n[actions.stop]\nstops_meter = true\ndeletes = "nothing"\nreversible = true\n'
        'box_command = "recorder stop {instance_id}"\nverified = "2026-06"\n')
KILL = ('\n[actions.terminate]\nstops_meter = true\ndeletes = "the instance and its disks"\n'
        'reversible = false\nbox_command = "recorder terminate {instance_id}"\nverified = "2026-06"\n')


def load(tmp_path: Path, text: str) -> profiles.Profile:
    (tmp_path / "x.toml").write_text(text)
    return profiles.load("x", tmp_path)


def test_no_deadman_table_means_notify(tmp_path: Path) -> None:
    dm = load(tmp_path, HEAD + STOP).deadman
    assert (dm.action, dm.allow, dm.instance_id_env) == (profiles.NOTIFY, (), None)


def test_a_reversible_box_action_may_be_the_default_a_destructive_one_only_allowed(tmp_path: Path) -> None:
    text = HEAD + STOP + KILL + ('\n[deadman]\naction = "stop"\nallow = ["terminate"]\n'
                                 'instance_id_env = "POD_ID"\nwhy = "keeps the disk"\nverified = "2026-06"\n')
    p = load(tmp_path, text)
    assert p.deadman.action == "stop" and p.deadman.allow == ("terminate",)
    assert p.deadman.instance_id_env == "POD_ID"
    assert p.actions["stop"].box_command == "recorder stop {instance_id}"


@pytest.mark.parametrize("deadman, needle", [
    ('action = "terminate"\nverified = "2026-06"\n',
     "cannot be undone (it deletes 'the instance and its disks')"),
    ('action = "reboot"\nverified = "2026-06"\n', "names 'reboot', which is not an [actions.<name>]"),
    ('action = "notify"\nallow = ["reboot"]\nverified = "2026-06"\n', "names 'reboot'"),
    ('action = "stop"\n', "[deadman] needs verified"),
    ('action = "stop"\nverified = "2026-13"\n', "[deadman] needs verified"),
    ('action = "stop"\ninstance_id_env = "A B"\nverified = "2026-06"\n', "instance_id_env must be"),
    ('action = "stop"\nwhen = "always"\nverified = "2026-06"\n', "unknown key 'deadman.when'"),
])
def test_a_bad_deadman_table_is_refused_with_file_and_line(tmp_path: Path, deadman: str, needle: str) -> None:
    text = HEAD + STOP + KILL + "\n[deadman]\n" + deadman
    with pytest.raises(profiles.ProfileError, match=re.escape(needle)) as e:
        load(tmp_path, text)
    assert re.search(r"x\.toml:\d+:", str(e.value))


def test_a_box_command_is_a_template_like_command(tmp_path: Path) -> None:
    text = HEAD + STOP.replace("recorder stop {instance_id}", "recorder stop $TOKEN")
    with pytest.raises(profiles.ProfileError, match=re.escape("'actions.stop.box_command' must not expand")):
        load(tmp_path, text)


def test_autodl_powers_off_and_generic_ssh_only_notifies() -> None:
    autodl = profiles.load("autodl")
    assert autodl.deadman.action == "shutdown" and autodl.actions["shutdown"].deletes == "nothing"
    assert "15-day" in autodl.deadman.why
    assert profiles.load("generic-ssh").deadman.action == profiles.NOTIFY
