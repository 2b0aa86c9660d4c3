"""`rgt profile list|show|stale` through click, inside an RgtGroup as controller/cli/main.py attaches it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
from click.testing import CliRunner, Result

import profiles
from controller.cli.base import RgtGroup
from controller.cli.profile import profile_group

GOOD = '''name = "{name}"
kind = "ssh-rental"
meter_stop_action = "stop"

[surface]
meter_stop = "stop in the console stops the meter."
danger_clocks = ["A stopped box is deleted after 3 days."]

[storage.disk]
path = "/data"
survives_stop = true
survives_release = false
bills_while_stopped = "half price"
verified = "{tier}"

[actions.stop]
stops_meter = true
deletes = "nothing"
reversible = true
box_command = "halt {{instance_id}}"
console = ["Click stop."]
verified = "{action}"
source = "a test"

[deadman]
action = "stop"
instance_id_env = "BOX_ID"
why = "keeps the disk"
verified = "2026-06"
'''


def rgt(*args: str) -> Result:
    group = RgtGroup("rgt")
    group.add_command(profile_group)
    return CliRunner().invoke(group, ["profile", *args], catch_exceptions=False)


def lines(text: str) -> List[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


@pytest.fixture
def pdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "profiles"
    where.mkdir()
    (where / "alpha.toml").write_text(GOOD.format(name="alpha", tier="2026-05", action="2026-01"))
    (where / "beta.toml").write_text(GOOD.format(name="beta", tier="2026-06", action="2026-06"))
    monkeypatch.setenv("RGT_PROFILES_DIR", str(where))
    return where


def test_list_shows_each_profile_with_its_actions_and_oldest_stamp(pdir: Path) -> None:
    res = rgt("list")
    assert res.exit_code == 0 and res.stderr == ""
    out = [ln.split() for ln in lines(res.stdout)]
    assert out == [["NAME", "KIND", "METER", "STOP", "DEAD-MAN", "OLDEST", "STAMP"],
                   ["alpha", "ssh-rental", "stop", "stop", "2026-01"],
                   ["beta", "ssh-rental", "stop", "stop", "2026-06"]]
    doc = json.loads(rgt("list", "--json").stdout)
    assert doc["broken"] == 0 and doc["directory"] == str(pdir)
    assert [(p["name"], p["oldest_stamp"], p["deadman"]) for p in doc["profiles"]] == [
        ("alpha", "2026-01", "stop"), ("beta", "2026-06", "stop")]


def test_list_marks_a_broken_profile_and_exits_1(pdir: Path) -> None:
    (pdir / "gamma.toml").write_text(GOOD.format(name="gamma", tier="2026-05", action="2026-01")
                                     .replace("bills_while_stopped", "billing"))
    res = rgt("list")
    assert res.exit_code == 1
    broken = [ln for ln in lines(res.stdout) if ln.startswith("gamma")]
    assert len(broken) == 1 and "BROKEN" in broken[0]
    assert "gamma.toml:13: unknown key 'storage.disk.billing'" in broken[0]
    assert lines(res.stderr)[0] == f"error: 1 of 3 profiles in {pdir} do not load"
    res = rgt("list", "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == 1 and doc["broken"] == 1
    assert doc["profiles"][2]["ok"] is False and "storage.disk.billing" in doc["profiles"][2]["error"]


def test_list_of_an_empty_directory_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RGT_PROFILES_DIR", str(tmp_path))
    res = rgt("list")
    assert res.exit_code == 1 and lines(res.stderr)[0] == f"error: no profiles in {tmp_path}"


def test_list_of_the_packaged_profiles_loads_them_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RGT_PROFILES_DIR", raising=False)
    res = rgt("list", "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == 0 and doc["broken"] == 0
    assert {p["name"] for p in doc["profiles"]} == set(profiles.names())


def test_show_puts_what_to_know_before_renting_first(pdir: Path) -> None:
    res = rgt("show", "alpha")
    assert res.exit_code == 0, res.output
    out = lines(res.stdout)
    assert out[0] == "alpha (ssh-rental): know this before you rent"
    assert out[1] == "  stops the meter: stop in the console stops the meter."
    assert out[2] == "  danger clock:    A stopped box is deleted after 3 days."
    heads = [ln.split(":")[0] for ln in out if not ln.startswith(" ")]
    assert heads[1:] == ["storage", "actions (the one that really stops the meter", "ssh", "spot", "dead-man",
                         "script overrides", "file"]
    matrix = out.index("  TIER  PATH   STOP  RELEASE  VERIFIED  BILLS WHILE STOPPED")
    assert out[matrix + 1].split() == ["disk", "/data", "kept", "LOST", "2026-05", "half", "price"]
    assert "  stop (the meter stop): stops the meter: yes, reversible: yes, verified 2026-01" in out
    assert "dead-man: stop (runs: halt {instance_id})" in out
    assert "  the instance id comes from $BOX_ID on the box" in out


def test_show_json_is_one_object_with_every_table(pdir: Path) -> None:
    res = rgt("show", "alpha", "--json")
    assert res.exit_code == 0 and len(lines(res.stdout)) == 1
    doc: Dict[str, Any] = json.loads(res.stdout)
    assert doc["surface"]["meter_stop"] == "stop in the console stops the meter."
    assert doc["storage"] == [{"name": "disk", "path": "/data", "survives_stop": True,
                               "survives_release": False, "bills_while_stopped": "half price", "cap": "",
                               "note": "", "verified": "2026-05", "source": ""}]
    assert doc["actions"][0]["name"] == "stop" and doc["meter_stop_action"] == "stop"
    assert doc["deadman"]["instance_id_env"] == "BOX_ID" and doc["ssh"]["rsync_works"] is None
    assert [s["key"] for s in doc["stamps"]] == ["storage.disk.verified", "actions.stop.verified",
                                                 "deadman.verified"]


def test_show_of_a_shipped_profile_names_its_survival_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RGT_PROFILES_DIR", raising=False)
    out = lines(rgt("show", "runpod").stdout)
    assert out[0] == "runpod (ssh-rental): know this before you rent"
    rows = {ln.split()[0]: ln.split()[1:5] for ln in out if ln.startswith("  ") and len(ln.split()) > 5}
    assert rows["container"] == ["/", "LOST", "LOST", "2026-06"]
    assert rows["volume"] == ["/workspace", "kept", "LOST", "2026-06"]


def test_show_of_an_unknown_profile_is_a_usage_error(pdir: Path) -> None:
    res = rgt("show", "nope")
    assert res.exit_code == 2 and res.stdout == ""
    assert "no profile 'nope'" in res.stderr and "known: alpha, beta" in res.stderr


def test_show_of_a_broken_profile_names_file_and_line(pdir: Path) -> None:
    (pdir / "alpha.toml").write_text(GOOD.format(name="alpha", tier="2026-5", action="2026-01"))
    res = rgt("show", "alpha")
    assert res.exit_code == 1
    first = lines(res.stderr)[0]
    assert first.startswith(f"error: {pdir / 'alpha.toml'}:14: 'storage.disk.verified' must be")


def test_stale_lists_exactly_the_old_stamps_and_exits_1(pdir: Path) -> None:
    res = rgt("stale", "--today", "2026-12", "--months", "6")
    assert res.exit_code == 1
    out = [ln.split() for ln in lines(res.stdout)]
    assert out == [["FILE:LINE", "KEY", "VERIFIED", "AGE"],
                   [f"{pdir / 'alpha.toml'}:22", "actions.stop.verified", "2026-01", "11", "months"],
                   [f"{pdir / 'alpha.toml'}:14", "storage.disk.verified", "2026-05", "7", "months"]]
    assert lines(res.stderr)[0] == "error: 2 of 6 stamps are older than 6 months on 2026-12"
    res = rgt("stale", "--today", "2026-12", "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == 1 and doc["scanned"] == 6 and doc["today"] == "2026-12"
    assert [(s["verified"], s["line"], s["age_months"]) for s in doc["stale"]] == [("2026-01", 22, 11),
                                                                                   ("2026-05", 14, 7)]


def test_stale_passing_says_it_does_not_verify_the_facts(pdir: Path) -> None:
    res = rgt("stale", "--today", "2026-07")
    assert res.exit_code == 0 and res.stderr == ""
    assert lines(res.stdout) == [
        "6 stamps in 2 profiles, none older than 6 months on 2026-07",
        "passing does not verify the facts: it only says each was checked within 6 months"]
    assert rgt("stale", "--today", "2026-12", "--months", "11").exit_code == 0
    doc = json.loads(rgt("stale", "--today", "2026-07", "--json").stdout)
    assert doc["stale"] == [] and "does not verify" in doc["note"]


@pytest.mark.parametrize("args", [["--today", "2026-13"], ["--today", "Dec 2026"], ["--months", "-1"]])
def test_stale_refuses_bad_options_as_usage_errors(pdir: Path, args: List[str]) -> None:
    res = rgt("stale", *args)
    assert res.exit_code == 2 and res.stderr.startswith("error: Invalid value for")


def test_stale_with_no_stamps_at_all_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bare.toml").write_text('name = "bare"\nkind = "ssh"\n')
    monkeypatch.setenv("RGT_PROFILES_DIR", str(tmp_path))
    res = rgt("stale", "--today", "2026-12")
    assert res.exit_code == 1 and lines(res.stderr)[0] == f"error: no verified stamps in {tmp_path}"


def test_stale_over_the_packaged_profiles_passes_on_their_oldest_month(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RGT_PROFILES_DIR", raising=False)
    oldest = min(a.verified for a in profiles.ages(today="2026-11"))
    assert rgt("stale", "--today", oldest).exit_code == 0
    res = rgt("stale", "--today", "2026-11", "--json")
    assert res.exit_code == 1 and [s["key"] for s in json.loads(res.stdout)["stale"]] == ["spot.verified"]
