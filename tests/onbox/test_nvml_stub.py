"""NvmlProbe with the real pynvml against a C stub of libnvidia-ml.so.1 (tests/onbox/nvml_stub).

pynvml keeps the loaded library in a module global, so every scenario runs the probe in its own
subprocess with LD_LIBRARY_PATH pointing at the stub; the child prints one JSON object.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

from onbox.sources.gpu import decode_reasons

REPO = Path(__file__).resolve().parents[2]
STUB_SOURCE = Path(__file__).resolve().parent / "nvml_stub" / "stub_nvml.c"
GIB = 1024**3

# The child: run one NvmlProbe session and report everything as JSON on stdout.
_CHILD = r"""
import ctypes, dataclasses, json, logging, sys, threading
from onbox.sources.nvml import NvmlProbe

opts = json.loads(sys.argv[1])
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
log = logging.getLogger("onbox.sources.nvml")
log.setLevel(logging.DEBUG)
log.addHandler(Keep())

probe = NvmlProbe(call_timeout_s=opts.get("call_timeout_s", 5.0), xid_wait_slice_s=0.05)
out = {"capability": dataclasses.asdict(probe.init())}
out["devices"] = [dataclasses.asdict(d) for d in probe.devices()]
rounds = []
for _ in range(opts.get("rounds", 1)):
    rounds.append([dataclasses.asdict(probe.sample(d.index)) for d in probe.devices()])
out["rounds"] = rounds
if opts.get("hang"):
    out["degraded_after_hang"] = probe.degraded_reason
    out["fail_fast"] = dataclasses.asdict(probe.sample(1))
    out["recovered"] = probe.wait_recovered(10.0)
    out["after_recovery"] = [dataclasses.asdict(probe.sample(d.index)) for d in probe.devices()]
    out["timeout_count"] = probe.timeout_count
xids = []
for timeout_s in opts.get("xid_waits", []):
    event = probe.wait_xid(timeout_s)
    xids.append(None if event is None else dataclasses.asdict(event))
out["xids"] = xids
out["missing"] = list(probe.missing_functions)
out["resolved"] = probe.resolved_functions
probe.close()
probe.close()
out["threads_after_close"] = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
try:
    stub = ctypes.CDLL("libnvidia-ml.so.1")
    out["stub_init_count"] = stub.fakeNvmlInitCount()
    out["stub_event_sets_live"] = stub.fakeNvmlEventSetsLive()
except OSError:
    out["stub_init_count"] = None
out["logs"] = records
print(json.dumps(out))
"""


def _build(out_dir: Path, *defines: str) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found: cannot build the NVML stub library")
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", *defines,
           "-Wl,-soname,libnvidia-ml.so.1", "-o", str(out_dir / "libnvidia-ml.so.1"), str(STUB_SOURCE)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    return out_dir


@pytest.fixture(scope="module")
def nvml_stub_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding a freshly built stub libnvidia-ml.so.1 (a current driver)."""
    return _build(tmp_path_factory.mktemp("nvml_stub"))


