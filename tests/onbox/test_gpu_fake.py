"""The GPU seam without a GPU: the scripted scenarios, and NvmlProbe's call path over an injected lib."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Dict, List, Optional

import pytest

from onbox.callrunner import CallRunner, CallTimeout, RunnerClosed
from onbox.sources import fake_gpu
from onbox.sources.fake_gpu import SCENARIOS, ScriptedProbe
from onbox.sources.gpu import (
    CLOCK_EVENT_REASONS,
    Capability,
    GpuInfo,
    GpuProbe,
    GpuSample,
    decode_reasons,
)
from onbox.sources.nvml import NvmlProbe
from tests.helpers import wait_until

WAIT_S = 30.0  # upper bound for anything that should happen "now"; never a sleep, never waited out

_NOT_READINGS = ("index", "ts", "processes", "lost", "error")
_READINGS = [f.name for f in dataclasses.fields(GpuSample) if f.name not in _NOT_READINGS]


def _runner_threads() -> List[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rgt-nvml") and t.is_alive()]


def _in_thread(fn: Any, *args: Any) -> queue.Queue[Any]:
    """Run fn(*args) on a thread; its result (or exception) lands in the returned queue."""
    out: queue.Queue[Any] = queue.Queue()

    def run() -> None:
        try:
            out.put(fn(*args))
        except BaseException as e:
            out.put(e)

    threading.Thread(target=run, name="test-caller", daemon=True).start()
    return out


# -- the data seam -------------------------------------------------------------------------------


def test_decode_reasons_uses_our_own_table_including_newer_bits() -> None:
    assert CLOCK_EVENT_REASONS[0x200] == "BoardLimit"
    assert CLOCK_EVENT_REASONS[0x400] == "Reliability"
    assert decode_reasons(0x4 | 0x40 | 0x200 | 0x400) == [
        "SwPowerCap", "HwThermalSlowdown", "BoardLimit", "Reliability"
    ]
    assert decode_reasons(0x800) == ["Unknown(0x800)"]
    assert decode_reasons(0) == []
    assert decode_reasons(None) == []


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_is_a_working_probe(name: str) -> None:
    probe: GpuProbe = SCENARIOS[name]()
    try:
        cap = probe.init()
        devices = probe.devices()
        assert cap.available and cap.device_count == len(devices) > 0
        for info in devices:
            sample = probe.sample(info.index)
            assert sample.index == info.index and sample.ts == fake_gpu.START_TS
        with pytest.raises(IndexError):
            probe.sample(len(devices))
    finally:
        probe.close()


def test_healthy_h100x8_is_healthy_at_every_tick() -> None:
    probe = fake_gpu.healthy_h100x8(ticks=6)
    assert [d.name for d in probe.devices()] == [fake_gpu.H100_NAME] * 8
    assert {d.memory_total_bytes for d in probe.devices()} == {81559 * 1024 * 1024}
    assert {d.power_limit_mw for d in probe.devices()} == {700_000}
    assert {d.sm_clock_max_mhz for d in probe.devices()} == {1980}
    assert len({d.pci_bus_id for d in probe.devices()}) == 8
    for tick in range(6):
        assert probe.tick == tick
        for i in range(8):
            s = probe.sample(i)
            assert not s.lost and s.error is None
            assert decode_reasons(s.clock_event_reasons) == []
            assert s.ecc_volatile_uncorrected == 0 and s.remapped_rows_failure is False
            assert 0 < (s.power_mw or 0) <= (s.power_limit_mw or 0)
            assert (s.sm_clock_mhz or 0) <= (s.sm_clock_max_mhz or 0)
            assert [p.pid for p in s.processes] == [4242 + i]
        probe.advance()
    assert probe.wait_xid(0) is None
    assert probe.advance() == 5  # past the end, the last tick repeats


def test_xid79_on_gpu3_delivers_one_event_then_gpu3_is_lost_alone() -> None:
    probe = fake_gpu.xid79_on_gpu3(ticks=6, at_tick=3)
    probe.advance(2)
    assert probe.wait_xid(0) is None
    assert not probe.sample(3).lost
    probe.advance()
    event = probe.wait_xid(0)
    assert event is not None
    assert (event.index, event.xid, event.pci_bus_id) == (3, 79, probe.devices()[3].pci_bus_id)
    assert probe.wait_xid(0) is None  # one event, delivered once
    for tick in range(3, 6):
        lost = [i for i in range(8) if probe.sample(i).lost]
        assert lost == [3], f"tick {tick}"
        assert all(getattr(probe.sample(3), f) is None for f in _READINGS)
        probe.advance()


def test_wait_xid_wakes_when_another_thread_advances() -> None:
    probe = fake_gpu.xid79_on_gpu3(ticks=5, at_tick=1)
    waiting = _in_thread(probe.wait_xid, 60.0)
    probe.advance()
    event = waiting.get(timeout=WAIT_S)
    assert event.xid == 79


def test_wait_xid_returns_none_when_closed() -> None:
    probe = fake_gpu.healthy_h100x8()
    waiting = _in_thread(probe.wait_xid, 60.0)
    probe.close()
    assert waiting.get(timeout=WAIT_S) is None


def test_thermal_throttle_flapping_toggles_thermal_bits_on_one_gpu() -> None:
    probe = fake_gpu.thermal_throttle_flapping(ticks=8, start_tick=2)
    gpu = fake_gpu.THROTTLE_GPU
    seen: List[List[str]] = []
    violations: List[int] = []
    for _ in range(8):
        s = probe.sample(gpu)
        seen.append(decode_reasons(s.clock_event_reasons))
        violations.append(s.violation_thermal_ns or 0)
        if "HwThermalSlowdown" in seen[-1]:
            assert (s.sm_clock_mhz or 0) * 2 <= 1980 and (s.temperature_c or 0) >= 89
        assert all(probe.sample(i).clock_event_reasons == 0 for i in range(8) if i != gpu)
        probe.advance()
    throttled = ["HwThermalSlowdown" in names for names in seen]
    assert throttled == [False, False, True, False, True, False, True, False]
    assert violations == sorted(violations) and violations[-1] == 3 * 10**9


def test_gpu_lost_mid_run_loses_the_only_gpu_without_an_xid() -> None:
    probe = fake_gpu.gpu_lost_mid_run(ticks=6, at_tick=4)
    states = []
    for _ in range(6):
        states.append(probe.sample(0).lost)
        probe.advance()
    assert states == [False] * 4 + [True] * 2
    assert "lost" in (probe.sample(0).error or "")
    assert probe.wait_xid(0) is None


def test_not_supported_everywhere_leaves_every_optional_field_none() -> None:
    probe = fake_gpu.not_supported_everywhere()
    info_fields = [f.name for f in dataclasses.fields(GpuInfo) if f.name != "index"]
    for info in probe.devices():
        assert all(getattr(info, f) is None for f in info_fields)
        s = probe.sample(info.index)
        assert all(getattr(s, f) is None for f in _READINGS)
        assert s.processes == () and not s.lost and s.error is None
    assert probe.init().missing_functions


def test_scripted_exception_is_raised_to_the_caller() -> None:
    boom = RuntimeError("driver went away")
    probe = ScriptedProbe(Capability(True, "1 GPU"), [GpuInfo(0)], [{0: boom}])
    with pytest.raises(RuntimeError, match="driver went away"):
        probe.sample(0)


def test_nvml_hang_blocks_until_released_and_other_gpus_still_answer() -> None:
    probe = fake_gpu.nvml_hang(ticks=4, at_tick=2)
    try:
        assert not probe.sample(fake_gpu.HANG_GPU).error
        probe.advance(2)
        result = _in_thread(probe.sample, fake_gpu.HANG_GPU)
        assert probe.hang_started.wait(WAIT_S)
        assert probe.sample(1).error is None  # the hang is on one call, not the probe
        with pytest.raises(queue.Empty):
            result.get(timeout=0.05)
        probe.release()
        sample = result.get(timeout=WAIT_S)
        assert isinstance(sample, GpuSample) and sample.index == fake_gpu.HANG_GPU and not sample.lost
    finally:
        probe.close()


def test_nvml_hang_is_released_by_close() -> None:
    probe = fake_gpu.nvml_hang(ticks=3, at_tick=0)
    result = _in_thread(probe.sample, fake_gpu.HANG_GPU)
    assert probe.hang_started.wait(WAIT_S)
    probe.close()
    assert isinstance(result.get(timeout=WAIT_S), GpuSample)


def test_a_timeout_wrapper_upstream_can_be_tested_with_the_hang() -> None:
    """What a sampler above the seam does with a probe that hangs: give up after its own deadline."""
    probe = fake_gpu.nvml_hang(ticks=3, at_tick=0)
    try:
        result = _in_thread(probe.sample, fake_gpu.HANG_GPU)
        with pytest.raises(queue.Empty):
            result.get(timeout=0.2)  # the upstream deadline
        assert probe.calls["sample"] == 1
    finally:
        probe.release()
        assert isinstance(result.get(timeout=WAIT_S), GpuSample)
        probe.close()


# -- CallRunner: the one worker thread with timeouts ----------------------------------------------


def test_call_runner_times_out_fails_fast_then_recovers() -> None:
    runner = CallRunner(name="rgt-nvml-test")
    runner.start()
    gate = threading.Event()
    ran: List[str] = []
    try:
        assert runner.call("quick", lambda: 41 + 1, WAIT_S) == 42
        t0 = time.monotonic()
        with pytest.raises(CallTimeout, match="blocker did not return"):
            runner.call("blocker", gate.wait, 0.5)
        assert time.monotonic() - t0 < WAIT_S
        assert "blocker" in (runner.degraded_reason or "")
        with pytest.raises(CallTimeout, match="skipped"):
            runner.call("next", lambda: ran.append("next"), WAIT_S)
        assert ran == []  # failed fast: never queued behind the stuck call
        gate.set()
        assert runner.wait_recovered(WAIT_S)
        assert runner.degraded_reason is None and runner.timeout_count == 1
        assert runner.call("after", lambda: "ok", WAIT_S) == "ok"
    finally:
        gate.set()
        assert runner.stop(WAIT_S)
    assert not runner.alive
    with pytest.raises(RunnerClosed):
        runner.call("late", lambda: None, WAIT_S)


def test_call_runner_passes_exceptions_through() -> None:
    runner = CallRunner(name="rgt-nvml-test")
    runner.start()
    try:
        with pytest.raises(ZeroDivisionError):
            runner.call("div", lambda: 1 // 0, WAIT_S)
        assert runner.degraded_reason is None
    finally:
        assert runner.stop(WAIT_S)


# -- NvmlProbe over an injected lib (no pynvml, no C) ---------------------------------------------


class _FakeNvmlError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"fake NVML error {value}")
        self.value = value


class _FakeLib:
    """The few pynvml functions NvmlProbe needs to start; everything else is "missing"."""

    NVMLError = _FakeNvmlError

    def __init__(self, gpus: int = 2) -> None:
        self.gpus = gpus
        self.gate = threading.Event()
        self.block_index: Optional[int] = None
        self.lost_index: Optional[int] = None
        self.temperature_calls: Dict[int, int] = {}
        self.handle_errors: Dict[int, int] = {}
        self.shutdowns = 0

    def nvmlInitWithFlags(self, flags: int) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.163.01"

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index in self.handle_errors:
            raise _FakeNvmlError(self.handle_errors[index])
        return index

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        if handle == 1:
            raise _FakeNvmlError(3)  # NotSupported
        return 600_000

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        self.temperature_calls[handle] = self.temperature_calls.get(handle, 0) + 1
        if handle == self.lost_index:
            raise _FakeNvmlError(15)  # GpuIsLost
        if handle == self.block_index:
            self.gate.wait()
        return 60 + handle


@pytest.fixture
def fake_lib_probe() -> Any:
    lib = _FakeLib()
    probe = NvmlProbe(call_timeout_s=1.0, lib=lib, xid_wait_slice_s=0.05)
    yield lib, probe
    lib.gate.set()
    probe.close()
    assert not _runner_threads()


def test_probe_over_injected_lib_maps_errors_per_gpu(fake_lib_probe: Any, caplog: Any) -> None:
    lib, probe = fake_lib_probe
    caplog.set_level(logging.INFO, logger="onbox.sources.nvml")
    cap = probe.init()
    assert cap.available and cap.device_count == 2 and cap.driver_version == "550.163.01"
    assert "nvmlDeviceGetUUID" in cap.missing_functions
    lib.lost_index = 0
    for _ in range(3):
        lost, fine = probe.sample(0), probe.sample(1)
        assert lost.lost and "lost" in (lost.error or "") and lost.temperature_c is None
        assert not fine.lost and fine.temperature_c == 61 and fine.power_mw is None  # NotSupported
    missing_logs = [r for r in caplog.records if "nvmlDeviceGetUtilizationRates" in r.getMessage()]
    assert len(missing_logs) == 1  # once per function, not per call


def test_probe_hung_call_returns_in_time_degrades_and_recovers(fake_lib_probe: Any) -> None:
    lib, probe = fake_lib_probe
    assert probe.init().available
    lib.block_index = 0
    t0 = time.monotonic()
    hung = probe.sample(0)
    assert time.monotonic() - t0 < WAIT_S
    assert not hung.lost and "did not return" in (hung.error or "")
    assert "nvmlDeviceGetTemperature" in (probe.degraded_reason or "")
    calls_before = dict(lib.temperature_calls)
    skipped = probe.sample(1)
    assert "degraded" in (skipped.error or "") and skipped.temperature_c is None
    assert lib.temperature_calls == calls_before  # failed fast, NVML not touched
    lib.block_index = None
    lib.gate.set()
    assert probe.wait_recovered(WAIT_S)
    assert probe.degraded_reason is None and probe.timeout_count == 1
    assert probe.sample(1).temperature_c == 61 and probe.sample(0).temperature_c == 60
    probe.close()
    assert lib.shutdowns == 1 and not _runner_threads()


def test_probe_close_while_hung_leaves_no_thread_once_released(fake_lib_probe: Any) -> None:
    lib, probe = fake_lib_probe
    probe.init()
    lib.block_index = 0
    assert probe.sample(0).error
    probe.close()  # must not hang on the stuck worker
    assert lib.shutdowns == 0  # NVML is not touched while a call is stuck in it
    lib.gate.set()
    wait_until(lambda: not _runner_threads(), WAIT_S, "the released worker to exit")


def test_sampling_works_while_another_thread_waits_for_xid(fake_lib_probe: Any) -> None:
    lib, probe = fake_lib_probe
    lib.nvmlEventSetCreate = lambda: "event-set"
    lib.nvmlDeviceRegisterEvents = lambda handle, types, es: None
    waited = threading.Event()

    def event_wait(es: Any, timeout_ms: int) -> None:
        waited.set()
        threading.Event().wait(timeout_ms / 1000.0)  # a real NVML wait blocks this long
        raise _FakeNvmlError(10)  # NVML_ERROR_TIMEOUT

    lib.nvmlEventSetWait = event_wait
    assert probe.init().available
    waiting = _in_thread(probe.wait_xid, 60.0)
    assert waited.wait(WAIT_S)
    for _ in range(5):  # each call fits in call_timeout_s only if waits are sliced
        assert probe.sample(0).temperature_c == 60
        assert probe.sample(1).error is None
    probe.close()
    assert waiting.get(timeout=WAIT_S) is None


def test_wait_xid_without_event_support_waits_and_wakes_on_close(fake_lib_probe: Any) -> None:
    _, probe = fake_lib_probe
    probe.init()
    assert probe.wait_xid(0.05) is None
    waiting = _in_thread(probe.wait_xid, 60.0)
    with pytest.raises(queue.Empty):
        waiting.get(timeout=0.05)  # no event API: it waits instead of spinning
    probe.close()
    assert waiting.get(timeout=WAIT_S) is None


def test_init_never_raises_and_leaves_no_thread() -> None:
    class Broken(_FakeLib):
        def nvmlInitWithFlags(self, flags: int) -> None:
            raise _FakeNvmlError(9)  # DriverNotLoaded

    class Weird(_FakeLib):
        def nvmlDeviceGetCount(self) -> int:
            raise RuntimeError("binding bug")

    for lib, needle in ((Broken(), "driver is not loaded"), (Weird(), "cannot count")):
        probe = NvmlProbe(call_timeout_s=2.0, lib=lib)
        cap = probe.init()
        assert not cap.available and needle in cap.reason
        assert probe.devices() == [] and probe.init() is cap
        assert not _runner_threads()
        with pytest.raises(IndexError):
            probe.sample(0)
        assert probe.wait_xid(0.01) is None
        probe.close()


def test_gpu_without_a_handle_is_lost_only_when_nvml_says_so() -> None:
    lib = _FakeLib(gpus=3)
    lib.handle_errors = {0: 15, 1: 4}  # GpuIsLost, NoPermission
    probe = NvmlProbe(call_timeout_s=2.0, lib=lib)
    try:
        cap = probe.init()
        assert cap.available and [d.index for d in probe.devices()] == [0, 1, 2]
        lost, refused, fine = probe.sample(0), probe.sample(1), probe.sample(2)
        assert lost.lost and "lost" in (lost.error or "")
        assert not refused.lost and "no handle" in (refused.error or "")
        assert not fine.lost and fine.temperature_c == 62
        lib.handle_errors = {}
        assert probe.sample(1).temperature_c == 61  # a handle refused once is asked for again
    finally:
        probe.close()


def test_init_after_close_starts_nothing() -> None:
    probe = NvmlProbe(call_timeout_s=2.0, lib=_FakeLib())
    probe.close()
    cap = probe.init()
    assert not cap.available and "closed" in cap.reason
    assert not _runner_threads()


def test_a_version_that_answers_not_supported_falls_back_to_an_older_one() -> None:
    class OldGpu(_FakeLib):
        def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
            raise _FakeNvmlError(3)  # exists, but NotSupported on this GPU

        def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int) -> int:
            return 0x4

    probe = NvmlProbe(call_timeout_s=2.0, lib=OldGpu())
    try:
        probe.init()
        assert [probe.sample(i).clock_event_reasons for i in (0, 1, 0)] == [0x4, 0x4, 0x4]
        assert probe.resolved_functions["clock_reasons"] == "nvmlDeviceGetCurrentClocksThrottleReasons"
    finally:
        probe.close()
