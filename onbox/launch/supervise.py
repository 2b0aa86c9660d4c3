"""The two detached processes `rgt-onbox launch` leaves behind: the job wrapper and the sidecar supervisor.

    python -m onbox.launch.supervise job --run-dir RUN              (spec on stdin)
    python -m onbox.launch.supervise sidecar --run-dir RUN --pid WRAPPER_PID [--linger S] [-- SERVE ARGS...]

**The job wrapper** (`job`) is what the sidecar watches (`serve --pid`). It reads its spec (argv,
cwd, the job's full environment) as one JSON object from stdin, so neither a secret value nor the
command appears in its own command line or environment. It appends a header to train.log, starts the
job in a session and process group of its own (stdin /dev/null, stdout+stderr appended to train.log),
writes rgt/job.json (wrapper and job pid + start time), waits, and writes rgt/exit.json (code, signal;
tmp + rename) before it exits with the job's status. SIGTERM/SIGINT sent to the wrapper are passed
on to the job's process group; when rgt did not ask for the stop (no rgt/stop.json) the wrapper
first writes rgt/preempt.json and the exit record says `preempted` (onbox/custody/preempt.py). SIGHUP is
ignored. It lowers its own OOM score where allowed, so the
kernel never picks the small wrapper instead of the job.

**The supervisor** (`sidecar`) keeps one `rgt-onbox serve --run-dir RUN --pid WRAPPER_PID` running,
niced +10 and in the best-effort I/O class at its lowest level (through `ionice`, where it exists),
both inherited from the supervisor itself. It polls its sidecar every 0.25 s; a sidecar that dies
while the job has not been reported is started again after a backoff of 0.5 s doubling to at most
4 s (reset once a sidecar has lived 30 s), so a restart begins within 5 s and never spins. It ends:

- when the job is gone, the sidecar has reported its exit (the monitor's rgt/job.exit_reported
  names the wrapper pid) and closed the run (rgt/run.closed: onbox/sidecar/closing.py; at most
  `--close-timeout` after the report, default 180 s), after `--linger` seconds (default 300: a
  controller that was away can still fetch the last events over the tunnel), by SIGTERM to the
  sidecar; or at once when the sidecar itself exits after that report;
- when the job is gone and no report came within `--report-timeout` (default 120 s);
- on SIGTERM/SIGINT (the launcher does this before a relaunch), stopping its sidecar first.
  With `--finish-on-term` (what `rgt-onbox launch --wait` asks for: under a scheduler such as
  Slurm, ending a step signals every process of it, the supervisor and the sidecar included) the
  first one, while the job's exit is not reported yet, only drops the linger: the supervisor ends
  once the sidecar has journaled the exit (the sidecar, started with the same option, stays for
  it too); a second one stops now.

Neither process ever signals anything but its own child: the supervisor only its sidecar, the wrapper
only its job's group (and only when told to through its own SIGTERM/SIGINT). Standard library only.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from rgtlib import lockfile
from rgtlib.backoff import Backoff

from onbox.custody.preempt import preemption, record_preemption
from onbox.runs import ProcRef, RunPaths, boot_id, read_json, utc_iso, write_atomic, write_json_atomic

log = logging.getLogger(__name__)

POLL_S = 0.25
BACKOFF_FIRST_S = 0.5
BACKOFF_CAP_S = 4.0
HEALTHY_AFTER_S = 30.0
SIDECAR_STOP_S = 10.0


# ---- the job wrapper ----------------------------------------------------------------------------


def _log_line(fd: int, text: str) -> None:
    try:
        os.write(fd, f"[rgt {utc_iso()}] {text}\n".encode(errors="replace"))
    except OSError:
        pass


def _lower_oom_score() -> None:
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-500\n")
    except OSError:
        pass  # needs CAP_SYS_RESOURCE; best effort


def _spawn_job(spec: Dict[str, Any], log_fd: int) -> subprocess.Popen:  # type: ignore[type-arg]
    return subprocess.Popen([str(a) for a in spec["argv"]], cwd=spec.get("cwd") or None,
                            env={str(k): str(v) for k, v in spec.get("env", {}).items()},
                            stdin=subprocess.DEVNULL, stdout=log_fd, stderr=subprocess.STDOUT,
                            start_new_session=True, close_fds=True)


def _oom_kills() -> Optional[int]:
    """The oom_kill counter of this process's memory cgroup (the job inherits it); None if unreadable.

    Read before the job starts and after it ends, this is the one reliable OOM witness: a job
    killed within its first second is gone before any sidecar could take a baseline."""
    from onbox.sources.host import CgroupReader

    try:
        reader = CgroupReader()
        where = reader.locate(os.getpid())
        memory = reader.memory(where) if where is not None else None
    except OSError:
        return None
    return memory.oom_kill if memory is not None else None


def _exit_doc(rc: int, job_pid: int, started: float, stop_requested: bool,
              oom_before: Optional[int] = None) -> Dict[str, Any]:
    oom_after = _oom_kills() if oom_before is not None and rc == -signal.SIGKILL else None
    oom_killed = oom_after is not None and oom_before is not None and oom_after > oom_before
    return {"code": rc if rc >= 0 else None, "signal": -rc if rc < 0 else None, "oom_killed": oom_killed,
            "pid": job_pid, "ended_at": utc_iso(), "duration_s": round(time.time() - started, 3),
            "stop_requested": stop_requested}


def _refuse_start(paths: RunPaths, log_fd: int, e: OSError, attempt: Any, started: float) -> int:
    code = 127 if isinstance(e, FileNotFoundError) else 126
    error = f"cannot start the command: {e.strerror or e} ({type(e).__name__})"
    _log_line(log_fd, error)
    me = ProcRef.of(os.getpid())
    write_json_atomic(paths.exit_json, {"code": code, "signal": None, "oom_killed": False, "pid": None,
                                        "ended_at": utc_iso(), "error": error, "stop_requested": False})
    # job.json last: the launcher reads exit.json's error as soon as job.json says "no job"
    write_json_atomic(paths.job_json, {"wrapper": me.to_dict() if me else {"pid": os.getpid()}, "job": None,
                                       "pgid": None, "attempt": attempt, "started_at": utc_iso(started)})
    return code


def run_job(run_dir: Path, spec: Dict[str, Any]) -> int:
    """Start the job, record it, wait for it, record its exit; returns the wrapper's exit status."""
    paths = RunPaths(run_dir)
    running: List[subprocess.Popen] = []  # type: ignore[type-arg]
    grace = spec.get("preempt_grace_s")
    grace_s = float(grace) if isinstance(grace, (int, float)) and not isinstance(grace, bool) else None

    recording: List[bool] = []   # a second signal inside the first's handler (Slurm signals twice)

    def forward(signum: int, _frame: Any) -> None:  # to the job's group, while it is ours to signal
        if running and running[0].returncode is None:
            if not recording:
                recording.append(True)
                try:
                    record_preemption(paths.rgt, signum, grace_s, running[0].pid)  # unless rgt asked
                finally:
                    recording.clear()
            try:
                os.killpg(running[0].pid, signum)
            except OSError:
                pass

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    log_fd = os.open(paths.train_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    attempt = spec.get("attempt")
    display = str(spec.get("display", "")).replace("\r", "\\r").replace("\n", "\\n")  # one header line
    _log_line(log_fd, f"run {spec.get('run_id')} attempt {attempt}: {display}")
    started = time.time()
    oom_before = _oom_kills()
    try:
        proc = _spawn_job(spec, log_fd)
    except OSError as e:
        return _refuse_start(paths, log_fd, e, attempt, started)
    running.append(proc)
    me, job = ProcRef.of(os.getpid()), ProcRef.of(proc.pid)
    write_json_atomic(paths.job_json, {
        "wrapper": me.to_dict() if me else {"pid": os.getpid()},
        "job": job.to_dict() if job else {"pid": proc.pid}, "pgid": proc.pid,
        "attempt": attempt, "started_at": utc_iso(started)})
    write_atomic(paths.job_pid, f"{os.getpid()}\n")
    _lower_oom_score()
    rc = proc.wait()
    doc = _exit_doc(rc, proc.pid, started, paths.stop_json.exists(), oom_before)
    preempt = preemption(paths.rgt)
    if preempt is not None:
        doc.update(preempted=True, preempt=preempt,
                   preempt_to_exit_s=round(max(0.0, time.time() - float(preempt.get("ts") or 0)), 3))
    write_json_atomic(paths.exit_json, doc)
    what = f"code {doc['code']}" if doc["signal"] is None else f"signal {doc['signal']}"
    what += " (killed by the kernel's OOM killer)" if doc["oom_killed"] else ""
    _log_line(log_fd, f"job exited with {what} after {doc['duration_s']:.1f} s")
    os.close(log_fd)
    return rc if rc >= 0 else 128 + (-rc)


def job_main(run_dir: Path) -> int:
    spec = json.load(sys.stdin)
    sys.stdin.close()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return run_job(run_dir, spec)


# ---- the sidecar supervisor ---------------------------------------------------------------------


def _renice_self() -> None:
    """+10 CPU nice and best-effort I/O level 7; inherited by the sidecar. Best effort."""
    try:
        os.nice(10)
    except OSError as e:
        log.warning("could not lower CPU priority: %s", e)
    ionice = shutil.which("ionice")
    if ionice is None:
        return
    try:
        subprocess.run([ionice, "-c", "2", "-n", "7", "-p", str(os.getpid())], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("ionice failed: %s", e)


class Supervisor:
    """Keeps one sidecar running for a job; see the module doc for when it ends."""

    def __init__(self, run_dir: Path, job_pid: int, serve_args: Sequence[str] = (), *,
                 linger_s: float = 300.0, report_timeout_s: float = 120.0, finish_on_term: bool = False,
                 close_timeout_s: float = 180.0,
                 python: str = sys.executable, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.paths = RunPaths(run_dir)
        self.finish_on_term = finish_on_term
        self.finishing = False
        self.job_pid = job_pid
        self.serve_args = list(serve_args)
        self.linger_s = linger_s
        self.report_timeout_s = report_timeout_s
        self.close_timeout_s = close_timeout_s
        self.exit_seen_at: Optional[float] = None   # the exit report seen, the close not yet
        self.python = python
        self._mono = monotonic
        self._stop = threading.Event()
        self.proc: Optional[subprocess.Popen] = None  # type: ignore[type-arg]
        self.started_mono = 0.0
        self.restarts = 0
        self.backoff = Backoff(BACKOFF_FIRST_S, BACKOFF_CAP_S, jitter=False)  # sidecar restarts
        self.restart_at = 0.0
        self.gone_at: Optional[float] = None
        self.reported_at: Optional[float] = None
        self.job = self._job_ref()
        self.me = ProcRef.of(os.getpid())

    def _job_ref(self) -> ProcRef:
        job = read_json(self.paths.job_json) or {}
        wrapper = ProcRef.from_dict(job.get("wrapper"))
        if wrapper is not None and wrapper.pid == self.job_pid:
            return wrapper
        return ProcRef.of(self.job_pid) or ProcRef(self.job_pid, None, boot_id())

    def stop(self) -> None:
        self._stop.set()

    def on_signal(self, signum: int) -> None:
        """SIGTERM/SIGINT: stop; with finish_on_term, the first one before the exit is reported
        only drops the linger (see the module doc)."""
        if self.finish_on_term and not self.finishing and self.reported_at is None:
            self.finishing = True
            self.linger_s = 0.0
            log.info("signal %d: the step is ending; stopping once the job's exit is journaled", signum)
            return
        log.info("signal %d: stopping", signum)
        self.stop()

    def _reported(self) -> bool:
        doc = read_json(self.paths.exit_reported)
        return doc is not None and doc.get("pid") == self.job_pid

    def _record(self, state: str) -> None:
        sidecar = ProcRef.of(self.proc.pid) if self.proc is not None and self.proc.poll() is None else None
        doc = {**(self.me.to_dict() if self.me else {"pid": os.getpid()}), "job_pid": self.job_pid,
               "sidecar": sidecar.to_dict() if sidecar else None, "restarts": self.restarts,
               "state": state, "updated_at": utc_iso(), "linger_s": self.linger_s}
        try:
            write_json_atomic(self.paths.supervisor_json, doc)
        except OSError as e:
            log.warning("could not write %s: %s", self.paths.supervisor_json, e)

    def _start_sidecar(self) -> None:
        argv = [self.python, "-m", "onbox.cli", "serve", "--run-dir", str(self.paths.run_dir),
                "--pid", str(self.job_pid), *(["--finish-on-term"] if self.finish_on_term else []),
                *self.serve_args]
        with open(self.paths.sidecar_log, "ab") as out:
            try:
                self.proc = subprocess.Popen(argv, cwd=str(self.paths.run_dir), stdin=subprocess.DEVNULL,
                                             stdout=out, stderr=subprocess.STDOUT, close_fds=True)
            except OSError as e:
                log.error("cannot start the sidecar: %s", e)
                self.proc = None
                self._schedule_restart(0.0)
                return
        self.started_mono = self._mono()
        log.info("sidecar started: pid %d", self.proc.pid)
        self._record("running")

    def _schedule_restart(self, lived_s: float) -> None:
        if lived_s >= HEALTHY_AFTER_S:  # a death after a healthy life is not a quick failure
            self.backoff.reset()
            delay = BACKOFF_FIRST_S
        else:
            delay = self.backoff.next()
        self.restart_at = self._mono() + delay
        log.warning("sidecar restart in %.1f s", delay)

    def _reap(self) -> Optional[int]:
        """The sidecar's exit status once it has exited (the Popen is then dropped), else None."""
        if self.proc is None:
            return None
        rc = self.proc.poll()
        if rc is None:
            return None
        self.proc = None
        return rc

    def _stop_sidecar(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(SIDECAR_STOP_S)
        except subprocess.TimeoutExpired:
            log.warning("sidecar %d ignored SIGTERM for %.0f s: SIGKILL", proc.pid, SIDECAR_STOP_S)
            proc.kill()
            proc.wait(SIDECAR_STOP_S)

    def tick(self) -> bool:
        """One round; False when the supervisor is done."""
        now = self._mono()
        rc = self._reap()
        job_gone = not self.job.alive()
        if job_gone and self.gone_at is None:
            self.gone_at = now
        if job_gone and self.reported_at is None and self._reported():
            self.exit_seen_at = now if self.exit_seen_at is None else self.exit_seen_at
            if self.paths.closed.exists() or now - self.exit_seen_at >= self.close_timeout_s:
                self.reported_at = now   # a sidecar that dies before the close is started again
        if rc is not None:
            log.warning("sidecar exited with status %d", rc)
            if self.reported_at is not None:
                return False  # the exit is reported and the sidecar is gone: done
            self._schedule_restart(now - self.started_mono)
            self._record("restarting")
        if self.reported_at is not None:
            return bool(now - self.reported_at < self.linger_s)
        if self.gone_at is not None and now - self.gone_at >= self.report_timeout_s:
            log.error("the job is gone and no exit was reported within %.0f s; giving up",
                      self.report_timeout_s)
            return False
        if self.proc is None and now >= self.restart_at:
            if self.started_mono:
                self.restarts += 1
            self._start_sidecar()
        return True

    def run(self) -> int:
        lock_fd = lockfile.try_lock(self.paths.supervisor_lock)
        if lock_fd is None:
            log.error("another supervisor holds %s", self.paths.supervisor_lock)
            return 1
        try:
            write_atomic(self.paths.supervisor_pid, f"{os.getpid()}\n")
            self._record("starting")
            while not self._stop.is_set() and self.tick():
                self._stop.wait(POLL_S)
            return 0
        finally:
            self._stop_sidecar()
            self._record("done")
            os.close(lock_fd)


def supervise_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rgt-supervise %(levelname)s: %(message)s")
    _renice_self()
    serve_args = [a for a in args.serve_args if a != "--"]
    sup = Supervisor(Path(args.run_dir), args.pid, serve_args, linger_s=args.linger,
                     report_timeout_s=args.report_timeout, finish_on_term=args.finish_on_term,
                     close_timeout_s=args.close_timeout)

    def on_stop(signum: int, _frame: Any) -> None:
        sup.on_signal(signum)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return sup.run()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m onbox.launch.supervise")
    sub = parser.add_subparsers(dest="mode", required=True)
    job = sub.add_parser("job", help="run the job described on stdin and record its exit")
    job.add_argument("--run-dir", required=True)
    sup = sub.add_parser("sidecar", help="keep the run's sidecar running until the job's exit is reported")
    sup.add_argument("--run-dir", required=True)
    sup.add_argument("--pid", type=int, required=True, help="the job wrapper's pid")
    sup.add_argument("--linger", type=float, default=300.0)
    sup.add_argument("--close-timeout", type=float, default=180.0)
    sup.add_argument("--report-timeout", type=float, default=120.0)
    sup.add_argument("--finish-on-term", action="store_true",
                     help="a first SIGTERM waits for the job's exit to be journaled (schedulers)")
    sup.add_argument("serve_args", nargs=argparse.REMAINDER)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.mode == "job":
        return job_main(Path(args.run_dir))
    return supervise_main(args)


if __name__ == "__main__":
    sys.exit(main())
