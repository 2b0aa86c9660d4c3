from __future__ import annotations

from pathlib import Path

import pytest

import profiles


def test_every_shipped_profile_loads_and_names_itself() -> None:
    found = profiles.names()
    assert {"autodl", "generic-ssh", "local"} <= set(found) and "ruff" not in found
    for name in found:
        p = profiles.load(name)
        assert p.name == name and p.kind


def test_autodl_scripts() -> None:
    s = profiles.load("autodl").scripts
    assert s.python == "/root/miniconda3/bin/python" and s.proxy_hook == "/etc/network_turbo"
    assert s.env["HF_ENDPOINT"].startswith("https://") and s.durable_dir == "/root/autodl-fs"


def write(tmp_path: Path, name: str, text: str) -> Path:
    (tmp_path / f"{name}.toml").write_text(text)
    return tmp_path


@pytest.mark.parametrize("text, needle", [
    ('name = "x"\nkind = "ssh"\ncolour = "red"\n', "x.toml:3: unknown key 'colour'"),
    ('name = "x"\nkind = "ssh"\n\n[scripts]\npython = "/p"\npyton = "/q"\n',
     "x.toml:6: unknown key 'scripts.pyton'"),
    ('name = "x"\nkind = "ssh"\n[scripts]\npython = 3\n', "x.toml:4: 'scripts.python' must be a str"),
    ('name = "x"\nkind = "ssh"\n[scripts.env]\nHF_ENDPOINT = 1\n', "must map NAME"),
    ('name = "y"\nkind = "ssh"\n', "does not match the file name"),
    ('name = "x"\n', "missing key 'kind'"),
    ('name = "x"\nkind = \n', "not valid TOML"),
])
def test_bad_profiles_are_refused_naming_file_key_and_line(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(profiles.ProfileError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        profiles.load("x", write(tmp_path, "x", text))


def test_unknown_profile_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(profiles.ProfileError, match="known: autodl"):
        profiles.load("nope")
    with pytest.raises(profiles.ProfileError, match="lowercase"):
        profiles.load("../etc/passwd")


def test_directory_follows_the_environment(tmp_path: Path) -> None:
    assert profiles.directory({"RGT_PROFILES_DIR": str(tmp_path)}) == tmp_path
    assert profiles.directory({}).name == "profiles"


def test_surface_facts_of_the_shipped_profiles() -> None:
    autodl = profiles.load("autodl").surface
    assert autodl.meter_stop and "关机" in autodl.meter_stop
    assert any("15 days" in clock for clock in autodl.danger_clocks)
    assert any("/root/autodl-fs" in note for note in autodl.notes)
    for name in profiles.names():
        s = profiles.load(name).surface
        assert s, name  # every shipped profile has something to surface
        assert all("\n" not in line and len(line) <= 110 for line in (s.meter_stop or "", *s.danger_clocks,
                                                                       *s.notes)), name


def test_a_profile_without_surface_has_an_empty_one(tmp_path: Path) -> None:
    s = profiles.load("x", write(tmp_path, "x", 'name = "x"\nkind = "ssh"\n')).surface
    assert not s and s.meter_stop is None and s.danger_clocks == () and s.notes == ()


@pytest.mark.parametrize("text, needle", [
    ('name = "x"\nkind = "ssh"\n[surface]\ncolour = "red"\n', "x.toml:4: unknown key 'surface.colour'"),
    ('name = "x"\nkind = "ssh"\n[surface]\ndanger_clocks = "one"\n',
     "x.toml:4: 'surface.danger_clocks' must be a list of one-line strings"),
    ('name = "x"\nkind = "ssh"\n[surface]\nnotes = ["a", 2]\n', "x.toml:4: 'surface.notes' must be a list"),
    ('name = "x"\nkind = "ssh"\n[surface]\nnotes = ["a\\nb"]\n', "x.toml:4: 'surface.notes' must be a list"),
    ('name = "x"\nkind = "ssh"\n[surface]\nmeter_stop = ["x"]\n',
     "x.toml:4: 'surface.meter_stop' must be a str"),
    ('name = "x"\nkind = "ssh"\nsurface = 1\n', "x.toml:3: 'surface' must be a table"),
])
def test_bad_surface_tables_are_refused_naming_the_line(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(profiles.ProfileError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        profiles.load("x", write(tmp_path, "x", text))
