"""The Python stacks of a stalled job's processes, captured off the scheduler thread.

Capture (`StackCapture`): every Python process of the job's tree (each torchrun rank; the rank from
RANK / LOCAL_RANK in /proc/PID/environ, else the order among the launcher's children) is dumped with
``py-spy dump --json --native`` (py-spy from the venv's bin next to sys.executable, else PATH), all
at once, within the budget. Native unwinding reads the symbols of libtorch first (1.2 s for a CPU
rank here quiet, 2.8 s beside six busy loops on two cores): a native dump that fails or runs out of
time is followed by a plain ``--nonblocking`` one (10 ms, no ptrace), kept in reserve
(`PLAIN_RESERVE_S`) at the end of the budget, so that a slow box still names every rank's Python
frames; the stack then says why its native frames are missing. A process in state T cannot be
suspended by py-spy: it is read with ``--nonblocking`` (it is stopped anyway). Where the box refuses
ptrace, py-spy exits 1 at once with "Permission Denied: Try running again with elevated
permissions": then the faulthandler route: the integrations register `faulthandler` on a signal and
write a hint line ``{"v":1,"kind":"faulthandler","pid":PID,"signal":N,"path":FILE}`` to
<run>/rgt/hints.jsonl; the capture sends that signal (only to a pid that registered it: any other
pid would die of it) and reads what the handler appended to FILE.

The emit-path hook (`StallStacks`), used by the sidecar's `emit`: a `job.stalled` onset is held
while a worker thread captures (bounded by `budget_s`: 8 s, `rgt-onbox serve --stacks-budget`), then
emitted once with ``stacks`` (compact, within the event size cap) and, when the stacks show it, the
verdict "hung in a collective on rank R". Held rather than followed by a second event because `rgt
watch` wakes on the onset: the wake that reaches the person must already carry the stacks. A
`job.progressing` or `job.exited` arriving meanwhile waits for the held onset (bounded) so the order
stays onset, then clear/exit. It also merges the two stall sources (detectors/hang.py `StallMerge`)."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from onbox.detectors.hang import (
    STOPPED_VERDICT,
    ProcessStack,
    StallMerge,
    ThreadStack,
    collective_verdict,
    compact,
    parse_faulthandler,
    parse_pyspy_json,
)
from onbox.hints import HintReader
from onbox.sources import process

log = logging.getLogger(__name__)

BUDGET_S = 8.0
PLAIN_RESERVE_S = 1.0    # of the budget, left for the plain dump after a native one that ran out
MAX_PROCESSES = 16
MAX_STACKS_BYTES = 40_000   # of protocol's 64 KiB per event: room for the rest of job.stalled
PERMISSION = "Permission Denied"

Emit = Callable[[str, Mapping[str, Any], Optional[str]], Any]


def find_py_spy(executable: str = sys.executable,
                which: Callable[[str], Optional[str]] = shutil.which) -> Optional[str]:
    """py-spy in the venv's bin (next to the interpreter), else on PATH; None when absent."""
    here = Path(executable).parent / "py-spy"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return which("py-spy")


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def faulthandler_hints(run_dir: Path) -> Dict[int, Tuple[int, str]]:
    """pid -> (signal, file) from the job's faulthandler hint lines (newest per pid wins), read
    through `onbox.hints.HintReader`, which keeps only <run>/rgt/stacks/<pid>.txt as the file."""
    out: Dict[int, Tuple[int, str]] = {}
    reader = HintReader(Path(run_dir))
    for _ in range(64):  # bounded: 64 reads of at most 1 MiB each
        batch = reader.poll()
        if not batch:
            break
        for hint in batch:
            if hint["kind"] == "faulthandler":
                out[hint["pid"]] = (hint["signal"], hint["path"])
    return out


