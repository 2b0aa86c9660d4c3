"""Multi-node runs in the controller: the group verdicts (controller.runs.groups) on synthetic node
streams in a real store, and what `rgt watch`, `rgt status`, `rgt runs` and `rgt track` make of them."""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, List, Optional

import pytest
from click.testing import CliRunner, Result

from controller.cli import runs as cli_runs
from controller.cli import track as cli_track
from controller.cli import watch as cli_watch
from controller.follow.watcher import Watcher
from controller.runs import explain, groups
from controller.store.db import LocalEvent, Store
from controller.wake import policy as wake
from controller.wake import watch as watch_mod
from controller.wake.watch import live_runs, watch
from protocol import Event

RUN = "train-81234"
N0, N1 = f"{RUN}.n0", f"{RUN}.n1"
WAIT_S = 10.0


class Box:
    """Node streams of RUN in the store, with events written the way a sidecar would."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.seq = {N0: 0, N1: 0}
        self.t0 = time.time() - 1000.0
        store.upsert_run(RUN, host="")
        store.set_lineage(RUN, group_run=RUN)
        for stream, node in ((N0, "n0"), (N1, "n1")):
            store.upsert_run(stream, host=f"node-{node}")
            store.set_lineage(stream, group_run=RUN, node=node)

    def add(self, stream: str, kind: str, sev: str = "info", at: Optional[float] = None,
            **data: Any) -> Event:
        self.seq[stream] += 1
        seq = self.seq[stream]
        ev = Event(run=stream, host="node", seq=seq, ts=self.t0 + seq if at is None else at, kind=kind,
                   sev=sev, data=data)
        self.store.apply(stream, [ev], seq)
        return ev

    def check_group(self, group: str) -> None:
        """The follower daemon's part (`rgt watch` asks it to record a group's verdicts)."""
        groups.check(self.store, group)

    def start(self, *streams: str) -> None:
        for s in streams or (N0, N1):
            self.add(s, "sidecar.started")
            self.add(s, "job.started", pid=10)

    def stall(self, stream: str, at: float, idle_s: float, step: Optional[int]) -> Event:
        return self.add(stream, "job.stalled", "warn", at=at, state="onset", verdict="unknown",
                        idle_s=idle_s, budget_s=2.0, step=step)

    def verdicts(self, kind: str = "job.") -> List[LocalEvent]:
        return self.store.local_events(RUN, kind_prefix=kind)


@pytest.fixture
def box(home: Path) -> Iterator[Box]:
    with Store.open() as s:
        yield Box(s)


# ---- job.rank_failed -------------------------------------------------------------------


def test_a_failed_node_while_another_runs_is_one_rank_failed_naming_it(box: Box) -> None:
    box.start()
    exited = box.add(N1, "job.exited", "warn", code=1, signal=None, oom_killed=False, final_ok=False)
    added = groups.check(box.store, N1)
    assert [e.kind for e in added] == ["job.rank_failed"] and added[0].sev == "critical"
    d = added[0].data
    assert (d["node"], d["stream"], d["code"], d["waiting"], d["how"]) == ("n1", N1, 1, ["n0"], "code 1")
    assert explain.explain(added[0]) == "node n1 exited (code 1) while n0 still wait on it"
    assert d["exit_seq"] == exited.seq
    # every later check (each node's watcher runs one) records nothing more
    assert groups.check(box.store, N0) == [] and groups.check(box.store, RUN) == []
    with Store.open() as other:
        assert groups.check(other, N1) == []
    assert len(box.verdicts("job.rank_failed")) == 1


def test_racing_checks_record_one_verdict(box: Box) -> None:
    box.start()
    box.add(N1, "job.exited", "warn", code=1, final_ok=False)
    added: List[int] = []
    gate = threading.Barrier(4)

    def race() -> None:
        with Store.open() as mine:
            gate.wait(WAIT_S)
            added.append(len(groups.check(mine, N0)))

    threads = [threading.Thread(target=race, name=f"race-{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert sorted(added) == [0, 0, 0, 1] and len(box.verdicts("job.rank_failed")) == 1


def test_a_clean_exit_counts_only_once_the_others_ran_on_past_the_grace(box: Box) -> None:
    box.start()
    now = time.time()
    box.add(N0, "job.exited", "warn", at=now, code=0, final_ok=True)
    assert groups.check(box.store, N0, now=now + 5) == []
    late = groups.check(box.store, N0, now=now + groups.CLEAN_EXIT_GRACE_S + 1)
    assert [(e.data["node"], e.data["clean"], e.data["waiting"]) for e in late] == [("n0", True, ["n1"])]


@pytest.mark.parametrize("reason", groups.JOB_WIDE_ENDS)
def test_a_node_the_scheduler_ended_with_the_whole_job_is_no_failed_rank(box: Box, reason: str) -> None:
    """Slurm's requeue, cancel, time limit or preemption signals every node; the first to exit
    leaves the others ending a moment later, never waiting on it."""
    box.start()
    now = time.time()
    box.add(N1, "job.preempted", "warn", at=now, reason=reason)
    box.add(N1, "job.exited", "warn", at=now + 1, code=143, preempted=True, preempt_reason=reason)
    assert groups.check(box.store, N1, now=now + groups.CLEAN_EXIT_GRACE_S + 1) == []
    # a SIGTERM to one node that Slurm cannot explain (scancel --signal, a kill) still counts
    box.start()
    box.add(N1, "job.exited", "warn", code=143, preempted=True, preempt_reason="signalled")
    assert [e.data["node"] for e in groups.check(box.store, N1)] == ["n1"]


def test_no_rank_failed_when_nothing_waits_and_a_new_one_after_a_relaunch(box: Box) -> None:
    box.start()
    box.add(N0, "job.exited", "warn", code=0, final_ok=True)
    box.add(N1, "job.exited", "warn", code=1, final_ok=False)
    assert groups.check(box.store, N1) == []  # every node ended: nobody waits on the failed one
    box.start()                               # both relaunched: a new episode
    box.add(N0, "job.exited", "warn", signal=9, code=None, final_ok=False)
    first = groups.check(box.store, N0)
    assert [(e.data["node"], e.data["signal"]) for e in first] == [("n0", 9)]
    box.add(N1, "job.exited", "warn", code=1, final_ok=False)  # a consequence, not a second culprit
    assert groups.check(box.store, N1) == [] and len(box.verdicts("job.rank_failed")) == 1
    box.start(N1)   # n1 alone relaunched: it waits on n0, which is still down
    assert [e.data["waiting"] for e in groups.check(box.store, N1)] == [["n1"]]


# ---- every node stalled ----------------------------------------------------------------


def test_every_node_stalled_is_one_hung_verdict_naming_the_node_that_stopped_first(box: Box) -> None:
    box.start()
    t = time.time() - 100
    # n1's last progress is older, though n0's stall was detected first
    box.add(N1, "train.progress", at=t, step=20, data_age_s=0.5)       # progress stopped at t - 0.5
    box.add(N0, "train.progress", at=t + 10, step=200, data_age_s=0.2)  # ... at t + 9.8
    box.stall(N0, at=t + 12, idle_s=30.0, step=200)                    # its detector saw activity at t-18
    assert groups.check(box.store, N0) == []   # n1 still progresses
    box.stall(N1, at=t + 14, idle_s=14.0, step=20)
    added = groups.check(box.store, N1)
    assert [(e.kind, e.sev) for e in added] == [("job.stalled", "warn")]
    d = added[0].data
    assert (d["verdict"], d["scope"], d["first_node"], d["step"]) == ("hung", "all nodes", "n1", 20)
    assert d["stopped_at"] == {"n0": pytest.approx(t + 9.8), "n1": pytest.approx(t - 0.5)}
    assert groups.check(box.store, N0) == []
    # n0 moves again: the verdict clears once; both stall again: a new verdict
    box.add(N0, "job.progressing", state="cleared", step=201)
    assert [(e.kind, e.data["nodes"]) for e in groups.check(box.store, N0)] == [("job.progressing", ["n0"])]
    assert groups.check(box.store, N0) == []
    box.stall(N0, at=time.time(), idle_s=5.0, step=201)
    again = groups.check(box.store, N0)
    assert [(e.kind, e.data["first_node"]) for e in again] == [("job.stalled", "n1")]


def test_without_progress_events_the_stall_detectors_last_activity_decides(box: Box) -> None:
    box.start()
    t = time.time()
    box.stall(N0, at=t, idle_s=50.0, step=None)   # quiet since t - 50
    box.stall(N1, at=t, idle_s=10.0, step=None)   # quiet since t - 10
    (verdict,) = groups.check(box.store, RUN)
    assert verdict.data["first_node"] == "n0"


def test_a_stall_while_another_node_exited_is_not_hung(box: Box) -> None:
    box.start()
    box.stall(N0, at=time.time(), idle_s=5.0, step=3)
    box.add(N1, "job.exited", "warn", code=1, final_ok=False)
    assert [e.kind for e in groups.check(box.store, N0)] == ["job.rank_failed"]


def test_a_plain_run_has_no_group_to_check(box: Box) -> None:
    box.store.upsert_run("plain", host="h")
    assert groups.check(box.store, "plain") == [] and groups.check(box.store, "unknown-run") == []
    assert groups.node_of(RUN, N1) == "n1" and groups.node_of(RUN, RUN) is None
    assert groups.node_of(RUN, f"{RUN}.a.b") is None and groups.node_of(RUN, "train-8.n0") is None


def test_the_wake_policy_treats_the_group_verdicts_as_material(box: Box) -> None:
    box.start()
    box.add(N1, "train.progress", step=5)
    box.stall(N0, at=time.time(), idle_s=5.0, step=9)
    box.stall(N1, at=time.time(), idle_s=5.0, step=5)
    (hung,) = groups.check(box.store, RUN)
    box.add(N0, "job.progressing", state="cleared")
    (clear,) = groups.check(box.store, RUN)
    box.add(N1, "job.exited", "warn", code=1, final_ok=False)
    (failed,) = groups.check(box.store, RUN)
    policy = wake.Policy()
    assert wake.judge(failed, policy, time.time(), {}).reason == "wake"
    assert wake.judge(hung, policy, time.time(), {}).reason == "wake"
    assert wake.judge(clear, policy, time.time(), {}).reason == "clear"


def test_a_node_streams_watcher_checks_its_group_after_a_job_event(box: Box) -> None:
    class NoLink:
        def connect(self) -> Any:
            raise OSError("not used")

        def alive(self) -> bool:
            return True

        def close(self) -> None:
            pass

    box.start()
    w = Watcher(N1, NoLink())
    w._check_group(box.store)          # the first look finds the group; nothing is due yet
    exited = box.add(N1, "job.exited", "warn", code=1, final_ok=False)
    w.on_events([exited])
    w._check_group(box.store)
    assert [e.data["node"] for e in box.verdicts("job.rank_failed")] == ["n1"]


# ---- watch, status, runs ---------------------------------------------------------------


def test_watching_the_group_wakes_on_rank_failed_first_and_not_again_on_that_exit(box: Box) -> None:
    box.start()
    box.add(N1, "job.exited", "warn", code=1, final_ok=False)
    # no node stream's follow recorded the verdict yet: the watch has the daemon check the group first
    first = watch(box.store, [RUN], timeout_s=WAIT_S, poll_s=0.01, check_group=box.check_group)
    assert first.exit_code == 10 and first.record["run"] == RUN
    event = first.record["event"]
    assert event["kind"] == "job.rank_failed" and event["data"]["node"] == "n1"
    again = watch(box.store, [RUN], timeout_s=0.2, poll_s=0.01, check_group=box.check_group)
    assert again.exit_code == 3 and set(again.record["runs"]) == {RUN, N0}
    assert again.record["status"][RUN].startswith("rank failed: node n1")


def test_watch_all_covers_the_group_and_wakes_on_its_verdict(box: Box) -> None:
    box.store.upsert_run("plain", host="h")
    box.start()
    box.add(N1, "job.exited", "warn", code=1, final_ok=False)
    assert set(live_runs(box.store)) == {"plain", RUN, N0}
    result = watch(box.store, all_runs=True, timeout_s=WAIT_S, poll_s=0.01, check_group=box.check_group)
    assert result.exit_code == 10 and result.record["event"]["kind"] == "job.rank_failed"


def test_a_live_watch_wakes_on_rank_failed_rather_than_the_exit_it_explains(
        box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch_mod, "GROUP_CHECK_S", 3600.0)   # only the exit itself can prompt it
    box.start()
    polling, applied = threading.Event(), threading.Event()

    def fail_n1() -> None:
        polling.wait(WAIT_S)
        with Store.open() as other:
            ev = Event(run=N1, host="node", seq=99, ts=time.time(), kind="job.exited", sev="warn",
                       data={"code": 1, "final_ok": False})
            other.apply(N1, [ev], 99)
        applied.set()

    def sleep(seconds: float) -> None:
        polling.set()
        applied.wait(seconds)

    thread = threading.Thread(target=fail_n1, name="fail-n1")
    thread.start()
    try:
        result = watch(box.store, [RUN], timeout_s=WAIT_S, poll_s=0.01, sleep=sleep,
                       check_group=box.check_group)
    finally:
        polling.set()
        thread.join(WAIT_S)
    assert result.exit_code == 10 and result.record["run"] == RUN
    assert result.record["event"]["kind"] == "job.rank_failed"
    assert box.store.woken(N1) == {"absorbed:seq:99": pytest.approx(time.time(), abs=30)}


def test_one_node_finishing_cleanly_does_not_end_the_groups_watch(box: Box) -> None:
    box.start()
    box.add(N0, "job.exited", "warn", at=time.time(), code=0, final_ok=True)
    early = watch(box.store, [RUN], timeout_s=0.2, poll_s=0.01, check_group=box.check_group)
    assert early.exit_code == 3
    assert RUN in live_runs(box.store) and N1 in live_runs(box.store) and N0 not in live_runs(box.store)
    box.add(N1, "job.exited", "warn", at=time.time(), code=0, final_ok=True)
    done = watch(box.store, [RUN], timeout_s=WAIT_S, poll_s=0.01, check_group=box.check_group)
    assert done.exit_code == 0 and done.record["run"] == N1
    assert live_runs(box.store) == []
    assert watch(box.store, all_runs=True, timeout_s=WAIT_S).exit_code == 0


def invoke(command: Any, args: List[str]) -> Result:
    return CliRunner().invoke(command, args, catch_exceptions=False)


def test_status_of_the_group_shows_one_line_per_node_and_the_verdict(box: Box) -> None:
    box.start()
    box.add(N0, "train.progress", step=120)
    box.add(N1, "train.progress", step=118)
    box.add(N1, "job.exited", "warn", code=1, final_ok=False)
    groups.check(box.store, RUN)
    out = json.loads(invoke(cli_watch.status_command, [RUN, "--json"]).output)
    assert out["group"] is True and out["state"] == "rank failed"
    assert [(n["node"], n["state"], n["step"]) for n in out["nodes"]] == [
        ("n0", "running", 120), ("n1", "failed (error)", 118)]
    assert "node n1" in out["state_reason"] and "n0 still runs" in out["state_reason"]
    text = invoke(cli_watch.status_command, [RUN]).output.splitlines()
    assert text[0].startswith(f"run {RUN} (multi-node, 2 nodes)") and "rank failed" in text[1]
    assert any(line.split()[:4] == ["n1", "node-n1", "failed", "(error)"] for line in text)
    every = json.loads(invoke(cli_watch.status_command, ["--json"]).output)["runs"]
    assert [r["run"] for r in every] == [RUN]   # the node streams show within their group


def test_status_says_hung_and_names_the_first_node(box: Box) -> None:
    box.start()
    box.add(N1, "train.progress", step=20, data_age_s=0.0)
    box.stall(N0, at=time.time(), idle_s=2.0, step=200)
    box.stall(N1, at=time.time(), idle_s=9.0, step=20)
    groups.check(box.store, RUN)
    out = json.loads(invoke(cli_watch.status_command, [RUN, "--json"]).output)
    assert out["state"] == "hung" and "n1 stopped first at step 20" in out["state_reason"]


def test_runs_lists_the_group_then_its_nodes(box: Box) -> None:
    box.store.upsert_run("plain", host="h")
    box.start()
    box.add(N1, "job.exited", "warn", code=1, final_ok=False)
    groups.check(box.store, RUN)
    rows = json.loads(invoke(cli_runs.runs_command, ["--json"]).output)["runs"]
    mine = [(r["run"], r["node"], r["state"]) for r in rows if r["group"] == RUN]
    assert mine == [(RUN, None, "rank_failed"), (N0, "n0", "running"), (N1, "n1", "failed")]
    assert next(r for r in rows if r["run"] == RUN)["nodes"] == ["n0", "n1"]
    assert [r["run"] for r in rows] == ["plain", RUN, N0, N1]   # newest first, nodes after their group
    only = json.loads(invoke(cli_runs.runs_command, [RUN, "--json"]).output)["runs"]
    assert [r["run"] for r in only] == [RUN, N0, N1]
    text = invoke(cli_runs.runs_command, []).output
    assert f"{RUN} (2 nodes)" in text and f"  n1: {N1}" in text


# ---- rgt-onbox ps --run and rgt track ---------------------------------------------------


def fake_run_dir(root: Path, stream: str, group: Optional[str]) -> None:
    d = root / "proj" / "active" / stream
    (d / "rgt").mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"id": stream, "project": "proj", "group": group}))


def test_track_records_every_node_stream_and_picks_up_new_ones(home: Path, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    fake_run_dir(root, N0, RUN)
    fake_run_dir(root, "other-run", None)
    fake_run_dir(root, f"{RUN}.x.y", "someone-else")
    with Store.open() as store:
        first = cli_track.track(store, "local", RUN, root=str(root), watch=False)
        assert first["group"] is True
        assert [(s["run"], s["node"], s["new"]) for s in first["streams"]] == [(N0, "n0", True)]
        fake_run_dir(root, N1, RUN)
        second = cli_track.track(store, "local", RUN, root=str(root), watch=False)
        assert [(s["node"], s["new"]) for s in second["streams"]] == [("n0", False), ("n1", True)]
        rows = {r["run"]: r for r in store.runs()}
        assert groups.is_group(rows[RUN]) and not rows[RUN]["target"]
        assert (rows[N1]["target"], rows[N1]["group_run"], rows[N1]["node"]) == ("local", RUN, "n1")
        assert rows[N1]["run_dir"] == str(root / "proj" / "active" / N1)
        assert "other-run" not in rows


def test_track_of_a_plain_run_and_of_nothing(home: Path, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    fake_run_dir(root, "solo", None)
    result = invoke(cli_track.track_command, ["local", "solo", "--root", str(root), "--no-watch", "--json"])
    answer = json.loads(result.output)
    assert answer["group"] is False and [s["node"] for s in answer["streams"]] == [None]
    with Store.open() as store:
        assert store.run("solo")["target"] == "local" and not store.run("solo")["group_run"]
    missing = CliRunner().invoke(cli_track.track_command, ["local", "nope", "--root", str(root)])
    assert missing.exit_code == 1 and "no run nope on local" in missing.output


def test_onbox_ps_filters_one_run_and_its_node_streams(tmp_path: Path) -> None:
    import subprocess

    from tests.helpers import REPO
    root = tmp_path / "runs"
    for stream, group in ((N0, RUN), (N1, RUN), ("other", None), (RUN + "x", None)):
        fake_run_dir(root, stream, group)
    argv = [sys.executable, "-m", "onbox.cli", "ps", "--root", str(root), "--run", RUN, "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
    assert [r["run_id"] for r in json.loads(out.stdout)["runs"]] == [N0, N1]


def test_the_slurm_example_parses_and_launches_one_sidecar_per_node() -> None:
    import re
    import subprocess

    from tests.helpers import REPO
    script = REPO / "examples" / "slurm" / "train.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)", text, re.M))
    assert sbatch["nodes"] == "2" and sbatch["ntasks-per-node"] == "1"
    step = re.search(r"^srun (.+?)\n\s+(.+?)\n\s+(.+?)$", text, re.M)
    assert step is not None
    words = " ".join(step.groups()).replace("\\", " ").split()
    assert words[:2] == ["--ntasks-per-node=1", "rgt-onbox"]
    assert {"launch", "--wait", "--node", "auto", "--run-id", '"$RGT_RUN"'} <= set(words)
