"""One handle on one box: its stored host record, the shell that reaches it, rgt-onbox there.

    box = Box.of(store, "gpu1")          # reads the host record once (`local` exists unstored)
    box.record, box.profile              # the stored host; its profile ("" when none)
    box.shell                            # its ssh master's Ssh, or LocalShell for `local`; made once
    box.onbox                            # shell text that runs rgt-onbox there
    done, answer = box.run_onbox(["ps", "--json"])   # the process and its last JSON line
    box.check_version()                  # VersionMismatch (OnboxNotFound) unless it is ours

Every package that reaches a box does it through this handle; `rgt install` only puts rgt-onbox
there. BoxError is the base of what a box refuses: `message`, and `hint`, the next step for a
person. SshError (the link, not the box) passes through every call here.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from protocol import PACKAGE_VERSION

from controller import paths
from controller.box.ssh import LocalShell, Shell, Ssh, ssh_config_file
from controller.output import last_json_object
from controller.paths import LOCAL
from controller.render import printable
from controller.store.db import HostNotFound, Store

_VERSION_OUT = re.compile(r"version\s+(\S+)")
AnyShell = Union[Ssh, LocalShell]


class BoxError(Exception):
    """The box could not do what was asked; `hint` is the next step for a person."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class VersionMismatch(BoxError):
    """rgt-onbox on the box is another version than this controller (or not there at all)."""


class OnboxNotFound(VersionMismatch):
    """rgt-onbox does not run on the box."""


def host_record(store: Store, name: str) -> Dict[str, Any]:
    """The stored host; `local` (this machine, no ssh) exists even when not stored."""
    try:
        return store.host(name)
    except HostNotFound:
        if name != LOCAL:
            raise
        return {"name": LOCAL, "ssh": "", "profile": "local", "onbox": "", "root": "", "installed": {}}


def check_version(remote_shell: Shell, onbox_cmd: str, host: Optional[str] = None) -> str:
    """The version of rgt-onbox (run by the shell text `onbox_cmd`) on the box; VersionMismatch
    (OnboxNotFound when it does not run) unless it is exactly this controller's."""
    name = host or remote_shell.alias
    done = remote_shell.run(f"{onbox_cmd} --version", check=False, timeout_s=60)
    found = _VERSION_OUT.search(done.stdout.decode("utf-8", "replace"))
    if done.returncode != 0 or found is None:
        err = [ln.strip() for ln in done.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
        raise OnboxNotFound(
            f"rgt-onbox does not run on {name} ({onbox_cmd}: exit {done.returncode}"
            f"{': ' + printable(err[-1][:200]) if err else ''})", hint=f"rgt install {name}")
    version = printable(found.group(1))
    if version != PACKAGE_VERSION:
        raise VersionMismatch(f"{name} has rgt-onbox {version}, but this rgt is {PACKAGE_VERSION}",
                              hint=f"rgt install {name}")
    return version


class Box:
    """Host NAME as this controller reaches it; made by Box.of (or from a record already read)."""

    def __init__(self, name: str, record: Dict[str, Any], shell: Optional[AnyShell] = None) -> None:
        self.name = name
        self.record = record
        self._shell = shell

    @classmethod
    def of(cls, store: Store, name: str, shell: Optional[AnyShell] = None) -> Box:
        """Host NAME's handle (HostNotFound when it is not stored and not `local`); `shell`: the
        one to use instead of making one (a test's, or one the caller holds)."""
        return cls(name, host_record(store, name), shell)

    @property
    def profile(self) -> str:
        """The host's profile name; "" when it has none."""
        return str(self.record.get("profile") or "")

    @property
    def shell(self) -> AnyShell:
        """The shell that reaches the box (`local`: this machine), made on first use and kept."""
        if self._shell is None:
            if self.record["name"] == LOCAL:
                self._shell = LocalShell()
            else:
                self._shell = Ssh(str(self.record["ssh"]), control_dir=paths.state_dir() / "ssh",
                                  config_file=ssh_config_file())
        return self._shell

    @property
    def onbox(self) -> str:
        """Shell text that runs rgt-onbox on the box: the installed one, else the host's `onbox`
        setting (used as written: it may be `~/venv/bin/rgt-onbox`), else `rgt-onbox` on PATH.
        For `local` without an install record, this controller's own Python runs it."""
        installed = self.record.get("installed") or {}
        if installed.get("onbox"):
            return shlex.quote(str(installed["onbox"]))
        if self.record.get("onbox"):
            return str(self.record["onbox"])
        if self.name == LOCAL:
            return shlex.join([sys.executable, "-m", "onbox.cli"])
        return "rgt-onbox"

    def run_onbox(self, args: Sequence[str], timeout_s: float = 120
                  ) -> Tuple[subprocess.CompletedProcess[bytes], Optional[Dict[str, Any]]]:
        """Run `rgt-onbox ARGS` on the box (every word quoted) and return the finished process and
        the JSON object it answered with (its last JSON line; None when there is none)."""
        line = f"{self.onbox} {shlex.join(list(args))}"
        done = self.shell.run(line, check=False, timeout_s=timeout_s)
        return done, last_json_object(done.stdout)

    def check_version(self) -> str:
        """The version of rgt-onbox on the box (check_version with this box's shell and onbox)."""
        return check_version(self.shell, self.onbox, self.name)


__all__ = ["Box", "BoxError", "OnboxNotFound", "VersionMismatch", "check_version", "host_record"]
