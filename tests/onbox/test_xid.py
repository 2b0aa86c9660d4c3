"""The Xid catalog, classification, the deduper and the `xids` report (onbox/xid.py,
onbox/cli/xids.py)."""

from __future__ import annotations

import copy
import importlib.resources
import io
import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from onbox.cli.xids import report, run_xids
from onbox.xid import (
    CLASSES,
    SEVERITIES,
    XidCatalog,
    XidCatalogError,
    XidDeduper,
    classify,
    load_catalog,
    normalize_pci,
    normalize_recovery_action,
)
from tests.helpers import Clock

DATA = Path(__file__).parent / "data"

# Xids that NVIDIA's catalog, DCGM's health mappings and the k8s device plugin act on: each is classified.
REFERENCE_CODES = {13, 31, 32, 38, 39, 42, 43, 45, 48, 54, 56, 57, 58, 60, 61, 62, 63, 64, 67, 68, 73, 74,
                   78, 79, 92, 93, 94, 95, 119, 120, 121, 137, 140, 154}


def _packaged_doc() -> Dict[str, Any]:
    text = importlib.resources.files("onbox.data").joinpath("xids.json").read_text(encoding="utf-8")
    doc: Dict[str, Any] = json.loads(text)
    return doc


# ---- the catalog as data ------------------------------------------------------------------------------


def test_catalog_is_versioned_data_with_sources() -> None:
    doc = _packaged_doc()
    assert doc["schema_version"] == 1
    assert len(doc["verified"]) >= 7 and doc["verified"][4] == "-"
    for code, entry in doc["xids"].items():
        assert entry["source"], code
        assert entry["description"] and entry["advice"], code
    cat = load_catalog()
    assert cat.schema_version == 1 and cat.verified == doc["verified"]
    assert set(cat.entries) == {int(c) for c in doc["xids"]}


def test_catalog_covers_the_reference_codes() -> None:
    missing = REFERENCE_CODES - set(load_catalog().entries)
    assert not missing


def test_every_entry_has_a_valid_class_severity_and_consistent_fatal_flag() -> None:
    for code, info in load_catalog().entries.items():
        assert info.xid_class in CLASSES and info.xid_class != "unknown", code
        assert info.severity in SEVERITIES, code
        if info.fatal:
            assert info.severity == "critical", code
            assert "re-rent" in info.advice, code
        if info.xid_class in ("gpu_reset", "node_reboot"):
            assert info.fatal, code


@pytest.mark.parametrize(
    "code,cls,fatal,severity",
    [
        (13, "application", False, "warn"),
        (31, "application", False, "warn"),
        (43, "application", False, "warn"),
        (45, "informational", False, "info"),
        (48, "memory", True, "critical"),
        (62, "gpu_reset", True, "critical"),
        (63, "memory", False, "warn"),
        (64, "memory", True, "critical"),
        (74, "nvlink", True, "critical"),
        (79, "node_reboot", True, "critical"),
        (92, "memory", False, "warn"),
        (94, "memory", False, "warn"),
        (95, "memory", True, "critical"),
        (119, "gpu_reset", True, "critical"),
        (120, "gpu_reset", True, "critical"),
        (140, "memory", True, "critical"),
    ],
)
def test_classification_of_key_codes(code: int, cls: str, fatal: bool, severity: str) -> None:
    info = classify(code)
    assert (info.xid_class, info.fatal, info.severity) == (cls, fatal, severity)
    assert info.known and info.advice_from == "catalog"


def test_rented_box_advice() -> None:
    for code in (48, 64, 74, 79, 95, 119, 120):
        assert "save" in classify(code).advice.lower() and "re-rent" in classify(code).advice, code
    for code in (13, 31, 43):
        assert "checkpoint" in classify(code).advice, code


@pytest.mark.parametrize("code", [0, 7, 999, 100000])
def test_unknown_codes(code: int) -> None:
    info = classify(code)
    assert info.xid_class == "unknown"
    assert info.severity == "warn"
    assert not info.fatal and not info.known
    assert info.advice


# ---- the driver's recovery action wins ----------------------------------------------------------------


def test_recovery_action_makes_an_application_error_fatal() -> None:
    info = classify(13, "gpu_reset")
    assert (info.xid_class, info.fatal, info.severity) == ("gpu_reset", True, "critical")
    assert info.recovery_action == "gpu_reset" and info.advice_from == "driver"
    assert classify(31, "reboot").xid_class == "node_reboot"
    assert classify(31, 2).xid_class == "node_reboot"


