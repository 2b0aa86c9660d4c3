"""Runs on this box: where they live and what state they are in (stopping one: onbox/stop.py).

A run is `<root>/<project>/active/<run-id>/`. The launcher and the processes it starts
leave these files in its `rgt/` directory; everything here is read from them and from /proc:

    job.json         written by the job wrapper once the job runs: the wrapper's and the job's pid,
                     start time (clock ticks since boot, /proc/<pid>/stat field 22) and boot id, so a
                     recycled pid is never taken for ours
    job.pid          the wrapper's pid (what the sidecar watches), for people and scripts
    exit.json        {"code", "signal", "oom_killed", ...} written by the wrapper before it exits
    stop.json        written by `stop_run` (onbox/stop.py) before it signals: the exit was asked for
    supervisor.pid   the sidecar supervisor's pid; supervisor.json its identity and its sidecar's
    events.jsonl     the sidecar's journal (only its tail is read, for the last seq)

Linux only (/proc). Standard library only: the job wrapper imports this module too.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Tuple

from protocol.ids import is_run_id

from onbox.custody import manifest
from onbox.errors import OnboxError
from onbox.fsutil import write_atomic, write_json_atomic

PROC = Path("/proc")
_TAIL_BYTES = 16 << 10
_SKIP_CKPT = (".tmp", ".partial", ".lock", ".incomplete")


class RunError(OnboxError):
    """A run cannot be found, read or stopped."""


# ---- files --------------------------------------------------------------------------------------


class RunPaths:
    """The files of one run directory (see the module doc)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.rgt = self.run_dir / "rgt"
        self.run_json = self.run_dir / "run.json"
        self.train_log = self.run_dir / "train.log"
        self.job_json = self.rgt / "job.json"
        self.job_pid = self.rgt / "job.pid"
        self.exit_json = self.rgt / "exit.json"
        self.stop_json = self.rgt / "stop.json"
        self.supervisor_pid = self.rgt / "supervisor.pid"
        self.supervisor_json = self.rgt / "supervisor.json"
        self.supervisor_log = self.rgt / "supervisor.log"
        self.sidecar_log = self.rgt / "sidecar.log"
        self.preflight_json = self.rgt / "preflight.json"
        self.exit_reported = self.rgt / "job.exit_reported"   # written by the sidecar's monitor
        self.closed = self.rgt / "run.closed"                  # the sidecar's close-out is done
        self.closing = self.rgt / "closing.json"               # ... and while it runs, what is pending
        self.attempts = self.rgt / "attempts"
        self.launch_lock = self.rgt / "launch.lock"
        self.supervisor_lock = self.rgt / "supervisor.lock"


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    """A JSON object from a file; None when it is missing, torn or not an object."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def utc_iso(ts: Optional[float] = None) -> str:
    """2024-06-01T12:00:00+00:00 (fromisoformat reads it on every Python we support)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() if ts is None else ts))


# ---- processes ----------------------------------------------------------------------------------


def proc_stat(pid: int, proc: Path = PROC) -> Optional[Tuple[str, int, int]]:
    """(state, process group, start ticks) of a pid, or None when it does not exist."""
    try:
        raw = (proc / str(pid) / "stat").read_bytes()
    except (OSError, ValueError):
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return fields[0].decode(), int(fields[2]), int(fields[19])
    except (IndexError, ValueError):
        return None


