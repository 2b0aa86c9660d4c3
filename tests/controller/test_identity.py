"""Identities are the laptop's: a box cannot choose a run id, take another run's record over, re-bind a
run to another host, make the watcher or a pull write outside their directories, or end a watch by
stopping its sidecar while the job may live. Real processes, real ZeroMQ, real files."""
from __future__ import annotations

import json
import os
import re
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pytest
import zmq
from click.testing import CliRunner

from controller import paths
from controller.box import jobs as boxes
from controller.box.jobs import BoxError
from controller.cli import main as cli
from controller.daemon.server import Daemon
from controller.follow import client, watcher
from controller.follow.subscriber import Subscriber, SubscriberRefused
from controller.follow.watcher import LocalLink, SshLink, Watcher, WatchRefused, finished
from controller.pull.fetch import PullError, destination
from controller.pull.stage import Entry, check_entries, prepare
from controller.queue import dispatch
from controller.queue import model as q
from controller.store.db import Store
from controller.trust import Untrusted
from protocol import PACKAGE_VERSION, PROTOCOL_VERSION, Event, HelloReply, SinceReply
from protocol.codec import decode_request, encode_event, encode_reply
from protocol.control import Hello, Since
from protocol.endpoints import Endpoints
from protocol.ids import is_run_id
from tests.controller.sidecars import RealSidecar
from tests.helpers import wait_until

VICTIM = "run-b"
JOB = [sys.executable, "-c", "print('hi')"]
RUN_ID_SHAPE = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{6}$")


def ev(run: str, seq: int, kind: str = "heartbeat", host: str = "realbox", **data: Any) -> Event:
    return Event(run=run, host=host, seq=seq, ts=1000.0 + seq, kind=kind, sev="info", data=data or {"n": seq})


def seed_victim(store: Store) -> Dict[str, Any]:
    """Run B, launched on another box and followed: what an attacker wants to take over."""
    store.upsert_run(VICTIM, host="realbox", boot_id="b1", protocol_version=1,
                     package_version=PACKAGE_VERSION, meta={"command": ["python", "train.py"]}, target="gpu2",
                     run_dir=f"/runs/p/active/{VICTIM}")
    store.apply(VICTIM, [ev(VICTIM, i) for i in (1, 2, 3)], 3)
    return snapshot(store, VICTIM)


def snapshot(store: Store, run: str) -> Dict[str, Any]:
    row = store.run(run)
    keys = ("host", "target", "run_dir", "meta", "boot_id", "last_seq", "endpoint")
    return {"row": {k: row[k] for k in keys},
            "events": [(e.seq, e.kind, e.host, dict(e.data)) for e in store.events(run)]}


