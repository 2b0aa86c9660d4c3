"""Run things on a box: launch a job there, stop it, ask what runs.

Every call goes through one shell for the host: the host's SSH ControlMaster
(controller.ssh.Ssh), or for the reserved host `local` this machine directly
(LocalShell), so `make demo` and a rented box take the same path. The box's
`rgt-onbox` does the work; this module builds its command lines (every word
shell-quoted; secrets never on them) and reads its one JSON answer.
"""
from __future__ import annotations

import json
import re
import shlex
import sys
from typing import Any, Dict, List, Optional, Sequence, Union

from protocol import PACKAGE_VERSION

from controller import paths
from controller.ssh import LocalShell, Ssh, SshError, ssh_config_file
from controller.store import Store

LOCAL = "local"
Shell = Union[Ssh, LocalShell]
_VERSION = re.compile(r"version\s+(\S+)")


class BoxError(Exception):
    """The box could not do what was asked; `hint` is the next step for a person."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


def host_record(store: Store, name: str) -> Dict[str, Any]:
    """The host as stored; `local` is built in and always exists."""
    if name == LOCAL:
        return {"name": LOCAL, "ssh": "", "profile": "local", "onbox": "", "root": "", "installed": {}}
    return store.host(name)


def shell_for(store: Store, name: str) -> Shell:
    host = host_record(store, name)
    if name == LOCAL:
        return LocalShell()
    return Ssh(str(host["ssh"]), control_dir=paths.state_dir() / "ssh", config_file=ssh_config_file())


def onbox_command(store: Store, name: str) -> str:
    """How `rgt-onbox` is started on the box, as a shell fragment."""
    if name == LOCAL:
        return shlex.join([sys.executable, "-m", "onbox.cli"])
    host = host_record(store, name)
    installed = host.get("installed") or {}
    return str(installed.get("onbox") or host.get("onbox") or "rgt-onbox")


def box_version(shell: Shell, onbox: str) -> str:
    """The version of rgt-onbox on the box; BoxError when it does not run there."""
    try:
        out = shell.run(f"{onbox} --version", check=False, timeout_s=60)
    except SshError as e:
        raise BoxError(e.message, e.hint) from e
    text = out.stdout.decode(errors="replace")
    found = _VERSION.search(text)
    if out.returncode != 0 or not found:
        err = out.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise BoxError(f"rgt-onbox does not run on the box ({onbox}: {err[0]})",
                       hint="install it there with 'rgt install HOST'")
    return found.group(1)


def check_version(shell: Shell, onbox: str, host: str) -> str:
    version = box_version(shell, onbox)
    if version != PACKAGE_VERSION:
        raise BoxError(f"the box runs rgt-onbox {version}, this rgt is {PACKAGE_VERSION}",
                       hint=f"put this version there with 'rgt install {host}'")
    return version


def _json_answer(out: Any, what: str) -> Dict[str, Any]:
    """The last JSON object rgt-onbox printed, or BoxError with its error lines."""
    for line in reversed(out.stdout.decode(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    err = [ln for ln in out.stderr.decode(errors="replace").splitlines() if ln.strip()]
    raise BoxError(f"{what} failed on the box (exit {out.returncode}): "
                   + (" / ".join(err[-3:]) if err else "no output"))


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
    check_version(shell, onbox, host)
    args: List[str] = ["launch", "--json"]
    profile = profile or (str(record["profile"]) if record.get("profile") and host != LOCAL else None)
    for flag, value in (("--run-id", run_id), ("--profile", profile), ("--project", project),
                        ("--root", root or (str(record["root"]) if record.get("root") else None))):
        if value:
            args += [flag, value]
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
    shell = shell_for(store, host)
    line = f"{onbox_command(store, host)} stop --json --grace {shlex.quote(grace)} " \
           f"{shlex.quote(str(info['run_dir']))}"
    try:
        out = shell.run(line, check=False, timeout_s=120)
    except SshError as e:
        raise BoxError(e.message, e.hint) from e
    answer = _json_answer(out, "rgt-onbox stop")
    return {**answer, "run": info["run"], "host": host, "exit": out.returncode}


def run_state(store: Store, run: str) -> Dict[str, Any]:
    """What the store knows of a run's life: running, exited (code) or stopped, and the last event."""
    exited = store.events(run, kind_prefix="job.exited")
    last = store.events(run, since=max(0, store.cursor(run) - 1))
    state: Dict[str, Any] = {"state": "running" if store.cursor(run) else "starting"}
    if exited:
        data = exited[-1].data
        ok = data.get("code") == 0 and data.get("final_ok") is not False
        state = {"state": "finished" if ok else "failed", "code": data.get("code"),
                 "signal": data.get("signal"), "oom_killed": data.get("oom_killed")}
    if last:
        state["last_event_ts"] = last[-1].ts
    links = store.local_events(run, kind_prefix="link.")
    state["link"] = "down" if links and links[-1].kind == "link.lost" else ("up" if links else "unknown")
    return state
