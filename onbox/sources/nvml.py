"""NVML through pynvml: the only module of ours that imports pynvml.

Every NVML call goes through one path, `NvmlProbe._attempt`, which runs it on one long-lived worker
thread (`CallRunner`) with a timeout, so a hung driver call never hangs the sidecar. Errors become data:
NotSupported -> None, a function missing from the driver or binding -> None (logged once), GpuIsLost or
Unknown -> that GPU's sample has ``lost=True`` while the others carry on, no library or no driver -> a
`Capability` with ``available=False``. Versioned functions are probed once and the choice is cached.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from onbox.callrunner import CallRunner, CallTimeout, RunnerClosed
from onbox.sources.gpu import RECOVERY_ACTIONS, Capability, GpuInfo, GpuProcess, GpuSample, XidEvent

logger = logging.getLogger(__name__)

# NVML return codes (nvml.h; part of the stable C ABI). Errors are classified by these values, so an
# injected `lib` only needs an `NVMLError` class whose instances carry `.value`.
_ERR_NOT_SUPPORTED = 3
_ERR_NO_PERMISSION = 4
_ERR_DRIVER_NOT_LOADED = 9
_ERR_TIMEOUT = 10
_ERR_LIBRARY_NOT_FOUND = 12
_ERR_FUNCTION_NOT_FOUND = 13
_ERR_GPU_IS_LOST = 15
_ERR_LIB_RM_VERSION_MISMATCH = 18
_ERR_UNKNOWN = 999
_LOST_CODES = frozenset({_ERR_GPU_IS_LOST, _ERR_UNKNOWN})

_INIT_FAILURES: Dict[int, str] = {
    _ERR_LIBRARY_NOT_FOUND: "NVML library libnvidia-ml.so.1 not found (no NVIDIA driver visible here)",
    _ERR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded",
    _ERR_NO_PERMISSION: "no permission to reach the NVIDIA driver (check /dev/nvidia* access)",
    _ERR_LIB_RM_VERSION_MISMATCH: "NVML library and kernel driver differ (driver upgraded, no reboot?)",
}

# nvml.h constants used below.
_TEMPERATURE_GPU = 0
_CLOCK_SM = 1
_PERF_POLICY_POWER = 0
_PERF_POLICY_THERMAL = 1
_ECC_CORRECTED, _ECC_UNCORRECTED = 0, 1
_ECC_VOLATILE, _ECC_AGGREGATE = 0, 1
_EVENT_XID_CRITICAL = 0x8
_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
_USED_MEMORY_NOT_AVAILABLE = (1 << 64) - 1


class _DeviceLost(Exception):
    """A GPU answered GpuIsLost or Unknown; its whole sample degrades."""


class _Missing(Exception):
    """An NVML function does not exist in this driver or binding."""


class _Unsupported(Exception):
    """An NVML function exists but answered NotSupported."""


_Candidate = Tuple[str, str, Optional[Callable[[Any], Dict[str, Any]]]]


def _memory_v2_kwargs(lib: Any) -> Dict[str, Any]:
    return {"version": lib.nvmlMemory_v2}


# Versioned NVML entry points, newest first: (symbol for logs, pynvml attribute, kwargs factory).
# The first one that exists is chosen on first use and cached for the life of the probe.
_FALLBACKS: Dict[str, Tuple[_Candidate, ...]] = {
    "memory": (
        ("nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMemoryInfo", _memory_v2_kwargs),
        ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo", None),
    ),
    "clock_reasons": (
        ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksEventReasons", None),
        ("nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetCurrentClocksThrottleReasons", None),
    ),
    "processes": (
        ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v3", None),
        ("nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetComputeRunningProcesses_v2", None),
    ),
}


def _chain(op: str) -> Tuple[_Candidate, ...]:
    return _FALLBACKS.get(op, ((op, op, None),))


def _text(value: Any) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _handle_key(handle: Any) -> Any:
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


class NvmlProbe:
    """`GpuProbe` over NVML. `lib` defaults to the pynvml module, imported inside `init`.

    `call_timeout_s` bounds every NVML call except nvmlInit, which gets `init_timeout_s` (without
    persistence mode, initialising a multi-GPU box can take seconds); `clock` stamps samples and events
    (unix seconds); `xid_wait_slice_s` is the longest single nvmlEventSetWait, so `close` and sampling
    never wait long behind an event wait.
    """

    def __init__(
        self,
        call_timeout_s: float = 2.0,
        *,
        lib: Any = None,
        clock: Callable[[], float] = time.time,
        xid_wait_slice_s: float = 0.2,
        init_timeout_s: float = 30.0,
    ) -> None:
        self._lib = lib
        self._timeout_s = call_timeout_s
        self._init_timeout_s = init_timeout_s
        self._clock = clock
        self._slice_s = xid_wait_slice_s
        self._runner = CallRunner()
        self._error_type: Any = ()
        self._init_lock = threading.Lock()
        self._log_lock = threading.Lock()
        self._capability: Optional[Capability] = None
        self._nvml_up = False
        self._closed = threading.Event()
        self._handles: List[Any] = []
        self._infos: List[GpuInfo] = []
        self._event_set: Any = None
        self._resolved: Dict[str, Optional[int]] = {}
        self._missing: List[str] = []
        self._logged: Set[Tuple[str, int]] = set()

    # -- public API -------------------------------------------------------------------------------

    @property
    def degraded_reason(self) -> Optional[str]:
        """Why NVML calls are failing fast right now (a call hung), or None."""
        return self._runner.degraded_reason

    @property
    def timeout_count(self) -> int:
        """NVML calls that overran `call_timeout_s` so far; a rise means a hang, even a healed one."""
        return self._runner.timeout_count

    def wait_recovered(self, timeout_s: float) -> bool:
        """Wait until no NVML call is stuck; False when still stuck after `timeout_s`."""
        return self._runner.wait_recovered(timeout_s)

    @property
    def missing_functions(self) -> Tuple[str, ...]:
        """NVML functions found missing so far (driver or binding too old), in discovery order."""
        with self._log_lock:
            return tuple(self._missing)

    @property
    def resolved_functions(self) -> Dict[str, Optional[str]]:
        """For each versioned query probed so far, the NVML symbol in use (None: no version exists)."""
        resolved = dict(self._resolved)
        return {
            op: (None if idx is None else _FALLBACKS[op][idx][0])
            for op, idx in resolved.items()
            if op in _FALLBACKS
        }

    def init(self) -> Capability:
        """Start NVML and read the static facts; never raises. Idempotent."""
        with self._init_lock:
            if self._capability is None and self._closed.is_set():
                return Capability(False, "probe closed before init")
            if self._capability is None:
                try:
                    self._capability = self._init_locked()
                except Exception as e:  # seam boundary: init must never raise
                    logger.exception("NVML init failed unexpectedly")
                    self._capability = Capability(False, f"NVML init failed: {e!r}")
                if not self._capability.available:
                    self._release()
            return self._capability

    def devices(self) -> List[GpuInfo]:
        return list(self._infos)

    def sample(self, index: int) -> GpuSample:
        if not 0 <= index < len(self._infos):
            raise IndexError(f"no GPU with index {index} (have {len(self._infos)})")
        ts = self._clock()
        if self._closed.is_set():
            return GpuSample(index, ts, error="probe closed")
        reason = self._runner.degraded_reason
        if reason is not None:
            return GpuSample(index, ts, error=f"NVML degraded: {reason}")
        try:
            handle = self._handles[index]
            if handle is None:
                handle = self._handle(index)
            if handle is None:
                return GpuSample(index, ts, error=f"NVML gives no handle for GPU {index}")
            return GpuSample(index=index, ts=ts, **self._read_sample(index, handle))
        except _DeviceLost as e:
            return GpuSample(index, ts, lost=True, error=str(e))
        except (CallTimeout, RunnerClosed) as e:
            return GpuSample(index, ts, error=f"NVML call failed: {e}")

    def wait_xid(self, timeout_s: float) -> Optional[XidEvent]:
        """Next Xid within `timeout_s`, else None. Waits in short slices so sampling interleaves."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while not self._closed.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if self._event_set is None:
                self._closed.wait(remaining)
                return None
            if self._runner.degraded_reason is not None:
                self._runner.wait_recovered(remaining)
                continue
            try:
                event = self._wait_once(min(remaining, self._slice_s))
            except _Missing:  # a broken event API: wait out the time rather than spin
                self._closed.wait(max(0.0, deadline - time.monotonic()))
                return None
            if event is not None:
                return event
        return None

    def _wait_once(self, wait_s: float) -> Optional[XidEvent]:
        """One bounded nvmlEventSetWait; raises `_Missing` when waiting cannot work at all."""
        try:
            data = self._runner.call(
                "nvmlEventSetWait",
                lambda: self._wait_slice(int(wait_s * 1000)),
                wait_s + self._timeout_s,
                background=True,
            )
        except (CallTimeout, RunnerClosed):
            return None
        except self._error_type as e:
            code = getattr(e, "value", -1)
            if code == _ERR_TIMEOUT:
                return None
            self._log_once("nvmlEventSetWait", code, "NVML event wait failed: %s", e)
            raise _Missing("nvmlEventSetWait") from None
        except Exception:  # a binding bug must not take the sidecar down
            if self._mark_logged("nvmlEventSetWait", -1):
                logger.exception("NVML nvmlEventSetWait raised unexpectedly")
            raise _Missing("nvmlEventSetWait") from None
        return self._to_xid(data)

    def close(self) -> None:
        """Free the event set, shut NVML down and stop the worker thread. Idempotent."""
        with self._init_lock:
            if not self._closed.is_set():
                self._closed.set()
                self._release()

    def _release(self) -> None:
        """Shut NVML down and stop the worker; never waits on a call that is already stuck."""
        stuck = self._runner.degraded_reason is not None
        if self._nvml_up and not stuck:
            try:
                self._runner.call("nvmlShutdown", self._shutdown_in_worker, self._timeout_s)
            except Exception as e:  # best effort: the process may be exiting anyway
                logger.warning("NVML shutdown failed: %s", e)
        self._nvml_up = False
        self._runner.stop(0.0 if stuck else self._timeout_s)

    # -- init -------------------------------------------------------------------------------------

    def _init_locked(self) -> Capability:
        if self._lib is None:
            try:
                import pynvml  # noqa: TID251 (the one import of pynvml in the code base)
            except ImportError as e:
                return Capability(False, f"nvidia-ml-py (module pynvml) is not installed: {e}")
            self._lib = pynvml
        self._error_type = getattr(self._lib, "NVMLError", ())
        self._runner.start()
        failure = self._start_nvml()
        if failure is not None:
            return Capability(False, failure)
        try:
            driver = _text(self._query("nvmlSystemGetDriverVersion"))
            nvml_version = _text(self._query("nvmlSystemGetNVMLVersion"))
            count = self._query("nvmlDeviceGetCount")
            if count is None:
                return Capability(False, "NVML cannot count GPUs", driver, nvml_version)
            for index in range(int(count)):
                self._handles.append(self._handle_or_none(index))
                self._infos.append(self._read_info(index, self._handles[index]))
            self._setup_events()
        except CallTimeout as e:
            return Capability(False, f"NVML stopped answering during init: {e}")
        if not self._infos:
            reason = "NVML reports no GPUs (container started without GPU access?)"
            return Capability(False, reason, driver, nvml_version, 0, self.missing_functions)
        reason = f"{len(self._infos)} GPU(s) via NVML"
        return Capability(True, reason, driver, nvml_version, len(self._infos), self.missing_functions)

    def _start_nvml(self) -> Optional[str]:
        lib = self._lib
        try:
            self._runner.call("nvmlInit", lambda: lib.nvmlInitWithFlags(0), self._init_timeout_s)
        except CallTimeout as e:
            return f"nvmlInit hung: {e}"
        except AttributeError as e:
            return f"the NVML binding has no nvmlInitWithFlags: {e}"
        except self._error_type as e:
            code = getattr(e, "value", -1)
            return f"{_INIT_FAILURES.get(code, 'nvmlInit failed')} [{e}]"
        self._nvml_up = True
        return None

    def _handle_or_none(self, index: int) -> Any:
        try:
            return self._handle(index)
        except _DeviceLost as e:
            logger.warning("GPU %d is lost at init: %s", index, e)
            return None

    def _handle(self, index: int) -> Any:
        """The GPU's handle, or None when NVML refuses one; raises `_DeviceLost` when it is lost."""
        handle = self._query("nvmlDeviceGetHandleByIndex", index)
        if handle is not None and index < len(self._handles):
            self._handles[index] = handle
        return handle

    def _read_info(self, index: int, handle: Any) -> GpuInfo:
        if handle is None:
            return GpuInfo(index)
        try:
            q = self._query
            pci = q("nvmlDeviceGetPciInfo", handle)
            mem = q("memory", handle)
            return GpuInfo(
                index=index,
                uuid=_text(q("nvmlDeviceGetUUID", handle)),
                name=_text(q("nvmlDeviceGetName", handle)),
                pci_bus_id=None if pci is None else _text(pci.busId),
                memory_total_bytes=None if mem is None else int(mem.total),
                sm_clock_max_mhz=q("nvmlDeviceGetMaxClockInfo", handle, _CLOCK_SM),
                power_limit_mw=q("nvmlDeviceGetEnforcedPowerLimit", handle),
            )
        except _DeviceLost as e:
            logger.warning("GPU %d is lost at init: %s", index, e)
            return GpuInfo(index)

    def _setup_events(self) -> None:
        event_set = self._query("nvmlEventSetCreate")
        if event_set is None:
            return
        registered = 0
        for index, handle in enumerate(self._handles):
            if handle is None:
                continue
            try:
                supported = self._query("nvmlDeviceGetSupportedEventTypes", handle)
                if supported is not None and not int(supported) & _EVENT_XID_CRITICAL:
                    continue
                ok, _ = self._attempt("nvmlDeviceRegisterEvents", (handle, _EVENT_XID_CRITICAL, event_set))
            except _DeviceLost:
                continue
            registered += ok
            logger.debug("GPU %d Xid events %s", index, "registered" if ok else "unavailable")
        if registered:
            self._event_set = event_set
        else:
            self._attempt("nvmlEventSetFree", (event_set,))

    # -- sampling ---------------------------------------------------------------------------------

    def _read_sample(self, index: int, handle: Any) -> Dict[str, Any]:
        q = self._query
        mem = q("memory", handle)
        util = q("nvmlDeviceGetUtilizationRates", handle)
        fields: Dict[str, Any] = {
            "utilization_gpu_pct": None if util is None else int(util.gpu),
            "memory_used_bytes": None if mem is None else int(mem.used),
            "memory_total_bytes": None if mem is None else int(mem.total),
            "temperature_c": q("nvmlDeviceGetTemperature", handle, _TEMPERATURE_GPU),
            "power_mw": q("nvmlDeviceGetPowerUsage", handle),
            "power_limit_mw": q("nvmlDeviceGetEnforcedPowerLimit", handle),
            "sm_clock_mhz": q("nvmlDeviceGetClockInfo", handle, _CLOCK_SM),
            "sm_clock_max_mhz": self._infos[index].sm_clock_max_mhz,
            "clock_event_reasons": q("clock_reasons", handle),
        }
        fields.update(self._read_health(handle))
        fields["processes"] = self._read_processes(handle)
        return fields

    def _read_health(self, handle: Any) -> Dict[str, Any]:
        q = self._query
        power = q("nvmlDeviceGetViolationStatus", handle, _PERF_POLICY_POWER)
        thermal = q("nvmlDeviceGetViolationStatus", handle, _PERF_POLICY_THERMAL)
        pending = q("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        rows = q("nvmlDeviceGetRemappedRows", handle)
        ecc = "nvmlDeviceGetTotalEccErrors"
        return {
            "violation_power_ns": None if power is None else int(power.violationTime),
            "violation_thermal_ns": None if thermal is None else int(thermal.violationTime),
            "ecc_volatile_corrected": q(ecc, handle, _ECC_CORRECTED, _ECC_VOLATILE),
            "ecc_volatile_uncorrected": q(ecc, handle, _ECC_UNCORRECTED, _ECC_VOLATILE),
            "ecc_aggregate_corrected": q(ecc, handle, _ECC_CORRECTED, _ECC_AGGREGATE),
            "ecc_aggregate_uncorrected": q(ecc, handle, _ECC_UNCORRECTED, _ECC_AGGREGATE),
            "retired_pages_pending": None if pending is None else bool(pending),
            "remapped_rows_pending": None if rows is None else bool(rows[2]),
            "remapped_rows_failure": None if rows is None else bool(rows[3]),
            "recovery_action": self._read_recovery_action(handle),
        }

    def _read_recovery_action(self, handle: Any) -> Optional[str]:
        values = self._query("nvmlDeviceGetFieldValues", handle, [_FI_DEV_GET_GPU_RECOVERY_ACTION])
        if values is None:
            return None
        field = values[0]
        code = int(field.nvmlReturn)
        if code in _LOST_CODES:
            raise _DeviceLost(f"GPU is lost (recovery-action field returned {code})")
        if code != 0:
            return None
        action = int(field.value.uiVal)
        return RECOVERY_ACTIONS.get(action, f"unknown({action})")

    def _read_processes(self, handle: Any) -> Tuple[GpuProcess, ...]:
        procs = self._query("processes", handle)
        if not procs:
            return ()
        out = []
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            if used == _USED_MEMORY_NOT_AVAILABLE:
                used = None
            out.append(GpuProcess(pid=int(p.pid), used_memory_bytes=None if used is None else int(used)))
        return tuple(out)

    # -- events -----------------------------------------------------------------------------------

    def _wait_slice(self, timeout_ms: int) -> Any:
        """Runs on the worker, so it cannot race with `_shutdown_in_worker` freeing the set."""
        if self._event_set is None or self._closed.is_set():
            return None
        return self._lib.nvmlEventSetWait(self._event_set, max(1, timeout_ms))

    def _to_xid(self, data: Any) -> Optional[XidEvent]:
        if data is None or not int(data.eventType) & _EVENT_XID_CRITICAL:
            return None
        key = _handle_key(data.device)
        index: Optional[int] = None
        for i, handle in enumerate(self._handles):
            if handle is not None and _handle_key(handle) == key:
                index = i
                break
        pci = self._infos[index].pci_bus_id if index is not None else None
        return XidEvent(index=index, pci_bus_id=pci, xid=int(data.eventData), ts=self._clock())

    def _shutdown_in_worker(self) -> None:
        event_set, self._event_set = self._event_set, None
        lib = self._lib
        if event_set is not None:
            try:
                lib.nvmlEventSetFree(event_set)
            except self._error_type as e:
                logger.debug("nvmlEventSetFree failed: %s", e)
        lib.nvmlShutdown()

    # -- the one call path ------------------------------------------------------------------------

    def _query(self, op: str, *args: Any) -> Any:
        """Value of one NVML query, or None when unsupported, missing or failed."""
        return self._attempt(op, args)[1]

    def _attempt(self, op: str, args: Iterable[Any]) -> Tuple[bool, Any]:
        """Run query `op` (a pynvml function or a `_FALLBACKS` key): (succeeded, value).

        The first call probes `op`'s versions newest first and caches the first that exists and
        answers (or, if none answers, the first that exists). Raises `_DeviceLost` (GpuIsLost/Unknown),
        `CallTimeout` and `RunnerClosed`; maps everything else to ``(False, None)``.
        """
        args = tuple(args)
        chain = _chain(op)
        if op in self._resolved:
            chosen = self._resolved[op]
            if chosen is None:
                return False, None
            try:
                return self._run_candidate(chain[chosen], args)
            except (_Missing, _Unsupported):
                return False, None
        first_existing: Optional[int] = None
        for position, candidate in enumerate(chain):
            try:
                result = self._run_candidate(candidate, args)
            except _Missing:
                continue
            except _Unsupported:  # exists; an older version may still answer on this GPU
                first_existing = position if first_existing is None else first_existing
                continue
            except _DeviceLost:
                self._resolved.setdefault(op, position)  # it answered, so it exists
                raise
            self._resolved.setdefault(op, position)
            if position:
                logger.debug("NVML %s: using %s (newer versions missing or unsupported)", op, candidate[0])
            return result
        self._resolved[op] = first_existing
        if first_existing is None:
            logger.info("NVML function %s is missing (driver or nvidia-ml-py too old); its fields stay empty",
                        " / ".join(c[0] for c in chain))
        return False, None

    def _run_candidate(self, candidate: _Candidate, args: Tuple[Any, ...]) -> Tuple[bool, Any]:
        symbol, attribute, kwargs_factory = candidate
        lib = self._lib
        try:
            fn = getattr(lib, attribute)
            kwargs = kwargs_factory(lib) if kwargs_factory is not None else {}
        except AttributeError:
            self._note_missing(symbol)
            raise _Missing(symbol) from None
        try:
            return True, self._runner.call(symbol, lambda: fn(*args, **kwargs), self._timeout_s)
        except (CallTimeout, RunnerClosed):
            raise
        except self._error_type as e:
            code = getattr(e, "value", -1)
            if code == _ERR_FUNCTION_NOT_FOUND:
                self._note_missing(symbol)
                raise _Missing(symbol) from None
            if code in _LOST_CODES:
                raise _DeviceLost(f"GPU is lost ({symbol}: {e})") from None
            if code == _ERR_NOT_SUPPORTED:
                raise _Unsupported(symbol) from None
            self._log_once(symbol, code, "NVML %s failed: %s", symbol, e)
            return False, None
        except Exception as e:  # a binding bug must not take the sidecar down; logged once per symbol
            if e.__class__.__name__ == "NVMLLibraryMismatchError":
                self._note_missing(symbol)
                raise _Missing(symbol) from None
            if self._mark_logged(symbol, -1):
                logger.exception("NVML %s raised unexpectedly", symbol)
            return False, None

    def _note_missing(self, symbol: str) -> None:
        with self._log_lock:
            if symbol not in self._missing:
                self._missing.append(symbol)

    def _mark_logged(self, symbol: str, code: int) -> bool:
        with self._log_lock:
            if (symbol, code) in self._logged:
                return False
            self._logged.add((symbol, code))
            return True

    def _log_once(self, symbol: str, code: int, msg: str, *args: Any) -> None:
        if self._mark_logged(symbol, code):
            logger.info(msg, *args)

