"""The follower daemon's process: `python -m controller.daemon.server serve`.

controller.follow.client starts it (ensure_daemon) and lists the requests it answers. It holds the
state dir's daemon.lock for as long as it lives, binds daemon.sock, resumes what a daemon before
it left (every run marked watchers/RUN.followed, every queue not over), then runs one loop
(controller.follow.loop) over every followed run, with each queue driven on a thread of its own
(controller.daemon.queues). It is the one writer of what the sidecars send, of the link and
silence events, and of the multi-node groups' verdicts (`rgt watch` asks it: check_group).
SIGTERM ends it cleanly; SIGKILL loses nothing: the journals on the boxes, the store's cursors and
the markers carry everything over to the next one.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import Any, Optional, Sequence

from rgtlib import lockfile

from controller import paths
from controller import trust as boxtrust
from controller.box.ssh import fallback_socket_dir
from controller.daemon.queues import Queues
from controller.follow.client import daemon_files, idle_exit_s
from controller.follow.link import make_link
from controller.follow.loop import Loop
from controller.follow.watcher import Watcher, files, finished, watcher_dir
from controller.runs import groups
from controller.store.db import Store, StoreError

log = logging.getLogger(__name__)

CONNECT_WORKERS = 8      # link connects at once (an SSH master's start, a slow box)


class Daemon:
    """The loop, with the control socket's requests and the markers of what it follows."""

    def __init__(self, store: Store, idle_s: float, connect_workers: int = CONNECT_WORKERS) -> None:
        self.store = store
        self.idle_s = idle_s
        self.loop = Loop(store, connect_workers=connect_workers, answer=self.answer,
                         on_end=self._ended, on_tick=self._idle_check)
        self.queues = Queues()
        self._idle_since: Optional[float] = time.monotonic()
        self._closing = False

    def resume(self) -> None:
        """Follow every run whose marker a daemon before this one left (it was killed, or ended
        with the machine); a marker of a run that needs no follow any more is dropped."""
        for marker in sorted(watcher_dir().glob("*.followed")):
            run = marker.name[:-len(".followed")]
            try:
                error = self.start_following(run, resumed=True)
            except Exception:   # one bad marker costs only its own run
                log.exception("resuming %s failed", run[:80])
                error = "failed"
            if error:
                log.info("not resuming %s: %s", run[:80], error)
                marker.unlink(missing_ok=True)

    def start_following(self, run: str, resumed: bool = False) -> str:
        """Follow RUN unless it is followed already; "" or why not."""
        try:
            run = boxtrust.run_id(run)
        except boxtrust.Untrusted as e:
            return str(e)
        if run in self.loop.follows:
            return ""   # its watcher takes a launch marker itself
        try:
            info = self.store.run(run)
        except StoreError as e:
            return str(e)
        if str(info["run"]) != run or not info["target"]:
            return "no rgt host follows it"
        f = files(run)
        if resumed and finished(self.store, run) and not f.launched.exists():
            return "followed to its end"
        link = make_link(self.store, info)
        self.loop.add(run, Watcher(run, link, launch_mark=f.launched))
        self._idle_since = None
        f.followed.touch()
        log.info("following %s on %s (%s)", run, info["target"], info["run_dir"])
        return ""

    def answer(self, body: bytes) -> bytes:
        try:
            request = json.loads(body)
            op = request["op"]
        except (ValueError, KeyError, TypeError):
            return _reply(ok=False, error="not a request")
        if op == "list":
            return _reply(ok=True, runs=sorted(self.loop.follows), queues=self.queues.names())
        if op in ("dispatch", "undispatch"):
            queue = request.get("queue")
            if not isinstance(queue, str):
                return _reply(ok=False, error="no queue named")
            if op == "undispatch":
                return _reply(ok=True, was=self.queues.stop(queue))
            self._idle_since = None
            error = self.queues.start(queue)
            return _reply(ok=not error, pid=os.getpid(), error=error)
        run = request.get("run")
        if not isinstance(run, str):
            return _reply(ok=False, error="no run named")
        if op == "follow":
            error = self.start_following(run)
            return _reply(ok=not error, pid=os.getpid(), error=error)
        if op == "unfollow":
            return _reply(ok=True, was=self.loop.drop(run))
        if op == "check_group":
            try:
                group = boxtrust.run_id(run)
            except boxtrust.Untrusted as e:
                return _reply(ok=False, error=str(e))
            return _reply(ok=True, recorded=len(groups.check(self.store, group)))
        return _reply(ok=False, error=f"unknown op {str(op)[:40]!r}")

    def _ended(self, run: str, code: int) -> None:
        if self._closing:
            return   # the daemon is ending, not the run's follow: its marker stays for the next one
        try:
            files(run).followed.unlink(missing_ok=True)
        except boxtrust.Untrusted:
            pass

    def _idle_check(self) -> None:
        if self.loop.follows or self.queues.busy():
            self._idle_since = None
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= self.idle_s:
            log.info("nothing followed for %gs: ending", self.idle_s)
            self.loop.stop.set()

    def serve(self) -> int:
        self.loop.hub.bind_control(str(daemon_files().sock))
        self.resume()
        try:
            self.queues.resume(self.store)
            self.loop.run()
        finally:
            self._closing = True
            try:
                self.queues.close()
            finally:
                self.loop.close()
        return 0


def _reply(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["serve"]:
        print("usage: python -m controller.daemon.server serve", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    f = daemon_files()
    try:
        lockfile.lock_with_pid(f.lock, f.pid)  # its fd stays open: held until this process ends
    except lockfile.Held:
        log.info("another follower daemon runs")
        return 0
    if f.sock.parent == fallback_socket_dir():
        paths.private_dir(f.sock.parent, follow=False)
    f.sock.unlink(missing_ok=True)   # a socket a killed daemon left; the lock says it is ours now
    with Store.open() as store:
        daemon = Daemon(store, idle_exit_s())

        def stop(signum: int, frame: Optional[FrameType]) -> None:
            daemon.loop.stop.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        log.info("follower daemon %d serving on %s", os.getpid(), f.sock)
        try:
            return daemon.serve()
        finally:
            f.pid.unlink(missing_ok=True)
            log.info("follower daemon %d ended", os.getpid())


if __name__ == "__main__":
    sys.exit(main())
