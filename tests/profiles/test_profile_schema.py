"""The [storage.<tier>], [ssh] and [spot] tables and `kind`: read as strictly as the rest."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import profiles

HEAD = 'name = "x"\nkind = "ssh-rental"\n'
TIER = ('\n[storage.volume]\npath = "/workspace"\nsurvives_stop = true\nsurvives_release = false\n'
        'bills_while_stopped = "2x"\ncap = "50 GB"\nnote = "the volume disk"\nverified = "2026-06"\n'
        'source = "docs"\n')
SSH = ('\n[ssh]\nuser = "root"\nport_changes_on_restart = true\nrsync_works = false\n'
       'notes = ["proxy only"]\nverified = "2026-06"\nsource = "docs"\n')
SPOT = ('\n[spot]\navailable = true\nsignal = "SIGTERM"\ngrace_s = 5\nnotes = ["cheap"]\n'
        'verified = "2026-04"\nsource = "docs"\n')


def load(tmp_path: Path, text: str) -> profiles.Profile:
    (tmp_path / "x.toml").write_text(text)
    return profiles.load("x", tmp_path)


def test_storage_ssh_and_spot_tables_load_with_their_facts(tmp_path: Path) -> None:
    p = load(tmp_path, HEAD + TIER + SSH + SPOT)
    tier = p.storage["volume"]
    assert (tier.path, tier.survives_stop, tier.survives_release) == ("/workspace", True, False)
    assert (tier.bills_while_stopped, tier.cap, tier.note, tier.verified, tier.source) == \
        ("2x", "50 GB", "the volume disk", "2026-06", "docs")
    assert (p.ssh.user, p.ssh.port_changes_on_restart, p.ssh.rsync_works, p.ssh.notes, p.ssh.verified) == \
        ("root", True, False, ("proxy only",), "2026-06")
    assert (p.spot.available, p.spot.signal, p.spot.grace_s, p.spot.verified) == \
        (True, "SIGTERM", 5.0, "2026-04")


def test_absent_tables_are_empty_and_unknown(tmp_path: Path) -> None:
    p = load(tmp_path, HEAD)
    assert p.storage == {} and p.ssh == profiles.Ssh() and p.spot == profiles.Spot() and p.stamps == ()
    assert p.ssh.rsync_works is None and p.spot.available is None


def test_ssh_and_spot_may_go_without_a_stamp_when_no_source_dates_them(tmp_path: Path) -> None:
    text = HEAD + SSH.replace('verified = "2026-06"\n', "") + SPOT.replace('verified = "2026-04"\n', "")
    p = load(tmp_path, text)
    assert p.ssh.verified is None and p.spot.verified is None and p.stamps == ()


def test_grace_may_be_a_float(tmp_path: Path) -> None:
    assert load(tmp_path, HEAD + SPOT.replace("grace_s = 5", "grace_s = 0.5")).spot.grace_s == 0.5


@pytest.mark.parametrize("text, needle", [
    # storage: unknown key, wrong types, bad or missing stamp, missing survival facts, bad path
    (HEAD + TIER.replace("cap =", "colour = 1\ncap ="), "x.toml:9: unknown key 'storage.volume.colour'"),
    (HEAD + TIER.replace("survives_stop = true", 'survives_stop = "yes"'),
     "x.toml:6: 'storage.volume.survives_stop' must be a bool"),
    (HEAD + TIER.replace('path = "/workspace"', "path = 1"), "x.toml:5: 'storage.volume.path' must be a str"),
    (HEAD + TIER.replace('"2026-06"', '"2026-13"'),
     "x.toml:11: 'storage.volume.verified' must be \"YYYY-MM\" (a real month), not '2026-13'"),
    (HEAD + TIER.replace('"2026-06"', '"2026-6"'), "x.toml:11: 'storage.volume.verified' must be"),
    (HEAD + TIER.replace('verified = "2026-06"\n', ""),
     "x.toml:4: [storage.volume] has no 'verified' = \"YYYY-MM\" stamp"),
    (HEAD + TIER.replace("survives_release = false\n", ""),
     "x.toml:4: [storage.volume] has no 'survives_release'"),
    (HEAD + TIER.replace('"/workspace"', '"workspace"'), "x.toml:5: 'storage.volume.path' must be absolute"),
    (HEAD + TIER.replace('"/workspace"', '"/scratch/x$USER"'),
     "x.toml:5: 'storage.volume.path' must be absolute"),
    (HEAD + TIER.replace("[storage.volume]", "[storage.Volume-1]"), "[storage.Volume-1]: a name is"),
    (HEAD + "storage = 3\n", "x.toml:3: 'storage' must be a table of [storage.<name>] tables"),
    # ssh
    (HEAD + SSH.replace("rsync_works = false", "rsync_works = false\nshell = \"bash\""),
     "x.toml:8: unknown key 'ssh.shell'"),
    (HEAD + SSH.replace("port_changes_on_restart = true", "port_changes_on_restart = 1"),
     "x.toml:6: 'ssh.port_changes_on_restart' must be a bool"),
    (HEAD + SSH.replace('notes = ["proxy only"]', 'notes = "proxy only"'),
     "x.toml:8: 'ssh.notes' must be a list of one-line strings"),
    (HEAD + SSH.replace('"2026-06"', '"2026-00"'), "x.toml:9: 'ssh.verified' must be \"YYYY-MM\""),
    (HEAD + "ssh = 1\n", "x.toml:3: 'ssh' must be a table"),
    # spot
    (HEAD + SPOT.replace("grace_s = 5", 'grace_s = "5 s"'),
     "x.toml:7: 'spot.grace_s' must be a number (int or float), 0 or more"),
    (HEAD + SPOT.replace("grace_s = 5", "grace_s = true"), "x.toml:7: 'spot.grace_s' must be a number"),
    (HEAD + SPOT.replace("grace_s = 5", "grace_s = -1"), "x.toml:7: 'spot.grace_s' must be a number"),
    (HEAD + SPOT.replace("available = true", "available = true\nbid = 1"),
     "x.toml:6: unknown key 'spot.bid'"),
    (HEAD + SPOT.replace('"2026-04"', '"April 2026"'), "x.toml:9: 'spot.verified' must be \"YYYY-MM\""),
    (HEAD + SPOT.replace('signal = "SIGTERM"\n', ""), "x.toml:5: [spot] available = true needs 'signal'"),
    # kind
    ('name = "x"\nkind = "vps"\n', "x.toml:2: kind = 'vps' is not one of ssh-rental, cloud-api, ssh"),
])
def test_bad_tables_are_refused_naming_file_key_and_line(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(profiles.ProfileError, match=re.escape(needle)):
        load(tmp_path, text)


def test_the_missing_stamp_names_the_tier_that_lacks_it(tmp_path: Path) -> None:
    second = TIER.replace("[storage.volume]", "[storage.scratch]").replace('verified = "2026-06"\n', "")
    needle = "x.toml:14: [storage.scratch] has no 'verified'"
    with pytest.raises(profiles.ProfileError, match=re.escape(needle)):
        load(tmp_path, HEAD + TIER + second)


def test_every_kind_the_schema_names_loads(tmp_path: Path) -> None:
    for kind in profiles.KINDS:
        assert load(tmp_path, f'name = "x"\nkind = "{kind}"\n').kind == kind


def tiers(tmp_path: Path) -> profiles.Profile:
    planted = [("root", 'path = "/"\n', "false"), ("volume", 'path = "/workspace"\n', "true"),
               ("shadow", 'path = "/workspace"\n', "true"), ("scratch", 'path = "/scratch/$USER"\n', "true"),
               ("home", 'path = "~/ckpt"\n', "true"), ("tmp", 'path = "$TMPDIR"\n', "false"),
               ("chosen", "", "true")]
    text = HEAD + "".join(
        f'\n[storage.{name}]\n{path}survives_stop = {stop}\nsurvives_release = false\nverified = "2026-06"\n'
        for name, path, stop in planted)
    return load(tmp_path, text)


@pytest.mark.parametrize("path, tier", [
    ("/workspace/run/ckpt.pt", "volume"),     # the longest covering path; on a tie the first listed
    ("/workspace", "volume"),
    ("/workspacex/a", "root"),                # a name that only starts the same is not inside
    ("/etc/hosts", "root"),
    ("/scratch/ann/runs", "scratch"),         # $USER from the box's environment
    ("/scratch/bob/runs", "root"),
    ("/home/ann/ckpt/a", "home"),
    ("/job/tmp/1/x", "tmp"),
])
def test_tier_of_finds_the_tier_that_holds_a_path(tmp_path: Path, path: str, tier: str) -> None:
    env = {"USER": "ann", "HOME": "/home/ann", "TMPDIR": "/job/tmp/1"}
    found = tiers(tmp_path).tier_of(path, env)
    assert found is not None and found.name == tier


def test_tier_of_skips_tiers_whose_place_is_unknown_here(tmp_path: Path) -> None:
    p = tiers(tmp_path)
    found = p.tier_of("/scratch/ann/x", {})       # no USER, no HOME, no TMPDIR: only "/" is known
    assert found is not None and found.name == "root"
    bare = profiles.Profile(name="x", kind="ssh", scripts=profiles.Scripts(), path=tmp_path)
    assert bare.tier_of("/a") is None
