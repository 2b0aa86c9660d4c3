"""controller.queue.model and controller.queue.dispatch against a real store file: the commands file, how an
attempt ended (from stored events), what may be retried, and where the dispatcher places cells.

The dispatcher's box calls (launch, probe, watch) are passed in: here they record what was asked
and store what boxes.launch would; tests/e2e/test_queue_e2e.py runs the real ones over sshd.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set

import pytest
from click.testing import CliRunner, Result

from controller.box.jobs import BoxError
from controller.cli import main as cli
from controller.follow import client
from controller.queue import dispatch as queuerun
from controller.queue import model as q
from controller.queue.dispatch import Dispatcher
from controller.store.db import Store
from protocol import Event

NOW = 1_800_000_000.0
RUN = "abl-0-aaaaaa"
EXIT_OK: Dict[str, Any] = dict(code=0, signal=None, oom_killed=False, vanished=False, final_ok=True,
                               final_reasons=[])
NAN_REASON = "training ended with non-finite loss (train.nonfinite)"


def ev(run: str, seq: int, kind: str, sev: str = "info", **data: Any) -> Event:
    return Event(run=run, host="box1", seq=seq, ts=NOW - 100 + seq, kind=kind, sev=sev, data=data)


def exited(run: str, seq: int, **over: Any) -> Event:
    return ev(run, seq, "job.exited", "info" if over.get("code", 0) == 0 else "warn", **{**EXIT_OK, **over})


def put(store: Store, run: str, *events: Event) -> None:
    store.upsert_run(run, host="box1", target="h1", run_dir=f"/runs/{run}")
    store.apply(run, list(events), max([store.cursor(run), *(e.seq for e in events)]))


def started(run: str, seq: int) -> Event:
    return ev(run, seq, "job.started", pid=4242)


@pytest.fixture
def store(home: Path) -> Iterator[Store]:
    with Store.open() as s:
        yield s


def begin(store: Store, cell: q.Cell, host: str, run: str, in_place: bool = False,
          now: float = NOW) -> Optional[q.Cell]:
    return q.begin_attempt(store, cell, host=host, run=run, in_place=in_place, since_seq=0, since_local=0,
                           now=now)


def judge(store: Store, run: str = RUN, **kw: Any) -> Optional[q.Outcome]:
    kw.setdefault("now", NOW)
    return q.classify(store, run, **kw)


# ---- the commands file ---------------------------------------------------------------------


def test_commands_one_per_line_split_like_a_shell_skipping_blanks_and_comments() -> None:
    text = ("# ablations\n\npython train.py --lr 3e-4\n  # indented comment\n"
            "python train.py --tag 'a b'  # why\n")
    assert q.parse_commands(text) == [["python", "train.py", "--lr", "3e-4"],
                                      ["python", "train.py", "--tag", "a b"]]


def test_a_line_a_shell_cannot_split_is_refused_with_its_number() -> None:
    with pytest.raises(q.QueueError, match=r"cmds.txt line 2: No closing quotation"):
        q.parse_commands("true\npython 'oops\n", "cmds.txt")
    with pytest.raises(q.QueueError, match="holds no command"):
        q.parse_commands("# nothing\n\n")


# ---- how an attempt ended --------------------------------------------------------------------


def test_a_clean_exit_is_done_and_a_running_job_is_not_judged(store: Store) -> None:
    put(store, RUN, ev(RUN, 1, "sidecar.started"), started(RUN, 2), ev(RUN, 3, "heartbeat"))
    assert judge(store) is None
    put(store, RUN, exited(RUN, 4))
    assert judge(store) == q.Outcome("ok", "", 4)


def test_nan_is_failed_even_when_the_job_exits_zero(store: Store) -> None:
    put(store, RUN, started(RUN, 1), ev(RUN, 2, "train.nonfinite", "critical", state="onset", name="loss"),
        exited(RUN, 3, final_ok=False, final_reasons=[NAN_REASON]))
    outcome = judge(store)
    assert outcome is not None and outcome.cls == "nan" and not outcome.retryable


def test_preemption_is_retryable_from_the_event_or_the_exit_flag(store: Store) -> None:
    put(store, RUN, started(RUN, 1), ev(RUN, 2, "job.preempted", "warn", signal=15, grace_s=30),
        exited(RUN, 3, code=None, signal=15))
    outcome = judge(store)
    assert outcome is not None and outcome.cls == "preempted" and outcome.retryable and outcome.at_seq == 3
    other = "abl-1-bbbbbb"
    put(store, other, started(other, 1), exited(other, 2, code=None, signal=15, preempted=True))
    assert getattr(judge(store, other), "cls", None) == "preempted"


@pytest.mark.parametrize("data, cls", [
    (dict(code=None, signal=9, oom_killed=True), "oom"),
    (dict(code=1), "error"),
    (dict(code=None, signal=11), "error"),
    (dict(code=None, signal=15, stop_requested=True), "stopped"),
    (dict(code=None, vanished=True, evidence={"rebooted": False}), "vanished"),
    (dict(code=0, final_ok=False, final_reasons=["a durable checkpoint copy failed (ckpt.sync_failed)"]),
     "final"),
])
def test_failures_that_are_never_retried(store: Store, data: Dict[str, Any], cls: str) -> None:
    put(store, RUN, started(RUN, 1), exited(RUN, 2, **data))
    outcome = judge(store)
    assert outcome is not None and outcome.cls == cls and not outcome.retryable


def test_link_loss_is_retryable_only_past_its_budget_and_unless_restored(store: Store) -> None:
    put(store, RUN, started(RUN, 1))
    store.add_local_event(RUN, "link.lost", "warn", {"reason": "gone"}, ts=NOW - 100)
    assert judge(store, link_budget_s=300) is None
    outcome = judge(store, link_budget_s=60)
    assert outcome is not None and outcome.cls == "link" and outcome.retryable
    store.add_local_event(RUN, "link.restored", "info", {"down_s": 90}, ts=NOW - 10)
    assert judge(store, link_budget_s=60) is None


def test_an_attempt_resumed_in_place_is_judged_on_its_own_events(store: Store) -> None:
    put(store, RUN, started(RUN, 1), ev(RUN, 2, "job.preempted", "warn"),
        exited(RUN, 3, code=None, signal=15, preempted=True), ev(RUN, 4, "sidecar.stopping"))
    lost = store.add_local_event(RUN, "link.lost", "warn", {}, ts=NOW - 1000)
    store.add_local_event(RUN, "link.restored", "info", {}, ts=NOW - 990)
    # The first attempt ended at seq 3: nothing of the second one is stored yet.
    assert judge(store, since_seq=3, since_local=lost.id + 1, link_budget_s=60) is None
    put(store, RUN, ev(RUN, 5, "sidecar.started"), started(RUN, 6), exited(RUN, 7))
    assert judge(store, since_seq=3, since_local=lost.id + 1) == q.Outcome("ok", "", 7)


# ---- rows and transitions --------------------------------------------------------------------


def make(store: Store, n: int = 3, hosts: Sequence[str] = ("h1", "h2"), max_attempts: int = 3,
         name: str = "abl") -> q.Queue:
    commands = [["python", "train.py", f"--seed={i}"] for i in range(n)]
    return q.create(store, name, hosts, commands, q.Options(max_attempts=max_attempts), NOW)


def test_a_queue_is_stored_and_a_name_is_taken_once(store: Store) -> None:
    queue = make(store)
    assert queue.hosts == ("h1", "h2") and queue.options.max_attempts == 3
    assert [(c.idx, c.state, c.command[-1]) for c in q.cells(store, "abl")] == [
        (0, "pending", "--seed=0"), (1, "pending", "--seed=1"), (2, "pending", "--seed=2")]
    with pytest.raises(q.QueueError, match="exists already"):
        make(store)
    assert q.unused_name(store, "abl") == "abl-2"
    with pytest.raises(q.QueueError, match="no queue 'nope'"):
        q.load(store, "nope")


def test_a_cell_moves_only_from_the_state_it_was_read_in(store: Store) -> None:
    make(store)
    cell = q.cells(store, "abl")[0]
    first = begin(store, cell, "h1", RUN)
    assert first is not None and first.state == "launching" and first.attempts == 1
    assert begin(store, cell, "h2", "other") is None  # stale: someone moved it first
    assert q.cells(store, "abl")[0].host == "h1"


def test_retries_stop_at_max_attempts_and_only_for_retryable_classes(store: Store) -> None:
    make(store, max_attempts=2)
    preempted = q.Outcome("preempted", "preempted")
    cell = q.cells(store, "abl")[0]
    for attempt in (1, 2):
        begun = begin(store, cell, "h1", RUN, in_place=attempt > 1)
        assert begun is not None
        running = q.launched(store, begun, {"pid": 1}, NOW)
        assert running is not None
        ended = q.end_attempt(store, running, preempted, 2, NOW)
        assert ended is not None
        cell = ended
    assert cell.state == "failed" and "no attempts left (2 of 2)" in cell.reason
    assert [h["outcome"] for h in cell.history] == ["preempted", "preempted"]
    other = q.cells(store, "abl")[1]
    begun = begin(store, other, "h2", "x")
    assert begun is not None
    nan = q.end_attempt(store, begun, q.Outcome("nan", "training went non-finite"), 2, NOW)
    assert nan is not None and nan.state == "failed" and nan.reason.endswith("(not retried)")


# ---- the dispatcher --------------------------------------------------------------------------


class Boxes:
    """What the dispatcher asks of boxes, recorded; a launch stores the run as boxes.launch does."""

    def __init__(self) -> None:
        self.launches: List[Dict[str, Any]] = []
        self.refuse: Set[str] = set()
        self.crash: Set[str] = set()
        self.unreachable: Set[str] = set()
        self.watched: List[str] = []
        self.before_in_place: List[str] = []

    def launch(self, store: Store, host: str, command: Sequence[str], run_id: str, project: str,
               onbox_args: Sequence[str]) -> Mapping[str, Any]:
        self.launches.append({"host": host, "run": run_id, "command": list(command), "project": project})
        if host in self.refuse:
            raise BoxError(f"{host}: connection refused")
        if host in self.crash:
            raise RuntimeError("a bug in the launch path")
        store.upsert_run(run_id, host="", target=host, run_dir=f"/runs/{run_id}")
        return {"run_id": run_id, "pid": 1000 + len(self.launches), "run_dir": f"/runs/{run_id}"}

    def probe(self, store: Store, host: str) -> bool:
        return host not in self.unreachable

    def watch(self, store: Store, run: str, since_seq: int) -> Optional[int]:
        self.watched.append(run)
        return 1

    def dispatcher(self, store: Store, name: str = "abl") -> Dispatcher:
        return Dispatcher(store, name, launch=self.launch, probe=self.probe, watch=self.watch,
                          before_in_place=self.before_in_place.append, clock=lambda: NOW)


def by_idx(store: Store, name: str = "abl") -> Dict[int, q.Cell]:
    return {c.idx: c for c in q.cells(store, name)}


def finish(store: Store, run: str, *events: Event) -> None:
    """The attempt's events as its watcher would store them, after what is stored already."""
    base = store.cursor(run)
    put(store, run, *[Event(run=e.run, host=e.host, seq=base + e.seq, ts=e.ts, kind=e.kind, sev=e.sev,
                            data=e.data) for e in events])


