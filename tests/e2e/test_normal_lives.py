"""Normal lives never wake anyone. Each common life of a run goes start to end through real
`rgt` subprocesses, on host `local` and on the test sshd, with the real CPU torch job
(scripts/train_tiny.py, or torchrun over tests/frameworks/ddp_tiny.py), and asserts the exact
sequence of `rgt watch --json` exits.

Tokens (tests/e2e/lives_box.py): "0" ended and nothing needs you (a clean finish, or a stop rgt
was asked for: the line then says "stopped_by"), "10" a new wake, "10r" an exit 10 on a run that
ended badly and was reported before (`already_reported`). An exit 10 where a life expects
none fails the life with the event that woke it: zero unexpected exit 10 is the pass condition.
A fault a life plants on purpose (a preemption, a reboot, an OOM, a dead-man warning) wakes
exactly once.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import stat
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Set, Tuple

import pytest

from onbox.deadman import daemon, lease
from onbox.runs import wait_for
from onbox.sidecar.journal import read_all
from tests.e2e.lives_box import (
    HOG,
    TORCHRUN,
    Story,
    as_if_rebooted,
    end_child,
    kind_of,
    last_json,
    launch,
    local,
    memory_cgroup,
    power_cut,
    runs_by_id,
    serve_again,
    stop_all_watchers,
    stored,
    story_end,
    tiny,
    wait_ckpt,
    wait_step,
    wait_stored,
)
from tests.e2e.rgtbox import ONBOX, TEST_ONBOX_ARGS, Rgt
from tests.e2e.test_deadman_e2e import write_profile
from tests.helpers import wait_until
from tests.sshbox import SshBox

pytestmark = pytest.mark.e2e

__all__ = ["memory_cgroup", "story_end"]   # fixtures used here

LONG = ("--steps", "100000", "--log-every", "5", "--step-seconds", "0.02")


@pytest.fixture(params=["local", "sshd"])
def host(request: pytest.FixtureRequest) -> Iterator[Tuple[Rgt, str]]:
    """(the controller, the host name): host `local`, or the test sshd as host `box`."""
    rgt: Rgt = request.getfixturevalue("rgt_local" if request.param == "local" else "rgt_box")
    try:
        yield rgt, "local" if request.param == "local" else "box"
    finally:
        stop_all_watchers(rgt)


@pytest.fixture
def on_local(rgt_local: Rgt) -> Iterator[Rgt]:
    try:
        yield rgt_local
    finally:
        stop_all_watchers(rgt_local)


@pytest.fixture
def on_box(rgt_box: Rgt) -> Iterator[Rgt]:
    try:
        yield rgt_box
    finally:
        stop_all_watchers(rgt_box)


def story(rgt: Rgt, life: str, stories: List[Story]) -> Story:
    s = Story(rgt, life)
    stories.append(s)
    return s


def stop(rgt: Rgt, run: str, grace: str = "10s") -> Dict[str, Any]:
    answer = last_json(rgt("stop", run, "--grace", grace, "--json", timeout_s=120).stdout)
    assert answer["outcome"] in ("stopped", "killed"), answer
    return answer


def resume(rgt: Rgt, run: str, on: str) -> Dict[str, Any]:
    answer = last_json(rgt("resume", run, "--on", on, "--root", str(rgt.root), "--json", "--yes",
                           *TEST_ONBOX_ARGS, timeout_s=300).stdout)
    rgt.runs.append(str(answer["run_id"]))
    return answer


# ---- clean finish, stop ----------------------------------------------------------------------------


def test_a_clean_finish_then_a_second_and_a_third_watch(host: Tuple[Rgt, str],
                                                        story_end: List[Story]) -> None:
    rgt, name = host
    s = story(rgt, f"clean finish on {name}", story_end)
    run = launch(rgt, name, tiny("--steps", "60", "--log-every", "10", "--ckpt-every", "30",
                                 "--step-seconds", "0.01"))["run_id"]
    s.watch(run)
    wait_stored(run, "sidecar.stopping")   # the second watch comes after the sidecar's own stop
    s.watch(run)
    s.watch(run)
    s.expect("0", "0", "0")
    assert [kind_of(r) for r in s.records] == ["run.closed"] * 3, s.records
    assert runs_by_id(rgt)[run]["state"] == "finished", f"{s.life}: {runs_by_id(rgt)[run]}"


def test_rgt_stop_of_one_process_is_stopped_by_request(host: Tuple[Rgt, str], story_end: List[Story]) -> None:
    rgt, name = host
    s = story(rgt, f"rgt stop (one process) on {name}", story_end)
    run = launch(rgt, name, tiny(*LONG, "--ckpt-every", "50"))["run_id"]
    wait_step(run, 10)
    stop(rgt, run)
    s.watch(run)
    s.watch(run)
    s.expect("0", "0")
    assert all(r.get("stopped_by") for r in s.records), f"{s.life}: no stopped_by: {s.records}"
    assert runs_by_id(rgt)[run]["state"] == "stopped", f"{s.life}: {runs_by_id(rgt)[run]}"


def test_rgt_stop_of_a_torchrun_job_is_stopped_by_request(on_local: Rgt, tmp_path: Path,
                                                         story_end: List[Story]) -> None:
    rgt = on_local
    s = story(rgt, "rgt stop (torchrun, 2 ranks on gloo) on local", story_end)
    job = tmp_path / "job"
    job.mkdir()
    run = launch(rgt, "local", [*TORCHRUN, "--steps", "100000", "--log-every", "2", "--save-every", "1000",
                                "--step-seconds", "0.05"], cwd=job)["run_id"]
    wait_step(run, 6, timeout_s=120)
    stop(rgt, run, grace="20s")
    s.watch(run)
    s.watch(run)
    s.expect("0", "0")
    assert all(r.get("stopped_by") for r in s.records), f"{s.life}: no stopped_by: {s.records}"
    assert runs_by_id(rgt)[run]["state"] == "stopped", f"{s.life}: {runs_by_id(rgt)[run]}"


def test_a_stop_then_a_relaunch_resumes_from_the_checkpoint(on_local: Rgt, tmp_path: Path,
                                                           story_end: List[Story]) -> None:
    rgt = on_local
    s = story(rgt, "stop, then relaunch to resume, on local", story_end)
    go = tmp_path / "go"
    run = launch(rgt, "local", tiny(*LONG, "--ckpt-every", "20", "--stop-file", str(go)))["run_id"]
    wait_ckpt(run, 40)
    stop(rgt, run)
    s.watch(run)
    wait_stored(run, "sidecar.stopping")
    rgt("pull", run, "--to", str(tmp_path / "pulled"), "--json", timeout_s=300)
    go.write_text("")   # the resumed job finishes at its first log step
    new = resume(rgt, run, "local")
    s.watch(new["run_id"])
    s.watch(run)
    s.expect("0", "0", "0")
    assert s.records[0].get("stopped_by") and s.records[2].get("stopped_by"), s.records
    log = (Path(new["run_dir"]) / "train.log").read_text()
    assert f"at step {new['checkpoint']['step']}" in log and "resumed from" in log, log[-2000:]


# ---- preemption, verify ------------------------------------------------------------------------------


def test_a_preemption_wakes_once_then_rgt_resume_finishes(on_box: Rgt, tmp_path: Path,
                                                          story_end: List[Story]) -> None:
    rgt = on_box
    s = story(rgt, "preemption then rgt resume, on the sshd", story_end)
    go = rgt.root / "go-preempt"
    answer = launch(rgt, "box", tiny(*LONG, "--ckpt-every", "20", "--stop-file", str(go)))
    run = answer["run_id"]
    wait_ckpt(run, 40)
    os.kill(int(answer["pid"]), signal.SIGTERM)   # a SIGTERM rgt did not send, to the job's wrapper
    woke = s.watch(run)
    wait_stored(run, "job.exited")
    rgt("pull", run, "--to", str(tmp_path / "pulled"), "--json", timeout_s=300)
    go.parent.mkdir(parents=True, exist_ok=True)
    go.write_text("")
    new = resume(rgt, run, "box")["run_id"]
    s.watch(new)
    s.watch(new)
    s.expect("10", "0", "0")
    assert kind_of(woke) in ("job.preempted", "run.closed") and "preempt" in woke["explain"].lower(), woke
    assert not woke.get("stopped_by"), woke
    states = runs_by_id(rgt)
    assert (states[run]["state"], states[new]["state"]) == ("preempted", "finished"), \
        (states[run], states[new])


def test_a_failed_verify_then_a_passing_one_does_not_wake(on_local: Rgt, tmp_path: Path,
                                                         story_end: List[Story]) -> None:
    rgt = on_local
    s = story(rgt, "verify failing then passing, on local", story_end)
    run = launch(rgt, "local", tiny("--steps", "60", "--log-every", "10", "--ckpt-every", "20",
                                    "--step-seconds", "0.01"))["run_id"]
    s.watch(run)
    wait_stored(run, "sidecar.stopping")
    dest = tmp_path / "pulled"
    rgt("pull", run, "--to", str(dest), "--json", timeout_s=300)
    ckpt = dest / "checkpoints" / "step000060.pt"
    good = ckpt.read_bytes()
    mid = len(good) // 2
    ckpt.write_bytes(good[:mid] + bytes([good[mid] ^ 0xFF]) + good[mid + 1:])   # same size, other bytes
    failed = rgt("verify", run, "--json", check=False, timeout_s=300)
    assert failed.returncode != 0 and last_json(failed.stdout)["ok"] is False, failed.stdout[-2000:]
    ckpt.write_bytes(good)
    passed = rgt("verify", run, "--json", timeout_s=300)
    assert last_json(passed.stdout)["ok"] is True
    s.watch(run)
    s.watch(run)
    s.expect("0", "0", "0")
    assert [e.data["ok"] for e in local(run, "verify.done")] == [False, True]


# ---- the link and the box --------------------------------------------------------------------------


def test_a_link_flap_of_a_few_seconds_wakes_nobody(on_box: Rgt, sshbox: SshBox,
                                                  story_end: List[Story]) -> None:
    rgt = on_box
    s = story(rgt, "a link flap of a few seconds, on the sshd", story_end)
    go = rgt.root / "go-flap"
    run = launch(rgt, "box", tiny(*LONG, "--ckpt-every", "100", "--stop-file", str(go)))["run_id"]
    wait_step(run, 20)
    during = s.start(run)
    sshbox.stop()   # sshd and every session go: the tunnel drops; the job runs on
    try:
        wait_until(lambda: local(run, "link.lost"), 30, "link.lost")
    finally:
        sshbox.start()
    wait_until(lambda: local(run, "link.restored"), 60, "link.restored")
    after = max(e.data.get("step") or 0 for e in stored(run, "train.progress"))
    wait_step(run, after + 10)   # events flow again
    go.write_text("")
    s.finish(during)
    s.watch(run)
    s.expect("0", "0")
    restored = local(run, "link.restored")[-1].data
    assert (restored.get("down_s") or 0) > 0, f"{s.life}: link.restored {restored}"
    assert stored(run, "job.exited")[0].data["code"] == 0


def test_a_box_reboot_wakes_once_as_a_vanished_job(on_box: Rgt, sshbox: SshBox,
                                                   story_end: List[Story]) -> None:
    rgt = on_box
    s = story(rgt, "a box reboot, on the sshd", story_end)
    answer = launch(rgt, "box", tiny(*LONG, "--ckpt-every", "100"))
    run, run_dir = answer["run_id"], Path(answer["run_dir"])
    wait_step(run, 20)
    sshbox.stop()
    again = None
    try:
        wrapper = power_cut(run_dir)
        as_if_rebooted(run_dir)
        # The box's start-up serves the run again, and the link comes back once it has said the job
        # vanished: the controller then meets a sidecar that answers. Started after the link, a
        # sidecar slower than 3 heartbeats (the suite's load) woke the watch as `sidecar.silent`.
        again = serve_again(run_dir, wrapper, sshbox.home)
        wait_until(lambda: [e for e in read_all(run_dir / "rgt") if e["kind"] == "job.exited"
                            and e["data"].get("vanished") is True], 60, "the restarted sidecar's job.exited")
        sshbox.start()
        woke = s.watch(run)
        s.watch(run)
    finally:
        sshbox.start()
        if again is not None:
            end_child(again)
    s.expect("10", "10r")
    assert kind_of(woke) == "run.closed", woke
    data = woke["event"]["data"]
    assert data.get("vanished") is True and data["evidence"]["rebooted"] is True, data
    assert "reboot" in woke["explain"].lower(), woke
    assert runs_by_id(rgt)[run]["state"] == "vanished", runs_by_id(rgt)[run]


# ---- watch --all -------------------------------------------------------------------------------------


def test_watch_all_over_four_runs_ends_0_only_when_all_have_ended(on_local: Rgt, tmp_path: Path,
                                                                   story_end: List[Story]) -> None:
    rgt = on_local
    s = story(rgt, "a run watched with --all beside three others, on local", story_end)
    gos = [tmp_path / f"go{i}" for i in range(4)]
    runs = [launch(rgt, "local", tiny("--steps", "100000", "--log-every", "5", "--ckpt-every", "100000",
                                      "--step-seconds", "0.05", "--stop-file", str(go)))["run_id"]
            for go in gos]
    for run in runs:
        wait_step(run, 5)
    every = s.start_all(runs)
    gos[0].write_text("")
    wait_stored(runs[0], "job.exited")
    stop(rgt, runs[1])
    wait_stored(runs[1], "job.exited")
    gos[2].write_text("")
    wait_stored(runs[2], "job.exited")
    assert s.running(every), f"{s.life}: `rgt watch --all` ended while {runs[3]} still runs: " \
                             f"{every.communicate(timeout=30)[0]}"
    gos[3].write_text("")
    last = wait_stored(runs[3], "job.exited")[0]
    all_line = s.finish(every)
    for run in runs:
        s.watch(run)
    s.expect("0", "0", "0", "0", "0")
    assert all_line["woke_at"] >= last.ts, all_line
    text = json.dumps(all_line)
    assert all(run in text for run in runs), f"{s.life}: the --all line does not say how each ended: {text}"
    assert s.records[2].get("stopped_by"), s.records[2]
    states = runs_by_id(rgt)
    assert [states[r]["state"] for r in runs] == ["finished", "stopped", "finished", "finished"], states


# ---- memory, the dead-man ----------------------------------------------------------------------------


def test_an_oom_after_a_memory_warning_wakes_once(on_local: Rgt, tmp_path: Path, memory_cgroup: Path,
                                                  story_end: List[Story]) -> None:
    rgt = on_local
    s = story(rgt, "an OOM after a memory warning, on local", story_end)
    hog, go = tmp_path / "hog.py", tmp_path / "go-oom"
    hog.write_text(HOG)
    os.mkfifo(go)
    writer = os.open(go, os.O_RDWR)  # never blocks, and keeps the FIFO open for the hog's read end
    try:
        run = launch(rgt, "local", [sys.executable, str(hog), str(memory_cgroup), str(go)])["run_id"]
        wait_stored(run, "mem.pressure", 60)
        os.write(writer, b"g")
        wait_stored(run, "job.exited", 60)
    finally:
        os.close(writer)
    woke = s.watch(run)
    s.watch(run)
    s.expect("10", "10r")
    assert kind_of(woke) == "run.closed" and woke["event"]["data"]["oom_killed"] is True, woke
    assert kind_of(s.records[1]) == "run.closed", \
        f"{s.life}: the superseded memory warning woke: {s.records[1]}"


SCALE = 600.0   # one real second is ten box minutes: the 1 h lease lasts 6 s, its T-30 warning at 3 s
RENEW_S = 4.5   # each renewal comes after the T-30 warning (15 box minutes before the end), none after T-5


@pytest.fixture
def late_box(sshbox: SshBox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Dict[str, Any]]:
    """The sshd box on a compressed dead-man clock with a recorder action, and a controller that
    renews the lease late every time; disarmed and its daemon gone at the end."""
    profiles_dir = sshbox.root / "profiles"
    recorder = sshbox.root / "recorder.sh"
    recorder.write_text(f'#!/bin/sh\necho "$@" >> {shlex.quote(str(sshbox.root / "recorded.txt"))}\n')
    recorder.chmod(recorder.stat().st_mode | stat.S_IXUSR)
    write_profile(profiles_dir, recorder, sshbox.home)
    sshbox.env.update({"RGT_DEADMAN_TIMESCALE": f"{SCALE:g}", "RGT_DEADMAN_TICK_S": "0.2",
                       "RGT_PROFILES_DIR": str(profiles_dir)})
    sshbox.restart()
    monkeypatch.setenv("RGT_PROFILES_DIR", str(profiles_dir))
    r = Rgt(tmp_path, sshbox, monkeypatch)
    r.env.update({"RGT_DEADMAN_RENEW_S": f"{RENEW_S:g}", "RGT_PROFILES_DIR": str(profiles_dir)})
    r("hosts", "add", "box", "--ssh", sshbox.alias, "--onbox", ONBOX, "--profile", "testcloud")
    paths = lease.paths_for({"HOME": str(sshbox.home)})
    try:
        yield {"rgt": r, "paths": paths}
    finally:
        try:
            stop_all_watchers(r)
            r("deadman", "box", "disarm", "--json", check=False)
            pid = daemon.daemon_pid(paths)
            if pid is not None and not wait_for(lambda: daemon.daemon_pid(paths) is None, 15.0):
                os.kill(pid, signal.SIGTERM)  # the daemon this test's launch started, by its pid
                wait_for(lambda: daemon.daemon_pid(paths) is None, 10.0)
        finally:
            r.end()


def test_a_lease_renewed_late_warns_once(late_box: Dict[str, Any], story_end: List[Story]) -> None:
    rgt: Rgt = late_box["rgt"]
    s = story(rgt, "a dead-man lease renewed late, on the sshd", story_end)
    go = rgt.root / "go-late"
    run = launch(rgt, "box", tiny(*LONG, "--ckpt-every", "100000", "--stop-file", str(go)),
                 "--onbox-arg=--deadman=1h")["run_id"]
    woke = s.watch(run)

    def periods() -> Set[Any]:
        return {e.data.get("key") for e in stored(run, "deadman.expiring")}
    seen = len(periods())
    # Two more lease periods, each warned (T-30) and then renewed late, while nobody watches: a
    # warning's key names its period, and a new period begins only at a renewal.
    wait_until(lambda: len(periods()) >= seen + 2, 60, "two more late renewals' warnings")
    go.parent.mkdir(parents=True, exist_ok=True)
    go.write_text("")
    s.watch(run)
    s.watch(run)
    s.expect("10", "0", "0")
    assert kind_of(woke) == "deadman.expiring", woke
