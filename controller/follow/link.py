"""How a run's watcher reaches its sidecar: the run's own sockets (host `local`), or two unix-socket
forwards on the host's shared SSH ControlMaster. controller.follow.watcher supervises a Link; a broken one
says only that the transport is down, never that the job died. A link also reads the run's journal
through the box's shell when the sidecar does not answer (controller.follow.readback).
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import time
from pathlib import Path
from typing import Any, Dict, Optional, Protocol

from protocol import ProtocolError
from protocol.endpoints import Endpoints

from controller import paths
from controller import trust as boxtrust
from controller.box.handle import Box, host_record
from controller.box.ssh import Ssh, SshError, short_socket_path, ssh_config_file
from controller.follow import readback
from controller.store.db import Store

log = logging.getLogger(__name__)

FULL_CHECK_S = 60.0          # how often `ssh -O check` confirms what /proc says of the master
                             # (6 ms of CPU each: every 10 s it was 3.5 % of a core over 64 runs)

# When each host's master was last confirmed by `ssh -O check`, by its control socket: the runs on
# one host share its master, so in the daemon one check a minute covers all of them.
_CONFIRMED: Dict[str, float] = {}


class Link(Protocol):
    """How the sidecar's sockets are reached from here."""

    def connect(self) -> Endpoints: ...
    def alive(self) -> bool: ...
    def close(self) -> None: ...
    def read_journal(self, since: int) -> Any: ...


def read_journal(box: Box, run_dir: str, since: int) -> Any:
    """`rgt-onbox journal RUN_DIR --since SINCE --json` on the box: its answer, unchecked (the
    caller checks it: controller.follow.readback); SshError when there is none."""
    done, doc = box.run_onbox(["journal", run_dir, "--since", str(int(since)), "--json"],
                              timeout_s=readback.TIMEOUT_S)
    if done.returncode != 0 or doc is None:
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise SshError(f"rgt-onbox journal on {box.name} exited {done.returncode}: "
                       f"{(said[-1] if said else 'no answer')[:200]!r}")
    return doc


class LocalLink:
    """Host `local`: the run's sockets are on this machine already."""

    def __init__(self, run_dir: str, box: Optional[Box] = None) -> None:
        self.run_dir = boxtrust.box_path(run_dir)
        self.rgt_dir = Path(self.run_dir) / "rgt"
        self.box = box or Box(paths.LOCAL, {"name": paths.LOCAL, "ssh": "", "onbox": "", "installed": {}})

    def connect(self) -> Endpoints:
        try:
            return Endpoints.read(self.rgt_dir)
        except FileNotFoundError as e:
            raise SshError(f"no sidecar endpoints in {self.rgt_dir} yet") from e
        except ProtocolError as e:
            raise SshError(str(e)) from e

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def read_journal(self, since: int) -> Any:
        return read_journal(self.box, self.run_dir, since)


class SshLink:
    """An SSH host: the sidecar's two unix sockets forwarded onto the host's ControlMaster."""

    def __init__(self, ssh: Ssh, run: str, run_dir: str, sock_dir: Path, box: Optional[Box] = None) -> None:
        self.ssh = ssh
        self.run_dir = boxtrust.box_path(run_dir)
        name = boxtrust.run_id(run)
        for ext in ("pub", "ctl"):
            boxtrust.contained(sock_dir, f"{name}.{ext}")  # the socket stays in tunnels/ (or its hash does)
        self.box = box or Box(ssh.alias, {"name": ssh.alias, "ssh": ssh.alias, "onbox": "", "installed": {}},
                              shell=ssh)
        self.local_pub = short_socket_path(sock_dir, f"{name}.pub")
        self.local_ctl = short_socket_path(sock_dir, f"{name}.ctl")
        self._remote: Optional[Endpoints] = None
        self._pid = 0

    def connect(self) -> Endpoints:
        self._pid = self.ssh.start_master()
        _CONFIRMED[str(self.ssh.control_path)] = time.monotonic()
        out = self.ssh.run(f"cat {shlex.quote(self.run_dir + '/rgt/endpoints.json')}", timeout_s=20)
        try:
            obj = json.loads(out.stdout)
            remote = Endpoints(pub=str(obj["pub"]), ctl=str(obj["ctl"]), pid=int(obj.get("pid", 0)))
        except (ValueError, KeyError, TypeError) as e:
            raise SshError(f"the sidecar's endpoints.json on {self.ssh.alias} is not readable: {e}") from e
        for name, where in (("pub", remote.pub), ("ctl", remote.ctl)):
            if not where.startswith("ipc://"):
                raise SshError(f"the sidecar's {name} endpoint {where} is not a unix socket; over SSH "
                               "rgt forwards unix sockets only (launch without --tcp)")
        self.ssh.forward(self.local_pub, remote.pub[len("ipc://"):])
        self.ssh.forward(self.local_ctl, remote.ctl[len("ipc://"):])
        self._remote = remote
        return Endpoints(pub=f"ipc://{self.local_pub}", ctl=f"ipc://{self.local_ctl}")

    def alive(self) -> bool:
        """Whether the master still runs. This is asked every SUPERVISE_S, so it looks at the
        master's process in /proc, and asks ssh itself (`-O check`, a process spawn) only where
        /proc cannot tell, or when no run on this host had it confirmed for FULL_CHECK_S."""
        quick = process_alive(self._pid) if self._pid else None
        if quick is False:
            return False
        key = str(self.ssh.control_path)
        if quick is None or time.monotonic() - _CONFIRMED.get(key, 0.0) >= FULL_CHECK_S:
            _CONFIRMED[key] = time.monotonic()
            return self.ssh.master_pid() is not None
        return True

    def read_journal(self, since: int) -> Any:
        """The journal page, through this link's master (the sidecar's sockets need not answer)."""
        return read_journal(self.box, self.run_dir, since)

    def close(self) -> None:
        """Drop this run's forwards. The shared master ends itself once idle (ssh.MASTER_IDLE_S)."""
        if self._remote is not None and self.alive():
            for local, remote in ((self.local_pub, self._remote.pub), (self.local_ctl, self._remote.ctl)):
                try:
                    self.ssh.cancel_forward(local, remote[len("ipc://"):])
                except SshError as e:
                    log.debug("cancel forward %s: %s", local, e)
        for sock in (self.local_pub, self.local_ctl):
            try:
                sock.unlink()
            except FileNotFoundError:
                pass


def process_alive(pid: int) -> Optional[bool]:
    """Whether pid runs (a zombie does not count); None where /proc cannot say (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False if os.path.isdir("/proc/self") else None
    except OSError:
        return None
    state = stat[stat.rfind(b")") + 2:][:1]
    return state not in (b"Z", b"X", b"")


def make_link(store: Store, run: Dict[str, Any]) -> Link:
    target = str(run["target"])
    if target == paths.LOCAL:
        return LocalLink(str(run["run_dir"]), Box(paths.LOCAL, host_record(store, paths.LOCAL)))
    host = store.host(target)
    ssh = Ssh(str(host["ssh"]), control_dir=paths.state_dir() / "ssh", config_file=ssh_config_file(),
              alive_interval_s=int(os.environ.get("RGT_SSH_ALIVE_INTERVAL", "5")),
              alive_count=int(os.environ.get("RGT_SSH_ALIVE_COUNT", "3")))
    return SshLink(ssh, str(run["run"]), str(run["run_dir"]), paths.state_dir() / "tunnels",
                   Box(target, host, shell=ssh))


__all__ = ["FULL_CHECK_S", "Link", "LocalLink", "SshLink", "make_link", "process_alive"]