def test_each_host_runs_one_cell_and_a_done_cell_frees_it(store: Store) -> None:
    make(store, n=3)
    boxes = Boxes()
    d = boxes.dispatcher(store)
    changes = d.tick()
    cells = by_idx(store)
    assert [(c.state, c.host) for c in cells.values()] == [("running", "h1"), ("running", "h2"),
                                                           ("pending", "")]
    assert [c.cell.state for c in changes] == ["launching", "running", "launching", "running"]
    assert [la["project"] for la in boxes.launches] == ["abl", "abl"]
    assert set(boxes.watched) == {cells[0].run, cells[1].run}
    assert d.tick() == [] and len(boxes.launches) == 2
    finish(store, cells[1].run, started(cells[1].run, 1), exited(cells[1].run, 2))
    d.tick()
    cells = by_idx(store)
    assert cells[1].state == "done" and (cells[2].state, cells[2].host) == ("running", "h2")


def test_a_preempted_cell_resumes_in_place_and_a_nan_cell_is_not_retried(store: Store) -> None:
    make(store, n=2)
    boxes = Boxes()
    d = boxes.dispatcher(store)
    d.tick()
    first = by_idx(store)
    finish(store, first[0].run, started(first[0].run, 1), ev(first[0].run, 2, "job.preempted", "warn"),
           exited(first[0].run, 3, code=None, signal=15, preempted=True))
    finish(store, first[1].run, started(first[1].run, 1), ev(first[1].run, 2, "train.nonfinite", "critical",
                                                               state="onset"), exited(first[1].run, 3))
    d.tick()
    cells = by_idx(store)
    assert (cells[0].state, cells[0].host, cells[0].run, cells[0].attempts) == ("running", "h1",
                                                                                first[0].run, 2)
    assert cells[0].history[-1]["in_place"] is True and cells[0].history[-1]["since_seq"] == 3
    assert boxes.before_in_place == [first[0].run]
    assert (cells[1].state, cells[1].attempts) == ("failed", 1) and "non-finite" in cells[1].reason
    assert len(boxes.launches) == 3
    finish(store, first[0].run, started(first[0].run, 1), exited(first[0].run, 2))
    assert d.serve() == 1  # one cell failed; the queue is over
    assert by_idx(store)[0].state == "done" and len(boxes.launches) == 3


