"""controller.insight.catalog: the packaged symptom catalog is complete, and a broken one is refused
clearly."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import pytest

from controller.insight import catalog
from controller.insight.catalog import CatalogError, parse
from controller.insight.explain import entry_for_event
from protocol import kinds as protocol_kinds

ROOT = Path(__file__).resolve().parents[2]
CONTROLLER_KINDS = ("link.lost", "link.restored", "sidecar.silent")
DEADMAN_KINDS = ("deadman.armed", "deadman.renewed", "deadman.expiring", "deadman.firing", "deadman.fired",
                 "deadman.disarmed", "deadman.held")

# What the issue asks the catalog to cover, each with the entry that does.
REQUIRED_TOPICS: Dict[str, str] = {
    "NaN/Inf": "nan-loss",
    "fp16 overflow": "nan-fp16-overflow",
    "bf16 switch": "nan-precision-switch",
    "missing GradScaler": "nan-missing-gradscaler",
    "loss spike": "loss-spike",
    "fp16 scaler collapse": "fp16-scaler-collapse",
    "resume at epoch 0": "resume-from-zero",
    "resume: opt-in flag": "resume-behind-flag",
    "resume: torchrun restarts": "resume-torchrun-restarts",
    "resume: script edited under the run": "script-edited-under-run",
    "weights-only checkpoint": "weights-only-checkpoint",
    "OOM at step 2": "oom-step-two",
    "OOM at the first backward": "oom-first-backward",
    "OOM only in eval": "oom-eval-only",
    "cgroup OOM, bare Killed": "cgroup-oom-killed",
    "one rank crashed, rest hang": "nccl-one-rank-crashed",
    "30-minute NCCL freeze": "nccl-30min-timeout",
    "starved GPU": "starved-gpu-dataloader",
    "0 % GPU while steps advance": "zero-gpu-util-steps-advance",
    "thermal throttle": "thermal-throttle",
    "disk full": "disk-full",
    "inode exhaustion": "inode-exhaustion",
    "non-atomic checkpoint": "non-atomic-checkpoint",
    "tracker offline without a key": "tracker-offline-no-key",
    "log frozen by buffering": "log-frozen-buffering",
    "vanished process": "vanished-process",
    "vanished: reboot": "vanished-after-reboot",
    "vanished: SSH hang-up": "killed-by-sighup",
    "vanished: manual kill": "killed-sigkill",
    "all-zero metrics": "metric-zero",
}

BASE = '''
schema = 1
verified = "2026-11"

[[entry]]
id = "one"
title = "One"
kinds = ["job.exited"]
symptoms = ["it broke"]
signals = ["job.exited"]
cause = "Because."
fix = ["Fix it."]
'''


def xid_table() -> Dict[str, object]:
    doc: Dict[str, object] = json.loads((ROOT / "onbox" / "data" / "xids.json").read_text(encoding="utf-8"))
    return doc


# ---- the packaged catalog -------------------------------------------------------------------


def test_the_packaged_catalog_loads_once_with_at_least_60_entries() -> None:
    cat = catalog.default_catalog()
    assert len(cat.entries) >= 60
    assert catalog.load() is cat   # parsed once per process
    assert len({e.id for e in cat.entries}) == len(cat.entries)


def test_every_event_kind_maps_to_an_entry() -> None:
    cat = catalog.default_catalog()
    wanted = set(protocol_kinds.all_kinds()) | set(CONTROLLER_KINDS) | set(DEADMAN_KINDS)
    missing = sorted(k for k in wanted if not cat.for_kind(k))
    assert not missing, f"kinds without an entry: {missing}"
    for kind in wanted:
        assert cat.default_for(kind) is not None, kind
        assert entry_for_event(kind, {}) is not None, kind


@pytest.mark.parametrize("topic, entry_id", sorted(REQUIRED_TOPICS.items()))
def test_the_issue_topics_are_covered(topic: str, entry_id: str) -> None:
    entry = catalog.default_catalog().get(entry_id)
    assert entry is not None, f"{topic}: no entry {entry_id!r}"
    assert entry.cause and entry.fix and entry.symptoms and entry.signals


def test_vanished_process_names_its_four_causes() -> None:
    entry = catalog.default_catalog().get("vanished-process")
    assert entry is not None
    text = entry.cause.lower()
    for cause in ("reboot", "oom", "hang-up", "by hand"):
        assert cause in text
    causes = {"vanished-after-reboot", "cgroup-oom-killed", "killed-by-sighup", "killed-sigkill"}
    assert set(entry.see) >= causes


def test_every_xid_in_the_sidecar_table_is_covered_by_its_class_entry() -> None:
    table = xid_table()
    xids = table["xids"]
    assert isinstance(xids, dict)
    cat = catalog.default_catalog()
    listed = {code for e in cat.entries for code in e.xids}
    for code_text, spec in xids.items():
        code = int(code_text)
        assert code in listed, f"Xid {code} is in no entry's xids"
        data = {"code": code, "class": spec["class"], "fatal": spec["fatal"]}
        best = cat.get(str(entry_for_event("gpu.xid", data)))
        assert best is not None and code in best.xids, (code, best)


def test_each_xid_class_has_an_entry_picked_by_the_class_alone() -> None:
    classes = xid_table()["classes"]
    assert isinstance(classes, dict)
    cat = catalog.default_catalog()
    for name in classes:
        best = cat.get(str(entry_for_event("gpu.xid", {"code": 100000, "class": name, "fatal": False})))
        assert best is not None and best.when.get("gpu.xid", {}).get("class") == name, name


def test_entries_serialize_to_plain_json() -> None:
    for entry in catalog.default_catalog().entries:
        json.dumps(entry.to_dict())


# ---- validation -----------------------------------------------------------------------------


def test_a_minimal_catalog_parses() -> None:
    cat = parse(BASE)
    assert [e.id for e in cat.entries] == ["one"]
    assert cat.default_for("job.exited") is not None


@pytest.mark.parametrize("change, message", [
    ('\nsymptom = ["typo"]\n', "entry 'one': unknown key(s) 'symptom'"),
    ('\nxids = [79]\n', "entry 'one': 'xids' needs gpu.xid"),
    ('\nsee = ["nowhere"]\n', "entry 'one': 'see' names 'nowhere'"),
    ('\nwhen = { "gpu.xid" = { code = 79 } }\n', "'when' names 'gpu.xid', which is not in this entry"),
    ('\nwhen = { "job.exited" = { code = [] } }\n', "when.job.exited.code"),
])
def test_entry_mistakes_name_the_entry_and_key(change: str, message: str) -> None:
    with pytest.raises(CatalogError) as info:
        parse(BASE + change)
    assert message in str(info.value)


@pytest.mark.parametrize("old, new, message", [
    ('id = "one"', 'id = "One_1"', "'id' must be kebab-case"),
    ('kinds = ["job.exited"]', 'kinds = ["job.exploded"]', "kind 'job.exploded' is not a known event kind"),
    ('fix = ["Fix it."]', 'fix = []', "entry 'one': 'fix' must be a non-empty list"),
    ('cause = "Because."', 'cause = ""', "entry 'one': 'cause' must be a non-empty string"),
    ('title = "One"\n', '', "entry 'one': missing key(s) 'title'"),
    ('schema = 1', 'schema = 9', "schema: 9 is not supported"),
    ('verified = "2026-11"', 'verified = "recently"', "verified: must be a YYYY-MM month"),
    ('schema = 1', 'schema = 1\nextra = true', "unknown top-level key(s) 'extra'"),
    ('symptoms = ["it broke"]', 'symptoms = ["it broke", 3]', "'symptoms' holds 3"),
])
def test_catalog_mistakes_are_refused(old: str, new: str, message: str) -> None:
    assert old in BASE
    with pytest.raises(CatalogError) as info:
        parse(BASE.replace(old, new))
    assert message in str(info.value)


def test_duplicate_ids_and_missing_defaults_are_refused() -> None:
    second = BASE.split("\n[[entry]]", 1)[1]
    with pytest.raises(CatalogError, match="entry 'one': the id is used twice"):
        parse(BASE + "\n[[entry]]" + second)
    other = "\n[[entry]]" + second.replace('id = "one"', 'id = "two"')
    with pytest.raises(CatalogError, match="need a default: job.exited"):
        parse(BASE + other)
    fixed = BASE.replace('verified = "2026-11"', 'verified = "2026-11"\n[defaults]\n"job.exited" = "two"')
    assert parse(fixed + other).default_for("job.exited").id == "two"   # type: ignore[union-attr]
    wrong = BASE.replace('verified = "2026-11"', 'verified = "2026-11"\n[defaults]\n"gpu.xid" = "one"')
    with pytest.raises(CatalogError, match="does not list 'gpu.xid'"):
        parse(wrong)


def test_bad_toml_is_a_catalog_error() -> None:
    with pytest.raises(CatalogError, match="not valid TOML"):
        parse(BASE + "\n[[entry]\n")


# ---- knowledge files --------------------------------------------------------------------------------

KNOWLEDGE = '''
schema = 1
verified = "2026-12"

[[entry]]
id = "two"
title = "Two"
kinds = []
symptoms = ["a second problem"]
signals = ["a sign"]
cause = "A cause."
fix = ["Fix it."]
source = ["training/oom-memory M5"]
command = "rgt verify RUN --check-finite"
see = ["one"]
'''


def test_knowledge_files_join_the_catalog_with_their_own_stamp() -> None:
    cat = parse(BASE, more=[("knowledge/x.toml", KNOWLEDGE)])
    assert [e.id for e in cat.entries] == ["one", "two"]
    two = cat.by_id["two"]
    assert two.verified == "2026-12" and cat.by_id["one"].verified == "2026-11"
    assert two.source == ("training/oom-memory M5",) and two.command == "rgt verify RUN --check-finite"
    assert two.to_dict()["source"] == ["training/oom-memory M5"]


@pytest.mark.parametrize("change, message", [
    ('\n[defaults]\n"job.exited" = "two"\n', "knowledge/x.toml: unknown top-level key(s) 'defaults'"),
    ('\ncommand = "pkill -f train"\n', "'command' must be an rgt command line"),
    ('', "entry 'one': the id is used twice"),
    ('\nverified = "2026-13"\n', "knowledge/x.toml: verified"),
])
def test_knowledge_file_mistakes_name_the_file_or_entry(change: str, message: str) -> None:
    text = KNOWLEDGE.replace('command = "rgt verify RUN --check-finite"\n', "")
    if change.startswith("\n[defaults]"):
        text = text.replace("see = [\"one\"]\n", "") + change
    elif change.startswith("\ncommand"):
        text += change
    elif change.startswith("\nverified"):
        text = text.replace('verified = "2026-12"\n', change.lstrip("\n"))
    else:
        text = text.replace('id = "two"', 'id = "one"').replace('see = ["one"]\n', "")
    with pytest.raises(CatalogError) as info:
        parse(BASE, more=[("knowledge/x.toml", text)])
    assert message in str(info.value)


def test_the_packaged_knowledge_files_are_read() -> None:
    main, more = catalog._read_packaged()
    assert "[defaults]" in main
    assert [name for name, _ in more] == sorted(name for name, _ in more)
    assert all(name.startswith("knowledge/") and name.endswith(".toml") for name, _ in more)
