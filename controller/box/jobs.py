"""Run things on a box: launch a job there, stop it, ask what runs.

Every call goes through one shell for the host: the host's SSH ControlMaster
(controller.box.ssh.Ssh), or for the reserved host `local` this machine directly
(LocalShell), so `make demo` and a rented box take the same path. The box's
`rgt-onbox` does the work; this module builds its command lines (every word
shell-quoted; secrets never on them) and reads its one JSON answer.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from protocol.ids import new_run_id
from rgtlib.units import human_bytes

from controller import trust as boxtrust
from controller.box import codesync
from controller.box.handle import Box, BoxError
from controller.box.ssh import LocalShell, Ssh, SshError
from controller.output import error_tail, last_json_object
from controller.paths import LOCAL
from controller.runs import groups, life
from controller.store.db import AmbiguousRun, RunNotFound, Store

Shell = Union[Ssh, LocalShell]
__all__ = ["LOCAL", "BoxError", "Code", "launch", "new_run_id", "recorded", "shell_for", "stop"]


def shell_for(store: Store, name: str) -> Shell:
    """The shell that reaches host NAME (`local`: this machine)."""
    return Box.of(store, name).shell


def _json_answer(out: Any, what: str) -> Dict[str, Any]:
    """The last JSON object rgt-onbox printed, or BoxError with its error lines."""
    obj = last_json_object(out.stdout)
    if obj is None:
        raise BoxError(f"{what} failed on the box (exit {out.returncode}): {error_tail(out.stderr)}")
    return obj


@dataclasses.dataclass
class Code:
    """`rgt launch --code DIR [--cwd PATH] [--python PY]`: what goes to the box before the launch."""

    code: Optional[Path] = None            # the working tree to sync (controller/box/codesync.py)
    cwd: Optional[str] = None              # the job's cwd on the box (relative: from the synced code)
    python: Optional[str] = None           # the job's interpreter on the box
    limit_bytes: Optional[int] = codesync.DEFAULT_LIMIT_BYTES   # None: copy whatever the size


def _sync_code(shell: Shell, code: Code, root: Optional[str], project: str,
               progress: Callable[[str], None]) -> Dict[str, Any]:
    """Scan DIR, refuse it when too big, rsync it to <root>/<project>/code; what run.json's caller shows."""
    assert code.code is not None
    try:
        scan = codesync.scan_tree(code.code)
        scan.check_size(code.limit_bytes)
        where = codesync.code_dir_on_box(shell, root, project)
        progress(f"code: {len(scan.files)} files, {human_bytes(scan.total_bytes)} from {scan.root} to "
                 f"{shell.alias}:{where} ({len(scan.left_out)} entries left out)")
        codesync.sync(shell, scan, where)
    except codesync.CodeError as e:
        raise BoxError(e.message, e.hint) from e
    except SshError as e:
        raise BoxError(e.message, e.hint) from e
    return {"dir": where, "files": len(scan.files), "bytes": scan.total_bytes,
            "left_out": [rel + ("/" if d else "") for rel, d in scan.left_out][:50]}


def _code_args(code: Code, where: Optional[str]) -> List[str]:
    args: List[str] = []
    for flag, value in (("--code-dir", where), ("--cwd", code.cwd), ("--python", code.python)):
        if value:
            args += [flag, value]
    return args




def recorded(store: Store, run: str) -> Optional[Dict[str, Any]]:
    """The stored run with exactly this id (never one it is a prefix of), or None."""
    try:
        info = store.run(run)
    except (RunNotFound, AmbiguousRun):
        return None
    return info if info["run"] == run else None


