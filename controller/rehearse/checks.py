"""What `rgt rehearse` reads from a run directory, and how it judges each stage.

The files of the run directory are the truth; this module reads them and never starts a process:

    rgt/events.jsonl     the sidecar's journal (Journal: read incrementally, by seq)
    metrics.jsonl        the job's own lines (steps_since: the steps written after an offset)
    rgt/manifest.jsonl   checkpoint custody: path, size, sha256 hashed at write time, step
    rgt/exit.json        the job wrapper's record of the job's exit
    rgt/job.json, rgt/supervisor.json   the processes the launcher started (Proc: pid + start time)

The judges (judge_*) take what was read and return (ok, one-line detail); the orchestration in
controller/rehearse/run.py decides when to read, and what to start or end. Nothing here imports onbox:
the few file shapes are read as JSON, the way any other reader of a run directory would.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from protocol.pull import is_temporary

from controller.runs import life
from controller.verify.identity import HashResult
from controller.verify.load import LoadResult

STAGES = ("launch", "metrics seen", "checkpoint committed", "resume", "safe load", "clean exit")
PASS, FAIL, SKIPPED = "pass", "fail", "skipped"

# What to change in the training script when a stage fails (the CLI prints it as `hint:`).
HINTS = {
    "launch": "run the command by hand first; train.log in the kept run directory says why it stopped",
    "metrics seen": "append one JSON object per log step, with a step field, to $RGT_METRICS, or add the "
                    "two-line integration (onbox.integrations.hf / .lightning RgtCallback)",
    "checkpoint committed": "save checkpoints into $RGT_CKPT_DIR (write a .tmp, then rename it), "
                            "early enough that a short rehearsal reaches one",
    "resume": "at start-up, load $RGT_RESUME_FROM when it is set (model, optimizer and step) and go on "
              "from that step",
    "safe load": "save tensors only (state_dict, safetensors): torch.load(weights_only=True) must read "
                 "every checkpoint, and nothing may rewrite one after it was saved",
    "clean exit": "exit 0 at the end of training, and end promptly on SIGTERM (that is how a run is "
                  "stopped)",
}
# The step fields the sidecar reads from a metrics line (onbox/sources/metrics.py).
STEP_KEYS = ("step", "global_step", "iteration", "iter")
_ROTATED = re.compile(r"^events\.(\d{12})\.jsonl$")


@dataclasses.dataclass
class Stage:
    name: str
    status: str = SKIPPED
    seconds: float = 0.0
    detail: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "status": self.status, "seconds": round(self.seconds, 2),
                "detail": self.detail}


# ---- the journal --------------------------------------------------------------------------------


class Journal:
    """The events of one run, read incrementally from rgt/events.jsonl (and rotated files).

    Each poll() reads the complete lines appended since the last one; an event is kept once, by
    seq, so a sidecar restart (which continues the seq) or a rotation never repeats one.
    """

    def __init__(self, rgt_dir: Path) -> None:
        self.rgt_dir = Path(rgt_dir)
        self.events: List[Dict[str, Any]] = []
        self.last_seq = 0
        self._inode: Optional[int] = None
        self._offset = 0

    def poll(self) -> List[Dict[str, Any]]:
        """The new events (also appended to self.events)."""
        path = self.rgt_dir / "events.jsonl"
        try:
            st = os.stat(path)
        except OSError:
            return []
        fresh: List[Dict[str, Any]] = []
        if st.st_ino != self._inode or st.st_size < self._offset:  # first read, or rotated
            for rotated in self._rotated():
                fresh += self._take(rotated.read_bytes())
            self._inode, self._offset = st.st_ino, 0
        try:
            with open(path, "rb") as f:
                f.seek(self._offset)
                raw = f.read()
        except OSError:
            return fresh
        end = raw.rfind(b"\n") + 1  # a torn last line waits for its newline
        self._offset += end
        return fresh + self._take(raw[:end])

    def _rotated(self) -> List[Path]:
        try:
            found = [(int(m.group(1)), p) for p in self.rgt_dir.iterdir() if (m := _ROTATED.match(p.name))]
        except OSError:
            return []
        return [p for _, p in sorted(found)]

    def _take(self, raw: bytes) -> List[Dict[str, Any]]:
        out: List[Dict[str, Any]] = []
        for line in raw.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if not isinstance(event, dict) or not isinstance(event.get("seq"), int):
                continue
            if event["seq"] <= self.last_seq:
                continue
            if not isinstance(event.get("data"), dict):
                event["data"] = {}
            self.last_seq = event["seq"]
            out.append(event)
        self.events += out
        return out

    def of(self, kind: str, after_seq: int = 0) -> List[Dict[str, Any]]:
        return [e for e in self.events if e.get("kind") == kind and e["seq"] > after_seq]

    def first_step(self, after_seq: int = 0) -> Optional[int]:
        """The step of the first train.progress event after `after_seq` that carries one."""
        for event in self.of("train.progress", after_seq):
            step = event["data"].get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                return step
        return None


# ---- metrics ------------------------------------------------------------------------------------


def step_of(line: Any) -> Optional[int]:
    """The step a metrics object carries (the first of STEP_KEYS, any case), else None."""
    if not isinstance(line, dict):
        return None
    for key, value in line.items():
        if str(key).lower() in STEP_KEYS:
            if isinstance(value, bool):
                return None
            if isinstance(value, (int, float)) and value == value and value >= 0:
                return int(value)
            return None
    return None


def steps_since(path: Path, offset: int) -> Tuple[List[int], int, int]:
    """(steps of the complete lines after byte `offset`, the offset after them, how many lines)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            raw = f.read()
    except OSError:
        return [], offset, 0
    end = raw.rfind(b"\n") + 1
    steps: List[int] = []
    lines = raw[:end].splitlines()
    for line in lines:
        try:
            step = step_of(json.loads(line))
        except ValueError:
            continue
        if step is not None:
            steps.append(step)
    return steps, offset + end, len(lines)