def tree(root: Path) -> List[str]:
    """Every path under ROOT but the store's own files (their contents change with any write)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.name.startswith("rgt.db"))


# ---- a fake rgt-onbox: host `local` with its `onbox` command set ------------------------------------------

FAKE_ONBOX = f"""
import json, sys
from pathlib import Path
scenario = Path(sys.argv[1])
args = sys.argv[2:]
with open(scenario.with_name("calls.jsonl"), "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[:1] == ["--version"]:
    print("rgt-onbox, version {PACKAGE_VERSION}")
    sys.exit(0)
sc = json.loads(scenario.read_text())
run_id = args[args.index("--run-id") + 1] if "--run-id" in args else "box-chose-this"
text = json.dumps(sc["launch"]).replace("{{run_id}}", run_id).replace("{{root}}", sc["root"])
print(json.dumps(json.loads(text)))
sys.exit(sc.get("exit", 0))
"""


class FakeBox:
    """Host `local`, whose rgt-onbox is a script answering `launch` with what the scenario holds."""

    def __init__(self, tmp_path: Path, store: Store) -> None:
        self.dir = tmp_path / "box"
        self.dir.mkdir()
        self.root = str(tmp_path / "box" / "runs")
        script = self.dir / "onbox.py"
        script.write_text(FAKE_ONBOX)
        self.scenario = self.dir / "scenario.json"
        onbox = shlex.join([sys.executable, str(script), str(self.scenario)])
        store.add_host(boxes.LOCAL, ssh="", onbox=onbox)

    def answer(self, **change: Any) -> None:
        launch = {"run_id": "{run_id}", "run_dir": "{root}/proj/active/{run_id}", "pid": 4242,
                  "project": "proj"}
        self.scenario.write_text(json.dumps({"root": self.root, "launch": {**launch, **change}}))

    def calls(self) -> List[List[str]]:
        path = self.dir / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def launches(self) -> List[List[str]]:
        return [c for c in self.calls() if c[:1] == ["launch"]]


@pytest.fixture
def store(home: Path) -> Iterator[Store]:
    with Store.open(paths.db_path()) as s:
        yield s


@pytest.fixture
def box(tmp_path: Path, store: Store) -> FakeBox:
    b = FakeBox(tmp_path, store)
    b.answer()
    return b


def test_the_laptop_chooses_the_run_id_and_records_what_it_launched(store: Store, box: FakeBox) -> None:
    answer = boxes.launch(store, boxes.LOCAL, JOB, onbox_args=["--env=X"])
    run = answer["run_id"]
    assert RUN_ID_SHAPE.match(run), run
    (call,) = box.launches()
    assert call[call.index("--run-id") + 1] == run
    row = store.run(run)
    assert (row["target"], row["run_dir"], row["host"]) == ("local", f"{box.root}/proj/active/{run}", "")
    # On `local` the job runs in this process's cwd: that is recorded, for a resume to run there too.
    assert row["launch"] == {"command": JOB, "cwd": os.getcwd(), "python": None, "code": None,
                             "profile": None, "project": None, "onbox_args": ["--env=X"], "host": "local"}


def test_a_given_run_id_is_checked_and_passed_as_is(store: Store, box: FakeBox) -> None:
    assert boxes.launch(store, boxes.LOCAL, JOB, run_id="mine-1")["run_id"] == "mine-1"
    assert box.launches()[0][box.launches()[0].index("--run-id") + 1] == "mine-1"


@pytest.mark.parametrize("given", ["../../x", "/abs/x", "a b", "-rf", "x\x1b[2J"])
def test_a_bad_run_id_is_refused_before_the_box_is_asked(store: Store, box: FakeBox, given: str) -> None:
    with pytest.raises(BoxError, match="--run-id refused: run id .* is not a run id") as e:
        boxes.launch(store, boxes.LOCAL, JOB, run_id=given)
    assert e.value.hint == "leave out --run-id: rgt chooses one"
    assert box.calls() == []


def test_a_run_id_already_recorded_is_refused_before_the_box_is_asked(store: Store, box: FakeBox) -> None:
    before = seed_victim(store)
    with pytest.raises(BoxError, match=f"run {VICTIM} exists already in this store") as e:
        boxes.launch(store, boxes.LOCAL, JOB, run_id=VICTIM)
    assert "leave out --run-id" in str(e.value.hint)
    assert box.calls() == [] and snapshot(store, VICTIM) == before


def test_a_relaunch_is_only_on_the_host_the_run_is_bound_to(store: Store, box: FakeBox) -> None:
    seed_victim(store)  # bound to gpu2
    with pytest.raises(BoxError, match=f"run {VICTIM} cannot be relaunched on local: it is bound to "
                                       "host gpu2"):
        boxes.launch(store, boxes.LOCAL, JOB, run_id=VICTIM, relaunch=True)
    assert box.calls() == []
    first = boxes.launch(store, boxes.LOCAL, JOB, run_id="cell-0-abcdef")
    again = boxes.launch(store, boxes.LOCAL, JOB, run_id="cell-0-abcdef", relaunch=True)
    assert again["run_dir"] == first["run_dir"] and len(box.launches()) == 2


HOSTILE = {
    "absolute id": ({"run_id": "{MARK}", "run_dir": "{MARK}"}, "is not a run id"),
    "dotdot id": ({"run_id": "../../../../..{MARK}", "run_dir": "{MARK}"}, "is not a run id"),
    "another run's id": ({"run_id": VICTIM, "run_dir": "{root}/proj/active/" + VICTIM}, "not the"),
    "run dir not named after the run": ({"run_dir": "/home/someone/.ssh"}, "is not named after run"),
    "relative run dir": ({"run_dir": "proj/active/{run_id}"}, "not an absolute path"),
    "pid not a pid": ({"pid": -1}, "pid"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_launch_answer_is_refused_and_nothing_is_recorded(tmp_path: Path, home: Path, store: Store,
                                                                    box: FakeBox, case: str) -> None:
    change, why = HOSTILE[case]
    mark = tmp_path / "outside"
    box.answer(**{k: v.replace("{MARK}", str(mark)) if isinstance(v, str) else v for k, v in change.items()})
    before = seed_victim(store)
    files = tree(home)
    with pytest.raises(BoxError, match="refused the box's answer to the launch: ") as e:
        boxes.launch(store, boxes.LOCAL, JOB)
    assert why in e.value.message
    assert [r["run"] for r in store.runs()] == [VICTIM] and snapshot(store, VICTIM) == before
    assert tree(home) == files and not mark.exists()
    assert len(box.launches()) == 1


def test_rgt_launch_says_what_was_refused_and_starts_no_watcher(home: Path, store: Store,
                                                                box: FakeBox) -> None:
    box.answer(run_id="../../evil", run_dir="/tmp/evil")
    files = tree(home)
    out = CliRunner().invoke(cli.main, ["launch", "local", "--json", "--", *JOB], catch_exceptions=False)
    assert out.exit_code == 1
    assert "refused the box's answer to the launch: the box's launch's run id '../../evil' is not a run id" \
        in out.output, out.output
    assert tree(home) == files
    bad = CliRunner().invoke(cli.main, ["launch", "local", "--run-id", "../x", "--", *JOB],
                             catch_exceptions=False)
    assert bad.exit_code == 1 and "--run-id refused" in bad.output and "leave out --run-id" in bad.output
    assert len(box.launches()) == 1             # the bad --run-id never reached the box


def test_a_queue_cell_relaunches_its_own_run_in_place_and_no_other(store: Store, box: FakeBox) -> None:
    first = dispatch.launch_on_box(store, boxes.LOCAL, JOB, "abl-0-abcdef", "abl", [])
    again = dispatch.launch_on_box(store, boxes.LOCAL, JOB, "abl-0-abcdef", "abl", [])
    assert first["run_dir"] == again["run_dir"] and len(box.launches()) == 2
    seed_victim(store)
    with pytest.raises(BoxError, match="cannot be relaunched on local: it is bound to host gpu2"):
        dispatch.launch_on_box(store, boxes.LOCAL, JOB, VICTIM, "abl", [])
    assert len(box.launches()) == 2


@pytest.mark.parametrize("name", ["a..b", "..", "x/y", "-q", ""])
def test_a_queue_name_its_run_ids_could_not_carry_is_refused(store: Store, name: str) -> None:
    with pytest.raises(q.QueueError, match="must be 1-48 of"):
        q.create(store, name, ["local"], [["true"]], q.Options(), 1.0)
    assert q.names(store) == []


def test_queue_names_and_run_ids_follow_the_run_id_grammar() -> None:
    assert q.name_from("sweep..v2.txt") == "sweep.v2" and q.name_from("../..weird...txt") == "weird"
    for name in ("abl", "a.b", "x" * 48, "a-"):
        assert is_run_id(q.new_run_id(q.check_name(name), 12))


# ---- the watcher's files and tunnels ------------------------------------------------------------------


@pytest.mark.parametrize("run", ["../../x", "/tmp/abs", "a/b", "", "x\x00", "..", "x\n"])
def test_the_watcher_makes_no_path_of_a_bad_run_id(home: Path, store: Store, run: str) -> None:
    with pytest.raises(Untrusted, match="is not a run id"):
        watcher.files(run)
    assert client.running_pid(run) is None and client.unfollow(run) is False
    with pytest.raises(Untrusted):
        SshLink(None, run, "/runs/p/active/x", home / "tunnels")  # type: ignore[arg-type]
    assert not Path("/tmp/abs.lock").exists() and not (home / "tunnels").exists()


def test_the_watcher_files_stay_in_watchers(home: Path) -> None:
    f = watcher.files("run-1")
    assert {p.parent for p in (f.followed, f.launched)} == {(home / "watchers").resolve()}
    os.symlink("/tmp", home / "watchers" / "run-2.followed")
    with pytest.raises(Untrusted, match="leads out of"):
        watcher.files("run-2")


def test_follow_refuses_a_stored_bad_run_readably(store: Store) -> None:
    store.upsert_run("../../etc/x", host="", target="gpu", run_dir="/r/x")  # recorded by an older rgt
    with pytest.raises(WatchRefused, match="rgt does not watch '../../etc/x'"):
        client.follow(store, "../../etc/x")
    assert client.daemon_pid() is None               # refused before any daemon was started


def test_the_daemon_refuses_a_bad_run_in_a_request_and_in_a_marker(home: Path, store: Store) -> None:
    store.upsert_run("../../etc/x", host="", target="gpu", run_dir="/r/x")
    d = Daemon(store, idle_s=60.0)
    try:
        answer = json.loads(d.answer(b'{"op": "follow", "run": "../../etc/x"}'))
        assert answer["ok"] is False and "is not a run id" in answer["error"]
        assert json.loads(d.answer(b"not json"))["error"] == "not a request"
        assert json.loads(d.answer(b'{"op": "follow"}'))["error"] == "no run named"
        marker = watcher.watcher_dir() / "..x.followed"   # a name no run id has, left in watchers/
        marker.write_text("")
        d.resume()
        assert not marker.exists() and d.loop.follows == {}
    finally:
        d.loop.close()


# ---- the pull --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("run", ["../../x", "/abs/x", "a/b", ".."])
def test_a_pull_makes_no_path_of_a_bad_run_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              run: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PullError, match="refused to pull .* is not a run id"):
        destination(run, "/runs/p/active/x", None)
    assert destination("run-1", "/r/run-1", None) == (tmp_path / "runs" / "run-1").resolve()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "run-2").symlink_to(tmp_path)   # ./runs/<run> leading out of ./runs
    with pytest.raises(PullError, match="leads out of"):
        destination("run-2", "/r/run-2", None)


def test_a_manifest_entry_leading_out_of_staging_is_refused_before_anything_is_written(
        tmp_path: Path) -> None:
    staging, outside = tmp_path / "dest.partial", tmp_path / "outside"
    outside.mkdir()
    for rel in ("../outside/evil.pth", "/etc/cron.d/evil", "a\x1b/b"):
        with pytest.raises(PullError, match="refused the box's manifest entry"):
            check_entries(staging, {rel: Entry(rel, 3, "0" * 64)})
    assert not staging.exists()
    staging.mkdir()
    (staging / "ckpt").symlink_to(outside)  # left in staging: the entry under it must not be followed
    with pytest.raises(PullError, match="leads out of"):
        prepare(staging, {"ckpt/evil.pth": Entry("ckpt/evil.pth", 3, "0" * 64)}, None)
    assert list(outside.iterdir()) == []


# ---- the sidecar's hello ----------------------------------------------------------------------------------


@pytest.fixture
def sidecars() -> Iterator[List[RealSidecar]]:
    made: List[RealSidecar] = []
    yield made
    for s in made:
        if s.thread.is_alive():
            s.close()


def follow_once(store: Store, ep: Endpoints, expect_run: Optional[str], seconds: float = 10.0) -> Subscriber:
    """Follow until refused, or for SECONDS (a bound, not a sleep: it ends at once when refused)."""
    sub = Subscriber(store, ep, expect_run=expect_run, request_timeout_s=0.5)
    deadline = time.monotonic() + seconds
    sub.run_until(threading.Event(), lambda: time.monotonic() > deadline or sub.caught_up)
    return sub


def test_a_hello_naming_another_run_is_refused_and_that_run_is_untouched(tmp_path: Path, store: Store,
                                                                         sidecars: List[RealSidecar]) -> None:
    before = seed_victim(store)
    evil = RealSidecar(tmp_path / "active" / VICTIM, host="evilbox")   # answers as run B
    sidecars.append(evil)
    for i in range(5):
        evil.sidecar.emit("job.exited", {"code": 0, "n": i})
    sub = Subscriber(store, evil.endpoints(), expect_run="run-a")
    deadline = time.monotonic() + 10                # a bound, not a sleep: the refusal ends it at once
    with pytest.raises(SubscriberRefused, match="the sidecar answered for run 'run-b', not the 'run-a'"):
        sub.run_until(threading.Event(), lambda: time.monotonic() > deadline or sub.caught_up)
    assert sub.stats.refused == 1 and sub.run is None
    assert snapshot(store, VICTIM) == before
    assert [r["run"] for r in store.runs()] == [VICTIM]


def test_a_hello_from_another_host_for_a_bound_run_is_refused(tmp_path: Path, store: Store,
                                                              sidecars: List[RealSidecar]) -> None:
    before = seed_victim(store)
    evil = RealSidecar(tmp_path / "active" / VICTIM, host="evilbox")
    sidecars.append(evil)
    with pytest.raises(SubscriberRefused, match="run 'run-b' was first seen on host 'realbox'; "
                                                "the sidecar now says 'evilbox'"):
        follow_once(store, evil.endpoints(), VICTIM)
    assert snapshot(store, VICTIM) == before
    evil.close()
    honest = RealSidecar(tmp_path / "honest" / VICTIM, host="realbox")  # the box it was first seen on
    sidecars.append(honest)
    sub = follow_once(store, honest.endpoints(), VICTIM)
    assert sub.caught_up and sub.stats.refused == 0
    assert store.run(VICTIM)["host"] == "realbox" and store.run(VICTIM)["boot_id"] == honest.sidecar.boot_id


class FakeSidecar:
    """Real ROUTER and PUB sockets answering hello as RUN and since with events of RUN and of another run."""

    def __init__(self, where: Path, run: str, events: Sequence[Event], host: str = "fakebox") -> None:
        where.mkdir(parents=True)
        self.host = host
        self.ctx = zmq.Context()
        self.router, self.pub = self.ctx.socket(zmq.ROUTER), self.ctx.socket(zmq.PUB)
        for sock in (self.router, self.pub):
            sock.setsockopt(zmq.LINGER, 0)
        self.ep = Endpoints(pub=f"ipc://{where}/pub", ctl=f"ipc://{where}/ctl")
        self.router.bind(self.ep.ctl)
        self.pub.bind(self.ep.pub)
        self.run, self.events = run, list(events)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="fake-sidecar")
        self.thread.start()

    def _serve(self) -> None:
        last = max(e.seq for e in self.events if e.run == self.run)
        while not self.stop.is_set():
            if not self.router.poll(50):
                continue
            ident, *frames = self.router.recv_multipart()
            req = decode_request(frames)
            if isinstance(req, Hello):
                reply = encode_reply(HelloReply(id=req.id, protocol_version=PROTOCOL_VERSION,
                                                package_version=PACKAGE_VERSION, boot_id="fake",
                                                host=self.host, run=self.run, run_meta={}, last_seq=last,
                                                oldest_seq=1))
            elif isinstance(req, Since):
                frames_out = [encode_event(e) for e in self.events if e.seq > req.seq]
                head = SinceReply(id=req.id, events=(), more=False, last_seq=last, oldest_seq=1)
                reply = encode_reply(head, frames_out)
            else:
                continue
            self.router.send_multipart([ident, *reply])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.router.close()
        self.pub.close()
        self.ctx.term()


def test_events_of_another_run_never_reach_the_store(tmp_path: Path, store: Store) -> None:
    before = seed_victim(store)
    mixed = [ev("run-a", 1, host="fakebox"), ev(VICTIM, 4, "job.exited"), ev(VICTIM, 5),
             ev("run-a", 2, host="fakebox"), ev(VICTIM, 6, "sidecar.stopping")]
    fake = FakeSidecar(tmp_path / "fake", "run-a", mixed)
    try:
        sub = follow_once(store, fake.ep, "run-a")
    finally:
        fake.close()
    assert [e.seq for e in store.events("run-a")] == [1, 2] and sub.stats.foreign >= 3
    assert snapshot(store, VICTIM) == before


def test_a_hello_with_an_overlong_host_name_is_refused(tmp_path: Path, store: Store) -> None:
    fake = FakeSidecar(tmp_path / "fake", "run-a", [ev("run-a", 1)], host="h" * 5000)
    try:
        with pytest.raises(SubscriberRefused, match="host name is not a string of at most 256"):
            follow_once(store, fake.ep, "run-a")
    finally:
        fake.close()
    assert store.runs() == []


def test_a_watcher_refused_by_the_sidecar_records_why_and_stops(tmp_path: Path, store: Store,
                                                                sidecars: List[RealSidecar]) -> None:
    before = seed_victim(store)
    evil = RealSidecar(tmp_path / "active" / VICTIM, host="evilbox")
    sidecars.append(evil)
    w = Watcher("run-a", LocalLink(str(evil.run_dir)))
    result: List[int] = []
    with Store.open(store.path) as main_store:
        t = threading.Thread(target=lambda: result.append(w.serve(main_store)),
                             name="test-watcher")
        t.start()
        try:
            wait_until(lambda: result, 20, "the watcher to give up on the sidecar")
        finally:
            w.stop.set()
            t.join(15)
    assert result == [1]
    (degraded,) = store.local_events("run-a", kind_prefix="sidecar.degraded")
    assert degraded.data["source"] == "controller"
    assert degraded.data["error"].startswith("refused the sidecar at ipc://")
    assert "answered for run 'run-b', not the 'run-a'" in degraded.data["error"]
    assert snapshot(store, VICTIM) == before


# ---- a sidecar that stops ends nothing while the job may live ---------------------------------------------


class Caught:
    caught_up = True


def test_a_stopping_sidecar_alone_does_not_finish_a_run(store: Store) -> None:
    store.apply("r", [ev("r", 1, "sidecar.started"), ev("r", 2, "job.started"),
                      ev("r", 3, "sidecar.stopping")], 3)
    assert not finished(store, "r")                # the supervisor restarts the sidecar; the job trains on
    store.apply("r", [ev("r", 4, "sidecar.started"), ev("r", 5, "train.nonfinite"),
                      ev("r", 6, "job.exited")], 6)
    assert not finished(store, "r")                # exited, but its sidecar still reports
    store.apply("r", [ev("r", 7, "sidecar.stopping")], 7)
    assert finished(store, "r")


def test_the_watcher_goes_on_after_a_stop_until_the_exit_is_stored(store: Store) -> None:
    now = [0.0]
    w = Watcher("r", LocalLink("/nonexistent/r"), monotonic=lambda: now[0])
    sub: Any = Caught()
    w.on_events([ev("r", 1, "job.started"), ev("r", 2, "sidecar.stopping")])
    now[0] += 3600
    assert not w.done(sub)
    store.apply("r", [ev("r", 1, "job.started"), ev("r", 2, "sidecar.stopping")], 2)
    w._exit_from_store(store)
    assert not w.done(sub)                          # no exit stored: the job may live
    w.on_events([ev("r", 3, "sidecar.started"), ev("r", 4, "job.exited")])
    assert not w.done(sub)                          # exited; the sidecar may still report its last events
    w.on_events([ev("r", 5, "sidecar.stopping")])
    assert w.done(sub)


def test_a_restarted_watcher_ends_on_a_stop_after_an_exit_stored_before_it(store: Store) -> None:
    store.apply("r", [ev("r", 1, "job.started"), ev("r", 2, "job.exited")], 2)
    w = Watcher("r", LocalLink("/nonexistent/r"))
    sub: Any = Caught()
    w.on_events([ev("r", 3, "sidecar.stopping")])
    assert not w.done(sub)
    store.apply("r", [ev("r", 3, "sidecar.stopping")], 3)
    w._exit_from_store(store)
    assert w.done(sub)


def test_a_real_watcher_follows_through_a_sidecar_restart(tmp_path: Path, store: Store,
                                                          sidecars: List[RealSidecar]) -> None:
    run_dir = tmp_path / "active" / "run-r"
    first = RealSidecar(run_dir, host="box")
    sidecars.append(first)
    first.sidecar.emit("job.started", {"pid": 1})
    w = Watcher("run-r", LocalLink(str(run_dir)))
    result: List[int] = []
    with Store.open(store.path) as main_store:
        t = threading.Thread(target=lambda: result.append(w.serve(main_store)),
                             name="test-watcher")
        t.start()
        try:
            wait_until(lambda: store.events("run-r", kind_prefix="job.started"), 20, "the job's start stored")
            first.close()                           # the supervisor restarts the sidecar; the job lives on
            second = RealSidecar(run_dir, host="box")
            sidecars.append(second)
            wait_until(lambda: store.events("run-r", kind_prefix="sidecar.stopping"), 20, "the stop stored")
            second.sidecar.emit("train.nonfinite", {"state": "onset", "step": 7})
            wait_until(lambda: store.events("run-r", kind_prefix="train.nonfinite"), 20,
                       "the later NaN stored")
            assert t.is_alive() and not result
            second.sidecar.emit("job.exited", {"code": 1})
            second.close()
            t.join(30)
            assert result == [0]
        finally:
            w.stop.set()
            t.join(15)