class StackCapture:
    """Stacks of the Python processes under a pid; see the module doc. OS calls are injectable."""

    def __init__(self, run_dir: Path, *, py_spy: Optional[str] = None, per_process_s: Optional[float] = None,
                 views: Optional[process.ProcessView] = None, kill: Callable[[int, int], None] = os.kill,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.run_dir = Path(run_dir)
        self.py_spy = py_spy if py_spy is not None else find_py_spy()
        self.per_process_s = per_process_s
        self._views = views or process.ProcessView()
        self._kill = kill
        self._mono = monotonic

    def targets(self, root_pid: int) -> List[Tuple[int, Optional[int], Optional[str]]]:
        """(pid, rank, name) of the Python processes of the tree under `root_pid`, in pid order."""
        found = process.python_tree(root_pid)
        if len(found) > 1 and process.is_wrapper(root_pid):  # rgt's job wrapper: not the job
            found = [f for f in found if f[0] != root_pid]
        found = found[:MAX_PROCESSES]
        ranks: Dict[int, Optional[int]] = {}
        for pid, _, _ in found:
            env = process.proc_env(pid)
            value = env.get("RANK") or env.get("LOCAL_RANK")
            ranks[pid] = int(value) if value is not None and value.isdigit() else None
        if not any(r is not None for r in ranks.values()):
            by_parent: Dict[int, List[int]] = {}
            for pid, ppid, _ in found:
                by_parent.setdefault(ppid, []).append(pid)
            siblings = max(by_parent.values(), key=len) if by_parent else []
            if len(siblings) > 1:  # the launcher's children, in start order
                ranks.update({pid: i for i, pid in enumerate(sorted(siblings))})
        return [(pid, ranks.get(pid), name) for pid, _, name in found]

    def capture(self, root_pid: int, budget_s: float = BUDGET_S) -> List[ProcessStack]:
        deadline = self._mono() + budget_s
        targets = self.targets(root_pid)
        running: Dict[int, Any] = {}
        if self.py_spy is not None:
            for pid, _, _ in targets:
                running[pid] = self._start(pid, process.proc_state(pid) == "T")
        out = []
        for pid, rank, name in targets:
            threads, source, error = self._finish(pid, running.get(pid), deadline)
            if threads is None and (error is None or PERMISSION in error or self.py_spy is None):
                threads, source, error = self._faulthandler(pid, deadline, error)
            out.append(ProcessStack(pid, rank, name, source, tuple(threads or ()), error))
        return out

    def _start(self, pid: int, stopped: bool) -> Optional[Tuple[Any, str]]:
        assert self.py_spy is not None
        mode = ["--nonblocking"] if stopped else ["--native"]
        argv = [self.py_spy, "dump", "--json", "--pid", str(pid), *mode]
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, close_fds=True)
        except OSError as e:
            log.warning("cannot run py-spy: %s", e)
            return None
        return proc, "py-spy --nonblocking" if stopped else "py-spy"

    def _finish(self, pid: int, started: Optional[Tuple[Any, str]],
                deadline: float) -> Tuple[Optional[List[ThreadStack]], Optional[str], Optional[str]]:
        if started is None:
            return None, None, None if self.py_spy is None else "py-spy could not start"
        proc, source = started
        native = "--native" in proc.args
        room = deadline - self._mono() - (PLAIN_RESERVE_S if native else 0.0)
        timeout = max(0.1, room if self.per_process_s is None else min(self.per_process_s, room))
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return self._plain_after(pid, native, deadline, f"py-spy --native took over {timeout:.1f} s")
        text = err.decode("utf-8", "replace").strip()
        if proc.returncode != 0:
            why = (text.splitlines()[0] if text else f"py-spy exited {proc.returncode}")[:300]
            if PERMISSION in text:
                return None, source, why
            return self._plain_after(pid, native, deadline, why)  # native unwinding failed
        try:
            return parse_pyspy_json(out.decode("utf-8", "replace")), source, None
        except ValueError as e:
            return None, source, f"py-spy output unreadable: {e}"[:300]

    def _plain_after(self, pid: int, native: bool, deadline: float, why: str
                     ) -> Tuple[Optional[List[ThreadStack]], Optional[str], Optional[str]]:
        """After a native dump that failed: the plain one, its stack saying why it has no native frames."""
        if not native:
            return None, "py-spy --nonblocking", why
        threads, source, error = self._finish(pid, self._retry_plain(pid), deadline)
        if threads is None:
            return None, source, f"{why}; then {error}"[:300]
        return threads, source, f"no native frames: {why}"[:300]

    def _retry_plain(self, pid: int) -> Optional[Tuple[Any, str]]:
        started = self._start(pid, True)
        if started is None:
            return None
        return started[0], "py-spy --nonblocking"

    def _faulthandler(self, pid: int, deadline: float, why: Optional[str]
                      ) -> Tuple[Optional[List[ThreadStack]], Optional[str], Optional[str]]:
        hint = faulthandler_hints(self.run_dir).get(pid)
        reason = why or "py-spy not found"
        if hint is None:
            return None, None, f"{reason}; no faulthandler registered (onbox.integrations)"[:300]
        signum, path = hint
        target = Path(path) if Path(path).is_absolute() else self.run_dir / path
        try:
            before = target.stat().st_size
        except OSError:
            before = 0
        try:
            self._kill(pid, signum)
        except OSError as e:
            return None, "faulthandler", f"{reason}; signal {signum}: {e}"[:300]
        last, stable_since = before, None
        while self._mono() < deadline:
            try:
                size = target.stat().st_size
            except OSError:
                size = before
            if size > before and size == last:
                if stable_since is not None and self._mono() - stable_since >= 0.2:
                    break
                stable_since = stable_since or self._mono()
            else:
                stable_since = None
            last = size
            time.sleep(0.05)  # polling a file another process appends to, within the deadline
        if last <= before:
            return None, "faulthandler", f"{reason}; the faulthandler dump did not arrive"[:300]
        with open(target, "rb") as f:
            f.seek(before)
            text = f.read(1 << 20).decode("utf-8", "replace")
        return parse_faulthandler(text), "faulthandler", None


