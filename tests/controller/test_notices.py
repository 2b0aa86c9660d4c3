"""First-contact notices: a platform's [surface] facts, shown once per store."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

import profiles
from controller.runs.notices import first_contact, topic
from controller.store.db import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store.open(tmp_path / "rgt.db") as s:
        yield s


def test_shown_once_with_every_fact(store: Store) -> None:
    text = first_contact(store, "autodl")
    assert text is not None
    surface = profiles.load("autodl").surface
    assert surface.meter_stop and surface.meter_stop in text
    assert all(line in text for line in (*surface.danger_clocks, *surface.notes))
    assert text.splitlines()[0].startswith("first time on autodl")
    assert first_contact(store, "autodl") is None  # recorded as shown
    assert store.mark_shown(topic("autodl")) is False
    assert first_contact(store, "generic-ssh") is not None  # each platform on its own


def test_a_profile_with_nothing_to_surface_says_nothing_and_marks_nothing(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pdir = tmp_path / "profiles"
    pdir.mkdir()
    (pdir / "quiet.toml").write_text('name = "quiet"\nkind = "ssh"\n')
    monkeypatch.setenv("RGT_PROFILES_DIR", str(pdir))
    assert first_contact(store, "quiet") is None
    assert store.mark_shown(topic("quiet")) is True  # it was never marked


def test_an_unknown_profile_is_an_error(store: Store) -> None:
    with pytest.raises(profiles.ProfileError, match="no profile 'nope'"):
        first_contact(store, "nope")