def test_recovery_action_none_clears_fatal() -> None:
    info = classify(79, "none")
    assert not info.fatal
    assert info.severity == "warn"
    assert info.xid_class == "node_reboot"  # what happened stays; what to do is the driver's
    assert "no recovery action" in info.advice
    assert classify(45, "none").severity == "info"


def test_recovery_action_drain_p2p() -> None:
    info = classify(74, "drain_p2p")
    assert (info.xid_class, info.fatal, info.severity) == ("nvlink", False, "critical")


def test_unknown_recovery_action_leaves_the_table_in_charge() -> None:
    assert classify(13, "frobnicate") == classify(13)
    assert classify(79, None) == classify(79)
    assert classify(79, 42) == classify(79)


@pytest.mark.parametrize(
    "value,expected",
    [
        ("reset", "gpu_reset"), ("GPU Reset Required", "gpu_reset"), ("PF FLR", "gpu_reset"),
        ("reboot", "node_reboot"), ("Node Reboot Required", "node_reboot"), ("OS Reboot", "node_reboot"),
        ("drain_p2p", "drain_p2p"), ("Drain P2P", "drain_p2p"), ("Drain and Reset", "drain_and_reset"),
        ("NVML_GPU_RECOVERY_ACTION_NODE_REBOOT", "node_reboot"), ("None", "none"), (0, "none"),
        (1, "gpu_reset"), (7, "system_reboot"), (8, None), ("", None), (None, None), (True, None),
    ],
)
def test_normalize_recovery_action(value: Any, expected: Any) -> None:
    assert normalize_recovery_action(value) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("0000:3B:00", "0000:3b:00"), ("PCI:0000:cb:00", "0000:cb:00"), ("00000000:3B:00.0", "0000:3b:00"),
        ("3b:00.0", "0000:3b:00"), ("0008:01:00.1", "0008:01:00"), ("zz:00", None), ("", None),
        (None, None), ("100000000:3b:00", None), ("0000:3b", None),
    ],
)
def test_normalize_pci(text: Any, expected: Any) -> None:
    assert normalize_pci(text) == expected


# ---- catalog validation -------------------------------------------------------------------------------


def _mutated(change: Any) -> str:
    doc = copy.deepcopy(_packaged_doc())
    change(doc)
    return json.dumps(doc)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda d: d["xids"]["79"].update({"class": "explode"}), "class"),
        (lambda d: d["xids"]["79"].update({"severity": "loud"}), "severity"),
        (lambda d: d["xids"]["79"].pop("fatal"), "fatal"),
        (lambda d: d["xids"]["79"].update({"advice": ""}), "advice"),
        (lambda d: d["xids"].update({"7x": d["xids"]["79"]}), "decimal"),
        (lambda d: d.update({"schema_version": 99}), "schema_version"),
        (lambda d: d.update({"verified": "soon"}), "verified"),
        (lambda d: d["classes"].pop("nvlink"), "classes"),
        (lambda d: d["recovery_actions"].pop("node_reboot"), "missing"),
        (lambda d: d["recovery_actions"].update({"explode": d["recovery_actions"]["none"]}), "explode"),
        (lambda d: d.update({"xids": {}}), "xids"),
    ],
)
def test_catalog_validation_rejects_bad_data(change: Any, message: str) -> None:
    with pytest.raises(XidCatalogError, match=message):
        XidCatalog.from_json(_mutated(change))


def test_catalog_validation_rejects_non_json() -> None:
    with pytest.raises(XidCatalogError, match="JSON"):
        load_catalog("{not json")


def test_a_custom_catalog_changes_classification() -> None:
    def demote_79(d: Dict[str, Any]) -> None:
        d["xids"]["79"].update({"class": "application", "fatal": False})

    cat = load_catalog(_mutated(demote_79))
    assert not cat.classify(79).fatal
    assert classify(79).fatal  # the packaged catalog is untouched


# ---- deduper ------------------------------------------------------------------------------------------


def test_deduper_window_with_an_injected_clock() -> None:
    clock = Clock()
    d = XidDeduper(window_s=10.0, clock=clock)
    assert d.admit("0000:3b:00", 79)
    clock.t += 0.01
    assert not d.admit("00000000:3B:00.0", 79)  # NVML's spelling of the same GPU
    assert d.admit("0000:3b:00", 48)  # another code
    assert d.admit("0000:cb:00", 79)  # another GPU
    clock.t += 5
    assert not d.admit("0000:3b:00", 79)
    assert d.suppressed("0000:3b:00", 79) == 2
    clock.t += 5  # 10.01 s after the first one passed
    assert d.admit("0000:3b:00", 79)
    assert d.suppressed("0000:3b:00", 79) == 0


