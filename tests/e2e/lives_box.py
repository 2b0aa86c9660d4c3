"""What the normal-lives suite (tests/e2e/test_normal_lives.py) shares: a story of `rgt watch` exits
per life, launches of any command, waits on the store, and the fakes of things a box does to a run
(a power cut and reboot, a memory cgroup, a late dead-man renewal).

A Story runs real `rgt watch --json` subprocesses and keeps every line they print. Each exit becomes
a token: "0", "3", "4", "10" (a new wake) or "10r" (an exit 10 that says `already_reported`: a run
that ended badly and was told before, not a new wake). A life then asserts its exact token sequence,
so one unexpected exit 10 fails it with the event that woke it named.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pytest

from controller.store.db import Store
from onbox.runs import ProcRef, read_json, wait_for
from tests.e2e.cgroups import small_memory_cgroup
from tests.e2e.rgtbox import TEST_ONBOX_ARGS, TRAIN, Rgt
from tests.helpers import REPO, onbox_cmd, rgt_cmd, wait_until

WATCH_TIMEOUT = "100s"   # a bound on one watch: every life's watch ends long before on its own
WATCH_LIMIT_S = 150.0
WHOLE = ("exit", "run", "event", "explain", "next")   # the keys every watch line carries
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(REPO / "tests" / "frameworks" / "ddp_tiny.py")]


def token(record: Dict[str, Any]) -> str:
    code = record.get("exit")
    return "10r" if code == 10 and record.get("already_reported") is True else str(code)


def kind_of(record: Dict[str, Any]) -> Optional[str]:
    event = record.get("event")
    return event.get("kind") if isinstance(event, dict) else None


def _line(record: Dict[str, Any]) -> str:
    return (f"exit {record.get('exit')} run {record.get('run')} event {kind_of(record)} "
            f"stopped_by {record.get('stopped_by')} already_reported {record.get('already_reported')}: "
            f"{str(record.get('explain') or record.get('status') or record.get('error'))[:200]}")


class Story:
    """The watches of one life, in order."""

    def __init__(self, rgt: Rgt, life: str) -> None:
        self.rgt = rgt
        self.life = life
        self.records: List[Dict[str, Any]] = []
        self._background: List[subprocess.Popen[str]] = []

    @property
    def tokens(self) -> List[str]:
        return [token(r) for r in self.records]

    def _args(self, targets: Sequence[str], extra: Sequence[str]) -> List[str]:
        return rgt_cmd("watch", *targets, "--timeout", WATCH_TIMEOUT, "--json", *extra)

    def _take(self, out: str, err: str, code: int) -> Dict[str, Any]:
        lines = [ln for ln in out.splitlines() if ln.strip()]
        assert len(lines) == 1, f"{self.life}: rgt watch printed {len(lines)} lines, not one:\n{out}\n{err}"
        record: Dict[str, Any] = json.loads(lines[0])
        assert record.get("exit") == code, f"{self.life}: the line says exit {record.get('exit')}, " \
                                           f"the process {code}: {record}"
        missing = [k for k in WHOLE if k not in record]
        assert not missing, f"{self.life}: the watch line lacks {missing} (every line has {WHOLE}): {record}"
        if code == 10 and isinstance(record.get("event"), dict):
            assert record.get("entry"), f"{self.life}: a wake on an event names no entry: {record}"
        self.records.append(record)
        return record

    def watch(self, *targets: str, extra: Sequence[str] = ()) -> Dict[str, Any]:
        """One `rgt watch TARGETS --json` to its end; its record."""
        out = subprocess.run(self._args(targets, extra), env=self.rgt.env, cwd=REPO, capture_output=True,
                             text=True, timeout=WATCH_LIMIT_S)
        return self._take(out.stdout, out.stderr, out.returncode)

    def start(self, *targets: str, extra: Sequence[str] = ()) -> subprocess.Popen[str]:
        """A watch left running while the test does something to the run; end it with finish()."""
        proc = subprocess.Popen(self._args(targets, extra), env=self.rgt.env, cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._background.append(proc)
        return proc

    def start_all(self, runs: Sequence[str]) -> subprocess.Popen[str]:
        """`rgt watch --all` left running, returned once it is known to watch `runs`. It takes in
        the runs live when it starts, so a run that ends before it has looked is not among them; its
        start is seen through the background watchers: those of `runs` are stopped first, and the
        watch starts one for each run it watches, once it has read which runs are live. It returns
        once each run streams into the store again: a run that ends before its follow connected
        would leave its exit with a sidecar that (with the tests' linger of 0 s) is gone."""
        from controller.follow.client import running_pid, unfollow

        for run in runs:
            unfollow(run)
            assert wait_for(lambda r=run: running_pid(r) is None, 15.0), f"the watcher of {run} did not end"
        with Store.open() as store:
            cursors = {run: store.cursor(run) for run in runs}
        proc = self.start(extra=["--all"])
        for run in runs:
            wait_until(lambda r=run: running_pid(r) is not None or proc.poll() is not None, 60,
                       f"`rgt watch --all` to take in {run}")
            wait_until(lambda r=run: _cursor(r) > cursors[r] or proc.poll() is not None, 60,
                       f"{run} to stream into the store again")
        assert proc.poll() is None, f"{self.life}: `rgt watch --all` ended at once: {proc.communicate()}"
        return proc

    def finish(self, proc: subprocess.Popen[str]) -> Dict[str, Any]:
        out, err = proc.communicate(timeout=WATCH_LIMIT_S)
        return self._take(out, err, proc.returncode)

    def running(self, proc: subprocess.Popen[str]) -> bool:
        return proc.poll() is None

    def end(self) -> None:
        """End any watch this story left running (our own children, by pid)."""
        for proc in self._background:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)

    def expect(self, *tokens: str) -> None:
        got = self.tokens
        if got == list(tokens):
            return
        unexpected = [i for i, (g, w) in enumerate(zip(got, tokens)) if g == "10" and w != "10"]
        head = (f"{self.life}: unexpected exit 10 at watch #{unexpected[0] + 1}" if unexpected
                else f"{self.life}: watch exits {got}, expected {list(tokens)}")
        story = "\n".join(f"  #{i + 1} {_line(r)}" for i, r in enumerate(self.records))
        raise AssertionError(f"{head} (got {got}, expected {list(tokens)})\n{story}")