def _run_id_for(store: Store, host: str, run_id: Optional[str], relaunch: bool) -> str:
    """The run id this launch asks the box for: the laptop's, checked, and not another run's.

    A run id already in the store is refused: the launch would take that run's record over (its
    host, directory and events). `relaunch` is the queue's retry in place: the same run, again on
    the host it is bound to."""
    if run_id is None:
        return new_run_id()
    try:
        run_id = boxtrust.run_id(run_id)
    except boxtrust.Untrusted as e:
        raise BoxError(f"--run-id refused: {e}", hint="leave out --run-id: rgt chooses one") from None
    known = recorded(store, run_id)
    if relaunch:
        if known is None or known["target"] != host:
            where = f"host {known['target'] or '(none)'}" if known else "no host: it is not recorded"
            raise BoxError(f"run {run_id} cannot be relaunched on {host}: it is bound to {where}")
    elif known is not None:
        on = known["target"] or known["host"] or "?"
        raise BoxError(f"run {run_id} exists already in this store (host {on}); a launch under its id "
                       "would take its record over",
                       hint="leave out --run-id: rgt chooses a new one")
    return run_id


def _checked_answer(store: Store, host: str, answer: Dict[str, Any], asked: str,
                    relaunch: bool) -> Dict[str, Any]:
    """The launch answer once boxtrust accepts it: the run id asked for (or its node stream), its
    run dir named after it. BoxError saying why otherwise; nothing is recorded then."""
    try:
        checked = boxtrust.launch_answer(answer, asked)
    except boxtrust.Untrusted as e:
        raise BoxError(f"refused the box's answer to the launch: {e}",
                       hint=f"nothing was recorded; if a job started on {host}, stop it there "
                            "('rgt-onbox stop RUN_DIR')") from None
    run = str(checked["run_id"])
    known = recorded(store, run)
    if run != asked and known is not None and not relaunch:
        raise BoxError(f"refused the box's answer to the launch: its stream {run} is another run, "
                       "recorded already", hint="launch again without --run-id")
    if relaunch and known is not None and known["run_dir"] and known["run_dir"] != checked["run_dir"]:
        raise BoxError(f"refused the box's answer to the launch: run {run} lives in {known['run_dir']}, "
                       f"not {checked['run_dir']}", hint=f"look at what runs on {host}")
    return checked


def launch(store: Store, host: str, command: Sequence[str], *, run_id: Optional[str] = None,
           profile: Optional[str] = None, root: Optional[str] = None, project: Optional[str] = None,
           onbox_args: Sequence[str] = (), code: Optional[Code] = None, relaunch: bool = False,
           progress: Callable[[str], None] = lambda line: None) -> Dict[str, Any]:
    """Start COMMAND on the box through `rgt-onbox launch`; its JSON answer, with `host` added
    (and `code`: where the synced tree went, with --code).

    The run id is the laptop's: given (and then checked, and refused when another run has it,
    unless `relaunch`: the queue's retry in place) or made here, and passed as --run-id; the
    box's answer must name it (controller.trust.launch_answer). The versions must match first:
    the sidecar and this controller speak one protocol. With `code.code` the working tree goes to
    <root>/<project>/code there first (project: DIR's name unless given) and the job's cwd defaults
    to it. The run is recorded in the store with its host and directory, and what the laptop asked
    for (Store.record_launch, what `rgt resume` re-runs), before anything follows it.
    """
    box = Box.of(store, host)
    record = box.record
    asked = _run_id_for(store, host, run_id, relaunch)
    shell = box.shell
    onbox = box.onbox
    box.check_version()  # VersionMismatch, OnboxNotFound: BoxError
    code = code or Code()
    root = root or (str(record["root"]) if record.get("root") else None)
    synced: Optional[Dict[str, Any]] = None
    if code.code is not None:
        project = project or codesync.project_for(code.code)
        synced = _sync_code(shell, code, root, project, progress)
    args: List[str] = ["launch", "--json", *_code_args(code, synced["dir"] if synced else None)]
    profile = profile or (str(record["profile"]) if record.get("profile") and host != LOCAL else None)
    for flag, value in (("--run-id", asked), ("--profile", profile), ("--project", project),
                        ("--root", root)):
        if value:
            args += [flag, value]
    if host == LOCAL and not any(a.startswith("--deadman") for a in onbox_args):
        args += ["--deadman", "off"]  # nothing bills on this machine: no dead-man to arm here
    args += list(onbox_args)
    line = f"{onbox} {shlex.join(args)} -- {shlex.join(list(command))}"
    try:
        out = shell.run(line, check=False, timeout_s=300)
    except SshError as e:
        raise BoxError(e.message, e.hint) from e
    answer = _json_answer(out, "rgt-onbox launch")
    if out.returncode != 0 or "run_id" not in answer:
        reason = answer.get("error") or answer.get("reason") or answer
        raise BoxError(f"the box refused the launch (exit {out.returncode}): {reason}")
    answer = _checked_answer(store, host, answer, asked, relaunch)
    run = str(answer["run_id"])
    first = recorded(store, run) is None
    store.upsert_run(run, host="", target=host, run_dir=str(answer["run_dir"]))
    if first or not relaunch:
        # On `local` the launcher's cwd is this process's: keep it, so a resume runs where the job ran.
        cwd = code.cwd or (os.getcwd() if host == LOCAL and code.code is None else None)
        store.record_launch(run, {"command": list(command), "cwd": cwd, "python": code.python,
                                  "code": synced["dir"] if synced else None, "profile": profile,
                                  "project": project, "onbox_args": list(onbox_args), "host": host})
    return {**answer, "host": host, **({"code": synced} if synced else {})}