def boot_id(proc: Path = PROC) -> Optional[str]:
    try:
        return (proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip() or None
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class ProcRef:
    """A process we started: pid plus start time and boot, so a recycled pid is not ours."""

    pid: int
    start_ticks: Optional[int]
    boot_id: Optional[str]

    @classmethod
    def of(cls, pid: int) -> Optional[ProcRef]:
        st = proc_stat(pid)
        return None if st is None else cls(pid, st[2], boot_id())

    @classmethod
    def from_dict(cls, doc: Any) -> Optional[ProcRef]:
        if not isinstance(doc, dict) or not isinstance(doc.get("pid"), int):
            return None
        ticks = doc.get("start_ticks")
        boot = doc.get("boot_id")
        return cls(doc["pid"], ticks if isinstance(ticks, int) else None,
                   boot if isinstance(boot, str) else None)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def alive(self) -> bool:
        """True while this very process runs (a zombie has exited; another boot's pid is not ours)."""
        if self.boot_id is not None and boot_id() not in (None, self.boot_id):
            return False
        st = proc_stat(self.pid)
        if st is None or st[0] in ("Z", "X", "x"):
            return False
        return self.start_ticks is None or st[2] == self.start_ticks

    def recycled(self) -> bool:
        """True when the pid now names another process (so it must never be signalled)."""
        st = proc_stat(self.pid)
        if st is None:
            return False
        other_boot = self.boot_id is not None and boot_id() not in (None, self.boot_id)
        return other_boot or (self.start_ticks is not None and st[2] != self.start_ticks)


def end_process(ref: Optional[ProcRef], timeout_s: float) -> None:
    """SIGTERM a process we started (pid + start time checked), SIGKILL it after `timeout_s`."""
    for signum, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        if ref is None or not ref.alive():
            return
        try:
            os.kill(ref.pid, signum)
        except ProcessLookupError:
            return
        wait_for(lambda: not ref.alive(), wait_s)


def group_members(pgid: int, proc: Path = PROC) -> List[int]:
    """Live (non-zombie) processes in process group `pgid`. Reads every /proc/<pid>/stat: call rarely."""
    out: List[int] = []
    try:
        names = os.listdir(proc)
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            st = proc_stat(int(name), proc)
            if st is not None and st[1] == pgid and st[0] not in ("Z", "X", "x"):
                out.append(int(name))
    return out


def wait_for(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.05) -> Any:
    """Poll `predicate` until truthy or the deadline; returns its last value."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        pause.wait(min(interval_s, max(0.0, deadline - time.monotonic())))


# ---- finding runs -------------------------------------------------------------------------------


def default_root(environ: Optional[Dict[str, str]] = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(env.get("RGT_ROOT") or "~/rgt-runs").expanduser()


def run_dirs(root: Path) -> List[Path]:
    """Every <root>/<project>/active/<run-id> that the launcher made (it holds run.json or rgt/)."""
    out: List[Path] = []
    root = Path(root).expanduser()
    for active in sorted(root.glob("*/active")):
        for run_dir in sorted(active.iterdir()) if active.is_dir() else []:
            if run_dir.is_dir() and ((run_dir / "run.json").exists() or (run_dir / "rgt").is_dir()):
                out.append(run_dir)
    return out


def resolve_run(root: Path, ref: str) -> Path:
    """A run from "<project>/<run-id>", a bare run id unique under the root, or an explicit path.

    Names come first: a ref is read by the run-id grammar under the root, so "..", "p" or a word
    that happens to name a folder in the cwd is never taken for a run. A path counts only when it
    says it is one (absolute, "~...", "./..." or "../...") and the folder holds a run (run.json, or
    the rgt/ of a journal)."""
    if _is_explicit_path(ref):
        as_path = Path(ref).expanduser()
        if as_path.is_dir() and ((as_path / "run.json").exists() or (as_path / "rgt").is_dir()):
            return as_path.resolve()
        raise RunError(f"{ref!r} is not a run directory (no run.json or rgt/ in it)")
    root = Path(root).expanduser()
    if "/" in ref:
        project, _, run_id = ref.partition("/")
        candidates = [root / project / "active" / run_id] if is_run_id(project) and is_run_id(run_id) else []
    else:
        candidates = list(root.glob(f"*/active/{ref}")) if is_run_id(ref) else []
    found = [c for c in candidates if c.is_dir()]
    if not found:
        raise RunError(f"no run {ref!r} under {root}")
    if len(found) > 1:
        names = ", ".join(f"{c.parent.parent.name}/{c.name}" for c in found)
        raise RunError(f"run id {ref!r} is in several projects ({names}); name it as <project>/<run-id>")
    return found[0].resolve()


def _is_explicit_path(ref: str) -> bool:
    """Whether a run ref is written as a path: absolute, from home, or relative with ./ or ../."""
    return ref.startswith(("/", "~", "./", "../"))


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _entry_size(path: Path, max_files: int = 10000) -> int:
    """A file's size, or the total of a directory's files (the first `max_files` of them)."""
    if path.is_file():
        return path.stat().st_size
    total, seen = 0, 0
    for base, _dirs, files in os.walk(path):
        for name in files[:max(0, max_files - seen)]:
            try:
                total += os.stat(os.path.join(base, name)).st_size
            except OSError:
                continue
        seen += len(files)
        if seen >= max_files:
            break
    return total


def newest_checkpoint_in(ckpt_dir: Path) -> Optional[Tuple[Path, int]]:
    """The newest entry (file, or directory of shards) in a checkpoint dir and its size; partial
    writes (.tmp, .partial, ...) and hidden files are not checkpoints."""
    try:
        entries = [p for p in ckpt_dir.iterdir()
                   if not p.name.startswith(".") and not p.name.endswith(_SKIP_CKPT)]
        newest = max(entries, key=lambda p: p.stat().st_mtime, default=None)
        return (newest, _entry_size(newest)) if newest is not None else None
    except OSError:
        return None


def newest_checkpoint_of(run_dir: Path, ckpt_dir: Optional[Path] = None) -> Optional[Tuple[Path, int]]:
    """A run's newest checkpoint and size: the manifest's newest record, else its checkpoint dir's."""
    records = manifest.read(run_dir)
    if records:
        rec = max(records, key=lambda r: (r.ts, r.step or -1))
        return run_dir / rec.path, rec.size
    if ckpt_dir is None:
        recorded = (read_json(run_dir / "run.json") or {}).get("ckpt_dir")
        ckpt_dir = Path(recorded) if isinstance(recorded, str) else run_dir / "checkpoints"
    return newest_checkpoint_in(ckpt_dir)


# ---- state --------------------------------------------------------------------------------------


@dataclasses.dataclass
class JobRecord:
    """rgt/job.json: the wrapper (watched by the sidecar) and the job (leader of its process group)."""

    wrapper: Optional[ProcRef]
    job: Optional[ProcRef]
    pgid: Optional[int]
    attempt: Optional[int]

    @classmethod
    def read(cls, paths: RunPaths) -> Optional[JobRecord]:
        doc = read_json(paths.job_json)
        if doc is None:
            return None
        pgid, attempt = doc.get("pgid"), doc.get("attempt")
        return cls(ProcRef.from_dict(doc.get("wrapper")), ProcRef.from_dict(doc.get("job")),
                   pgid if isinstance(pgid, int) else None, attempt if isinstance(attempt, int) else None)

    def alive(self) -> bool:
        return any(ref is not None and ref.alive() for ref in (self.wrapper, self.job))


@dataclasses.dataclass
class RunStatus:
    run_id: str
    project: str
    run_dir: str
    state: str                       # starting | running | stopping | exited | vanished | failed
    code: Optional[int] = None
    signal: Optional[int] = None
    stop_requested: bool = False
    pid: Optional[int] = None        # the job wrapper (what the sidecar watches)
    job_pid: Optional[int] = None    # the job itself, leader of its process group
    attempt: Optional[int] = None
    sidecar_alive: Optional[bool] = None
    supervisor_alive: Optional[bool] = None
    last_seq: Optional[int] = None
    last_kind: Optional[str] = None
    last_ts: Optional[float] = None
    started_at: Optional[str] = None
    error: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def label(self) -> str:
        """"running", "exited code 1", "killed by SIGKILL (stop)", "vanished"..."""
        if self.state != "exited":
            return self.state
        why = " (stop)" if self.stop_requested else ""
        if self.signal is not None:
            return f"killed by {signal_name(self.signal)}{why}"
        return f"exited code {self.code}{why}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def journal_tail(rgt_dir: Path) -> Optional[Tuple[int, Optional[str], Optional[float]]]:
    """(seq, kind, ts) of the journal's last complete event, reading at most the last 16 KiB."""
    candidates = [rgt_dir / "events.jsonl"]
    try:
        rotated = sorted(p for p in rgt_dir.iterdir() if re.match(r"^events\.\d{12}\.jsonl$", p.name))
    except OSError:
        rotated = []
    candidates += reversed(rotated)
    for path in candidates:
        try:
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - _TAIL_BYTES))
                tail = f.read()
        except OSError:
            continue
        for line in reversed(tail.split(b"\n")[1 if size > _TAIL_BYTES else 0:-1]):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and isinstance(event.get("seq"), int):
                kind, ts = event.get("kind"), event.get("ts")
                return (event["seq"], kind if isinstance(kind, str) else None,
                        float(ts) if isinstance(ts, (int, float)) else None)
    return None


