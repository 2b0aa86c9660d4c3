"""What an event says to a person: one printable line about it, and the command to run next. The
wake's text (controller.wake.policy) and the run's status (controller.runs.status) both say it so.

Box data is printed through render.printable and cut to one line: a hostile path or
error text can neither move the cursor nor add lines. Every `next` is one line a shell can
run as it is: run ids and host names are shlex-quoted, and two steps are joined by `&&`.
"""
from __future__ import annotations

import shlex
import signal
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

import protocol
from protocol.ids import is_run_id

from controller.render import huge_int_text, number, printable, seconds, size, summarize, text_of
from controller.runs import life as life_mod
from controller.store.db import LocalEvent

AnyEvent = Union[protocol.Event, LocalEvent]

EXPLAIN_MAX = 240


def signal_name(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and not huge_int_text(value):
        try:
            return f"{value} ({signal.Signals(value).name})"
        except ValueError:
            return str(value)
    return text_of(value)


class _Fields(Dict[str, Any]):
    """Event data for str.format_map: each value formatted by its name's unit, '?' when missing."""

    def __missing__(self, key: str) -> str:
        return "?"

    def __getitem__(self, key: str) -> str:
        value = self.get(key)
        if key == "at":
            return _at(self)
        if key == "where":
            gpu, pci = self.get("gpu"), self.get("pci")
            where = f"GPU {text_of(gpu)}" if gpu is not None else "a GPU"
            return where + (f" ({text_of(pci)})" if pci else "")
        if value is None:
            return "?"
        if isinstance(value, list):
            return ", ".join(map(text_of, value)) or "?"
        if key.endswith("bytes"):
            return size(value)
        return seconds(value) if key.endswith("_s") else number(value)


def _at(d: Mapping[str, Any]) -> str:
    if d.get("step") is not None:
        return f" at step {number(d['step'])}"
    return f" at epoch {number(d['epoch'])}" if d.get("epoch") is not None else ""


def _exited(d: Mapping[str, Any], duration: str) -> str:
    code, sig = d.get("code"), d.get("signal")
    if d.get("vanished"):
        evidence = d.get("evidence")
        rebooted = isinstance(evidence, Mapping) and evidence.get("rebooted") is True
        head = ("the job vanished without an exit record: the box rebooted under it" if rebooted
                else "the job vanished without an exit record")
        head += " (OOM kill counted)" if d.get("oom_killed") else ""
    elif d.get("oom_killed"):
        what = f"signal {signal_name(sig)}" if sig else f"code {text_of(code)}"
        limit = d.get("oom_limit")
        head = (f"the job was OOM-killed ({what}): limit hit: {limit}" if isinstance(limit, str) and limit
                else f"the job was OOM-killed ({what})")
    elif d.get("preempted"):
        head = f"the job was preempted: stopped by {signal_name(sig) if sig else 'a signal'} rgt did not send"
    elif sig:
        head = f"the job was killed by signal {signal_name(sig)}"
    elif code == 0 and d.get("final_ok") is not False:
        head = "the job finished cleanly (code 0)"
    else:
        head = f"the job exited with code {text_of(code)}"
    reasons = d.get("final_reasons")
    if code == 0 and d.get("final_ok") is False:
        why = "; ".join(map(text_of, reasons)) if isinstance(reasons, list) and reasons else "see its events"
        return f"{head}{duration}, but the run failed: {why}"
    return head + duration


def stack_lines(d: Mapping[str, Any], limit: int = 8) -> List[str]:
    """A short form of a job.stalled's stacks (box data: checked, escaped later): one line per
    process, "rank 1 (pid 12): f (a.py:3) < g (b.py:9)", innermost frame first."""
    stacks = d.get("stacks")
    if not isinstance(stacks, list):
        return []
    out: List[str] = []
    for s in stacks[:limit]:
        if not isinstance(s, Mapping):
            continue
        rank, pid, threads = s.get("rank"), s.get("pid"), s.get("threads")
        who = f"rank {number(rank)} (pid {number(pid)})" if rank is not None else f"pid {number(pid)}"
        first: Mapping[str, Any] = {}
        if isinstance(threads, list) and threads and isinstance(threads[0], Mapping):
            first = threads[0]
        frames = first.get("frames") if isinstance(first.get("frames"), list) else []
        body = (" < ".join(text_of(f)[:120] for f in frames[:4]) if frames
                else text_of(s.get("error") or "no stack"))
        out.append(printable(f"{who}: {body}")[:300])
    return out


def _stalled(d: Mapping[str, Any]) -> str:
    if d.get("verdict") == "stopped (SIGSTOP)":
        return "process {stopped_pids} of the job is stopped (SIGSTOP, state T): nothing runs until SIGCONT"
    line = "no progress for {idle_s} (budget {budget_s}){at}; verdict {verdict}" + (
        ", GPU {gpu_util_pct}% busy" if d.get("gpu_util_pct") is not None else "") + (
        " on every node; {first_node} stopped first" if d.get("scope") == "all nodes" else "")
    hang = d.get("hang")
    if isinstance(hang, Mapping) and isinstance(hang.get("detail"), str):
        return line + "; " + str(hang["detail"]).replace("{", "(").replace("}", ")")
    lines = stack_lines(d, 1)
    return line + ("; " + lines[0].replace("{", "(").replace("}", ")") if lines else "")


def _silent(d: Mapping[str, Any]) -> str:
    silent_s, every = d.get("silent_s"), d.get("heartbeat_interval_s")
    if isinstance(silent_s, (int, float)) and isinstance(every, (int, float)) and every > 0:
        return (f"the link is up but no heartbeat for {silent_s / every:.0f} intervals ({{silent_s}}): "
                "the sidecar or the whole box is frozen (a paused spot instance sends no signal)")
    return "the link is up but no heartbeat arrived"


Template = Union[str, Callable[[Mapping[str, Any]], str]]
_TEMPLATES: Dict[str, Template] = {
    "train.nonfinite": "{name} is {value}{at} ({source})",
    "train.loss_spike": "{name} spiked to {value}{at} (window mean {mean}, sigma {sigma})",
    "train.metric_zero": ("{name} stayed at exactly 0 for {evaluations} evaluations{at} while the loss "
                          "fell ({loss_then} -> {loss_now})"),
    "train.restarted_from_zero": lambda d: (
        "training restarted at step {new_step} (it had reached step {last_step})"
        if d.get("new_step") is not None else
        "training restarted at epoch {new_epoch} (it had reached epoch {last_epoch})"),
    "train.slow": "steps advance while the GPU idles ({gpu_util_pct}% busy): data-bound",
    "train.short_run": "the job finished early: {fraction} of its expected {by}",
    "job.stalled": lambda d: _stalled(d),
    "gpu.xid": lambda d: "Xid {code} ({xid_name}) on {where}" + (": {advice}" if d.get("advice") else ""),
    "gpu.lost": "{where} was lost (evidence: {evidence})",
    "gpu.ecc": lambda d: (
        "row remapping failed on {where}: the GPU needs replacing" if d.get("reason") == "row_remap_failure"
        else "uncorrected ECC errors rose on {where} (+{volatile_uncorrected_delta} volatile, "
             "+{aggregate_uncorrected_delta} aggregate)"),
    "gpu.throttle": "{where} is throttled: {reasons}",
    "gpu.foreign_memory": "processes that are not the job hold {bytes} on {where} (pids {pids})",
    "disk.low": lambda d: "disk {path} is {used_pct}% full ({resource}): " + (
        "{inodes_free} inodes free" if d.get("resource") == "inodes" else "{avail_bytes} free") + (
        ", full in ~{eta_to_full_s}" if d.get("eta_to_full_s") is not None else ""),
    "mem.pressure": lambda d: (
        "the kernel OOM-killed a process in the job's memory group (+{oom_kill_delta})"
        if d.get("state") == "oom_kill"
        else "job memory at {used_pct}% of its limit ({used_bytes} of {limit_bytes})"),
    "ckpt.suspect": "checkpoint {path} looks suspect: {reason}",
    "ckpt.stale": lambda d: "no good checkpoint for {age_s} (limit {stale_after_s})" + (
        "; the last is {last_path} (step {last_step})" if d.get("last_path") else ""),
    "ckpt.sync_failed": "the durable copy of {path} failed: {error}",
    "sidecar.silent": _silent,
    "sidecar.degraded": lambda d: ("the controller's watcher failed: {error}"
                                   if d.get("source") == "controller"
                                   else "sidecar part {part} is failing: {error}"),
    "deadman.fired": "the dead-man lease expired and its safe action ran",
    "job.preempted": lambda d: _preempted(d),
    "job.rank_failed": "node {node} exited ({how}) while {waiting} still wait on it",
}


_PREEMPT_HEADS = {
    "time_limit": "Slurm's time limit: the job was told to stop as its --time runs out (not a crash)",
    "requeued": "Slurm requeued the job: it will run again and resume from its newest checkpoint",
    "cancelled": "the job was cancelled through Slurm (scancel), not by rgt",
    "preempted": "Slurm preempted the job for another one",
}


def _preempted(d: Mapping[str, Any]) -> str:
    reason = d.get("reason")
    head = _PREEMPT_HEADS.get(reason, "") if isinstance(reason, str) else ""
    head = head or "the job was told to stop by someone else than rgt (preemption)"
    if d.get("grace_s") is None:
        return head + ", grace unknown"
    source = " (Slurm's)" if d.get("grace_from") == "slurm" else ""
    return head + ", grace {grace_s} before SIGKILL" + source


def cut(text: str) -> str:
    """Printable, and at most EXPLAIN_MAX characters."""
    text = printable(text)
    return text if len(text) <= EXPLAIN_MAX else text[: EXPLAIN_MAX - 3] + "..."


def _took(event: AnyEvent, job_started_at: Optional[float]) -> str:
    took = event.ts - job_started_at if job_started_at is not None else None
    return f" after {seconds(took)}" if took is not None and took >= 0 else ""


def _how(d: Mapping[str, Any]) -> str:
    code, sig = d.get("code"), d.get("signal")
    if code is not None:
        return f"exit code {text_of(code)}" + (" (SIGTERM)" if code in life_mod.SIGTERM_CODES else "")
    return f"signal {signal_name(sig)}" if sig is not None else "no exit code"


def closed_tail(d: Mapping[str, Any]) -> str:
    """What a run.closed adds to its exit: the final manifest, or why there is none, and what was
    still incomplete at the close."""
    m = d.get("manifest")
    if isinstance(m, Mapping) and isinstance(m.get("sha256"), str):
        text = (f"; closed: final manifest {text_of(m['sha256'][:12])} ({text_of(m.get('checkpoints'))} "
                f"checkpoint(s), {text_of(m.get('files'))} files)")
    else:
        text = f"; closed without a final manifest: {text_of(d.get('manifest_error') or 'unknown')}"
    incomplete = d.get("incomplete")
    if isinstance(incomplete, list) and incomplete:
        first = incomplete[0].get("path") if isinstance(incomplete[0], Mapping) else incomplete[0]
        text += f"; {len(incomplete)} checkpoint(s) still incomplete at the close ({text_of(first)}, ...)"
    return text


def explain(event: AnyEvent, job_started_at: Optional[float] = None,
            life: Optional[life_mod.Life] = None, cause: Optional[AnyEvent] = None) -> str:
    """One printable line saying what happened (box text escaped, <= EXPLAIN_MAX chars); never raises.

    life: for a job.exited, how it ended the run (controller.runs.life.exit_life): a stop by request,
    a SIGTERM nobody asked for and an exit after the training went non-finite (cause: that
    train.nonfinite) are told as such, not as the bare exit code."""
    d = event.data
    template = _TEMPLATES.get(event.kind)
    try:
        if event.kind in life_mod.END_KINDS:
            took = _took(event, job_started_at)
            if life is not None and life.state == life_mod.STOPPED:
                text = f"the job was stopped by request ({life.stopped_by}) and ended with {_how(d)}{took}"
            elif life is not None and life.state == life_mod.PREEMPTED and \
                    any(life.reason == line for _, line in life_mod.SCHEDULER_ENDS.values()):
                text = f"the job ended with {_how(d)}{took}: {life.reason}"
            elif life is not None and life.state == life_mod.PREEMPTED and not d.get("preempted"):
                text = (f"the job ended with {_how(d)}{took} and no stop was asked for: a preemption "
                        "(a SIGTERM nobody asked rgt for)")
            elif life is not None and life.outcome == "nan":
                text = f"the job ended with {_how(d)}{took}, but training had gone non-finite" + (
                    f": {explain(cause)}" if cause is not None else "")
            else:
                text = _exited(d, took)
            if event.kind == life_mod.CLOSED_KIND:
                text += closed_tail(d)
        elif template is not None:
            text = (template if isinstance(template, str) else template(d)).format_map(_Fields(d))
        else:
            text = f"{event.kind} ({event.sev}): {summarize(d, 120)}"
    except Exception as e:  # odd stored data: say so rather than fail the watch
        text = (f"{text_of(event.kind)} ({text_of(event.sev)}): its data could not be shown "
                f"({type(e).__name__})")
    return cut(text)


def quoted(value: str) -> str:
    """A run id or host name as one shell word, safe to print."""
    return printable(shlex.quote(value))


def resume_command(run: str, host: Optional[str]) -> str:
    """Pull, then a dry run of the resume (it shows the plan; nothing changes on the box)."""
    q = quoted(run)
    if not host:
        return f"rgt pull {q}"
    return f"rgt pull {q} && rgt resume {q} --on {quoted(host)} --dry-run"


def next_command(event: AnyEvent, life: Optional[life_mod.Life] = None, host: Optional[str] = None) -> str:
    """The command a person or agent should run next: one line a shell runs as it is.

    host: the run's host as this laptop knows it (for a resume); the event's own host otherwise."""
    run = quoted(event.run)
    box = host or (event.host if isinstance(event, protocol.Event) else "") or None
    preempted = event.data.get("preempted") or (life is not None and life.state == life_mod.PREEMPTED)
    requeued = event.data.get("reason") == "requeued" or (life is not None and life.outcome == "requeued")
    ended = event.kind in life_mod.END_KINDS
    if requeued and (event.kind == "job.preempted" or ended):
        # Slurm runs it again under the same id: follow the next attempt (its nodes may differ).
        group = event.data.get("group")
        target = group if isinstance(group, str) and is_run_id(group) else event.run
        return f"rgt track {quoted(box)} {quoted(target)}" if box else f"rgt status {run}"
    if event.kind == "job.preempted" or (ended and preempted):
        return resume_command(event.run, box)
    if ended:
        return f"rgt status {run} && rgt pull {run}"
    for prefix in ("train.", "gpu.", "ckpt.", "sidecar.degraded"):
        if event.kind.startswith(prefix):
            return f"rgt events {run} --kind {prefix.split('.')[0]}."
    return f"rgt status {run}"


__all__ = ["AnyEvent", "EXPLAIN_MAX", "cut", "explain", "next_command", "quoted", "resume_command",
           "signal_name", "stack_lines"]
