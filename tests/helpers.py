"""Small test helpers: deadline waits (never bare sleeps) and a sidecar process."""
from __future__ import annotations

import collections
import glob
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, TypeVar

import zmq

from protocol import Event, decode_event, decode_reply
from protocol.endpoints import Endpoints

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent

# The names of documents that live outside this repository (the product's early design notes and
# reference texts): what the repo says must stand on its own, so no text of ours may cite them.
OUTSIDE_DOCUMENT = (r"DESIGN[.]md|[.][.]/sha[r]ed|seed[ -]inventory|seed[ -]skill|peer[ -]anchors"
                    r"|spot-resilience|(?-i:\bAD-[A-Z]{2,})|gotcha\s*#?\d")
# What a person reads (help, hints, the catalog, README and SKILL.md) also names no section of such a
# document and no issue of our tracker.
CITATION = re.compile(r"§|\bissue\s+#?\d+\b|" + OUTSIDE_DOCUMENT, re.IGNORECASE)
# Citations for the scanners' own tests, each put together from two halves so that no file of ours
# holds one whole: a file that did would read as citing what it only detects.
CITED_SAMPLES = tuple(a + b for a, b in (
    ("source: seed", " inventory §3.3"), ("AutoDL profile §5 and AD", "-DANGER"), ("see DES", "IGN.md"),
    ("as seed", "-skill says"), ("gotcha", " #4"), ("(peer", "-anchors 3.4)"), ("see issue", " 16"),
    ("as ../sha", "red/DES" "IGN.md says")))


def citations(text: str) -> List[str]:
    """Each line of `text` that cites an internal document."""
    return [line.strip() for line in text.splitlines() if CITATION.search(line)]


def wait_until(predicate: Callable[[], T], timeout_s: float = 10.0, what: str = "condition",
               interval_s: float = 0.02) -> T:
    """Poll `predicate` until it returns something truthy; fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        pause.wait(interval_s)


def onbox_cmd(*args: str) -> List[str]:
    return [sys.executable, "-m", "onbox.cli", *args]


def exec_script(path: Path, argv: List[str]) -> Path:
    """A /bin/sh script at `path` that execs `argv` with its own arguments after them: a command
    by one plain name (on PATH, in a file) whatever the paths in argv hold (a space, a non-ASCII
    letter: a checkout or venv anywhere). argv is quoted for the shell word by word."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec {shlex.join(argv)} "$@"\n')
    path.chmod(0o755)
    return path


def pyenv_glob(pattern: str) -> List[str]:
    """pyenv's interpreters matching `pattern` under its versions/ ($PYENV_ROOT, else ~/.pyenv),
    sorted: a HOME moved elsewhere (.ci/run) still finds the machine's pyenv through PYENV_ROOT."""
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    return sorted(glob.glob(os.path.join(glob.escape(root), "versions", pattern)))


def rgt_cmd(*args: str) -> List[str]:
    return [sys.executable, "-m", "controller.cli.main", *args]


class SidecarProcess:
    """`rgt-onbox serve` in a child process, ended by pid when the test is done."""

    def __init__(self, run_dir: Path, *extra: str, env: Optional[dict] = None,
                 preexec: Optional[Callable[[], None]] = None) -> None:
        self.run_dir = run_dir
        self.args = onbox_cmd("serve", "--run-dir", str(run_dir), *extra)
        self.env = {**os.environ, **(env or {})}
        self.preexec = preexec
        self.proc: Optional[subprocess.Popen] = None
        self.log = run_dir.parent / f"{run_dir.name}.sidecar.log"

    def start(self, wait: bool = True) -> SidecarProcess:
        old_pid = self._endpoint_pid()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=REPO, preexec_fn=self.preexec)
        if wait:
            wait_until(lambda: self._endpoint_pid() not in (None, old_pid)
                       or self.proc.poll() is not None, 20, "the sidecar to bind")
            assert self.proc.poll() is None, self.log.read_text()
        return self

    def _endpoint_pid(self) -> Optional[int]:
        import json
        try:
            return int(json.loads((self.run_dir / "rgt" / "endpoints.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError("sidecar ignored SIGTERM") from None


class Client:
    """A bare DEALER + SUB, the way a controller talks to a sidecar."""

    def __init__(self, ep: Endpoints, curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        for s in (self.dealer, self.sub):
            s.setsockopt(zmq.LINGER, 0)
            if curve:
                s.curve_serverkey, s.curve_publickey, s.curve_secretkey = curve
        self.dealer.connect(ep.ctl)
        self.sub.connect(ep.pub)

    def ask(self, frames: List[bytes], timeout_ms: int = 5000) -> object:
        self.dealer.setsockopt(zmq.SNDTIMEO, timeout_ms)
        try:
            self.dealer.send_multipart(frames)
        except zmq.Again:  # never connected (e.g. refused by CURVE)
            return None
        if not self.dealer.poll(timeout_ms):
            return None
        return decode_reply(self.dealer.recv_multipart())

    def next_event(self, timeout_ms: int = 5000) -> Event:
        assert self.sub.poll(timeout_ms), "no live event"
        return decode_event(self.sub.recv())

    def close(self) -> None:
        self.dealer.close()
        self.sub.close()
        self.ctx.term()


class Clock:
    """A clock the test moves by hand: pass it where code takes `clock=` or `monotonic=`."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Recorder:
    """An `emit(kind, data, sev)` callable that keeps every event and lets a test wait for one."""

    wait_s = 30.0  # a bound on the wait for an event that must come; a passing test never waits it out

    def __init__(self) -> None:
        self.events: List[Tuple[str, Dict[str, Any], Optional[str]]] = []
        self.cond = threading.Condition()

    def __call__(self, kind: str, data: Mapping[str, Any], sev: Optional[str]) -> None:
        with self.cond:
            self.events.append((kind, dict(data), sev))
            self.cond.notify_all()

    def of(self, kind: str, **match: Any) -> List[Dict[str, Any]]:
        """The data of every `kind` event whose fields equal `match`."""
        with self.cond:
            return [d for k, d, _ in self.events
                    if k == kind and all(d.get(a) == b for a, b in match.items())]

    def wait_for(self, kind: str, count: int = 1, **match: Any) -> List[Dict[str, Any]]:
        with self.cond:
            ok = self.cond.wait_for(lambda: len(self.of(kind, **match)) >= count, timeout=self.wait_s)
        assert ok, f"no {count} x {kind} {match} within {self.wait_s}s; got {self.kinds()}"
        return self.of(kind, **match)

    def kinds(self) -> Dict[str, int]:
        return dict(collections.Counter(k for k, _, _ in self.events))



def end_box_side(run_dir: Path) -> None:
    """End a run's box side by pid once its job has ended: SIGTERM the supervisor, which stops its
    sidecar first, then the sidecar if it is still there; SIGKILL after 15 s. Nothing is left to
    prove by then, so a lingering sidecar (--sidecar-linger, kept for a last checkpoint's custody)
    is not waited out."""
    from onbox.runs import ProcRef, end_process, read_json, wait_for

    sup = read_json(run_dir / "rgt" / "supervisor.json") or {}
    sidecar = ProcRef.from_dict(sup.get("sidecar"))
    end_process(ProcRef.from_dict(sup), 15.0)
    if sidecar is not None and not wait_for(lambda: not sidecar.alive(), 1.0):
        end_process(sidecar, 15.0)
