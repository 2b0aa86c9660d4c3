"""The GPU path against real hardware, and replays of what real hardware reported.

Tests marked `gpu` need an NVIDIA driver and skip without one. The replay
tests run everywhere over the captures in data/real_gpu/ (made with
scripts/capture_gpu_fixture.py on a GPU box), and the capture format itself is
checked with a capture built from the scripted H100 scenario.
"""
from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from onbox.monitors.preflight import run_health
from onbox.sources import fake_gpu
from onbox.sources.fake_gpu import ScriptedProbe
from onbox.sources.gpu import Capability, GpuInfo, GpuProcess, GpuSample, decode_reasons
from tests.helpers import REPO, onbox_cmd

CAPTURES = sorted((Path(__file__).parent / "data" / "real_gpu").glob("*.json"))

_PROBE = """
import json, sys
from onbox.sources.nvml import NvmlProbe
p = NvmlProbe(); cap = p.init()
out = {"available": cap.available, "reason": cap.reason, "samples": []}
if cap.available:
    for d in p.devices():
        s = p.sample(d.index)
        out["samples"].append({"name": d.name, "mem": s.memory_total_bytes, "temp": s.temperature_c,
                               "lost": s.lost, "error": s.error})
p.close(); print(json.dumps(out))
"""


def _real_probe() -> Dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


@pytest.fixture(scope="module")
def real_gpu() -> Dict[str, Any]:
    found = _real_probe()
    if not found["available"]:
        pytest.skip(f"no GPU here: {found['reason']}")
    return found


@pytest.mark.gpu
def test_nvml_probe_reads_every_real_gpu(real_gpu: Dict[str, Any]) -> None:
    assert real_gpu["samples"]
    for s in real_gpu["samples"]:
        assert s["mem"] and s["mem"] > 1 << 30 and not s["lost"] and s["error"] is None
        assert s["temp"] is None or 0 < s["temp"] < 110


@pytest.mark.gpu
def test_health_on_a_real_gpu_checks_it(real_gpu: Dict[str, Any], tmp_path: Path) -> None:
    out = subprocess.run(onbox_cmd("health", "--seconds", "3", "--json", "--run-dir", str(tmp_path)),
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 2), out.stderr
    report = json.loads(out.stdout)
    assert report["gpu"]["available"] and report["gpu"]["devices"] == len(real_gpu["samples"])
    assert not [c for c in report["checks"] if c["check"] == "gpu" and c["status"] == "SKIP"]


# ---- replaying captures --------------------------------------------------------------------------


def probe_from_capture(capture: Dict[str, Any]) -> ScriptedProbe:
    def sample(d: Dict[str, Any]) -> GpuSample:
        procs = tuple(GpuProcess(pid=1_000_000 + i, used_memory_bytes=p.get("used_memory_bytes"))
                      for i, p in enumerate(d.get("processes", [])))
        return GpuSample(**{**d, "processes": procs})

    devices = [GpuInfo(**d) for d in capture["devices"]]
    per_gpu: List[List[GpuSample]] = [[sample(s) for s in rows] for rows in capture["samples"]]
    ticks = [{i: rows[t] for i, rows in enumerate(per_gpu)} for t in range(len(per_gpu[0]))]
    cap = Capability(**{k: v for k, v in capture["capability"].items()
                        if k in {f.name for f in dataclasses.fields(Capability)}})
    return ScriptedProbe(cap, devices, ticks)


def capture_of(probe: ScriptedProbe, samples: int) -> Dict[str, Any]:
    """What scripts/capture_gpu_fixture.py writes, from a scripted probe."""
    cap = probe.init()
    devices = probe.devices()
    rows: List[List[Dict[str, Any]]] = [[] for _ in devices]
    for _ in range(samples):
        for i, d in enumerate(devices):
            rows[i].append(dataclasses.asdict(probe.sample(d.index)))
        probe.advance()
    probe.close()
    return {"schema": 1, "capability": dataclasses.asdict(cap),
            "devices": [dataclasses.asdict(d) for d in devices], "samples": rows, "health_exit": 0}


def replay_health(capture: Dict[str, Any]) -> Dict[str, Any]:
    out = io.StringIO()
    run_health(None, 3.0, True, REPO, out, probe=probe_from_capture(capture))
    return dict(json.loads(out.getvalue()))


def test_capture_format_round_trips_through_the_detectors() -> None:
    capture = json.loads(json.dumps(capture_of(fake_gpu.healthy_h100x8(), 4), default=str))
    report = replay_health(capture)
    assert report["gpu"]["available"] and report["gpu"]["devices"] == 8
    assert {c["status"] for c in report["checks"] if c["check"] != "foreign_vram"} <= {"PASS"}


@pytest.mark.parametrize("path", CAPTURES, ids=[p.stem for p in CAPTURES])
def test_real_capture_replays_to_the_verdict_it_had(path: Path) -> None:
    capture = json.loads(path.read_text())
    report = replay_health(capture)
    assert report["gpu"]["devices"] == len(capture["devices"])
    if capture.get("health_exit") == 0:
        assert report["exit_code"] == 0, report


def test_a_busy_h200_at_its_power_cap_is_not_a_fault() -> None:
    """A real H200 at full load sits at its 700 W software power cap with the SM clock well below
    its maximum; the throttle check must call that normal, not slowdown."""
    capture = json.loads((Path(__file__).parent / "data" / "real_gpu" / "nvidia-h200-load.json").read_text())
    loaded = [s for s in capture["samples"][0] if s["utilization_gpu_pct"] >= 90]
    assert loaded and all(decode_reasons(s["clock_event_reasons"]) == ["SwPowerCap"] for s in loaded)
    assert all(s["sm_clock_mhz"] < 0.8 * s["sm_clock_max_mhz"] for s in loaded)
    report = replay_health(capture)
    throttle = [c for c in report["checks"] if c["check"] == "throttle"]
    assert throttle and {c["status"] for c in throttle} == {"PASS"}, throttle
