"""Where a hang is: py-spy stacks of every rank of a real torchrun job, the collective verdict, the
faulthandler route where ptrace is refused, and a stopped process named at once."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Set

import psutil
import pytest

from onbox.detectors.hang import (
    STOPPED_VERDICT,
    ProcessStack,
    StallMerge,
    collective_verdict,
    compact,
    parse_faulthandler,
    parse_pyspy_json,
    short_text,
)
from onbox.monitors import stacks as stack_capture
from onbox.monitors.health import HealthMonitor, MonitorConfig
from onbox.monitors.stacks import StackCapture, StallStacks, find_py_spy
from protocol import MAX_EVENT_BYTES
from tests.helpers import REPO, Recorder, exec_script, wait_until

DATA = Path(__file__).parent / "data" / "pyspy"
DDP = REPO / "tests" / "frameworks" / "ddp_tiny.py"


def _stack(name: str, pid: int, rank: Optional[int]) -> ProcessStack:
    threads = parse_pyspy_json((DATA / name).read_text())
    return ProcessStack(pid, rank, "python3", "py-spy", tuple(threads))


def test_pyspy_json_with_native_frames_parses_innermost_first() -> None:
    threads = parse_pyspy_json((DATA / "ddp_rank0_native.json").read_text())
    assert [t.name for t in threads] == ["MainThread"]
    names = [f.name for f in threads[0].frames]
    assert names.index("c10d::Reducer::finalize_backward") < names.index("_engine_run_backward")
    assert threads[0].frames[-2].text() == "<module> (tests/frameworks/ddp_tiny.py:58)"


def test_the_rank_not_in_the_collective_is_named() -> None:
    stacks = [_stack("ddp_rank0_native.json", 10, 0), _stack("ddp_rank1_native.json", 11, 1),
              ProcessStack(9, None, "torchrun", "py-spy", ())]   # the launcher: no rank, left out
    found = collective_verdict(stacks)
    assert found is not None and found["verdict"] == "hung in a collective on rank 1"
    assert found["collective"] == "all_reduce (DDP gradient sync in backward)"
    assert found["ranks_waiting"] == [0] and found["ranks_elsewhere"] == [1]
    assert "rank 1 is at main (tests/frameworks/ddp_tiny.py:41)" in found["detail"]


def test_no_collective_no_verdict_and_every_rank_waiting_names_no_culprit() -> None:
    rank1 = _stack("ddp_rank1_native.json", 11, 1)
    assert collective_verdict([rank1]) is None
    found = collective_verdict([_stack("ddp_rank0_native.json", 10, 0)])
    assert found is not None and found["verdict"] == "hung in a collective" and found["ranks_elsewhere"] == []


def test_a_python_level_collective_frame_counts() -> None:
    text = """Thread 0x00007f01 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/job/train.py", line 40 in main

Current thread 0x00007f02 (most recent call first):
  File "/job/train.py", line 12 in <module>