def test_deduper_lets_a_storm_through_once_per_window() -> None:
    clock = Clock()
    d = XidDeduper(window_s=3.0, clock=clock)
    passed = 0
    for _ in range(100):  # one report every 0.5 s for 50 s
        passed += d.admit("0000:3b:00", 13)
        clock.t += 0.5
    assert passed == 17  # t = 0, 3, 6, ..., 48


def test_deduper_rejects_a_bad_window() -> None:
    with pytest.raises(ValueError):
        XidDeduper(window_s=0)


# ---- the `xids` report --------------------------------------------------------------------------------


def test_report_fatal_log_exits_2() -> None:
    records, code = report((DATA / "dmesg_plain.log").read_text())
    assert code == 2
    assert [r.code for r in records] == [13, 13, 43, 79, 154]
    by_code = {r.code: r for r in records}
    assert by_code[79].fatal and by_code[79].xid_class == "node_reboot"
    assert by_code[154].recovery_action == "node_reboot" and by_code[154].fatal
    assert not by_code[13].fatal


def test_report_application_errors_only_exit_0() -> None:
    records, code = report((DATA / "app_only.log").read_text())
    assert code == 0
    assert {r.xid_class for r in records} == {"application"}
    assert len(records) == 3


def test_report_empty_and_gpu_lost_only() -> None:
    assert report("") == ([], 0)
    assert report("[ 1.0] usb 1-1: new device\n") == ([], 0)
    records, code = report("[ 9.0] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.\n")
    assert records == [] and code == 2


def test_report_154_reset_makes_the_box_fatal() -> None:
    text = ("NVRM: Xid (PCI:0000:9a:00): 154, GPU recovery action changed from 0x0 (None) "
            "to 0x1 (GPU Reset Required)")
    records, code = report(text)
    assert code == 2 and records[0].xid_class == "gpu_reset"
    none = text.replace("0x1 (GPU Reset Required)", "0x0 (None)")
    assert report(none)[1] == 0


def test_run_xids_json_shape() -> None:
    out = io.StringIO()
    code = run_xids(str(DATA / "journal.log"), True, io.StringIO(), out, io.StringIO())
    doc = json.loads(out.getvalue())
    assert set(doc) == {"xids", "summary"}
    assert code == 2
    xids: List[Dict[str, Any]] = doc["xids"]
    assert [x["code"] for x in xids] == [119, 154, 74, 120]
    for x in xids:
        assert {"code", "pci", "pid", "name", "class", "severity", "fatal", "advice"} <= set(x)
    assert xids[0]["pid"] == 2212 and xids[0]["name"] == "python" and xids[0]["class"] == "gpu_reset"
    summary = doc["summary"]
    assert summary["count"] == 4 and summary["fatal"] == 4 and summary["exit_code"] == 2
    assert summary["worst_severity"] == "critical"
    assert summary["by_class"]["gpu_reset"] == 3 and summary["by_class"]["nvlink"] == 1
    assert summary["catalog"]["schema_version"] == 1
    assert "re-rent" in summary["verdict"]


def test_run_xids_table_from_stdin() -> None:
    out = io.StringIO()
    code = run_xids("-", False, io.StringIO((DATA / "app_only.log").read_text()), out, io.StringIO())
    text = out.getvalue()
    assert code == 0
    assert text.splitlines()[0].split() == ["XID", "PCI", "PID", "NAME", "CLASS", "SEVERITY", "FATAL", "TIME"]
    assert "0000:18:00" in text and "application" in text
    assert "verdict: no fatal Xid" in text


def test_run_xids_json_with_no_xids() -> None:
    out = io.StringIO()
    assert run_xids("-", True, io.StringIO("nothing here\n"), out, io.StringIO()) == 0
    doc = json.loads(out.getvalue())
    assert doc["xids"] == [] and doc["summary"]["count"] == 0 and doc["summary"]["worst_severity"] is None


def test_run_xids_unreadable_file(tmp_path: Path) -> None:
    err = io.StringIO()
    out = io.StringIO()
    assert run_xids(str(tmp_path / "missing.log"), False, io.StringIO(), out, err) == 1
    assert err.getvalue().startswith("error: cannot read")
    assert out.getvalue() == ""
