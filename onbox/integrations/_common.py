"""What the framework callbacks share: the rgt environment, metric lines, hints, stack dumps.

Standard library only (it runs inside the job's own Python, 3.9+). Nothing here raises into the
training loop: `guarded` wraps every hook, logs its first failure with the traceback and lets
training go on.
"""
from __future__ import annotations

import faulthandler
import functools
import logging
import math
import os
import signal
from typing import IO, Any, Callable, Dict, Mapping, Optional, Set, TypeVar

from onbox import hints, report

log = logging.getLogger("onbox.integrations")

# The signal the callbacks register faulthandler on. SIGUSR1 is taken by Lightning's SLURM
# requeue and by some launchers; no framework we support uses SIGUSR2.
STACKS_SIGNAL = signal.SIGUSR2

F = TypeVar("F", bound=Callable[..., Any])

_FAILED: Set[str] = set()
_STACK_FILES: Dict[int, IO[str]] = {}  # pid -> the open file faulthandler writes into


def lazy_class(namespace: Dict[str, Any], module: str, build: Callable[[], type]) -> Callable[[str], Any]:
    """A module-level `__getattr__` that builds `RgtCallback` on first access (importing the
    framework only then) and caches it in the module's namespace."""
    def getattr_(name: str) -> Any:
        if name == "RgtCallback":
            cls = build()
            namespace[name] = cls
            return cls
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return getattr_


def run_dir() -> Optional[str]:
    return os.environ.get("RGT_RUN_DIR") or None


def metrics_enabled() -> bool:
    return bool(os.environ.get("RGT_METRICS"))


def guarded(fn: F) -> F:
    """Run a hook; an exception in it is logged once per hook (with its traceback) and swallowed."""

    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception:
            name = getattr(fn, "__qualname__", "hook")
            if name not in _FAILED:
                _FAILED.add(name)
                log.warning("rgt integration: %s failed; training goes on, this hook's later "
                            "failures are not logged", name, exc_info=True)

    return hook  # type: ignore[return-value]


def scalar(value: Any) -> Optional[float]:
    """A float from a number, a one-element tensor or a numpy scalar; None for anything else."""
    if isinstance(value, bool):
        return float(value)
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (str, bytes)):
        try:
            if getattr(value, "numel", lambda: 1)() != 1:
                return None
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # "nan" as some frameworks format it
        except ValueError:
            return None
    return None


def log_metrics(step: Optional[int], epoch: Optional[float], values: Mapping[str, Any]) -> bool:
    """One line in $RGT_METRICS with the numeric scalars of `values` (NaN/Inf kept, as strings);
    False (nothing written) outside an rgt launch or when there is nothing numeric."""
    if not metrics_enabled():
        return False
    scalars: Dict[str, Any] = {}
    for name, value in values.items():
        if name in ("step", "epoch") or not isinstance(name, str):
            continue
        number = scalar(value)
        if number is not None:
            scalars[name] = int(number) if isinstance(value, int) and math.isfinite(number) else number
    if not scalars:
        return False
    report.log(step=step, epoch=epoch, **scalars)
    return True


def hint(kind: str, path: str, *, step: Optional[int] = None, framework: str) -> bool:
    """A hint line in <run>/rgt/hints.jsonl; False outside an rgt launch."""
    base = run_dir()
    if base is None:
        return False
    return hints.write(kind, path, step=step, framework=framework, run_dir=base)


def _signal_in_use(signum: int) -> bool:
    """Whether anything in this process already catches or ignores `signum`: the kernel's view in
    /proc/self/status (a faulthandler or C handler shows there too), else Python's own table."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("SigCgt:", "SigIgn:")) and int(line.split()[1], 16) >> (signum - 1) & 1:
                    return True
        return False
    except (OSError, ValueError, IndexError):
        return signal.getsignal(signum) not in (signal.SIG_DFL, None)


def register_stacks(framework: str, signum: int = STACKS_SIGNAL) -> Optional[str]:
    """Make this process dump every thread's Python stack into <run>/rgt/stacks/<pid>.txt on
    `signum` (faulthandler, chain=False), and hint it. Once per process; the registration stays
    for the life of the process (a hang after training is still a hang). Nothing is registered
    outside an rgt launch or when the signal is already in use. Returns the file's path."""
    base = run_dir()
    if base is None:
        return None
    pid = os.getpid()
    path = hints.stacks_path(base, pid)
    if pid in _STACK_FILES:
        return str(path)
    if _signal_in_use(signum):
        log.info("rgt integration: signal %d is already handled in this process; no stack dumps on it",
                 signum)
        return None
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    stream = open(path, "w")  # kept open: faulthandler writes into its fd on the signal
    try:
        faulthandler.register(signum, file=stream, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        stream.close()
        raise
    _STACK_FILES[pid] = stream
    hints.write("faulthandler", str(path), pid=pid, signal=int(signum), framework=framework, run_dir=base)
    return str(path)


def warn_resume_ignored(framework: str, how: str) -> None:
    """RGT_RESUME_FROM is set but the run starts from zero: say how to pass it on, once."""
    resume = os.environ.get("RGT_RESUME_FROM")
    key = f"resume-{framework}"
    if resume and key not in _FAILED:
        _FAILED.add(key)
        log.warning("rgt: RGT_RESUME_FROM=%s is set but training starts from step 0; pass it on: %s",
                    resume, how)


__all__ = ["STACKS_SIGNAL", "guarded", "hint", "log_metrics", "metrics_enabled", "register_stacks",
           "run_dir", "scalar", "warn_resume_ignored"]