def annotate(data: Mapping[str, Any], stacks: Sequence[ProcessStack], elapsed_s: float) -> Dict[str, Any]:
    """job.stalled's data with the stacks and, when they show it, the collective verdict."""
    out = dict(data)
    out["stacks"] = compact(stacks, MAX_STACKS_BYTES)
    out["stacks_s"] = round(elapsed_s, 2)
    found = collective_verdict(stacks)
    if found is not None:
        if out.get("verdict") != STOPPED_VERDICT:
            out["verdict_before_stacks"] = out.get("verdict")
            out["verdict"] = found["verdict"]
        out["hang"] = found
    return out


class StallStacks:
    """The sidecar's emit-path hook for stalls; see the module doc."""

    def __init__(self, job_pid: Optional[int], emit: Emit, capture: Optional[StackCapture] = None,
                 budget_s: float = BUDGET_S, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.job_pid = job_pid
        self._emit = emit
        self._capture = capture
        self.budget_s = budget_s
        self._mono = monotonic
        self.merge = StallMerge()
        self._lock = threading.Lock()
        self._worker: Optional[threading.Thread] = None
        self.last_capture_s: Optional[float] = None

    def route(self, kind: str, data: Mapping[str, Any], sev: Optional[str]) -> bool:
        """True: the caller emits (kind, data) now; False: it was taken (held, or merged away)."""
        if kind == "job.exited":
            self.wait(self.budget_s + 2.0)
            self.merge.reset()
            return True
        if kind not in ("job.stalled", "job.progressing"):
            return True
        if kind == "job.progressing":
            self.wait(self.budget_s + 2.0)
        if not self.merge.route(kind, data):
            log.info("%s merged into the open stall: %s", kind, data.get("verdict") or data.get("signal"))
            return False
        if kind != "job.stalled" or self.job_pid is None or self._capture is None:
            return True
        worker = threading.Thread(target=self._run, args=(dict(data), sev), name="rgt-stacks", daemon=True)
        with self._lock:
            self._worker = worker
        worker.start()
        return False

    def _run(self, data: Dict[str, Any], sev: Optional[str]) -> None:
        started = self._mono()
        try:
            assert self._capture is not None and self.job_pid is not None
            stacks = self._capture.capture(self.job_pid, self.budget_s)
            self.last_capture_s = self._mono() - started
            data = annotate(data, stacks, self.last_capture_s)
        except Exception as e:  # a thread boundary: the stall goes out without stacks
            log.exception("stack capture failed")
            data["stacks_error"] = f"{type(e).__name__}: {e}"[:300]
        self._emit("job.stalled", data, sev)

    def wait(self, timeout_s: float) -> bool:
        """Wait for a held onset to go out; True when none is pending."""
        with self._lock:
            worker = self._worker
        if worker is None or worker is threading.current_thread():
            return True
        worker.join(timeout_s)
        return not worker.is_alive()

    def close(self, timeout_s: float = BUDGET_S + 2.0) -> None:
        self.wait(timeout_s)


__all__ = ["StackCapture", "StallStacks", "annotate", "faulthandler_hints", "find_py_spy"]