@pytest.fixture
def story_end() -> Iterator[List[Story]]:
    """Stories registered here have their background watches ended at teardown."""
    stories: List[Story] = []
    yield stories
    for s in stories:
        s.end()


# ---- runs ----------------------------------------------------------------------------------------


def last_json(text: str) -> Dict[str, Any]:
    return dict(json.loads(text.strip().splitlines()[-1]))


def launch(rgt: Rgt, host: str, command: Sequence[str], *onbox: str,
           cwd: Optional[Path] = None) -> Dict[str, Any]:
    """`rgt launch HOST -- COMMAND` with the test box options; the launch answer (run_id, run_dir, pid)."""
    where = ["--cwd", str(cwd)] if cwd is not None else []
    answer = last_json(rgt("launch", host, "--root", str(rgt.root), "--json", *where, *TEST_ONBOX_ARGS,
                           *onbox, "--", *command).stdout)
    rgt.runs.append(str(answer["run_id"]))
    return answer


def tiny(*args: str) -> List[str]:
    return [*TRAIN, *args]


def stored(run: str, kind: str) -> List[Any]:
    with Store.open() as store:
        return list(store.events(run, kind_prefix=kind))


def local(run: str, kind: str) -> List[Any]:
    with Store.open() as store:
        return list(store.local_events(run, kind_prefix=kind))


def wait_stored(run: str, kind: str, timeout_s: float = 60.0, what: str = "", **match: Any) -> List[Any]:
    def found() -> List[Any]:
        return [e for e in stored(run, kind) if all(e.data.get(k) == v for k, v in match.items())]
    return wait_until(found, timeout_s, what or f"{kind} {match or ''} of {run} in the store")


def wait_step(run: str, step: int, timeout_s: float = 60.0) -> None:
    """Until a train.progress at `step` or later is stored: the job trains and the link carries it."""
    wait_until(lambda: [e for e in stored(run, "train.progress")
                        if isinstance(e.data.get("step"), int) and e.data["step"] >= step],
               timeout_s, f"train.progress at step {step} of {run}")