"""
    threads = parse_faulthandler(text)
    assert [len(t.frames) for t in threads] == [3, 1]
    assert threads[0].frames[0].file == "torch/distributed/distributed_c10d.py"
    found = collective_verdict([ProcessStack(1, 0, "p", "faulthandler", tuple(threads[:1])),
                                ProcessStack(2, 1, "p", "faulthandler", tuple(threads[1:]))])
    assert found is not None and found["verdict"] == "hung in a collective on rank 1"
    assert found["collective"] == "all_reduce"


def test_compact_stays_under_the_cap_and_short_text_reads() -> None:
    big = [_stack("ddp_rank0_native.json", 100 + i, i) for i in range(64)]
    out = compact(big, 20_000)
    assert len(json.dumps(out)) <= 20_000
    small = compact([_stack("ddp_rank0_native.json", 10, 0)])
    frames = small[0]["threads"][0]["frames"]
    assert frames[0] == "c10d::Reducer::finalize_backward (libtorch_cpu.so)"  # libc noise dropped
    assert short_text(small)[0].startswith("rank 0 (pid 10): c10d::Reducer::finalize_backward")


def test_the_merge_gives_one_onset_and_one_clear() -> None:
    m = StallMerge()
    stopped = {"state": "onset", "source": "process_state"}
    assert m.route("job.stalled", stopped) is True
    assert m.route("job.stalled", {"state": "onset", "verdict": "unknown"}) is False   # the floor, later
    assert m.route("job.progressing", {"state": "cleared", "source": "process_state"}) is False  # SIGCONT
    assert m.route("job.progressing", {"state": "cleared", "signal": "step"}) is True   # steps again
    assert m.route("job.progressing", {"state": "cleared"}) is True                     # nobody opened it


# ---- real processes ---------------------------------------------------------------------------------


@pytest.fixture
def ddp_hang(tmp_path: Path) -> Iterator[subprocess.Popen]:  # type: ignore[type-arg]
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    env = {**os.environ, "RGT_CKPT_DIR": str(tmp_path / "ckpt"), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "train.log", "wb")
    proc = subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node", "2", str(DDP),
                             "--hang-rank", "1", "--hang-at", "10", "--steps", "1000"],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    ranks: Set[int] = set()
    try:
        yield proc
    finally:
        # torchrun starts each rank in a session of its own, so killpg misses them: end them by pid,
        # read from the tree while torchrun still lives.
        try:
            ranks = {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.Error:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait(30)
        psutil.wait_procs([p for p in map(_proc, ranks) if p is not None], timeout=30)
        log.close()


def _proc(pid: int) -> Optional[psutil.Process]:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


@pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")
def test_a_torchrun_rank_that_hangs_is_named_from_the_stacks(ddp_hang: subprocess.Popen,  # type: ignore[type-arg]
                                                            tmp_path: Path) -> None:
    cap = StackCapture(tmp_path)

    wait_until(lambda: "step 5 loss" in (tmp_path / "train.log").read_text(), 120,
               "rank 0's step 5 (the hang is at step 10)", interval_s=0.2)

    def hung() -> Optional[Dict[str, Any]]:
        targets = cap.targets(ddp_hang.pid)
        if len([t for t in targets if t[1] is not None]) < 2:
            return None
        found = collective_verdict(cap.capture(ddp_hang.pid))
        return found if found and found["ranks_elsewhere"] else None
    found = wait_until(hung, 120, "one rank to block in the collective", interval_s=0.5)
    assert found["verdict"] == "hung in a collective on rank 1", found
    # the sidecar's path: a job.stalled onset goes out once, with the stacks, within the budget
    rec = Recorder()
    stalls = StallStacks(ddp_hang.pid, rec, cap, budget_s=120)  # room for native dumps under any load
    began = time.monotonic()
    assert stalls.route("job.stalled", {"state": "onset", "verdict": "unknown"}, "warn") is False
    ev = rec.wait_for("job.stalled")[0]
    took = time.monotonic() - began
    stalls.close()
    assert ev["verdict"] == "hung in a collective on rank 1" and ev["verdict_before_stacks"] == "unknown"
    assert {s["rank"] for s in ev["stacks"] if s["rank"] is not None} == {0, 1}
    assert len(json.dumps(ev)) < MAX_EVENT_BYTES
    print(f"stall verdict -> stacks captured: {took:.2f} s (capture {ev['stacks_s']} s)")


# A py-spy whose native dump fails (unwinding, as on some builds) or never ends (a box too loaded to
# read libtorch's symbols in time), and whose plain one answers with the stack it was given.
FAKE_PY_SPY = """#!/bin/sh
case " $* " in *" --native "*) %s ;; esac
cat "$(dirname "$0")/plain.json"
"""
NATIVE_FAILS = 'echo "Error: Failed to unwind the native stack" >&2; exit 1'
NATIVE_HANGS = "exec sleep 3600"


@pytest.mark.parametrize("native", [NATIVE_FAILS, NATIVE_HANGS])
def test_a_native_dump_that_fails_or_runs_out_leaves_the_plain_frames_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: str) -> None:
    # A reserve far above what the plain dump needs on any machine: the test is of the fallback,
    # not of the time a loaded machine takes to start the fake.
    monkeypatch.setattr(stack_capture, "PLAIN_RESERVE_S", 30.0)
    fake = tmp_path / "py-spy"
    fake.write_text(FAKE_PY_SPY % native)
    fake.chmod(0o755)
    shutil.copy(DATA / "ddp_rank1_native.json", tmp_path / "plain.json")
    job = subprocess.Popen([sys.executable, "-c", "import threading\nthreading.Event().wait()"])
    try:
        [s] = StackCapture(tmp_path, py_spy=str(fake)).capture(job.pid, budget_s=32.0)
    finally:
        job.kill()
        job.wait(30)
    assert s.source == "py-spy --nonblocking" and s.threads, s
    why = ("Error: Failed to unwind the native stack" if native == NATIVE_FAILS
           else "py-spy --native took over ")
    assert s.error is not None and s.error.startswith(f"no native frames: {why}"), s
    [doc] = compact([s])
    assert doc["error"] == s.error and doc["threads"]


FAULTHANDLER_JOB = """
import faulthandler, json, os, signal, sys, threading
path = os.path.join(sys.argv[1], "rgt", "stacks", "%d.txt" % os.getpid())
os.makedirs(os.path.dirname(path), exist_ok=True)
out = open(path, "w")
faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
with open(sys.argv[2], "a") as hints:
    hints.write(json.dumps({"v": 1, "kind": "faulthandler", "pid": os.getpid(),
                            "signal": int(signal.SIGUSR1), "path": path}) + "\\n")