def file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


# ---- checkpoint custody -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Record:
    """One line of rgt/manifest.jsonl (onbox/custody/manifest.py writes it)."""

    path: str          # relative to the run dir
    size: int
    sha256: str
    mtime_ns: int
    inode: int
    step: Optional[int]
    ts: float

    def matches(self, run_dir: Path) -> bool:
        """The file is still what was hashed (same size, mtime and inode)."""
        try:
            st = os.stat(Path(run_dir) / self.path)
        except OSError:
            return False
        return (st.st_size, st.st_mtime_ns, st.st_ino) == (self.size, self.mtime_ns, self.inode)


def read_manifest(run_dir: Path) -> List[Record]:
    """Every well-formed custody record, oldest first."""
    try:
        raw = (Path(run_dir) / "rgt" / "manifest.jsonl").read_bytes()
    except OSError:
        return []
    out: List[Record] = []
    for line in raw.splitlines():
        try:
            obj = json.loads(line)
            step = obj.get("step")
            out.append(Record(path=str(obj["path"]), size=int(obj["size"]), sha256=str(obj["sha256"]),
                              mtime_ns=int(obj["mtime_ns"]), inode=int(obj["inode"]),
                              step=step if isinstance(step, int) else None, ts=float(obj["ts"])))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def newest_per_path(records: Iterable[Record]) -> Dict[str, Record]:
    """The newest record of each path: a checkpoint saved again supersedes its older record."""
    out: Dict[str, Record] = {}
    for rec in sorted(records, key=lambda r: r.ts):
        out[rec.path] = rec
    return out


def record_of(run_dir: Path, path: Path, records: Iterable[Record]) -> Optional[Record]:
    """The newest record naming `path` (absolute, or relative to the run dir), or a file inside
    it when `path` is a directory checkpoint (HF `checkpoint-N/`: one unit, recorded file by file)."""
    full = os.path.normpath(Path(run_dir) / path)
    inside = full + os.sep
    found = [r for r in records if os.path.normpath(Path(run_dir) / r.path) == full]
    found = found or [r for r in records if os.path.normpath(Path(run_dir) / r.path).startswith(inside)]
    return max(found, key=lambda r: (r.step is not None, r.ts)) if found else None


_NAMED_STEP = re.compile(r"(?:checkpoint-|step[=_-]?)(\d+)")


def named_step(path: str) -> Optional[int]:
    """The step a standard checkpoint name carries (HF `checkpoint-40`, Lightning `step=40`,
    `step000040.pt`), for a record that names none; None when the name has no step."""
    found = _NAMED_STEP.findall(os.path.basename(os.path.normpath(path)))
    return int(found[-1]) if found else None