@pytest.fixture(scope="module")
def nvml_stub_legacy_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stub as an old driver: ClocksThrottleReasons and ComputeRunningProcesses_v2 only."""
    return _build(tmp_path_factory.mktemp("nvml_stub_legacy"), "-DSTUB_LEGACY")


def _run_probe(lib_dir: Path, env: Optional[Dict[str, str]] = None, **opts: Any) -> Dict[str, Any]:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NVML_")}
    child_env.update(env or {})
    child_env["LD_LIBRARY_PATH"] = str(lib_dir)
    child_env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(opts)], env=child_env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out: Dict[str, Any] = json.loads(proc.stdout)
    assert out["threads_after_close"] == [], "the NVML worker thread outlived close()"
    return out


def test_queries_return_the_stub_values(nvml_stub_lib: Path) -> None:
    out = _run_probe(nvml_stub_lib, {"FAKE_NVML_TEMP": "83", "FAKE_NVML_REASONS": "0x248",
                                     "FAKE_NVML_ECC_UNC": "2"}, rounds=2)
    cap = out["capability"]
    assert cap["available"] and cap["device_count"] == 2
    assert (cap["driver_version"], cap["nvml_version"]) == ("550.163.01", "12.550.163.01")
    dev = out["devices"][1]
    assert dev["name"] == "NVIDIA H100 80GB HBM3" and dev["uuid"].startswith("GPU-")
    assert dev["pci_bus_id"] == "00000000:2A:00.0"
    assert (dev["memory_total_bytes"], dev["sm_clock_max_mhz"], dev["power_limit_mw"]) == (
        81559 * 1024**2, 1980, 700000)
    for samples in out["rounds"]:
        for s in samples:
            i = s["index"]
            assert not s["lost"] and s["error"] is None
            assert s["temperature_c"] == 83 and s["utilization_gpu_pct"] == 90 + i
            assert s["memory_used_bytes"] == (40 + i) * GIB and s["memory_total_bytes"] == 81559 * 1024**2
            assert (s["power_mw"], s["power_limit_mw"]) == (350000 + 1000 * i, 700000)
            assert (s["sm_clock_mhz"], s["sm_clock_max_mhz"]) == (1755, 1980)
            reasons = decode_reasons(s["clock_event_reasons"])
            assert reasons == ["HwSlowdown", "HwThermalSlowdown", "BoardLimit"]
            assert (s["violation_power_ns"], s["violation_thermal_ns"]) == (5_000_000, 250_000_000)
            assert (s["ecc_volatile_corrected"], s["ecc_volatile_uncorrected"]) == (3, 2)
            assert (s["ecc_aggregate_corrected"], s["ecc_aggregate_uncorrected"]) == (17, 0)
            assert s["retired_pages_pending"] is None  # NotSupported, as on H100
            assert (s["remapped_rows_pending"], s["remapped_rows_failure"]) == (True, False)
            assert s["processes"] == [{"pid": 4242 + i, "used_memory_bytes": 40 * GIB, "name": None}]
    assert out["resolved"] == {
        "memory": "nvmlDeviceGetMemoryInfo",  # the stub has no _v2: probed, fell back
        "clock_reasons": "nvmlDeviceGetCurrentClocksEventReasons",
        "processes": "nvmlDeviceGetComputeRunningProcesses_v3",
    }
    assert out["stub_init_count"] == 0, "close() did not call nvmlShutdown"
    assert out["stub_event_sets_live"] == 0, "close() did not free the event set"


def test_not_supported_fields_become_none(nvml_stub_lib: Path) -> None:
    off = "temperature,power,reasons,ecc,procs,violation"
    out = _run_probe(nvml_stub_lib, {"FAKE_NVML_NOT_SUPPORTED": off})
    for s in out["rounds"][0]:
        for field in ("temperature_c", "power_mw", "clock_event_reasons", "violation_power_ns",
                      "ecc_volatile_corrected", "ecc_aggregate_uncorrected"):
            assert s[field] is None, field
        assert s["processes"] == [] and not s["lost"] and s["error"] is None
        assert s["utilization_gpu_pct"] is not None and s["sm_clock_mhz"] == 1755  # the rest still reads
    assert not [m for m in out["logs"] if "failed" in m], "NotSupported is data, not a failure"


def test_a_lost_gpu_degrades_only_its_own_record(nvml_stub_lib: Path) -> None:
    out = _run_probe(nvml_stub_lib, {"FAKE_NVML_COUNT": "3", "FAKE_NVML_LOST_INDEX": "1"}, rounds=2)
    assert out["capability"]["available"] and out["capability"]["device_count"] == 3
    assert out["devices"][1]["name"] is None and out["devices"][2]["name"] == "NVIDIA H100 80GB HBM3"
    for samples in out["rounds"]:
        assert [s["lost"] for s in samples] == [False, True, False]
        assert "lost" in samples[1]["error"] and samples[1]["temperature_c"] is None
        assert samples[0]["temperature_c"] == samples[2]["temperature_c"] == 45


def test_driver_not_loaded_means_unavailable_not_an_exception(nvml_stub_lib: Path) -> None:
    out = _run_probe(nvml_stub_lib, {"FAKE_NVML_NO_DRIVER": "1"}, xid_waits=[0.05])
    cap = out["capability"]
    assert not cap["available"] and "driver is not loaded" in cap["reason"]
    assert out["devices"] == [] and out["xids"] == [None]
    assert out["stub_init_count"] == 0


def test_missing_function_is_none_and_logged_once(nvml_stub_lib: Path) -> None:
    out = _run_probe(nvml_stub_lib, rounds=3)
    assert all(s["recovery_action"] is None for samples in out["rounds"] for s in samples)
    assert "nvmlDeviceGetFieldValues" in out["missing"]
    logged = [m for m in out["logs"] if "nvmlDeviceGetFieldValues" in m]
    assert len(logged) == 1, logged  # 3 rounds x 2 GPUs, one line


def test_old_driver_falls_back_to_older_symbols_once(nvml_stub_legacy_lib: Path) -> None:
    out = _run_probe(nvml_stub_legacy_lib, {"FAKE_NVML_REASONS": "0x4"}, rounds=3)
    assert out["resolved"]["clock_reasons"] == "nvmlDeviceGetCurrentClocksThrottleReasons"
    assert out["resolved"]["processes"] == "nvmlDeviceGetComputeRunningProcesses_v2"
    assert {"nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetComputeRunningProcesses_v3"} <= set(
        out["missing"])
    for samples in out["rounds"]:
        assert [s["clock_event_reasons"] for s in samples] == [0x4, 0x4]
        assert [p["pid"] for s in samples for p in s["processes"]] == [4242, 4243]
    fallbacks = [m for m in out["logs"] if "using nvmlDeviceGetCurrentClocksThrottleReasons" in m]
    assert len(fallbacks) == 1, "the versioned symbol must be probed once, then cached"


def test_one_xid_is_delivered_through_wait_xid(nvml_stub_lib: Path) -> None:
    out = _run_probe(nvml_stub_lib, {"FAKE_NVML_XID": "1:79"}, xid_waits=[10.0, 0.2])
    first, second = out["xids"]
    assert first is not None
    assert (first["index"], first["pci_bus_id"], first["xid"], first["source"]) == (
        1, "00000000:2A:00.0", 79, "nvml")
    assert second is None  # the stub delivers one event, like NVML's one-shot Xid
    assert out["stub_event_sets_live"] == 0


def test_hung_nvml_call_times_out_and_the_probe_recovers(nvml_stub_lib: Path) -> None:
    out = _run_probe(nvml_stub_lib, {"FAKE_NVML_HANG_MS": "2000"}, call_timeout_s=1.0, hang=True)
    hung = out["rounds"][0][0]
    assert not hung["lost"] and "nvmlDeviceGetTemperature did not return" in hung["error"]
    assert "nvmlDeviceGetTemperature" in out["degraded_after_hang"]
    assert "degraded" in out["fail_fast"]["error"]
    assert out["recovered"] and out["timeout_count"] == 1
    assert [s["temperature_c"] for s in out["after_recovery"]] == [45, 45]
    assert out["stub_init_count"] == 0


def test_no_library_means_unavailable_with_a_reason(tmp_path: Path) -> None:
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("a real libnvidia-ml is installed here; LD_LIBRARY_PATH cannot hide it")
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _run_probe(empty, xid_waits=[0.05])
    cap = out["capability"]
    assert not cap["available"] and "not found" in cap["reason"]
    assert out["devices"] == [] and out["xids"] == [None]