def wait_ckpt(run: str, step: int, timeout_s: float = 90.0) -> None:
    wait_until(lambda: [e for e in stored(run, "ckpt.saved") if (e.data.get("step") or 0) >= step],
               timeout_s, f"a ckpt.saved at step {step} or later of {run}")


def runs_by_id(rgt: Rgt) -> Dict[str, Dict[str, Any]]:
    return {r["run"]: r for r in json.loads(rgt("runs", "--json").stdout)["runs"]}


def _cursor(run: str) -> int:
    with Store.open() as store:
        return store.cursor(run)


def stop_all_watchers(rgt: Rgt) -> None:
    """End the background watcher of every run the store knows (resumed runs included), by pid."""
    from controller.follow.client import running_pid, unfollow

    with Store.open() as store:
        runs = [str(r["run"]) for r in store.runs()]
    for run in runs:
        if run not in rgt.runs:
            rgt.runs.append(run)
        unfollow(run)
        assert wait_for(lambda r=run: running_pid(r) is None, 15.0), f"the watcher of {run} did not end"


# ---- a power cut and a reboot --------------------------------------------------------------------


def power_cut(run_dir: Path) -> int:
    """SIGKILL what the launch left on the box (supervisor, sidecar, job wrapper, the job's group),
    as a power cut would: nothing writes an exit record. The wrapper's pid."""
    rgt_dir = run_dir / "rgt"
    sup = read_json(rgt_dir / "supervisor.json") or {}
    job = read_json(rgt_dir / "job.json") or {}
    refs = [ProcRef.from_dict(sup), ProcRef.from_dict(sup.get("sidecar")),
            ProcRef.from_dict(job.get("wrapper")), ProcRef.from_dict(job.get("job"))]
    for ref in refs:   # in this order: nothing is left to restart the sidecar or report the exit
        if ref is not None and ref.alive():
            os.kill(ref.pid, signal.SIGKILL)
            assert wait_for(lambda r=ref: not r.alive(), 10.0), f"pid {ref.pid} outlived SIGKILL"
    pgid = job.get("pgid")
    if isinstance(pgid, int):
        try:
            os.killpg(pgid, signal.SIGKILL)   # the job's own group, which this test's launch made
        except ProcessLookupError:
            pass
    wrapper = job.get("wrapper") or {}
    return int(wrapper["pid"])


def as_if_rebooted(run_dir: Path) -> None:
    """The job's announcement now names an earlier boot, as after a reboot of the box."""
    path = run_dir / "rgt" / "job.announced"
    doc = json.loads(path.read_text())
    doc["boot_id"] = "boot-before-the-power-cut"
    path.write_text(json.dumps(doc) + "\n")


def serve_again(run_dir: Path, wrapper_pid: int, home: Path) -> subprocess.Popen[bytes]:
    """`rgt-onbox serve` on the run again, as the box's start-up would after the reboot."""
    log = open(run_dir / "rgt" / "after-reboot.log", "ab")
    try:
        return subprocess.Popen(onbox_cmd("serve", "--run-dir", str(run_dir), "--pid", str(wrapper_pid),
                                          "--heartbeat", "1", "--no-kmsg", "--gpu", "none"),
                                env={**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO)}, cwd=REPO,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def end_child(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# ---- a memory cgroup -----------------------------------------------------------------------------


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """An empty cgroup limited to 256 MiB (no swap); removed once empty."""
    with small_memory_cgroup("rgt-lives") as cg:
        yield cg


# A job that joins the cgroup, grows to ~95 % of its limit (by the cgroup's own count), holds there
# until a byte comes through the FIFO named GO, then grows until the kernel kills it. Pages are
# written, so they count.
HOG = """import os, sys
cg, go = sys.argv[1], sys.argv[2]
with open(os.path.join(cg, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
def read(*names):
    for name in names:
        try:
            return int(open(os.path.join(cg, name)).read().split()[0])
        except (OSError, ValueError):
            pass
    return 0
limit = read("memory.max", "memory.limit_in_bytes")
held = []
while read("memory.current", "memory.usage_in_bytes") < 0.95 * limit:
    held.append(b"x" * (2 << 20))
print("holding at", read("memory.current", "memory.usage_in_bytes") >> 20, "MiB of", limit >> 20, flush=True)
with open(go, "rb") as f:
    f.read(1)
while True:
    held.append(b"y" * (8 << 20))
"""
