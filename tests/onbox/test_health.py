"""`run_health`: the pre-flight report over scripted GPUs, fake kernel logs, statvfs and cgroups."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import pytest

from onbox.errors import ConfigError
from onbox.monitors.preflight import run_health
from onbox.sources import fake_gpu
from onbox.sources.host import CgroupReader
from tests.helpers import REPO


def health(tmp_path: Path, gpu: str = "none", gpu_index: Optional[int] = None, *, kmsg: str = "",
           used_pct: int = 50, inodes_pct: int = 10, host_mem: Tuple[int, int] = (1000, 800),
           **options: Any) -> Tuple[int, Dict[str, Any], str]:
    """Run the check twice (JSON and table) over the same fakes; (exit code, report, table)."""
    kmsg_path = tmp_path / "kmsg"
    kmsg_path.write_text(kmsg)
    stat = SimpleNamespace(f_frsize=1024, f_bsize=1024, f_blocks=100, f_bfree=100 - used_pct,
                           f_bavail=100 - used_pct, f_files=100, f_ffree=100 - inodes_pct,
                           f_favail=100 - inodes_pct)
    common: Dict[str, Any] = {
        "gpu": gpu, "kmsg_path": str(kmsg_path), "stat": lambda p: stat,
        "cgroups": CgroupReader(root=tmp_path / "no-cg", proc=tmp_path / "no-proc"),
        "host_memory": lambda: host_mem, **options,
    }
    out = io.StringIO()
    code = run_health(gpu_index, 5, True, tmp_path, out, **common)
    table = io.StringIO()
    assert run_health(gpu_index, 5, False, tmp_path, table, **common) == code
    assert table.getvalue().endswith(f"RESULT: {json.loads(out.getvalue())['result']}\n")
    return code, json.loads(out.getvalue()), table.getvalue()


def statuses(report: Dict[str, Any], name: str) -> Dict[Optional[int], str]:
    return {c["gpu"]: c["status"] for c in report["checks"] if c["check"] == name}


def test_no_gpu_is_unavailable_not_a_failure_and_disk_and_memory_still_run(tmp_path: Path) -> None:
    code, report, table = health(tmp_path, gpu="none")
    assert code == 0 and report["result"] == "PASS" and not report["gpu"]["available"]
    assert [(c["check"], c["status"]) for c in report["checks"]] == [
        ("gpu", "SKIP"), ("disk", "PASS"), ("memory", "PASS")]
    assert "unavailable" in table and "disk" in table and "memory" in table


def test_healthy_box_passes_but_warns_about_vram_already_held(tmp_path: Path) -> None:
    code, report, table = health(tmp_path, gpu="fake:healthy_h100x8")
    assert code == 0 and report["result"] == "WARN"
    assert set(statuses(report, "throttle").values()) == {"PASS"}
    assert set(statuses(report, "foreign_vram").values()) == {"WARN"}
    assert statuses(report, "xid") == {None: "PASS"}
    assert "throttle         0-7" in table  # alike GPUs share a row
    assert report["gpu"]["names"] == ["NVIDIA H100 80GB HBM3"] * 8  # the model, for `rgt compare`


@pytest.mark.parametrize("scenario,check,gpu", [
    ("xid79_on_gpu3", "gpu_lost", 3),
    ("xid79_on_gpu3", "xid", None),
    ("thermal_throttle_flapping", "throttle", fake_gpu.THROTTLE_GPU),
    ("gpu_lost_mid_run", "gpu_lost", 0),
])
def test_fake_scenarios_fail_where_the_box_is_bad(tmp_path: Path, scenario: str, check: str,
                                                  gpu: Optional[int]) -> None:
    code, report, _ = health(tmp_path, gpu=f"fake:{scenario}")
    assert code == 2 and report["result"] == "FAIL"
    failing = [(c["check"], c["gpu"]) for c in report["checks"] if c["status"] == "FAIL"]
    assert (check, gpu) in failing
    if scenario == "thermal_throttle_flapping":
        assert failing == [("throttle", gpu)]
        assert statuses(report, "temperature")[gpu] == "WARN"


def test_not_supported_fields_are_skipped_not_failed(tmp_path: Path) -> None:
    code, report, _ = health(tmp_path, gpu="fake:not_supported_everywhere")
    assert code == 0 and report["result"] == "PASS"
    for name in ("throttle", "temperature", "ecc", "row_remap", "recovery_action"):
        assert set(statuses(report, name).values()) == {"SKIP"}


def test_a_hung_probe_call_is_a_warning_and_health_still_ends(tmp_path: Path) -> None:
    code, report, _ = health(tmp_path, gpu="fake:nvml_hang", round_timeout_s=0.5)
    assert code == 0 and report["result"] == "WARN"
    assert statuses(report, "nvml") == {fake_gpu.HANG_GPU: "WARN"}


def test_one_gpu_only_and_a_missing_index(tmp_path: Path) -> None:
    code, report, _ = health(tmp_path, gpu="fake:thermal_throttle_flapping", gpu_index=5)
    assert code == 2 and statuses(report, "throttle") == {5: "FAIL"}
    code, report, _ = health(tmp_path, gpu="fake:thermal_throttle_flapping", gpu_index=2)
    assert code == 0 and statuses(report, "throttle") == {2: "PASS"}
    code, report, _ = health(tmp_path, gpu="fake:healthy_h100x8", gpu_index=9)
    assert code == 2 and statuses(report, "gpu") == {9: "FAIL"}


KMSG_48 = "3,10,5000000,-;NVRM: Xid (PCI:0000:ca:00): 48, pid=77, name=python, DBE (0x1)\n"
KMSG_13 = "3,11,5000001,-;NVRM: Xid (PCI:0000:18:00): 13, pid=78, name=python, Graphics Exception\n"
KMSG_FAKE = "12,12,5000002,-;NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, written by user space\n"


def test_xid_history_from_the_kernel_backlog(tmp_path: Path) -> None:
    code, report, _ = health(tmp_path, gpu="fake:healthy_h100x8", kmsg=KMSG_13 + KMSG_FAKE)
    assert code == 0 and statuses(report, "xid") == {None: "WARN"}
    xid = [c for c in report["checks"] if c["check"] == "xid"][0]
    assert [(x["code"], x["gpu"]) for x in xid["xids"]] == [(13, 0)]
    code, report, _ = health(tmp_path, gpu="fake:healthy_h100x8", kmsg=KMSG_48)  # lettered bus id
    assert code == 2 and statuses(report, "xid") == {None: "FAIL"}
    code, report, _ = health(tmp_path, gpu="fake:healthy_h100x8", gpu_index=1, kmsg=KMSG_13)
    assert statuses(report, "xid") == {1: "PASS"}  # GPU 0's Xid is not GPU 1's history


def test_unreadable_kernel_log_is_a_warning(tmp_path: Path) -> None:
    code, report, _ = health(tmp_path, gpu="fake:not_supported_everywhere",
                             kmsg_path=str(tmp_path / "missing"))
    assert code == 0 and statuses(report, "xid") == {None: "WARN"}


@pytest.mark.parametrize("used,inodes,expect", [(91, 10, "WARN"), (98, 10, "FAIL"), (20, 99, "FAIL")])
def test_disk_bytes_and_inodes(tmp_path: Path, used: int, inodes: int, expect: str) -> None:
    code, report, _ = health(tmp_path, used_pct=used, inodes_pct=inodes)
    assert statuses(report, "disk") == {None: expect}
    assert code == (2 if expect == "FAIL" else 0)


def test_memory_headroom_from_the_cgroup_limit(tmp_path: Path) -> None:
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/\n")
    cg.mkdir()
    (cg / "memory.current").write_text("95\n")
    (cg / "memory.max").write_text("100\n")
    out = io.StringIO()
    stat = SimpleNamespace(f_frsize=1, f_bsize=1, f_blocks=10, f_bfree=5, f_bavail=5, f_files=0,
                           f_ffree=0, f_favail=0)
    code = run_health(None, 1, True, tmp_path, out, gpu="none", stat=lambda p: stat,
                      cgroups=CgroupReader(root=cg, proc=proc), host_memory=lambda: (10, 9))
    memory = [c for c in json.loads(out.getvalue())["checks"] if c["check"] == "memory"][0]
    assert code == 0 and memory["status"] == "WARN" and memory["scope"] == "cgroup"
    code, report, _ = health(tmp_path, host_mem=(1000, 10))
    assert code == 2 and statuses(report, "memory") == {None: "FAIL"}


def test_bad_gpu_option_raises_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        run_health(None, 1, False, tmp_path, io.StringIO(), gpu="fake:nope")


def test_as_a_subprocess_on_this_gpu_less_machine(tmp_path: Path) -> None:
    code = ("import sys; from pathlib import Path; from onbox.monitors.preflight import run_health; "
            f"sys.exit(run_health(None, 1, True, Path({str(tmp_path)!r}), sys.stdout, "
            "kmsg_path='/nonexistent'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert not report["gpu"]["available"] and report["result"] in ("PASS", "WARN")
    checks: List[str] = [c["check"] for c in report["checks"]]
    assert checks[0] == "gpu" and "disk" in checks and "memory" in checks