def unrecorded(run_dir: Path, ckpt_dir: Path, records: Iterable[Record]) -> List[str]:
    """Finished files under the checkpoint dir that no custody record matches (run-relative)."""
    matched = {os.path.normpath(Path(run_dir) / r.path) for r in records if r.matches(run_dir)}
    out: List[str] = []
    for base, dirs, files in os.walk(ckpt_dir):
        dirs[:] = sorted(d for d in dirs if not is_temporary(d))
        for name in sorted(files):
            full = os.path.normpath(os.path.join(base, name))
            if not is_temporary(os.path.relpath(full, ckpt_dir)) and full not in matched:
                out.append(os.path.relpath(full, run_dir))
    return out


def custody_caught_up(run_dir: Path, ckpt_dir: Path) -> bool:
    return not unrecorded(run_dir, ckpt_dir, read_manifest(run_dir))


# ---- processes the launcher recorded (rgt/job.json, rgt/supervisor.json) ------------------------


def _start_ticks(pid: int) -> Optional[Tuple[str, int]]:
    """(state, start time in clock ticks) of a pid from /proc, or None when there is none."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return fields[0].decode(), int(fields[19])
    except (IndexError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class Proc:
    """A process the launcher recorded: it is ours while its pid has the recorded start time."""

    pid: int
    start_ticks: Optional[int]

    @classmethod
    def from_doc(cls, doc: Any) -> Optional[Proc]:
        if not isinstance(doc, dict) or not isinstance(doc.get("pid"), int):
            return None
        ticks = doc.get("start_ticks")
        return cls(doc["pid"], ticks if isinstance(ticks, int) else None)

    def alive(self) -> bool:
        st = _start_ticks(self.pid)
        if st is None or st[0] in ("Z", "X", "x"):
            return False
        return self.start_ticks is None or st[1] == self.start_ticks

    def send(self, signum: int) -> None:
        if self.alive():
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    """A JSON object from a file; None when it is missing, torn or not an object."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# ---- the judges ---------------------------------------------------------------------------------