def _sidecar_alive(paths: RunPaths) -> Tuple[Optional[bool], Optional[bool]]:
    doc = read_json(paths.supervisor_json)
    if doc is None:
        return None, None
    sup = ProcRef.from_dict(doc)
    sidecar = ProcRef.from_dict(doc.get("sidecar"))
    return (sidecar is not None and sidecar.alive()), (sup is not None and sup.alive())


def close_state(run_dir: Path) -> Dict[str, Any]:
    """Whether the run's pull manifest is final (onbox/sidecar/closing.py), from its files and /proc:
    "closed" (final), "incomplete" (closed with units still hashing), "closing" (the job exited and
    its sidecar or their supervisor still runs: a run.closed will come), "running" (the job has not
    exited: a pull is a snapshot), "unclosed" (exited, and nothing is left to close it)."""
    paths = RunPaths(Path(run_dir))
    closed = read_json(paths.closed)
    if closed is not None:
        found = closed.get("incomplete")
        incomplete: List[Any] = found if isinstance(found, list) else []
        return {"state": "incomplete" if incomplete else "closed", "final": not incomplete,
                "incomplete": incomplete[:50], "seq": closed.get("seq")}
    if not (paths.exit_reported.exists() or paths.exit_json.exists()):
        return {"state": "running", "final": False}
    sidecar, supervisor = _sidecar_alive(paths)
    if sidecar or supervisor:
        doc = read_json(paths.closing) or {}
        pending = doc.get("pending")
        return {"state": "closing", "final": False,
                "pending": pending[:50] if isinstance(pending, list) else [],
                "pending_bytes": doc.get("pending_bytes"), "eta_s": doc.get("eta_s"),
                "elapsed_s": doc.get("elapsed_s")}
    return {"state": "unclosed", "final": False,
            "reason": "the job exited and no sidecar is left to close the run: checkpoints it wrote at the "
                      "end may not be recorded"}


