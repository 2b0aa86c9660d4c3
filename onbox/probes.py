"""Making a GPU probe from a setting, and the worker thread that runs one sampling round at a time."""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional, Tuple

from onbox.errors import ConfigError
from onbox.sources.fake_gpu import SCENARIOS
from onbox.sources.gpu import Capability, GpuProbe
from onbox.sources.nvml import NvmlProbe

log = logging.getLogger(__name__)


def make_probe(spec: str) -> Optional[GpuProbe]:
    """The probe a `gpu` setting names: NVML for "auto", a scripted scenario for "fake:<name>"."""
    if spec == "none":
        return None
    if spec == "auto":
        return NvmlProbe()
    if spec.startswith("fake:"):
        name = spec[len("fake:"):]
        if name not in SCENARIOS:
            raise ConfigError(f"unknown fake GPU scenario {name!r} (known: {', '.join(sorted(SCENARIOS))})")
        return SCENARIOS[name]()
    raise ConfigError(f"gpu must be 'auto', 'none' or 'fake:<scenario>', not {spec!r}")


def init_probe(probe: Optional[GpuProbe], spec: str) -> Capability:
    """`probe.init()`, never raising; an absent probe is a capability that says the GPU part is off."""
    if probe is None:
        return Capability(False, f"GPU monitoring is off (gpu={spec})")
    try:
        return probe.init()
    except Exception as e:  # seam boundary: a broken probe turns the GPU section off, nothing else
        log.exception("GPU probe init failed")
        return Capability(False, f"GPU probe init failed: {type(e).__name__}: {e}")


class RoundWorker:
    """One daemon thread that runs one call at a time; the caller waits with a timeout.

    A call that never returns leaves the worker busy (`busy`), never the caller blocked.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._fn: Optional[Callable[[], Any]] = None
        self._done = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._closed = False
        self.busy = False
        self.current: Any = None  # what the call is working on (set by the call itself)
        self._thread: Optional[threading.Thread] = None

    def submit(self, fn: Callable[[], Any]) -> None:
        with self._cond:
            if self.busy:
                raise RuntimeError("round worker is busy")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self.busy = True
            self._done.clear()
            self._fn = fn
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """True once the submitted call has finished (or nothing is submitted)."""
        return not self.busy or self._done.wait(max(0.0, timeout_s))

    def take(self) -> Tuple[Any, Optional[BaseException]]:
        """The finished call's (result, exception); the worker is free again."""
        with self._cond:
            result, error = self._result, self._error
            self._result, self._error, self.busy = None, None, False
            return result, error

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._fn is not None or self._closed)
                if self._closed:
                    return
                fn, self._fn = self._fn, None
            assert fn is not None
            try:
                result, error = fn(), None
            except Exception as e:  # a round boundary: the caller gets the exception as data
                result, error = None, e
            with self._cond:
                self._result, self._error = result, error
            self._done.set()

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