def wait_here():
    threading.Event().wait()   # hangs here for good, as a deadlocked job does
wait_here()
"""


def test_without_ptrace_permission_the_faulthandler_dump_is_used(tmp_path: Path) -> None:
    setpriv, py_spy = shutil.which("setpriv"), find_py_spy()
    if os.geteuid() != 0 or setpriv is None or py_spy is None:
        pytest.skip("needs root, setpriv and py-spy to run py-spy as nobody against a root process")
    (tmp_path / "rgt").mkdir()
    hints = tmp_path / "rgt" / "hints.jsonl"
    as_nobody = tmp_path / "py-spy-as-nobody"
    exec_script(as_nobody, [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups", py_spy])
    job = subprocess.Popen([sys.executable, "-c", FAULTHANDLER_JOB, str(tmp_path), str(hints)])
    try:
        wait_until(lambda: hints.exists() and hints.read_text().endswith("\n"), 30, "the hint")
        stacks = StackCapture(tmp_path, py_spy=str(as_nobody)).capture(job.pid)
        assert job.poll() is None                   # the registered signal did not kill it
    finally:
        job.kill()
        job.wait(30)
    [s] = stacks
    assert s.source == "faulthandler" and s.error is None
    assert any(f.name == "wait_here" for t in s.threads for f in t.frames)


def test_without_permission_or_hint_the_error_says_why(tmp_path: Path) -> None:
    setpriv, py_spy = shutil.which("setpriv"), find_py_spy()
    if os.geteuid() != 0 or setpriv is None or py_spy is None:
        pytest.skip("needs root, setpriv and py-spy")
    as_nobody = tmp_path / "py-spy-as-nobody"
    exec_script(as_nobody, [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups", py_spy])
    job = subprocess.Popen([sys.executable, "-c", "import threading\nthreading.Event().wait()"])
    try:
        [s] = StackCapture(tmp_path, py_spy=str(as_nobody)).capture(job.pid)
    finally:
        job.kill()
        job.wait(30)
    assert s.threads == () and s.error is not None
    assert s.error.startswith("Permission Denied") and "no faulthandler registered" in s.error


def test_a_stopped_job_is_named_at_once_and_cleared_on_sigcont(tmp_path: Path) -> None:
    job = subprocess.Popen([sys.executable, "-c", "import threading\nthreading.Event().wait()"])
    rec = Recorder()
    mon = HealthMonitor(MonitorConfig(run_dir=tmp_path / "run", job_pid=job.pid, gpu="none", kmsg=False), rec)
    try:
        mon.start()
        mon.job_tick()
        assert rec.of("job.stalled") == []
        os.kill(job.pid, signal.SIGSTOP)
        wait_until(lambda: mon.job_tick() or rec.of("job.stalled"), 30, "the stopped verdict")
        [ev] = rec.of("job.stalled")
        assert ev["verdict"] == STOPPED_VERDICT and ev["stopped_pids"] == [job.pid]
        os.kill(job.pid, signal.SIGCONT)
        wait_until(lambda: mon.job_tick() or rec.of("job.progressing"), 30, "the clear")
        assert rec.of("job.progressing")[0]["signal"] == "SIGCONT" and len(rec.of("job.stalled")) == 1
    finally:
        mon.close()
        job.kill()
        job.wait(30)
