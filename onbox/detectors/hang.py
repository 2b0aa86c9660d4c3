"""Where a hang is: Python stacks parsed and judged, stopped processes, one stall state.

Pure interpretation; the capture (py-spy, faulthandler, /proc) is onbox/monitors/stacks.py.

- `parse_pyspy_json` reads ``py-spy dump --json [--native]``; `parse_faulthandler` reads what
  `faulthandler.dump_traceback` writes. Both give `ThreadStack`s, innermost frame first.
- `collective_verdict`: when some ranks wait in a collective (torch.distributed all_reduce/broadcast/
  barrier/wait..., DDP's gradient all_reduce at the end of backward, gloo/nccl/c10d native frames)
  and others are elsewhere, the run is "hung in a collective on rank R" (R: the ranks that are not
  in it: the ones the others wait for).
- `compact`: the innermost frames of each thread as "func (file:line)", capped in size, for the event.
- `StoppedDetector`: a process of the job in state T (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU: /proc does
  not say which) is a `job.stalled` with verdict "stopped (SIGSTOP)" at once; `job.progressing`
  when it runs again.
- `StallMerge`: the training monitor's stall and the stopped-process stall are one state to the
  person: one onset, one clear.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from onbox.detectors.hysteresis import Finding

STOPPED_VERDICT = "stopped (SIGSTOP)"
SOURCE_PROCESS_STATE = "process_state"
MAX_FRAMES = 12
MAX_THREADS = 8

# torch.distributed's blocking calls (Python frames whose file is under torch/distributed)
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
               "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "wait",
               "batch_isend_irecv", "new_group", "init_process_group", "_store_based_barrier"}
_NATIVE_COLLECTIVE = re.compile(
    r"Reducer::finalize_backward|ProcessGroup\w*::|gloo::|nccl|"
    r"c10d::\S*(?:allreduce|all_reduce|broadcast|barrier|allgather|all_gather|reduce_scatter|alltoall|wait)",
    re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Frame:
    name: str
    file: str
    line: int
    native: bool = False

    def text(self) -> str:
        return f"{self.name} ({self.file})" if self.native else f"{self.name} ({self.file}:{self.line})"


@dataclasses.dataclass(frozen=True)
class ThreadStack:
    name: str
    frames: Tuple[Frame, ...]       # innermost first
    tid: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class ProcessStack:
    """One process's stacks, or why there are none (`error`)."""

    pid: int
    rank: Optional[int]
    name: Optional[str]
    source: Optional[str]           # "py-spy", "py-spy --nonblocking", "faulthandler"
    threads: Tuple[ThreadStack, ...] = ()
    error: Optional[str] = None


def _short(path: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    parts = path.rsplit("/", 2)
    return "/".join(parts[-2:]) if len(parts) > 2 else path


def _native(name: str, file: str, line: int) -> bool:
    return line == 0 and not file.endswith(".py")


def parse_pyspy_json(text: str) -> List[ThreadStack]:
    """``py-spy dump --json`` output (a list of threads); raises ValueError when it is not that."""
    doc = json.loads(text)
    if not isinstance(doc, list):
        raise ValueError("py-spy output is not a list of threads")
    out: List[ThreadStack] = []
    for thread in doc:
        if not isinstance(thread, dict):
            continue
        frames = []
        for f in thread.get("frames") or []:
            if not isinstance(f, dict):
                continue
            name, line = str(f.get("name") or "?")[:200], f.get("line")
            file = str(f.get("short_filename") or f.get("filename") or "?")[:300]
            line = line if isinstance(line, int) and not isinstance(line, bool) else 0
            frames.append(Frame(name, file, line, _native(name, file, line)))
        tid = thread.get("os_thread_id")
        out.append(ThreadStack(str(thread.get("thread_name") or "thread")[:100], tuple(frames),
                               tid if isinstance(tid, int) else None))
    return out


_FH_THREAD = re.compile(r"^(?:Current thread|Thread) (?P<tid>0x[0-9a-f]+)|^Stack \(most recent call first\)")
_FH_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<name>\S+)')


def parse_faulthandler(text: str) -> List[ThreadStack]:
    """What `faulthandler.dump_traceback(all_threads=True)` writes, innermost frame first."""
    out: List[ThreadStack] = []
    name: Optional[str] = None
    tid: Optional[int] = None
    frames: List[Frame] = []
    for raw in text.splitlines():
        head = _FH_THREAD.match(raw)
        if head is not None:
            if name is not None:
                out.append(ThreadStack(name, tuple(frames), tid))
            tid = int(head.group("tid"), 16) if head.group("tid") else None
            name, frames = ("current thread" if raw.startswith("Current") else "thread"), []
            continue
        m = _FH_FRAME.match(raw)
        if m is not None and name is not None:
            frames.append(Frame(m.group("name"), _short(m.group("file")), int(m.group("line"))))
    if name is not None:
        out.append(ThreadStack(name, tuple(frames), tid))
    return out


def collective_of(thread: ThreadStack) -> Optional[str]:
    """The collective this thread waits in, or None."""
    for frame in thread.frames:
        if frame.native:
            if "Reducer::finalize_backward" in frame.name:
                return "all_reduce (DDP gradient sync in backward)"
            if _NATIVE_COLLECTIVE.search(frame.name):
                return frame.name.split("(")[0][:80]
            continue
        base = frame.name.rsplit(".", 1)[-1]
        if "torch/distributed" in frame.file and base in COLLECTIVES:
            return base
    return None


def _where(stack: ProcessStack) -> str:
    for thread in stack.threads:
        for frame in thread.frames:
            if not frame.native:
                return frame.text()
    return "?"


def _label(stack: ProcessStack) -> str:
    return f"rank {stack.rank}" if stack.rank is not None else f"pid {stack.pid}"


