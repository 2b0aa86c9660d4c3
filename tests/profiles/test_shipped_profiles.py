"""The packaged profiles: every platform rgt covers is there, and the facts rgt acts on are right."""
from __future__ import annotations

import shlex

import pytest

import profiles

PLATFORMS = {"autodl", "runpod", "vastai", "lambda", "paperspace", "gpushare", "matpool", "featurize",
             "lanrui", "generic-ssh", "slurm", "kubernetes", "colab-kaggle", "local"}
CHINA = ("autodl", "gpushare", "matpool", "featurize", "lanrui")


def test_every_platform_is_shipped_and_fully_described() -> None:
    assert PLATFORMS <= set(profiles.names())
    for name in PLATFORMS:
        p = profiles.load(name)
        assert p.kind in profiles.KINDS and p.surface.meter_stop, name
        assert p.storage, f"{name}: no storage tiers"
        assert p.deadman.verified and p.deadman.why, f"{name}: no [deadman] table"
        if p.kind != "local":
            assert p.meter_stop_action and p.actions[p.meter_stop_action].stops_meter, name


def test_the_deadman_defaults_of_issue_7() -> None:
    want = {"autodl": "shutdown", "runpod": "stop", "vastai": "stop"}
    for name in PLATFORMS:
        p = profiles.load(name)
        assert p.deadman.action == want.get(name, profiles.NOTIFY), name
        if p.deadman.action != profiles.NOTIFY:
            chosen = p.actions[p.deadman.action]
            assert chosen.reversible and chosen.box_command and chosen.stops_meter, name


def test_runpod_stop_keeps_the_volume_billing_at_2x_and_wipes_the_container_disk() -> None:
    p = profiles.load("runpod")
    assert p.meter_stop_action == "terminate" and p.deadman.instance_id_env == "RUNPOD_POD_ID"
    assert p.actions["stop"].box_command == "runpodctl stop pod {instance_id}"
    container, volume, network = p.storage["container"], p.storage["volume"], p.storage["network_volume"]
    assert (container.path, container.survives_stop, container.survives_release) == ("/", False, False)
    assert (volume.path, volume.survives_stop, volume.survives_release) == ("/workspace", True, False)
    assert network.survives_stop and network.survives_release
    assert "2x" in p.deadman.why and "volume" in p.deadman.why
    # The dead-man's guard: a run under /workspace keeps files through a stop, one under / does not.
    assert p.tier_of("/workspace/proj/active/r1", {}) is volume
    assert p.tier_of("/root/proj/active/r1", {}) is container
    assert p.spot.available and p.spot.grace_s == 5 and p.spot.verified == "2026-04"


def test_vastai_stop_bills_the_disk_and_destroy_deletes_it() -> None:
    p = profiles.load("vastai")
    assert p.meter_stop_action == "destroy" and p.deadman.instance_id_env == "CONTAINER_ID"
    assert p.actions["stop"].box_command == "vastai stop instance {instance_id}"
    assert p.storage["container"].survives_stop and not p.storage["container"].survives_release
    assert "disk" in p.deadman.why and "bandwidth" in p.deadman.why
    assert p.spot.grace_s == 0 and p.spot.available


def test_lambda_only_notifies_and_terminate_needs_a_person() -> None:
    p = profiles.load("lambda")
    assert p.deadman.action == profiles.NOTIFY and p.deadman.allow == ("terminate",)
    terminate = p.actions["terminate"]
    assert terminate.box_command == "python3 -m onbox.deadman.provider lambda-terminate {instance_id}"
    assert terminate.credentials_env == ("LAMBDA_API_KEY",) and not terminate.reversible
    assert "shutdown" in p.deadman.why and "terminate" in p.deadman.why
    assert p.ssh.user == "ubuntu" and not p.storage["local"].survives_release
    assert p.storage["nfs"].survives_release


def test_generic_ssh_may_be_allowed_an_irreversible_poweroff() -> None:
    p = profiles.load("generic-ssh")
    poweroff = p.actions["poweroff"]
    assert poweroff.box_command == "shutdown -h now" and not poweroff.reversible
    assert p.deadman.action == profiles.NOTIFY and p.deadman.allow == ("poweroff",)


def test_autodl_tiers_match_its_teardown_facts() -> None:
    p = profiles.load("autodl")
    assert [(t.path, t.survives_stop, t.survives_release) for t in p.storage.values()] == [
        ("/", True, False), ("/root/autodl-tmp", True, False), ("/root/autodl-fs", True, True)]
    assert p.scripts.durable_dir == "/root/autodl-fs"


@pytest.mark.parametrize("name", CHINA)
def test_the_china_family_downloads_through_mirrors(name: str) -> None:
    env = profiles.load(name).scripts.env
    assert env["HF_ENDPOINT"] == "https://hf-mirror.com" and env["HF_HUB_ENABLE_HF_TRANSFER"] == "0"


def test_commands_exist_only_where_a_real_cli_does() -> None:
    programs = set()
    for name in profiles.names():
        for a in profiles.load(name).actions.values():
            programs |= {shlex.split(c)[0] for c in (a.command, a.box_command) if c}
    assert programs == {"runpodctl", "vastai", "kubectl", "scancel", "shutdown", "python3"}


def test_durable_dirs_are_tiers_that_survive_a_release() -> None:
    for name in profiles.names():
        p = profiles.load(name)
        if p.scripts.durable_dir:
            tier = p.tier_of(p.scripts.durable_dir, {})
            assert tier is not None and tier.survives_release, name


def test_sources_say_so_where_no_provider_page_backs_a_fact() -> None:
    for name in profiles.names():
        p = profiles.load(name)
        for what in (p.ssh, p.spot):
            if what.verified is None and what != type(what)():
                assert "no date" in what.source or "reasoning" in what.source, name
        stamped = [(a.verified, a.source) for a in p.actions.values()]
        stamped += [(t.verified, t.source) for t in p.storage.values()]
        stamped.append((p.deadman.verified, p.deadman.source))
        for verified, source in stamped:
            if verified == "2026-11":  # written the month these profiles were, not read off a provider page
                assert "reasoning" in source, name