def test_a_preempted_cell_whose_box_is_gone_starts_anew_on_another_host(store: Store) -> None:
    make(store, n=1)
    boxes = Boxes()
    d = boxes.dispatcher(store)
    d.tick()
    old = by_idx(store)[0]
    boxes.unreachable.add(old.host)
    finish(store, old.run, started(old.run, 1), exited(old.run, 2, code=None, signal=15, preempted=True))
    d.tick()
    new = by_idx(store)[0]
    assert (new.state, new.host, new.attempts) == ("running", "h2", 2) and new.run != old.run
    assert new.history[-1]["in_place"] is False and boxes.before_in_place == []
    assert store.run(new.run)["resumed_from"] == old.run


def test_a_lost_link_past_its_budget_moves_the_cell(store: Store) -> None:
    make(store, n=1)
    boxes = Boxes()
    d = boxes.dispatcher(store)
    d.tick()
    old = by_idx(store)[0]
    finish(store, old.run, started(old.run, 1))
    long_ago = NOW - 2 * q.DEFAULT_LINK_BUDGET_S
    store.add_local_event(old.run, "link.lost", "warn", {"reason": "timeout"}, ts=long_ago)
    d.tick()
    new = by_idx(store)[0]
    assert new.history[0]["outcome"] == "link" and (new.host, new.attempts) == ("h2", 2)