def run_status(run_dir: Path, full: bool = True) -> RunStatus:
    """The state of one run from its files and /proc; never raises for a half-written run.
    Without `full`, only the job's state: the sidecar's liveness and the journal's tail are not read."""
    paths = RunPaths(Path(run_dir))
    meta = read_json(paths.run_json) or {}
    status = RunStatus(run_id=str(meta.get("id") or paths.run_dir.name),
                       project=str(meta.get("project") or paths.run_dir.parent.parent.name),
                       run_dir=str(paths.run_dir), state="starting",
                       attempt=meta.get("attempt") if isinstance(meta.get("attempt"), int) else None,
                       started_at=meta.get("started_at") if isinstance(meta.get("started_at"), str) else None)
    job = JobRecord.read(paths)
    exit_doc = read_json(paths.exit_json)
    stop_doc = read_json(paths.stop_json)
    status.stop_requested = stop_doc is not None
    if job is not None:
        status.pid = job.wrapper.pid if job.wrapper else None
        status.job_pid = job.job.pid if job.job else None
    if exit_doc is not None:  # this attempt's record (a relaunch files the old one away)
        code, sig = exit_doc.get("code"), exit_doc.get("signal")
        status.code = code if isinstance(code, int) else None
        status.signal = sig if isinstance(sig, int) else None
        status.error = exit_doc.get("error") if isinstance(exit_doc.get("error"), str) else None
        status.state = "failed" if status.error else "exited"
    elif job is not None and job.alive():
        status.state = "stopping" if stop_doc is not None else "running"
    elif job is not None:
        status.state = "vanished"
    if not full:
        return status
    status.sidecar_alive, status.supervisor_alive = _sidecar_alive(paths)
    tail = journal_tail(paths.rgt)
    if tail is not None:
        status.last_seq, status.last_kind, status.last_ts = tail
    return status


def list_runs(root: Path, full: bool = True) -> List[RunStatus]:
    return [run_status(d, full) for d in run_dirs(root)]


def render_ps(statuses: Sequence[RunStatus], root: Path, as_json: bool, out: IO[str],
              now: Optional[float] = None) -> None:
    """A short table, or one JSON object {"root", "runs": [...]}."""
    if as_json:
        out.write(json.dumps({"root": str(root), "runs": [s.to_dict() for s in statuses]}) + "\n")
        return
    if not statuses:
        out.write(f"no runs under {root}\n")
        return
    now = time.time() if now is None else now
    rows = [("RUN", "STATE", "PID", "SIDECAR", "SEQ", "LAST EVENT")]
    for s in statuses:
        sidecar = "-" if s.sidecar_alive is None else ("up" if s.sidecar_alive else "down")
        last = "-"
        if s.last_kind is not None and s.last_ts is not None:
            last = f"{s.last_kind} {max(0.0, now - s.last_ts):.0f}s ago"
        rows.append((f"{s.project}/{s.run_id}", s.label, str(s.pid or "-"), sidecar,
                     "-" if s.last_seq is None else str(s.last_seq), last))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        out.write("  ".join([*(r[i].ljust(widths[i]) for i in range(5)), r[5]]).rstrip() + "\n")


__all__ = ["JobRecord", "ProcRef", "RunError", "RunPaths", "RunStatus", "boot_id", "close_state",
           "default_root", "end_process", "group_members", "journal_tail", "list_runs",
           "nearest_existing", "newest_checkpoint_in", "newest_checkpoint_of",
           "proc_stat", "read_json", "render_ps", "resolve_run", "run_dirs",
           "run_status", "utc_iso", "wait_for", "write_atomic", "write_json_atomic"]