def stop(store: Store, run: str, grace: str = "30s", by: str = "rgt stop") -> Dict[str, Any]:
    """Stop RUN's job on its box (`rgt-onbox stop`): SIGTERM, SIGKILL after the grace.

    The stop request is recorded first (life.STOP_KIND, with `by`: who asked), while the run has not
    ended: the job's exit that follows, whatever its code (143, the SIGTERM, 0 after saving), is
    then "stopped by request", never a preemption or a crash. A run whose job exit is stored records
    nothing; one "lost" (its sidecar stopped, no exit stored) does: its job may still run."""
    info = store.run(run)
    if groups.is_group(info):
        return _stop_group(store, str(info["run"]), grace, by)
    if not info["target"] or not info["run_dir"]:
        raise BoxError(f"run {info['run']} was not launched through rgt: no host or run directory known",
                       hint="stop it on the box with 'rgt-onbox stop RUN_DIR'")
    host = str(info["target"])
    run_id = str(info["run"])
    now_life = life.of_run(store, run_id)
    asked = None
    if not now_life.ended or now_life.state == life.LOST:
        asked = store.add_local_event(run_id, life.STOP_KIND, "info", {"by": by, "grace": grace})
    try:
        out, _ = Box.of(store, host).run_onbox(["stop", "--json", "--grace", grace, str(info["run_dir"])])
    except SshError as e:
        raise BoxError(e.message, e.hint) from e
    answer = _json_answer(out, "rgt-onbox stop")
    if asked is not None:
        # What the box said to it: "not_running" means the job had ended before the stop reached it.
        store.add_local_event(run_id, life.STOP_ANSWER_KIND, "info", {
            "by": by, "request_id": asked.id, "outcome": str(answer.get("outcome") or ""),
            "exit": out.returncode})
    return {**answer, "run": info["run"], "host": host, "exit": out.returncode}


def _stop_group(store: Store, group: str, grace: str, by: str) -> Dict[str, Any]:
    """Stop every node stream of a multi-node run, one after the other. Under Slurm the first one
    already ends them all (`rgt-onbox stop` marks every node stopped, then scancel's the step),
    and the others answer "not running"; each node's exit is then "stopped by request"."""
    found = groups.members(store, group)
    if not found:
        raise BoxError(f"run {group} has no node streams tracked yet",
                       hint=f"track them first: rgt track HOST {group}")
    nodes = [{"node": m.get("node"), **stop(store, str(m["run"]), grace, by)} for m in found]
    outcomes = sorted({str(n.get("outcome") or "") for n in nodes})
    return {"run": group, "outcome": ", ".join(o for o in outcomes if o) or "unknown", "nodes": nodes,
            "exit": max(int(n["exit"]) for n in nodes)}
