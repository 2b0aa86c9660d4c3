"""`rgt rehearse`: run the exact launch command here, on CPU, under the sidecar, and prove each
thing a rented run will rely on before the meter starts.

    result = Rehearsal(RehearseOptions(command=["python", "train.py"])).run(on_stage)
    result.ok, result.failed_stage, result.to_dict()

The job is started the way `rgt launch local` starts one: `rgt-onbox launch` as a child process
(`python -m onbox.cli`; the controller never imports onbox), in a private temporary root, with
CUDA_VISIBLE_DEVICES="" (CPU only), no pre-flight, no GPU probe, no box secrets, a short stall floor,
and the command's own working directory (this one). Stages, in order:

    launch                the launcher started the job and its sidecar
    metrics seen          the sidecar reported a step (train.progress), read from $RGT_METRICS
    checkpoint committed  custody hashed and recorded a checkpoint (ckpt.saved, rgt/manifest.jsonl)
    resume                the job is SIGKILLed (its process group, by the pid and start time in
                          rgt/job.json), relaunched as the same run (the launcher hands it the newest
                          recorded checkpoint in RGT_RESUME_FROM), and its first step is above 0, not
                          under that checkpoint's step, with no train.restarted_from_zero
    safe load             every recorded checkpoint hashes to its write-time sha256 and loads through
                          the pull verifier's seam (controller.verify.load); none is left unrecorded
    clean exit            the job ran to its end: code 0 and the sidecar's final_ok. With --steps N it
                          is asked to stop (`rgt-onbox stop`: SIGTERM, SIGKILL after the grace) once a
                          step >= N is logged after the relaunch; then clean means it ended on that
                          SIGTERM (exit 0, 143, or the signal itself) within the grace, never the SIGKILL

After a failed stage the later ones are skipped, except safe load, which still runs on what was
recorded. Every wait polls with a deadline (--timeout for the whole rehearsal). Before returning,
also on Ctrl-C, every process the rehearsal started is ended, each by its recorded pid and start
time. The private root is removed after a pass unless asked to keep it; after a failure it stays.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from controller.rehearse.checks import (
    FAIL,
    HINTS,
    PASS,
    SKIPPED,
    STAGES,
    Ending,
    Journal,
    Proc,
    Record,
    Stage,
    copy_listed,
    custody_caught_up,
    describe_exit,
    file_size,
    judge_exit,
    judge_resume,
    judge_verified,
    named_step,
    newest_per_path,
    read_json,
    read_manifest,
    record_of,
    rewritten,
    steps_since,
    unrecorded,
)
from controller.verify.prove import verify

PROJECT = "rehearse"
RUN_ID = "rehearsal"
POLL_S = 0.05
LAUNCH_S = 60.0        # one `rgt-onbox launch` (its own waits are 15 s each)
EXIT_GRACE_S = 5.0     # after the job's exit, how long the sidecar may still report what it saw
CONFIRM_S = 10.0       # the sidecar's word on a step or an exit the files already show
KILLED_S = 30.0        # the wrapper records a SIGKILLed job's exit
CUSTODY_S = 30.0       # custody records the last checkpoints after the job ended
SAFE_LOAD_TRIES = 4    # manifest + copy again while custody still appends to rgt/manifest.jsonl
LINGER_S = 600.0       # the sidecar stays until the rehearsal ends it (after custody caught up)
END_S = 15.0           # ending one leftover process: SIGTERM, then SIGKILL
LOAD_MIN_S = 60.0      # the least time one safe-load child gets, even late in the rehearsal

OnStage = Callable[[Stage], None]


@dataclasses.dataclass
class RehearseOptions:
    command: Sequence[str]
    steps: Optional[int] = None            # stop once this step is logged after the relaunch
    timeout_s: float = 600.0
    stall_floor_s: float = 30.0
    grace_s: float = 30.0                  # --steps: SIGTERM to SIGKILL
    keep: bool = False                     # keep the private root after a pass too
    tmp_dir: Optional[Path] = None         # where the private root is made (default: the system's)
    cwd: Optional[Path] = None             # the job's working directory (default: this one)
    python: str = sys.executable           # runs `-m onbox.cli`


@dataclasses.dataclass
class RehearseResult:
    stages: List[Stage]
    root: Path
    run_dir: Path
    kept: bool
    notes: List[str] = dataclasses.field(default_factory=list)

    @property
    def failed(self) -> Optional[Stage]:
        return next((s for s in self.stages if s.status == FAIL), None)

    @property
    def ok(self) -> bool:
        return all(s.status == PASS for s in self.stages)

    @property
    def hint(self) -> Optional[str]:
        failed = self.failed
        return HINTS.get(failed.name) if failed is not None else None

    def to_dict(self) -> Dict[str, Any]:
        failed = self.failed
        return {"result": "pass" if self.ok else "fail", "failed_stage": failed.name if failed else None,
                "stages": [s.to_dict() for s in self.stages], "run_dir": str(self.run_dir),
                "root": str(self.root), "kept": self.kept, "hint": self.hint, "notes": self.notes}


def _size(path: Path) -> int:
    """The file's size; -1 when it cannot be read (so that any later size differs)."""
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln[len("error:"):].strip() for ln in lines if ln.startswith("error:")]
    return (errors or lines or ["no output"])[-1][:300]