def collective_verdict(stacks: Sequence[ProcessStack]) -> Optional[Dict[str, Any]]:
    """"hung in a collective on rank R" and its details when the stacks show it, else None."""
    seen = [s for s in stacks if s.threads]
    ranked = [s for s in seen if s.rank is not None]
    procs = ranked or seen  # the launcher (torchrun's agent) has no rank: leave it out
    waiting: Dict[int, str] = {}
    for s in procs:
        op = next((c for c in map(collective_of, s.threads) if c), None)
        if op is not None:
            waiting[s.pid] = op
    if not waiting:
        return None
    others = [s for s in procs if s.pid not in waiting]
    ops = sorted(set(waiting.values()))
    in_it = [_label(s) for s in procs if s.pid in waiting]
    if others:
        names = ", ".join(_label(s).replace("rank ", "") if s.rank is not None else _label(s) for s in others)
        verdict = f"hung in a collective on rank {names}"
        detail = (f"{', '.join(in_it)} wait in {', '.join(ops)}; "
                  + "; ".join(f"{_label(s)} is at {_where(s)}" for s in others))
    else:
        verdict = "hung in a collective"
        detail = (f"every rank seen ({', '.join(in_it)}) waits in {', '.join(ops)} "
                  "(a rank elsewhere, another node?)")
    return {"verdict": verdict, "collective": ops[0], "detail": detail[:600],
            "ranks_waiting": [s.rank for s in procs if s.pid in waiting and s.rank is not None],
            "ranks_elsewhere": [s.rank for s in others if s.rank is not None],
            "pids_elsewhere": [s.pid for s in others]}


def _thread_doc(thread: ThreadStack, max_frames: int) -> Dict[str, Any]:
    shown = [f for f in thread.frames if not f.native or _NATIVE_COLLECTIVE.search(f.name)]
    return {"name": thread.name, "frames": [f.text()[:200] for f in shown[:max_frames]],
            "more": max(0, len(shown) - max_frames)}


def compact(stacks: Sequence[ProcessStack], max_bytes: int = 40_000,
            max_frames: int = MAX_FRAMES) -> List[Dict[str, Any]]:
    """The stacks for an event: per process its innermost frames per thread, within `max_bytes`
    (fewer frames, then fewer threads, then a process with only its error, as it must)."""
    for frames, threads in ((max_frames, MAX_THREADS), (6, 4), (3, 1), (0, 0)):
        out = []
        for s in stacks:
            doc: Dict[str, Any] = {"pid": s.pid, "rank": s.rank, "name": s.name, "source": s.source}
            if s.error:
                doc["error"] = s.error[:300]
            if threads:
                doc["threads"] = [_thread_doc(t, frames) for t in s.threads[:threads]]
            out.append(doc)
        if len(json.dumps(out)) <= max_bytes:
            return out
    return out[: max(1, max_bytes // 400)]


def short_text(stacks: Sequence[Mapping[str, Any]], frames: int = 4, width: int = 400) -> List[str]:
    """One line per process: "rank 0 (pid 12): f (a.py:3) < g (b.py:9)" (innermost first)."""
    lines = []
    for s in stacks:
        who = f"rank {s.get('rank')}" if s.get("rank") is not None else "pid"
        threads = s.get("threads") or []
        top = (threads[0].get("frames") or []) if threads and isinstance(threads[0], Mapping) else []
        body = " < ".join(str(f) for f in top[:frames]) if top else (s.get("error") or "no stack")
        lines.append(f"{who} (pid {s.get('pid')}): {body}"[:width])
    return lines


class StoppedDetector:
    """`job.stalled` "stopped (SIGSTOP)" as soon as a process of the job is in state T; its clear
    when every one of them runs again (or is gone while the job lives)."""

    def __init__(self) -> None:
        self.stopped: Dict[int, Mapping[str, Any]] = {}
        self.since: Optional[float] = None

    def update(self, now: float, stopped: Mapping[int, Mapping[str, Any]], alive: bool) -> List[Finding]:
        if not alive:
            self.stopped, self.since = {}, None  # the exit tells; no clear
            return []
        if stopped and not self.stopped:
            self.stopped, self.since = dict(stopped), now
            pids = sorted(stopped)
            data = {"state": "onset", "verdict": STOPPED_VERDICT, "source": SOURCE_PROCESS_STATE,
                    "stopped_pids": pids, "processes": [dict(stopped[p]) for p in pids][:32],
                    "idle_s": 0.0, "budget_s": None,
                    "how": "state T in /proc/PID/stat: stopped by SIGSTOP (or SIGTSTP/SIGTTIN/SIGTTOU); "
                           "SIGCONT resumes it"}
            return [Finding("job.stalled", data, "warn")]
        if stopped:
            self.stopped.update(stopped)
            return []
        if not self.stopped:
            return []
        pids, since = sorted(self.stopped), self.since or now
        self.stopped, self.since = {}, None
        data = {"state": "cleared", "signal": "SIGCONT", "source": SOURCE_PROCESS_STATE, "pids": pids,
                "stopped_s": round(now - since, 1)}
        return [Finding("job.progressing", data, "info")]


class StallMerge:
    """One stall state from two sources (the training monitor's no-progress stall and the stopped
    process): only the first onset and the last clear pass; a clear nobody opened passes too."""

    def __init__(self) -> None:
        self.active: Set[str] = set()

    def route(self, kind: str, data: Mapping[str, Any]) -> bool:
        source = str(data.get("source") or "progress")
        if kind == "job.stalled" and data.get("state") != "cleared":
            was = bool(self.active)
            self.active.add(source)
            return not was
        if source not in self.active:
            return True
        self.active.discard(source)
        return not self.active

    def reset(self) -> None:
        self.active.clear()
