"""The Slurm path for real: examples/slurm/train.sbatch on the private two-node cluster, followed
by the real `rgt` (tests/e2e/rgtbox.py), through a requeue, a time limit, a failed rank, a hang
and `rgt stop`.

Slurm ends a step by signalling every process in it, so these are also the tests of the
sidecar staying until it has journaled the job's exit (launch --wait's --finish-on-term), and of
what scontrol says at the signal (onbox/sources/slurm.py). KillWait is 10 s here, so "the grace
Slurm gave" is a number the test knows.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from controller.runs import life
from controller.store.db import Store
from onbox.custody import manifest
from onbox.runs import read_json
from tests.e2e.rgtbox import Rgt
from tests.e2e.test_multinode_e2e import last_step, track, verdicts
from tests.helpers import wait_until
from tests.slurm.cluster import FINISHED, SlurmCluster
from tests.slurm.trainjob import LAUNCH_ARGS, NODE_SHAPE, NODES, TrainJob

pytestmark = pytest.mark.slurm

KILL_WAIT = 10
SLURM_NODE_SHAPE = {**NODE_SHAPE, "kill_wait": KILL_WAIT}
STEPS = ["--steps", "100000", "--step-seconds", "0.05", "--log-every", "5", "--ckpt-every", "100000"]


def followed(rgt: Rgt, run: str) -> None:
    """`rgt track` of the run, and both node streams' job.started stored: the daemon is connected to
    each sidecar before the test makes a job end (a test sidecar lingers 0 s after the exit)."""
    track(rgt, run)
    with Store.open() as store:
        wait_until(lambda: all(store.events(f"{run}.{n}", kind_prefix="job.started") for n in NODES), 60,
                   "both node streams followed")


def node_states(rgt: Rgt, run: str) -> Dict[str, Any]:
    return dict(json.loads(rgt("status", run, "--json").stdout))


def watch(rgt: Rgt, run: str, timeout: str = "90s") -> Dict[str, Any]:
    out = rgt("watch", run, "--timeout", timeout, "--json", check=False, timeout_s=150)
    record = json.loads(out.stdout.strip().splitlines()[-1])
    return {"code": out.returncode, **record}


def test_a_requeue_is_a_preemption_with_slurms_grace_and_the_run_resumes_then_rgt_stop_ends_the_step(
        slurm: SlurmCluster, rgt_local: Rgt, tmp_path: Path) -> None:
    run = "train-requeue"
    args = ["--steps", "100000", "--step-seconds", "0.05", "--log-every", "5", "--ckpt-every", "20"]
    job = TrainJob(slurm, tmp_path, run, rgt_local.root, {n: {"args": args} for n in NODES})
    job_id = job.submit("--requeue")
    job.wait_sidecars()
    followed(rgt_local, run)
    # Both nodes have a hashed checkpoint before the requeue.
    before = {n: wait_until(lambda d=job.stream_dir(n): manifest.newest_good(d), 60,
                            f"{n}'s first checkpoint\n{job.output()}") for n in NODES}
    slurm.run("scontrol", "requeue", job_id)
    for node in NODES:
        pre = job.wait_event(node, "job.preempted")[0]["data"]
        assert (pre["reason"], pre["grace_s"], pre["grace_from"]) == ("requeued", KILL_WAIT, "slurm"), pre
        assert pre["scheduler"]["job_id"] == job_id and pre["scheduler"]["restarts"] == 1
        # The whole step got SIGTERM, the sidecar too: it still journaled the exit.
        exited = job.wait_event(node, "job.exited")[0]["data"]
        assert exited["preempted"] is True and exited["preempt_reason"] == "requeued", exited
    # Slurm runs the script again (SLURM_RESTART_COUNT=1): the same run id, attempt 2, one journal,
    # started from the newest hashed checkpoint of attempt 1.
    job.wait_sidecars(attempt=2, timeout_s=120)
    for node in NODES:
        d = job.stream_dir(node)
        meta = read_json(d / "run.json") or {}
        resumed = Path(str(meta.get("resume_from")))
        assert meta["attempt"] == 2 and meta["scheduler"]["restart_count"] == 1, meta
        assert resumed.parent == before[node].parent and resumed.name >= before[node].name, (resumed, before)
        assert resumed == manifest.newest_good(d) or resumed.name < manifest.newest_good(d).name
        said = f"resumed from {resumed}"
        wait_until(lambda d=d, s=said: s in (d / "train.log").read_text("utf-8", "replace"), 60,
                   f"{node}'s job to say it resumed from {resumed}")
        seqs = [e["seq"] for e in job.journal(node)]
        assert seqs == sorted(set(seqs)) and [e["kind"] for e in job.journal(node)].count("job.started") == 2
    track(rgt_local, run)
    with Store.open() as store:
        wait_until(lambda: all(len(store.events(f"{run}.{n}", kind_prefix="job.started")) == 2
                               for n in NODES), 30, "attempt 2 in the store")
        first_exit = store.events(f"{run}.n0", kind_prefix="job.exited")[0]
        assert life.of_exit(store, f"{run}.n0", first_exit).outcome == "requeued"
    # rgt stop of the group: stop.json on every node, then scancel of the step (not the job). The
    # box's scancel finds this cluster as a node's finds its own: through SLURM_CONF.
    rgt_local.env["SLURM_CONF"] = slurm.env["SLURM_CONF"]
    stopped = json.loads(rgt_local("stop", run, "--json", timeout_s=120).stdout)
    assert (stopped["nodes"][0]["via"], stopped["nodes"][0]["nodes_marked"]) == (
        f"scancel --signal=TERM {job_id}.0", 1), stopped
    for node in NODES:
        ended = job.wait_event(node, "job.exited", count=2)[1]["data"]
        assert ended["stop_requested"] is True and "preempted" not in ended, ended
    # `rgt watch` wakes on the requeue (each node's, once), then ends 0: stopped by request.
    woke = [watch(rgt_local, run)]
    while woke[-1]["code"] == 10 and len(woke) < 6:   # one wake per material event, then the end
        woke.append(watch(rgt_local, run))
    told = [w for w in woke if w["code"] == 10]
    assert told and all(w["entry"] == "slurm-requeued" for w in told), woke
    assert told[0]["next"] == f"rgt track local {run}", told[0]
    assert woke[-1]["code"] == 0, woke
    info = slurm.wait_job(job_id, tuple(FINISHED), 60)
    states = node_states(rgt_local, run)
    assert [n["state"] for n in states["nodes"]] == ["stopped by request"] * 2, states
    assert info["Restarts"] == "1" and info["JobState"] in ("COMPLETED", "FAILED"), info   # the job ran on


def test_the_time_limit_is_its_own_ending_not_a_crash(slurm: SlurmCluster, rgt_local: Rgt,
                                                      tmp_path: Path) -> None:
    """--time=2 --signal=TERM@30. sbatch's --signal may come up to 60 s before the time asked for
    (slurmctld checks limits every 30 s and sends early rather than late): measured here with
    TERM@58 of 60 s (0.4 s after the start) and TERM@90 of 120 (3 s after). With 30 of 120 the
    warning comes 30-90 s after the start, when the sidecars are up, and before the limit itself
    (which would read TIMEOUT, with KillWait alone as the grace)."""
    run = "train-timelimit"
    job = TrainJob(slurm, tmp_path, run, rgt_local.root, {n: {"args": STEPS} for n in NODES})
    job_id = job.submit("--time=2", "--signal=TERM@30")
    job.wait_sidecars()
    followed(rgt_local, run)
    for node in NODES:
        pre = job.wait_event(node, "job.preempted", timeout_s=150)[0]["data"]
        assert pre["reason"] == "time_limit" and pre["grace_from"] == "slurm", pre
        # the time left (30-90 s; EndTime is in whole seconds: up to 1 s over), plus KillWait
        assert KILL_WAIT + 29 < pre["grace_s"] <= 90 + 1 + KILL_WAIT, pre
        exited = job.wait_event(node, "job.exited")[0]["data"]
        assert exited["preempt_reason"] == "time_limit", exited
    woke = watch(rgt_local, run)
    assert woke["code"] == 10 and woke["event"]["kind"] in ("job.preempted", "job.exited", "run.closed"), woke
    assert "time limit" in woke["explain"].lower(), woke
    states = node_states(rgt_local, run)
    assert [n["life"]["outcome"] for n in states["nodes"]] == ["time_limit", "time_limit"], states
    assert all("time limit" in n["life"]["reason"] for n in states["nodes"]), states
    slurm.wait_job(job_id, tuple(FINISHED), 60)


def test_a_failed_rank_wakes_rank_failed_while_real_srun_waits_on_the_other(
        slurm: SlurmCluster, rgt_local: Rgt, tmp_path: Path) -> None:
    run, stop = "train-rankfail", tmp_path / "n1.stop"
    jobs: Dict[str, Dict[str, Any]] = {
        "n0": {"args": [*STEPS, "--hang-at", "20"]},                          # stops making progress
        "n1": {"args": [*STEPS, "--stop-file", str(stop)], "exit": 1}}   # exits 1 when told
    job = TrainJob(slurm, tmp_path, run, rgt_local.root, jobs)
    job_id = job.submit()
    job.wait_sidecars()
    followed(rgt_local, run)
    stop.write_text("")
    found = wait_until(lambda: verdicts(run, "job.rank_failed"), 60, f"job.rank_failed\n{job.output()}")
    assert (found[0]["node"], found[0]["code"], found[0]["waiting"]) == ("n1", 1, ["n0"])
    woke = watch(rgt_local, run)
    assert woke["code"] == 10 and woke["event"]["kind"] == "job.rank_failed", woke
    assert woke["event"]["data"]["node"] == "n1"
    # Real srun (no --kill-on-bad-exit, WaitTime=0) keeps the step, and the allocation, running.
    assert slurm.job_state(job_id) == "RUNNING"
    assert node_states(rgt_local, run)["state"] == "rank failed"


def test_every_rank_hung_is_the_groups_hung_verdict_naming_the_first(
        slurm: SlurmCluster, rgt_local: Rgt, tmp_path: Path) -> None:
    run = "train-hung"
    jobs = {"n0": {"args": [*STEPS, "--hang-at", "200"]},   # stops ~10 s in
            "n1": {"args": [*STEPS, "--hang-at", "40"]}}    # stops ~2 s in: first
    job = TrainJob(slurm, tmp_path, run, rgt_local.root, jobs,
                   launch_args=f"{LAUNCH_ARGS} --stall-floor 2 --stall-grace 10")
    job.submit()
    job.wait_sidecars()
    followed(rgt_local, run)
    for node, at in (("n1", 40), ("n0", 200)):
        wait_until(lambda d=job.stream_dir(node), a=at: last_step(d) >= a - 5, 120,
                   f"{node}'s job to reach its hang at step {at}\n{job.output()}")
    found = wait_until(lambda: [v for v in verdicts(run, "job.stalled") if v.get("verdict") == "hung"], 90,
                       f"the hung verdict\n{job.output()}")
    assert (found[-1]["scope"], found[-1]["first_node"]) == ("all nodes", "n1"), found
    woke = watch(rgt_local, run)
    assert woke["code"] == 10 and woke["event"]["data"]["first_node"] == "n1", woke
    assert not verdicts(run, "job.rank_failed")


def test_rgt_track_over_ssh_follows_the_job_and_watch_exits_0_when_it_ends(
        slurm: SlurmCluster, rgt_box: Rgt, tmp_path: Path) -> None:
    run, done = "train-ssh", tmp_path / "done"
    job = TrainJob(slurm, tmp_path, run, rgt_box.root,
                   {n: {"args": [*STEPS, "--stop-file", str(done)]} for n in NODES})
    job.submit()
    job.wait_sidecars()
    answer = json.loads(rgt_box("track", "box", run, "--root", str(rgt_box.root), "--json").stdout)
    rgt_box.runs += [s["run"] for s in answer["streams"]]
    assert answer["group"] is True and [s["node"] for s in answer["streams"]] == list(NODES)
    with Store.open() as store:
        wait_until(lambda: all(store.events(f"{run}.{n}", kind_prefix="job.started") for n in NODES), 60,
                   "both streams over ssh")
    done.write_text("")
    woke = watch(rgt_box, run, timeout="120s")
    assert woke["code"] == 0, woke
    info = slurm.wait_job(job.job_id or "", ("COMPLETED",), 60)
    assert info["ExitCode"] == "0:0"
    for node in NODES:
        exited: List[Dict[str, Any]] = job.events(node, "job.exited")
        assert exited and exited[0]["data"]["code"] == 0