def _killpg(pgid: int) -> None:
    """SIGKILL a job's process group (its leader was just checked: pid and start time)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---- the rehearsal ------------------------------------------------------------------------------


class Rehearsal:
    """One rehearsal in its own temporary root; see the module doc."""

    def __init__(self, opts: RehearseOptions, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not opts.command:
            raise ValueError("no command to rehearse")
        self.opts = opts
        self._clock = clock
        self.root = Path(tempfile.mkdtemp(prefix="rgt-rehearse-", dir=opts.tmp_dir))
        self.run_dir = self.root / PROJECT / "active" / RUN_ID
        self.rgt = self.run_dir / "rgt"
        self.journal = Journal(self.rgt)
        self.stages = {name: Stage(name) for name in STAGES}
        self.notes: List[str] = []
        self.deadline = clock() + opts.timeout_s
        self.base_seq = 0          # the journal's last seq when the current attempt was launched
        self.attempt_pid: Optional[int] = None    # its job wrapper (what its job.started names)
        self.attempt_seq: Optional[int] = None    # the seq of that job.started
        self.metrics_offset = 0    # metrics.jsonl bytes written before the current attempt
        self._pause = threading.Event()
        self._on_stage: OnStage = lambda stage: None

    # ---- small readers ----------------------------------------------------------------------

    @property
    def metrics_path(self) -> Path:
        recorded = (read_json(self.run_dir / "run.json") or {}).get("metrics")
        return Path(recorded) if isinstance(recorded, str) else self.run_dir / "metrics.jsonl"

    @property
    def ckpt_dir(self) -> Path:
        recorded = (read_json(self.run_dir / "run.json") or {}).get("ckpt_dir")
        return Path(recorded) if isinstance(recorded, str) else self.run_dir / "checkpoints"

    def _exit_doc(self) -> Optional[Dict[str, Any]]:
        return read_json(self.rgt / "exit.json")

    def _job(self) -> Tuple[Optional[Proc], Optional[Proc], Optional[int]]:
        """(wrapper, job, process group) of the current attempt, from rgt/job.json."""
        doc = read_json(self.rgt / "job.json") or {}
        pgid = doc.get("pgid")
        return (Proc.from_doc(doc.get("wrapper")), Proc.from_doc(doc.get("job")),
                pgid if isinstance(pgid, int) else None)

    def _log_tail(self) -> str:
        """`; train.log: <its last line from the job>`, or "" when it has none."""
        try:
            with open(self.run_dir / "train.log", "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        mine = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("[rgt ")]
        return f"; train.log: {mine[-1][:200]}" if mine else ""

    def _left(self) -> float:
        return max(0.0, self.deadline - self._clock())

    def _wait(self, found: Callable[[], Any], limit_s: float) -> Any:
        """Poll the journal and `found` until it gives something truthy, for at most `limit_s`."""
        until = min(self.deadline, self._clock() + limit_s)
        while True:
            self.journal.poll()
            value = found()
            if value or self._clock() >= until:
                return value
            self._pause.wait(POLL_S)

    def _await(self, found: Callable[[], Any], what: str) -> Tuple[Any, str]:
        """Wait for `found` until the job ends (plus EXIT_GRACE_S), stalls, or the deadline passes;
        (value, "") or (None, why)."""
        exited_at: Optional[float] = None
        while True:
            self.journal.poll()
            value = found()
            if value:
                return value, ""
            now = self._clock()
            stall = self.journal.of("job.stalled", self.base_seq)
            if stall:
                data = stall[0]["data"]
                return None, (f"the sidecar reported a stall (no progress for {data.get('idle_s')} s, "
                              f"verdict {data.get('verdict')}) before {what}")
            doc = self._exit_doc()
            if exited_at is None and doc is not None:
                exited_at = now
            if doc is not None and exited_at is not None and now - exited_at >= EXIT_GRACE_S:
                return None, f"the job ended ({describe_exit(doc)}) before {what}{self._log_tail()}"
            if now >= self.deadline:
                return None, f"nothing within the {self.opts.timeout_s:g} s timeout: waited for {what}"
            self._pause.wait(POLL_S)

    # ---- rgt-onbox --------------------------------------------------------------------------

    def _onbox(self, args: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        argv = [self.opts.python, "-m", "onbox.cli", *args]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        return subprocess.run(argv, cwd=str(self.opts.cwd or Path.cwd()), env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=max(1.0, timeout_s), check=False)

    def launch_args(self) -> List[str]:
        """`rgt-onbox launch` for this rehearsal: the first launch and the relaunch alike."""
        return ["launch", "--root", str(self.root), "--project", PROJECT, "--run-id", RUN_ID,
                "--no-preflight", "--probe", "none", "--no-secrets", "--deadman", "off",
                "--stall-floor", f"{self.opts.stall_floor_s:g}",
                "--stall-grace", f"{max(self.opts.stall_floor_s, self.opts.timeout_s):g}",
                "--sidecar-linger", f"{LINGER_S:g}s", "--serve-arg=--no-kmsg", "--json",
                "--", *self.opts.command]

    def _launch(self) -> Tuple[Optional[Dict[str, Any]], str]:
        """(the launcher's JSON answer, "") or (None, why it failed)."""
        try:
            done = self._onbox(self.launch_args(), min(LAUNCH_S, max(5.0, self._left())))
        except subprocess.TimeoutExpired:
            return None, f"rgt-onbox launch did not answer within {LAUNCH_S:g} s"
        if done.returncode != 0:
            return None, f"rgt-onbox launch failed (exit {done.returncode}): {_last_error(done.stderr)}"
        try:
            answer = json.loads(done.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return None, f"rgt-onbox launch gave no JSON answer: {done.stdout[-200:]!r}"
        self.notes += [ln[len("warning: "):] for ln in done.stderr.splitlines() if ln.startswith("warning: ")]
        if not answer.get("sidecar_supervisor_pid"):
            return None, "the sidecar did not start (see rgt/supervisor.log in the run directory)"
        return answer, ""

    # ---- the stages -------------------------------------------------------------------------

    def stage_launch(self) -> Tuple[bool, str]:
        answer, why = self._launch()
        if answer is None:
            return False, why
        return True, f"job pid {answer.get('job_pid')} and its sidecar started, run dir {self.run_dir}"

    def stage_metrics(self) -> Tuple[bool, str]:
        step, why = self._await(lambda: self.journal.first_step() is not None, "the sidecar's first step")
        steps, _, lines = steps_since(self.metrics_path, 0)
        if step:
            where = f"from {self.metrics_path.name}" if steps else "from train.log: no step in $RGT_METRICS"
            return True, f"the sidecar reported step {self.journal.first_step()} ({where})"
        if lines and not steps:
            why += f"; {self.metrics_path.name} has {lines} lines, none with a step field"
        elif not lines:
            why += f"; nothing was written to $RGT_METRICS ({self.metrics_path.name})"
        return False, why

    def stage_checkpoint(self) -> Tuple[bool, str]:
        saved, why = self._await(lambda: self.journal.of("ckpt.saved"), "a committed checkpoint")
        if not saved:
            suspects = self.journal.of("ckpt.suspect")
            if suspects:
                data = suspects[0]["data"]
                why += f"; custody suspects {data.get('path')}: {data.get('reason')}"
            return False, why
        data = saved[0]["data"]
        return True, (f"{data.get('path')} (step {data.get('step')}, {data.get('size')} bytes, sha256 "
                      f"{str(data.get('sha256'))[:12]}...) hashed and recorded")

    def _kill_job(self) -> Tuple[Optional[int], str]:
        """SIGKILL the job's process group; (the last step it logged, "") or (None, why not)."""
        doc = self._exit_doc()
        if doc is not None:
            return None, (f"the job ended ({describe_exit(doc)}) before it could be killed after its "
                          "first checkpoint: rehearse a longer run")
        wrapper, job, pgid = self._job()
        if job is None or pgid is None or not job.alive():
            return None, "rgt/job.json names no running job to kill"
        self.journal.poll()
        before = self.journal.last_seq
        _killpg(pgid)
        # Gone means the wrapper's exit record, no process left, and the sidecar's job.exited: the
        # sidecar reads the job's last lines and reports their progress before it journals the exit,
        # so after it nothing of the killed attempt can arrive among the relaunch's events.
        gone = self._wait(lambda: self._exit_doc() is not None and not (wrapper and wrapper.alive())
                          and not job.alive() and bool(self.journal.of("job.exited", before)), KILLED_S)
        if not gone:
            return None, f"the SIGKILLed job's exit was not recorded within {KILLED_S:g} s"
        steps = steps_since(self.metrics_path, 0)[0] + [
            e["data"]["step"] for e in self.journal.of("train.progress", self.base_seq)
            if isinstance(e["data"].get("step"), int)]
        return (max(steps) if steps else 0), ""

    def _current(self, kind: str) -> List[Dict[str, Any]]:
        """`kind` events of the current attempt: from its job.started on. What the sidecar reported
        of the killed attempt came before its job.exited, which the relaunch waited for."""
        if self.attempt_seq is None:
            started = [e for e in self.journal.of("job.started", self.base_seq)
                       if e["data"].get("pid") == self.attempt_pid]
            if not started:
                return []
            self.attempt_seq = started[0]["seq"]
        found = self.journal.of(kind, self.attempt_seq - 1)
        return [e for e in found if kind != "job.exited" or e["data"].get("pid") == self.attempt_pid]

    def _first_new_step(self) -> Optional[int]:
        """The first step the relaunched job logged: from $RGT_METRICS, or (for a job that logs
        its steps elsewhere, so never to that file) from the sidecar's first report on it."""
        steps, _, _ = steps_since(self.metrics_path, self.metrics_offset)
        if steps:
            return steps[0]
        if steps_since(self.metrics_path, 0)[0]:
            return None
        for event in self._current("train.progress"):
            if isinstance(event["data"].get("step"), int):
                return int(event["data"]["step"])
        return None

    def stage_resume(self) -> Tuple[bool, str]:
        killed_at, why = self._kill_job()
        if killed_at is None:
            return False, why
        self.journal.poll()
        self.base_seq, self.metrics_offset = self.journal.last_seq, file_size(self.metrics_path)
        answer, why = self._launch()
        if answer is None:
            return False, f"the relaunch failed: {why}"
        self.attempt_pid = answer.get("pid") if isinstance(answer.get("pid"), int) else None
        resume_from = answer.get("resume_from")
        record = record_of(self.run_dir, Path(resume_from), read_manifest(self.run_dir)) \
            if resume_from else None
        first: Optional[int] = None
        if resume_from:
            got, why = self._await(lambda: self._first_new_step() is not None, "a step after the relaunch")
            if not got:
                return False, f"killed at step {killed_at}; {why}"
            first = self._first_new_step()
            if record is None or record.step is None:  # no step to compare: the sidecar's word decides
                self._wait(lambda: self._sidecar_saw(first), CONFIRM_S)
        restarts = self._current("train.restarted_from_zero")
        if resume_from and (record is None or record.step is None) and named_step(resume_from) is not None:
            bare = Record(path=str(resume_from), size=0, sha256="", mtime_ns=0, inode=0, step=None, ts=0.0)
            record = dataclasses.replace(record or bare, step=named_step(resume_from))
        ok, detail = judge_resume(resume_from, record, first, restarts)
        return ok, f"killed at step {killed_at} (SIGKILL), relaunched; {detail}"

    def _sidecar_saw(self, step: Optional[int]) -> bool:
        if self._current("train.restarted_from_zero"):
            return True
        return any(isinstance(e["data"].get("step"), int) and step is not None and e["data"]["step"] >= step
                   for e in self._current("train.progress"))

    def _steps_reached(self) -> Optional[int]:
        if self.opts.steps is None:
            return None
        steps, _, _ = steps_since(self.metrics_path, self.metrics_offset)
        progress = [e["data"].get("step") for e in self._current("train.progress")]
        top = max([s for s in [*steps, *progress] if isinstance(s, int)], default=None)
        return top if top is not None and top >= self.opts.steps else None

    def run_out(self) -> Ending:
        """Let the relaunched job end on its own, or stop it once --steps is reached."""
        ended, _ = self._await(lambda: self._exit_doc() is not None or self._steps_reached() is not None,
                               "the job's end")
        stall = self.journal.of("job.stalled", self.base_seq)
        end = Ending(exit_doc=self._exit_doc(), stall=stall[0] if stall else None,
                     timed_out=not ended and not stall)
        if ended and end.exit_doc is None:
            end.stopped_at = self._steps_reached()
            end.stop_outcome = self._stop(self.opts.grace_s)
            end.exit_doc = self._exit_doc()
        if end.exit_doc is not None:
            exited = self._wait(lambda: self._current("job.exited"), CONFIRM_S)
            end.exited = exited[0] if exited else None
        return end

    def _stop(self, grace_s: float) -> Optional[str]:
        """`rgt-onbox stop` on the run; its outcome (stopped | killed | not_running), None if unknown."""
        try:
            done = self._onbox(["stop", str(self.run_dir), "--root", str(self.root), "--grace",
                                f"{grace_s:g}s", "--json"], grace_s + 30.0)
            outcome = json.loads(done.stdout.strip().splitlines()[-1]).get("outcome")
        except (subprocess.TimeoutExpired, ValueError, IndexError, AttributeError):
            return None
        return outcome if isinstance(outcome, str) else None

    def stage_safe_load(self) -> Tuple[bool, str]:
        """What `rgt pull` + `rgt verify` would say: the box half builds the pull manifest
        (`rgt-onbox manifest`: custody's records, directory units, rotation), the listed files are
        copied to <root>/pulled the way the pull lays them out, and controller.verify.prove proves them
        (identity, then safe load through its seam, known companions and all). Custody may still be
        recording the job's last save (a unit counts once quiet): when rgt/manifest.jsonl changed
        between the manifest and the copy, both are made again (SAFE_LOAD_TRIES in all)."""
        for _ in range(SAFE_LOAD_TRIES):
            self._wait(lambda: custody_caught_up(self.run_dir, self.ckpt_dir) or not self._sidecar_alive(),
                       CUSTODY_S)
            before = _size(self.rgt / "manifest.jsonl")
            every = read_manifest(self.run_dir)
            records = newest_per_path(every)
            stray = [rel for rel in unrecorded(self.run_dir, self.ckpt_dir, every) if rel not in records]
            try:
                done = self._onbox(["manifest", str(self.run_dir), "--root", str(self.root), "--json"],
                                   max(LOAD_MIN_S, self._left()))
            except subprocess.TimeoutExpired:
                return False, "rgt-onbox manifest (the box half of the pull) did not answer"
            if done.returncode != 0:
                if not records:
                    return False, "no checkpoint was recorded by the sidecar's custody"
                return False, f"the pull manifest fails: {_last_error(done.stderr)}"
            doc = read_json(self.rgt / "PULL_MANIFEST.json") or {}
            pulled = self.root / "pulled"
            shutil.rmtree(pulled, ignore_errors=True)
            problems = copy_listed(self.run_dir, doc, pulled) + rewritten(doc, records)
            if _size(self.rgt / "manifest.jsonl") == before:
                break     # custody recorded nothing meanwhile: the copy is what the manifest lists
        (pulled / "rgt").mkdir(parents=True, exist_ok=True)
        shutil.copy2(self.rgt / "PULL_MANIFEST.json", pulled / "rgt" / "PULL_MANIFEST.json")
        report = verify(pulled, write=False, load_timeout_s=max(LOAD_MIN_S, self._left()))
        return judge_verified(report.to_dict(), problems, stray, report.failures())

    # ---- the whole rehearsal ----------------------------------------------------------------

    def _do(self, name: str, fn: Callable[[], Tuple[bool, str]], started: Optional[float] = None) -> bool:
        stage = self.stages[name]
        started = self._clock() if started is None else started
        stage.status, stage.detail = FAIL, "interrupted"  # what stays if Ctrl-C ends it
        try:
            ok, stage.detail = fn()
        finally:
            stage.seconds = self._clock() - started
        stage.status = PASS if ok else FAIL
        self._on_stage(stage)
        return ok

    def _sequence(self) -> None:
        for name, fn in (("launch", self.stage_launch), ("metrics seen", self.stage_metrics),
                         ("checkpoint committed", self.stage_checkpoint), ("resume", self.stage_resume)):
            if not self._do(name, fn):
                if read_manifest(self.run_dir):  # safe load still judges what was recorded
                    self._stop(5.0)
                    self._do("safe load", self.stage_safe_load)
                return
        started = self._clock()
        stage = self.stages["clean exit"]
        stage.status, stage.detail = FAIL, "interrupted"
        ending = self.run_out()
        ran_out = self._clock() - started
        stage.status, stage.detail = SKIPPED, ""
        if self._do("safe load", self.stage_safe_load):
            self._do("clean exit", lambda: judge_exit(ending), self._clock() - ran_out)

    def run(self, on_stage: Optional[OnStage] = None) -> RehearseResult:
        """Run every stage (see the module doc); always ends what it started before returning."""
        self._on_stage = on_stage or (lambda stage: None)
        try:
            self._sequence()
        except KeyboardInterrupt:
            self.notes.append("interrupted (Ctrl-C or SIGTERM)")
        finally:
            self.end_all()
        self._note_events()
        result = RehearseResult(stages=[self.stages[n] for n in STAGES], root=self.root,
                                run_dir=self.run_dir, kept=True, notes=self.notes)
        if result.ok and not self.opts.keep:
            shutil.rmtree(self.root, ignore_errors=True)
            result.kept = self.root.exists()
        return result

    def _note_events(self) -> None:
        self.journal.poll()
        judged = {"job.exited", "job.stalled", "train.restarted_from_zero"}
        seen: Dict[str, int] = {}
        for event in self.journal.events:
            if event.get("sev") in ("warn", "critical") and event.get("kind") not in judged:
                seen[str(event.get("kind"))] = seen.get(str(event.get("kind")), 0) + 1
        if seen:
            self.notes.append("the sidecar also reported: " + ", ".join(
                f"{kind}" + (f" x{n}" if n > 1 else "") for kind, n in sorted(seen.items())))

    # ---- ending what we started -------------------------------------------------------------

    def _sidecar_alive(self) -> bool:
        doc = read_json(self.rgt / "supervisor.json") or {}
        sidecar = Proc.from_doc(doc.get("sidecar"))
        return sidecar is not None and sidecar.alive()

    def _end(self, proc: Optional[Proc], term_s: float) -> None:
        """SIGTERM a recorded process, SIGKILL it when it has not ended after `term_s`."""
        for signum, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, 5.0)):
            if proc is None or not proc.alive():
                return
            proc.send(signum)
            self._wait_plain(lambda: not proc.alive(), wait_s)

    def _wait_plain(self, done: Callable[[], bool], limit_s: float) -> bool:
        """Poll `done` for at most `limit_s`, whatever the rehearsal's own deadline."""
        until = self._clock() + limit_s
        while not done():
            if self._clock() >= until:
                return False
            self._pause.wait(POLL_S)
        return True

    def end_all(self) -> None:
        """End the job (stop, then SIGKILL its group), its wrapper, every supervisor and sidecar."""
        wrapper, job, pgid = self._job()
        if job is not None and job.alive():
            self._stop(5.0)
            if job.alive() and pgid is not None:
                _killpg(pgid)
        if wrapper is not None:  # it records the job's exit, then ends by itself
            self._wait_plain(lambda: not wrapper.alive(), END_S)
            self._end(wrapper, 5.0)
        supervisors = [self.rgt / "supervisor.json", *sorted(self.rgt.glob("attempts/*/supervisor.json"))]
        for path in supervisors:
            doc = read_json(path) or {}
            self._end(Proc.from_doc(doc), END_S)          # it stops its sidecar first
            self._end(Proc.from_doc(doc.get("sidecar")), END_S)


__all__ = ["PROJECT", "RUN_ID", "RehearseOptions", "RehearseResult", "Rehearsal"]