def _names(items: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def describe_exit(doc: Optional[Mapping[str, Any]]) -> str:
    """"code 0", "signal 9", "no exit record" from rgt/exit.json."""
    if not doc:
        return "no exit record"
    if isinstance(doc.get("error"), str):
        return f"not started: {doc['error']}"
    if isinstance(doc.get("signal"), int):
        return f"signal {doc['signal']}" + (" (OOM-killed)" if doc.get("oom_killed") else "")
    return f"code {doc.get('code')}"


def judge_resume(resume_from: Optional[str], record: Optional[Record], first_step: Optional[int],
                 restarts: Sequence[Mapping[str, Any]]) -> Tuple[bool, str]:
    """Did the relaunched job go on from the checkpoint the launcher handed it?

    It did when the launcher found a recorded checkpoint, the first step logged after the relaunch
    is above 0 and not below that checkpoint's step, and the sidecar saw no restart from zero.
    """
    if not resume_from:
        return False, "the relaunch found no recorded checkpoint to hand over in RGT_RESUME_FROM"
    name = record.path if record is not None else resume_from
    if first_step is None:
        return False, f"the relaunched job logged no step (it was given {name})"
    if first_step <= 0:
        return False, f"the relaunched job started at step {first_step}: it ignored RGT_RESUME_FROM={name}"
    step = record.step if record is not None else None
    if step is not None and first_step < step:
        return False, (f"first step after the relaunch is {first_step}, under the checkpoint's step {step}: "
                       f"the job did not resume from RGT_RESUME_FROM={name}")
    if restarts:
        data = restarts[0].get("data") or {}
        return False, (f"the sidecar saw a restart from zero (step {data.get('last_step')} -> "
                       f"{data.get('new_step')}) after the relaunch from {name}")
    if step is None:
        return True, f"resumed from {name} at step {first_step} (the checkpoint names no step to compare)"
    return True, f"resumed from {name} (step {step}): first step after the relaunch is {first_step}"


def judge_safe_load(records: Mapping[str, Record], hashes: Mapping[str, HashResult],
                    loads: Mapping[str, LoadResult], stray: Sequence[str]) -> Tuple[bool, str]:
    """Every recorded checkpoint hashes to its write-time sha256 and loads safely; none unrecorded.

    `records` and `hashes` are keyed by the run-relative path; `loads` holds the files whose hash
    matched; `stray` lists finished checkpoint files no custody record covers.
    """
    if not records:
        return False, "no checkpoint was recorded by the sidecar's custody"
    problems: List[str] = []
    for rel, rec in sorted(records.items()):
        got = hashes.get(rel)
        if isinstance(got, OSError) or got is None:
            problems.append(f"{rel}: unreadable ({getattr(got, 'strerror', None) or got or 'not hashed'})")
        elif got[1] != rec.sha256:
            problems.append(f"{rel}: sha256 {got[1][:12]}... differs from {rec.sha256[:12]}... recorded at "
                            "write time")
        elif rel in loads and loads[rel].status == "failed":
            problems.append(f"{rel}: does not load safely: {loads[rel].reason}")
    problems += [f"{rel}: never recorded by custody (no write-time hash)" for rel in stray]
    if problems:
        total = len(records) + len(stray)
        return False, f"{len(problems)} of {total} checkpoints fail: {_names(problems, 2)}"
    unknown = [rel for rel, res in loads.items() if res.status == "unknown"]
    tail = f" ({len(unknown)} of unknown format, proven by hash only)" if unknown else ""
    one = len(records) == 1
    return True, (f"{len(records)} checkpoint{'' if one else 's'} hash{'es' if one else ''} to the sha256 "
                  f"recorded at write time and load{'s' if one else ''} safely{tail}")


def copy_listed(run_dir: Path, doc: Mapping[str, Any], dest: Path) -> List[str]:
    """Copy every file the pull manifest `doc` lists from `run_dir` into `dest` at the same relative
    path, the layout `rgt pull` gives (a local pull: the rehearsal's box is this machine). Links are
    followed the way the pull's rsync follows them (a checkpoint place outside the run dir is
    linked in as rgt/external/<name>); the path itself must stay inside the run dir. Returns one
    line per file that could not be copied."""
    root = os.path.realpath(run_dir)
    problems: List[str] = []
    for entry in doc.get("files") or []:
        rel = str(entry.get("path", "")) if isinstance(entry, dict) else ""
        src = os.path.normpath(os.path.join(root, rel))
        if not rel or os.path.isabs(rel) or not src.startswith(root + os.sep):
            problems.append(f"{rel or '?'}: leads out of the run dir")
            continue
        target = Path(dest, *rel.split("/"))
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
        except OSError as e:
            problems.append(f"{rel}: {e.strerror or e}")
    return problems


def rewritten(doc: Mapping[str, Any], records: Mapping[str, Record]) -> List[str]:
    """Checkpoints whose bytes now differ from the sha256 custody recorded at write time."""
    out: List[str] = []
    for entry in doc.get("files") or []:
        if not isinstance(entry, dict) or entry.get("kind") != "checkpoint":
            continue
        rec = records.get(str(entry.get("path")))
        if rec is not None and entry.get("sha256") != rec.sha256:
            out.append(f"{entry.get('path')}: sha256 {str(entry.get('sha256'))[:12]}... differs from "
                       f"{rec.sha256[:12]}... recorded at write time")
    return out


_NOT_A_LOAD_FAILURE = ("ok", "skipped", "not loadable", "identity only")


def judge_verified(report: Mapping[str, Any], problems: Sequence[str], stray: Sequence[str],
                   verifier_failures: Sequence[str] = ()) -> Tuple[bool, str]:
    """The rehearsal's safe load: the pull verifier's verdict (controller.verify.prove, `Report.to_dict()`)
    on a local pull of the run, plus what the rehearsal itself found (`problems`: rewritten after
    the record, not copyable; `stray`: checkpoint files no custody record covers). A failed verdict
    whose cause none of those name (a save the box's custody judged suspect, a checkpoint removed by
    something other than the job) is told in the verifier's own lines (`Report.failures()`)."""
    files = [f for f in report.get("files") or [] if isinstance(f, dict)]
    ckpts = [f for f in files if f.get("kind") == "checkpoint"]
    proofs = {k: v for k, v in (report.get("proofs") or {}).items() if isinstance(v, dict)}
    failures = [*problems, *(f"{rel}: never recorded by custody (no write-time hash)" for rel in stray)]
    for name, proof in proofs.items():
        if proof.get("status") == "failed" and proof.get("reason"):
            failures.append(f"{name}: {proof['reason']}")
    load_failed = (proofs.get("safe_load") or {}).get("status") == "failed"
    for f in files:
        if f.get("identity") != "ok":
            failures.append(f"{f.get('path')}: identity: {f.get('identity')}")
        elif load_failed and not str(f.get("load")).startswith(_NOT_A_LOAD_FAILURE):
            failures.append(f"{f.get('path')}: safe load: {f.get('load')}")
    extra = (proofs.get("identity") or {}).get("extra") or []
    failures += [f"{x.get('path')}: {x.get('reason')}" for x in extra if isinstance(x, dict)]
    if not ckpts:
        failures.append("no checkpoint was recorded by the sidecar's custody")
    elif report.get("ok") is not True and not failures:
        failures.extend(verifier_failures or ["rgt verify did not pass (no reason given)"])
    if failures:
        return False, f"{len(failures)} problem{'' if len(failures) == 1 else 's'}: {_names(failures, 2)}"
    loaded = sum(1 for f in ckpts if f.get("load") == "ok")
    by_id = len(ckpts) - loaded
    tail = f", {by_id} proven by identity only" if by_id else ""
    return True, (f"{len(ckpts)} checkpoint file{'' if len(ckpts) == 1 else 's'} pulled and verified "
                  f"(rgt verify): identity ok, {loaded} passed its safe load{tail}")


@dataclasses.dataclass
class Ending:
    """How the rehearsal's last attempt ended, gathered by the orchestration."""

    exit_doc: Optional[Dict[str, Any]]            # rgt/exit.json
    exited: Optional[Dict[str, Any]] = None       # the sidecar's job.exited event, if it came
    stopped_at: Optional[int] = None              # --steps: the step at which the stop was asked
    stop_outcome: Optional[str] = None            # rgt-onbox stop: stopped | killed | not_running
    stall: Optional[Dict[str, Any]] = None        # a job.stalled event while it ran out
    timed_out: bool = False


def _verdict(exited: Optional[Mapping[str, Any]]) -> Tuple[Optional[bool], List[str]]:
    if exited is None:
        return None, []
    data = exited.get("data") or {}
    reasons = data.get("final_reasons")
    return data.get("final_ok"), [str(r) for r in reasons] if isinstance(reasons, list) else []


def judge_exit(end: Ending) -> Tuple[bool, str]:
    """A clean exit: code 0 and the sidecar's verdict final_ok; after a --steps stop, the job ended
    on the SIGTERM itself (code 0, 143 after saving, or the signal) within the grace, never needing
    the SIGKILL."""
    how = describe_exit(end.exit_doc)
    if end.stall is not None:
        data = end.stall.get("data") or {}
        return False, (f"the sidecar reported a stall (no progress for {data.get('idle_s')} s, verdict "
                       f"{data.get('verdict')}) before the end")
    if end.timed_out or end.exit_doc is None:
        return False, "the job did not end before the rehearsal's timeout (--steps N stops it sooner)"
    if end.stopped_at is not None:
        if end.stop_outcome == "killed":
            return False, f"stopped at step {end.stopped_at}: the job ignored SIGTERM and was SIGKILLed"
        code, sig = end.exit_doc.get("code"), end.exit_doc.get("signal")
        if code == 0 or code in life.SIGTERM_CODES or sig == life.SIGTERM:  # 143: saved, then said so
            return True, f"stopped at step {end.stopped_at} (--steps) by SIGTERM: ended with {how}"
        return False, f"stopped at step {end.stopped_at} (--steps): the job ended with {how}"
    if end.exit_doc.get("code") != 0:
        return False, f"the job ended with {how}"
    ok, reasons = _verdict(end.exited)
    if ok is False:
        return False, f"exit code 0, but the sidecar judged the run failed: {'; '.join(reasons) or '?'}"
    if ok is None:
        return True, "exit code 0 (the sidecar did not report the exit in time)"
    return True, "exit code 0, and the sidecar judged the run ok"


__all__ = ["FAIL", "HINTS", "PASS", "SKIPPED", "STAGES", "Ending", "Journal", "Record", "Stage",
           "Proc", "custody_caught_up", "describe_exit", "file_size", "is_temporary", "judge_exit",
           "judge_resume", "judge_safe_load", "judge_verified", "copy_listed", "rewritten", "named_step",
           "newest_per_path", "read_json", "read_manifest", "record_of", "step_of", "steps_since",
           "unrecorded"]