def test_a_failed_launch_rests_the_host_and_the_cell_goes_elsewhere(store: Store) -> None:
    make(store, n=2)
    boxes = Boxes()
    boxes.refuse.add("h1")
    d = boxes.dispatcher(store)
    d.tick()
    cells = by_idx(store)
    assert (cells[0].state, cells[0].history[0]["outcome"]) == ("retrying", "launch")
    assert "connection refused" in cells[0].reason and cells[1].host == "h2"
    finish(store, cells[1].run, started(cells[1].run, 1), exited(cells[1].run, 2))
    d.tick()  # h2 is free, h1 rests: cell 0 runs on h2 under a new run id
    cells = by_idx(store)
    assert (cells[0].state, cells[0].host, cells[0].attempts) == ("running", "h2", 2)
    assert [la["host"] for la in boxes.launches] == ["h1", "h2", "h2"]


def test_a_launch_that_raises_anything_is_a_failed_launch_not_a_dead_dispatcher(store: Store) -> None:
    make(store, n=1, hosts=("h1",), max_attempts=1)
    boxes = Boxes()
    boxes.crash.add("h1")
    assert boxes.dispatcher(store).serve() == 1
    cell = by_idx(store)[0]
    assert (cell.state, cell.history[0]["outcome"]) == ("failed", "launch")
    assert "a bug in the launch path; no attempts left (1 of 1)" in cell.reason


def test_a_new_dispatcher_picks_up_a_cell_left_launching(store: Store) -> None:
    make(store, n=2)
    cells = by_idx(store)
    # The box launched cell 0 (the store has its run); cell 1's launch never reached the box.
    for cell, run in ((cells[0], "abl-0-cccccc"), (cells[1], "abl-1-dddddd")):
        begun = begin(store, cell, f"h{cell.idx + 1}", run, now=time.time() - 5)  # the store's clock
        assert begun is not None
    store.upsert_run("abl-0-cccccc", host="", target="h1", run_dir="/runs/abl-0-cccccc")
    boxes = Boxes()
    boxes.dispatcher(store).tick()
    cells = by_idx(store)
    assert [(c.state, c.run, c.attempts) for c in cells.values()] == [
        ("running", "abl-0-cccccc", 1), ("running", "abl-1-dddddd", 1)]
    assert [la["run"] for la in boxes.launches] == ["abl-1-dddddd"]


