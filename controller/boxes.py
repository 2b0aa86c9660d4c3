"""Run things on a box: launch a job there, stop it, ask what runs.

Every call goes through one shell for the host: the host's SSH ControlMaster
(controller.ssh.Ssh), or for the reserved host `local` this machine directly
(LocalShell), so `make demo` and a rented box take the same path. The box's
`rgt-onbox` does the work; this module builds its command lines (every word
shell-quoted; secrets never on them) and reads its one JSON answer.
"""
from __future__ import annotations

import shlex
from typing import Any, Dict, List, Optional, Sequence, Union

from controller import install, status, wake
from controller.install import LOCAL, InstallError, check_version, host_record, onbox_command
from controller.output import error_tail, last_json_object
from controller.ssh import LocalShell, Ssh, SshError
from controller.store import Store

Shell = Union[Ssh, LocalShell]
__all__ = ["LOCAL", "BoxError", "host_record", "launch", "onbox_command", "run_state", "shell_for", "stop"]


class BoxError(Exception):
    """The box could not do what was asked; `hint` is the next step for a person."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


def shell_for(store: Store, name: str) -> Shell:
    """The shell that reaches host NAME (`local`: this machine)."""
    return install.shell_for(install.host_record(store, name))


def _json_answer(out: Any, what: str) -> Dict[str, Any]:
    """The last JSON object rgt-onbox printed, or BoxError with its error lines."""
    obj = last_json_object(out.stdout)
    if obj is None:
        raise BoxError(f"{what} failed on the box (exit {out.returncode}): {error_tail(out.stderr)}")
    return obj


def launch(store: Store, host: str, command: Sequence[str], *, run_id: Optional[str] = None,
           profile: Optional[str] = None, root: Optional[str] = None, project: Optional[str] = None,
           onbox_args: Sequence[str] = ()) -> Dict[str, Any]:
    """Start COMMAND on the box through `rgt-onbox launch`; its JSON answer, with `host` added.

    The versions must match first: the sidecar and this controller speak one protocol.
    The run is recorded in the store with its host and directory before anything follows it.
    """
    record = host_record(store, host)
    shell = shell_for(store, host)
    onbox = onbox_command(store, host)
    try:
        check_version(shell, onbox, host)
    except InstallError as e:
        raise BoxError(e.message, e.hint) from e
    args: List[str] = ["launch", "--json"]
    profile = profile or (str(record["profile"]) if record.get("profile") and host != LOCAL else None)
    for flag, value in (("--run-id", run_id), ("--profile", profile), ("--project", project),
                        ("--root", root or (str(record["root"]) if record.get("root") else None))):
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
    store.upsert_run(str(answer["run_id"]), host="", target=host, run_dir=str(answer["run_dir"]))
    return {**answer, "host": host}


def stop(store: Store, run: str, grace: str = "30s") -> Dict[str, Any]:
    """Stop RUN's job on its box (`rgt-onbox stop`): SIGTERM, SIGKILL after the grace."""
    info = store.run(run)
    if not info["target"] or not info["run_dir"]:
        raise BoxError(f"run {info['run']} was not launched through rgt: no host or run directory known",
                       hint="stop it on the box with 'rgt-onbox stop RUN_DIR'")
    host = str(info["target"])
    try:
        out, _ = install.run_onbox(store, host, ["stop", "--json", "--grace", grace, str(info["run_dir"])])
    except SshError as e:
        raise BoxError(e.message, e.hint) from e
    answer = _json_answer(out, "rgt-onbox stop")
    return {**answer, "run": info["run"], "host": host, "exit": out.returncode}


def run_state(store: Store, run: str, now: float) -> Dict[str, Any]:
    """What the store knows of a run's life, cheaply (for `rgt runs`): running, finished or failed
    (the same verdict as `rgt watch`), the last event's time and the link state of `rgt status`."""
    exited = store.events(run, kind_prefix="job.exited")
    last = store.events(run, since=max(0, store.cursor(run) - 1))
    state: Dict[str, Any] = {"state": "running" if store.cursor(run) else "starting"}
    if exited:
        data = exited[-1].data
        state = {"state": "finished" if wake.finished_cleanly(exited[-1]) else "failed",
                 "code": data.get("code"), "signal": data.get("signal"), "oom_killed": data.get("oom_killed")}
    if last:
        state["last_event_ts"] = last[-1].ts
    state["link"] = status.link_state(store.local_events(run), now)["state"]
    return state
