"""The profiles' [actions.<name>] tables: the teardown facts, read as strictly as the rest."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import profiles

HEAD = 'name = "x"\nkind = "ssh"\n'
STOP = ('\n[actions.stop]\nstops_meter = true\ndeletes = "nothing"\nreversible = true\n'
        'console = ["Click stop."]\nverified = "2026-06"\n')


def load(tmp_path: Path, text: str) -> profiles.Profile:
    (tmp_path / "x.toml").write_text(text)
    return profiles.load("x", tmp_path)


def refused(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(profiles.ProfileError, match=re.escape(needle)):
        load(tmp_path, text)


def test_an_action_table_loads_with_its_facts(tmp_path: Path) -> None:
    text = HEAD.replace('kind = "ssh"\n', 'kind = "ssh"\nmeter_stop_action = "stop"\n') + STOP + (
        '\n[actions.destroy]\nstops_meter = true\ndeletes = "the disks"\nstill_bills = "snapshots"\n'
        'reversible = false\ncommand = "provider destroy {instance_id} --tag {run_id}@{host}"\n'
        'credentials_env = ["PROVIDER_TOKEN"]\nverified = "2025-12"\nsource = "docs page"\n')
    p = load(tmp_path, text)
    assert p.meter_stop_action == "stop" and list(p.actions) == ["stop", "destroy"]
    stop, destroy = p.actions["stop"], p.actions["destroy"]
    assert (stop.stops_meter, stop.deletes, stop.reversible, stop.console, stop.command) == \
        (True, "nothing", True, ("Click stop.",), None)
    assert destroy.credentials_env == ("PROVIDER_TOKEN",) and destroy.still_bills == "snapshots"
    assert destroy.verified == "2025-12" and destroy.source == "docs page" and not destroy.reversible


@pytest.mark.parametrize("text, needle", [
    (HEAD + STOP.replace("reversible = true\n", "reversible = true\ncolour = 1\n"),
     "x.toml:8: unknown key 'actions.stop.colour'"),
    (HEAD + STOP.replace('"2026-06"', '"2026-13"'), "x.toml:9: 'actions.stop.verified' must be \"YYYY-MM\""),
    (HEAD + STOP.replace('"2026-06"', '"June 2026"'), "x.toml:9: 'actions.stop.verified' must be"),
    (HEAD + STOP.replace('verified = "2026-06"\n', ""), "x.toml:4: [actions.stop] has no 'verified'"),
    (HEAD + STOP.replace("deletes = \"nothing\"\n", ""), "x.toml:4: [actions.stop] has no 'deletes'"),
    (HEAD + STOP.replace("reversible = true", 'reversible = "yes"'),
     "x.toml:7: 'actions.stop.reversible' must be a bool"),
    (HEAD + STOP.replace('console = ["Click stop."]\n', ""),
     "[actions.stop] needs a command, a box_command or console steps"),
    (HEAD + STOP.replace('console = ["Click stop."]', 'command = "p stop {api_key}"'),
     "x.toml:8: 'actions.stop.command' may name only {instance_id}, {host}, {run_id}, not {api_key}"),
    (HEAD + STOP.replace('console = ["Click stop."]', 'command = "p stop --key $KEY"'),
     "'actions.stop.command' must not expand variables"),
    (HEAD + STOP.replace('console = ["Click stop."]', 'command = "p stop \'unclosed"'),
     "'actions.stop.command' is not a usable template"),
    (HEAD + STOP.replace('console = ["Click stop."]', 'command = "p"\ncredentials_env = ["NOT-A-NAME"]'),
     "'actions.stop.credentials_env' must be a list of environment variable names"),
    (HEAD + STOP.replace('console = ["Click stop."]', 'console = ["a"]\ncredentials_env = ["KEY"]'),
     "[actions.stop] names credentials_env but has no command"),
    (HEAD + 'meter_stop_action = "halt"\n' + STOP, "x.toml:3: meter_stop_action = 'halt' names no"),
    (HEAD + STOP.replace("[actions.stop]", "[actions.Stop-1]"), "[actions.Stop-1]: a name is"),
    (HEAD + "actions = 3\n", "x.toml:3: 'actions' must be a table of [actions.<name>] tables"),
])
def test_bad_action_tables_are_refused_naming_file_key_and_line(tmp_path: Path, text: str,
                                                                needle: str) -> None:
    refused(tmp_path, text, needle)


def test_the_line_named_is_the_one_in_the_offending_table(tmp_path: Path) -> None:
    two = HEAD + STOP + STOP.replace("[actions.stop]", "[actions.halt]").replace('"2026-06"', '"2026-6"')
    refused(tmp_path, two, "x.toml:16: 'actions.halt.verified'")  # not line 9, the stop's


def test_the_shipped_profiles_teardown_facts() -> None:
    autodl = profiles.load("autodl")
    assert autodl.meter_stop_action == "shutdown"
    shutdown, release = autodl.actions["shutdown"], autodl.actions["release"]
    assert shutdown.stops_meter and shutdown.reversible and shutdown.deletes == "nothing"
    assert "关机" in " ".join(shutdown.console) and shutdown.command is None
    assert release.stops_meter and not release.reversible and "/root/autodl-tmp" in release.deletes
    assert "释放" in " ".join(release.console)
    generic = profiles.load("generic-ssh")
    assert generic.meter_stop_action == "destroy" and not generic.actions["destroy"].reversible
    assert all(a.command is None for a in generic.actions.values())  # nothing rgt can run there
    assert not profiles.load("local").actions and profiles.load("local").meter_stop_action is None
    for name in profiles.names():
        for action in profiles.load(name).actions.values():
            assert re.match(r"^\d{4}-\d{2}$", action.verified) and action.source, (name, action.name)