def test_a_cancelled_queue_places_nothing_and_resume_reopens_it(store: Store) -> None:
    make(store, n=3, hosts=("h1",))
    boxes = Boxes()
    d = boxes.dispatcher(store)
    d.tick()
    q.cancel(store, "abl", NOW)
    assert [c.state for c in q.cells(store, "abl")] == ["running", "cancelled", "cancelled"]
    assert d.serve() == 1 and len(boxes.launches) == 1
    q.reopen(store, "abl", NOW)
    assert [c.state for c in q.cells(store, "abl")] == ["running", "pending", "pending"]


# ---- the command line --------------------------------------------------------------------------


def rgt(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args))


def test_usage_errors_exit_2(store: Store, tmp_path: Path) -> None:
    good = tmp_path / "cells.txt"
    good.write_text("python train.py\n")
    bad = tmp_path / "bad.txt"
    bad.write_text("python 'unclosed\n")
    assert rgt("queue", str(good), "--hosts", "h1,h1").exit_code == 2
    assert rgt("queue", str(bad), "--hosts", "local").exit_code == 2
    assert rgt("queue", str(tmp_path / "missing.txt"), "--hosts", "local").exit_code == 2
    assert rgt("queue", str(good), "--hosts", "local", "--name", "-x").exit_code == 2
    unknown = rgt("queue", str(good), "--hosts", "nosuch")
    assert unknown.exit_code == 1 and "no host 'nosuch'" in unknown.output
    assert q.names(store) == []


def test_status_shows_every_cell_and_exits_1_when_one_failed(store: Store) -> None:
    make(store, n=2, hosts=("h1",))
    cell = q.cells(store, "abl")[1]
    begun = begin(store, cell, "h1", RUN)
    assert begun is not None
    q.end_attempt(store, begun, q.Outcome("oom", "the job was killed for memory (OOM)"), 3, NOW)
    q.set_options(store, "abl", NOW, cancelled=True)  # no dispatcher may start from this test
    out = rgt("queue", "status", "abl", "--json")
    assert out.exit_code == 1, out.output
    report = json.loads(out.output)
    assert report["name"] == "abl" and report["counts"] == {"pending": 1, "failed": 1}
    assert [(c["idx"], c["state"], c["host"], c["run"], c["attempts"]) for c in report["cells"]] == [
        (0, "pending", "", "", 0), (1, "failed", "h1", RUN, 1)]
    assert "OOM" in report["cells"][1]["reason"]
    table = rgt("queue", "status")
    assert table.exit_code == 1 and "queue abl (cancelled; no dispatcher)" in table.output
    assert RUN in table.output and "killed for memory" in table.output


def test_cancel_stops_placing_cells(store: Store) -> None:
    make(store, n=2, hosts=("h1",))
    out = rgt("queue", "cancel", "abl", "--json")
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["state"] == "cancelled" and [c["state"] for c in report["cells"]] == ["cancelled"] * 2
    assert rgt("queue", "cancel", "nope").exit_code == 1


def test_status_starts_a_dispatcher_for_a_queue_still_going_and_cancel_ends_it(store: Store) -> None:
    make(store, n=1, hosts=("h1",))
    cell = q.cells(store, "abl")[0]
    begun = begin(store, cell, "h1", "abl-0-nowhere")  # running on h1: nothing to place, nothing to judge
    assert begun is not None and q.launched(store, begun, {}, NOW) is not None
    assert queuerun.running_pid("abl") is None
    out = rgt("queue", "status", "abl", "--json")
    assert out.exit_code == 0, out.output
    pid = json.loads(out.output)["dispatcher_pid"]
    assert pid and queuerun.running_pid("abl") == pid
    again = json.loads(rgt("queue", "status", "abl", "--json").output)
    assert again["dispatcher_pid"] == pid  # one dispatcher per queue
    cancelled = rgt("queue", "cancel", "abl", "--json")
    assert cancelled.exit_code == 0 and queuerun.running_pid("abl") is None
    assert json.loads(cancelled.output)["cells"][0]["state"] == "running"  # its job is left alone
    log = client.daemon_files().log.read_text()   # the follower daemon drove it
    assert "dispatching queue abl" in log and "stopped dispatching queue abl" in log
    assert client.daemon_pid() == pid              # and lives on for the other queues and runs
