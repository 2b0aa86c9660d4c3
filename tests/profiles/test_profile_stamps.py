"""`verified` stamps: every one found with its key and line, and exactly the old ones called stale."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict

import pytest

import profiles


def profile_text(name: str, action: str, tier: str, deadman: str, spot: str = "") -> str:
    spot_table = f'\n[spot]\navailable = false\nverified = "{spot}"\n' if spot else ""
    return (f'name = "{name}"\nkind = "ssh-rental"\n'
            f'\n[storage.disk]\npath = "/"\nsurvives_stop = true\nsurvives_release = false\n'
            f'verified = "{tier}"\n'
            f'\n[actions.stop]\nstops_meter = true\ndeletes = "nothing"\nreversible = true\n'
            f'box_command = "halt"\nverified = "{action}"\n' + spot_table +
            f'\n[deadman]\naction = "stop"\nverified = "{deadman}"\n')


def planted(tmp_path: Path, files: Dict[str, str]) -> Path:
    where = tmp_path / "profiles"
    where.mkdir()
    for name, text in files.items():
        (where / f"{name}.toml").write_text(text)
    return where


def test_stamps_lists_every_verified_with_its_key_and_line(tmp_path: Path) -> None:
    where = planted(tmp_path, {"a": profile_text("a", "2026-01", "2026-05", "2026-06", spot="2025-12")})
    want = [profiles.Stamp("storage.disk.verified", "2026-05", 8),
            profiles.Stamp("actions.stop.verified", "2026-01", 15),
            profiles.Stamp("spot.verified", "2025-12", 19),
            profiles.Stamp("deadman.verified", "2026-06", 23)]
    assert profiles.stamps(where / "a.toml") == want
    assert profiles.stamps(profiles.load("a", where)) == want
    lines = (where / "a.toml").read_text().splitlines()
    assert all(lines[s.line - 1] == f'verified = "{s.verified}"' for s in want)


def test_stale_flags_exactly_the_stamps_older_than_the_limit(tmp_path: Path) -> None:
    where = planted(tmp_path, {"a": profile_text("a", "2026-01", "2026-06", "2026-06"),
                               "b": profile_text("b", "2026-06", "2026-05", "2026-06")})
    old = profiles.stale(today="2026-12", months=6, where=where)
    assert [(a.profile, a.key, a.verified, a.age_months) for a in old] == [
        ("a", "actions.stop.verified", "2026-01", 11), ("b", "storage.disk.verified", "2026-05", 7)]
    assert old[0].where == f"{where / 'a.toml'}:15" and old[1].where == f"{where / 'b.toml'}:8"
    assert [a.verified for a in profiles.stale(today="2026-12", months=10, where=where)] == ["2026-01"]
    assert profiles.stale(today="2026-06", months=6, where=where) == []


def test_six_months_old_is_not_yet_stale_seven_is(tmp_path: Path) -> None:
    where = planted(tmp_path, {"a": profile_text("a", "2026-06", "2026-06", "2026-06")})
    assert profiles.stale(today="2026-12", where=where) == []
    assert len(profiles.stale(today="2027-01", where=where)) == 3
    assert all(a.age_months == 7 for a in profiles.ages(today="2027-01", where=where))


def test_a_broken_profile_stops_the_scan_naming_its_file(tmp_path: Path) -> None:
    where = planted(tmp_path, {"a": profile_text("a", "2026-06", "2026-06", "2026-06").replace(
        'verified = "2026-06"\n\n[deadman]', 'verified = "06-2026"\n\n[deadman]')})
    with pytest.raises(profiles.ProfileError, match=re.escape("a.toml:15: 'actions.stop.verified' must be")):
        profiles.stale(today="2026-12", where=where)


def test_months_between_counts_calendar_months() -> None:
    assert profiles.months_between("2025-11", "2026-02") == 3
    assert profiles.months_between("2026-06", "2026-04") == -2
    with pytest.raises(ValueError):
        profiles.months_between("2026-6", "2026-12")
    assert profiles.is_month("2026-12") and not profiles.is_month("2026-13")


def test_the_shipped_profiles_are_not_stale_on_their_oldest_stamps_month() -> None:
    aged = profiles.ages(today="2026-11")
    oldest = min(a.verified for a in aged)
    assert profiles.stale(today=oldest) == []
    # On the day the profiles were last checked, only RunPod's spot capacity gate (2026-04) is stale.
    assert [(a.profile, a.key) for a in profiles.stale(today="2026-11")] == [("runpod", "spot.verified")]


def test_every_teardown_fact_of_the_shipped_profiles_is_stamped() -> None:
    for name in profiles.names():
        p = profiles.load(name)
        keys = {s.key for s in p.stamps}
        assert {f"actions.{a}.verified" for a in p.actions} <= keys, name
        assert {f"storage.{t}.verified" for t in p.storage} <= keys, name
        assert "deadman.verified" in keys, name
        assert all(t.source for t in p.storage.values()) and p.deadman.source, name
