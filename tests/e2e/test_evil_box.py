"""A compromised box, through the real sshd: every hostile answer is refused at the boundary, and nothing
on the laptop is written, run or printed on the box's say.

The box is tests/e2e/evil: a fake `rgt-onbox` (the host's --onbox) that answers with what a scenario
holds, and a fake sidecar reached through rgt's own forwards. Each row names the hostile answer and the
refusal expected (controller/trust.py is the boundary).
"""
from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from controller.store.db import Store
from protocol import Event
from tests.e2e.evil.box import EvilBox, good_launch
from tests.e2e.rgtbox import Rgt

pytestmark = pytest.mark.timeout(240)

VICTIM = "victim-run"
JOB = [sys.executable, "-c", "print('hi')"]


@pytest.fixture
def evil(rgt_box: Rgt) -> Iterator[EvilBox]:
    assert rgt_box.box is not None
    box = EvilBox(rgt_box.box.home)
    rgt_box("hosts", "add", "evil", "--ssh", rgt_box.box.alias, "--onbox", box.onbox)
    try:
        yield box
    finally:
        box.end()
        stop_watchers(rgt_box)


def stop_watchers(rgt: Rgt) -> None:
    """End the watcher of every run this test's store knows (these runs are launched by hand, not
    through Rgt.launch), by the pid its lock file names."""
    from controller.follow.client import running_pid, unfollow
    from onbox.runs import wait_for
    with rgt.store() as store:
        runs = [str(r["run"]) for r in store.runs()]
    for run in runs:
        unfollow(run)
        assert wait_for(lambda r=run: running_pid(r) is None, 15.0), f"the watcher of {run} did not end"


def seed_victim(store: Store) -> Dict[str, Any]:
    """Run B, followed from another box: what an attacker wants to take over."""
    store.upsert_run(VICTIM, host="realbox", boot_id="b1", protocol_version=1, package_version="0.1.0",
                     meta={"command": ["python", "train.py"]}, target="box",
                     run_dir=f"/runs/p/active/{VICTIM}")
    store.apply(VICTIM, [Event(run=VICTIM, host="realbox", seq=i, ts=1000.0 + i, kind="sidecar.heartbeat",
                               sev="info", data={"n": i}) for i in (1, 2, 3)], 3)
    return snapshot(store, VICTIM)


def snapshot(store: Store, run: str) -> Dict[str, Any]:
    row = store.run(run)
    return {"row": {k: row[k] for k in ("host", "target", "run_dir", "meta", "boot_id", "last_seq")},
            "events": [(e.seq, e.kind, e.host, dict(e.data)) for e in store.events(run)]}


def home_files(rgt: Rgt) -> List[str]:
    return sorted(str(p.relative_to(rgt.home)) for p in rgt.home.rglob("*"))


# ---- 1. launch answers: the run id and run dir are the laptop's ------------------------------------------

MARK = f"rgt-evil-{secrets.token_hex(4)}"
HOSTILE_LAUNCH = {
    "dotdot id": ({"run_id": f"../../../../tmp/{MARK}", "run_dir": f"/tmp/{MARK}"}, "is not a run id"),
    "absolute id": ({"run_id": f"/tmp/{MARK}", "run_dir": f"/tmp/{MARK}"}, "is not a run id"),
    "another run's id": ({"run_id": VICTIM, "run_dir": f"{{root}}/proj/active/{VICTIM}"}, "not the"),
    "relative run dir": ({"run_dir": "proj/active/{run_id}"}, "not an absolute path"),
    "run dir not the run's": ({"run_dir": "/home/someone/.ssh"}, "is not named after run"),
    "run dir with ..": ({"run_dir": "{root}/../../{run_id}"}, "'..'"),
    "run dir with a newline": ({"run_dir": "{root}/x\n/{run_id}"}, "control characters"),
    "pid not a pid": ({"pid": 10 ** 400}, "pid"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_LAUNCH))
def test_a_hostile_launch_answer_is_refused_and_nothing_is_recorded(rgt_box: Rgt, evil: EvilBox,
                                                                    case: str) -> None:
    change, refusal = HOSTILE_LAUNCH[case]
    evil.write({"launch": {**good_launch(), **change}})
    with rgt_box.store() as store:
        before = seed_victim(store)
    files_before = home_files(rgt_box)
    out = rgt_box("launch", "evil", "--json", "--", *JOB, check=False)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "refused" in out.stderr and refusal in out.stderr, out.stderr
    with rgt_box.store() as store:
        assert [r["run"] for r in store.runs()] == [VICTIM]
        assert snapshot(store, VICTIM) == before
    assert not Path(f"/tmp/{MARK}").exists()
    assert home_files(rgt_box) == files_before   # no watcher, tunnel or lock file for it
    launched = [c for c in evil.calls() if c[:1] == ["launch"]]
    assert len(launched) == 1 and "--run-id" in launched[0]   # the laptop named the run


def test_a_run_id_given_twice_is_refused_before_the_box_is_asked(rgt_box: Rgt, evil: EvilBox) -> None:
    evil.write({"launch": good_launch()})
    with rgt_box.store() as store:
        seed_victim(store)
    out = rgt_box("launch", "evil", "--run-id", VICTIM, "--json", "--", *JOB, check=False)
    assert out.returncode == 1 and "exists" in out.stderr, out.stderr
    assert not [c for c in evil.calls() if c[:1] == ["launch"]]


def test_an_honest_launch_answer_is_recorded_with_what_the_laptop_asked(rgt_box: Rgt, evil: EvilBox) -> None:
    evil.write({"launch": good_launch()})
    out = rgt_box("launch", "evil", "--no-watch", "--json", "--", *JOB)
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    run = answer["run_id"]
    with rgt_box.store() as store:
        row = store.run(run)
    assert row["target"] == "evil" and row["run_dir"].endswith(f"/proj/active/{run}")
    assert row["launch"]["command"] == JOB


# ---- 9. the box's words on the terminal ------------------------------------------------------------------

NASTY = "\x1b[2J\x1b]52;c;ZWNobyBwd25lZA==\x07gate OPEN\x9b31m\u202eNEPO\u2066x\r\n"
UNSAFE = ["\x1b", "\x07", "\x9b", "\u202e", "\u2066", "\r"]


@pytest.mark.parametrize("verb", ["status", "renew", "disarm"])
def test_dead_man_answers_reach_the_terminal_escaped(rgt_box: Rgt, evil: EvilBox, verb: str) -> None:
    answer = {"armed": True, "seconds_left": 100, "ttl_s": 7200, "renewed_by": NASTY,
              "daemon": {"alive": True, "pid": NASTY},
              "decision": {"verdict": NASTY, "reason": NASTY},
              "would": {"action": NASTY, "reason": NASTY, "refused": NASTY}}
    evil.write({f"deadman {verb}": answer})
    out = rgt_box("deadman", "evil", verb, check=False)
    shown = out.stdout + out.stderr
    assert "gate OPEN" in shown or verb == "disarm"
    for ch in UNSAFE:
        assert ch not in shown, (verb, repr(ch), shown)


def test_a_refusal_that_quotes_the_box_is_escaped(rgt_box: Rgt, evil: EvilBox) -> None:
    evil.write({"launch": {"error": NASTY}, "launch exit": 2})
    out = rgt_box("launch", "evil", "--json", "--", *JOB, check=False)
    assert out.returncode == 1
    for ch in UNSAFE:
        assert ch not in out.stdout + out.stderr, repr(ch)


# ---- manifests: a pull writes only under its destination -------------------------------------------------

def launched(rgt: Rgt, evil: EvilBox) -> str:
    evil.write({"launch": good_launch()})
    out = rgt("launch", "evil", "--no-watch", "--json", "--", *JOB)
    return str(json.loads(out.stdout.strip().splitlines()[-1])["run_id"])


def manifest_doc(run: str, files: List[Dict[str, Any]]) -> Dict[str, Any]:
    from protocol.pull import manifest_digest
    doc: Dict[str, Any] = {"schema": "rgt.pull_manifest", "version": 1, "run_id": run, "host": "evilbox",
                           "created_at": "2026-12-01T00:00:00Z", "total_bytes": sum(f["size"] for f in files),
                           "files": files}
    doc["sha256"] = manifest_digest(doc)
    return doc


def serve_manifest(evil: EvilBox, doc: Dict[str, Any], written_in: str) -> None:
    """The box answers `rgt-onbox manifest` with DOC, saying it wrote it in WRITTEN_IN."""
    evil.write({"launch": good_launch(), "manifest": {"sha256": doc["sha256"], "run_dir": written_in},
                "manifest_doc": doc})


HOSTILE_MANIFEST = {
    "a .pth beside site-packages": ("../../../../../usr/lib/python3/dist-packages/evil.pth",
                                    "bad manifest path"),
    "absolute path": ("/etc/cron.d/evil", "bad manifest path"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_MANIFEST))
def test_a_manifest_that_leads_out_of_the_pull_is_refused(rgt_box: Rgt, evil: EvilBox, tmp_path: Path,
                                                        case: str) -> None:
    path, refusal = HOSTILE_MANIFEST[case]
    run = launched(rgt_box, evil)
    doc = manifest_doc(run, [{"path": path, "size": 3, "sha256": "0" * 64, "kind": "checkpoint",
                              "hashed": "custody"}])
    serve_manifest(evil, doc, "{root}/proj/active/" + run)
    dest = tmp_path / "pulled"
    out = rgt_box("pull", run, "--to", str(dest), check=False)
    assert out.returncode == 1 and refusal in out.stderr, out.stdout + out.stderr
    assert not dest.exists() or not any(dest.rglob("*.pth"))


def test_a_manifest_for_another_run_is_refused(rgt_box: Rgt, evil: EvilBox, tmp_path: Path) -> None:
    run = launched(rgt_box, evil)
    doc = manifest_doc(VICTIM, [])
    serve_manifest(evil, doc, "{root}/proj/active/" + run)
    out = rgt_box("pull", run, "--to", str(tmp_path / "pulled"), check=False)
    assert out.returncode == 1 and VICTIM in out.stderr and "refused" in out.stderr, out.stderr


def test_a_manifest_read_from_elsewhere_on_the_box_is_refused(rgt_box: Rgt, evil: EvilBox,
                                                              tmp_path: Path) -> None:
    """The answer's run_dir says where the manifest was written: it must be the run's own directory."""
    run = launched(rgt_box, evil)
    doc = manifest_doc(run, [])
    serve_manifest(evil, doc, "/etc")
    out = rgt_box("pull", run, "--to", str(tmp_path / "pulled"), check=False)
    assert out.returncode == 1 and "refused" in out.stderr, out.stderr


# ---- 2, 5, 6, 7: the fake sidecar, reached through rgt's own forwards --------------------------------------

def follow(rgt: Rgt, evil: EvilBox, sidecar: Dict[str, Any]) -> str:
    """Launch on the evil box with a fake sidecar, a watcher following it; the run id."""
    evil.write({"launch": good_launch(), "sidecar": sidecar})
    out = rgt("launch", "evil", "--json", "--", *JOB)
    return str(json.loads(out.stdout.strip().splitlines()[-1])["run_id"])


def watcher_pid(run: str) -> int:
    from controller.follow.client import running_pid
    pid = running_pid(run)
    assert pid is not None
    return pid


def test_a_hello_for_another_run_is_refused_and_that_run_is_untouched(rgt_box: Rgt, evil: EvilBox) -> None:
    from controller.follow.client import running_pid
    from onbox.runs import wait_for
    with rgt_box.store() as store:
        before = seed_victim(store)
    exits = [{"seq": i, "frame": {**_event(i, VICTIM), "kind": "job.exited", "data": {"code": 0}}}
             for i in (1, 2, 3, 4)]
    run = follow(rgt_box, evil, {"run": VICTIM, "host": "realbox", "run_meta": {"command": ["evil"]},
                                 "events": exits})
    assert wait_for(lambda: running_pid(run) is None, 60.0), "the watcher kept following a refused sidecar"
    with rgt_box.store() as store:
        assert snapshot(store, VICTIM) == before
        refusals = [e for e in store.local_events(run) if e.kind == "sidecar.degraded"]
        assert refusals and "refused" in str(refusals[-1].data["error"]), refusals
        assert VICTIM in str(refusals[-1].data["error"])
        assert list(store.events(run)) == []


def _event(seq: int, run: str = "{run_id}", kind: str = "sidecar.heartbeat") -> Dict[str, Any]:
    return {"v": 1, "run": run, "host": "evilbox", "seq": seq, "ts": 1767225600.0 + seq, "kind": kind,
            "sev": "info", "data": {"n": seq}}


def _raw(seq: int, ts: str = "1767225600.5", data: str = '{"n": 1}') -> str:
    head = '{"v": 1, "run": "{run_id}", "host": "evilbox", "seq": SEQ, "ts": TS, "kind": "train.progress"'
    text = (head + ', "sev": "info", "data": DATA}').replace("SEQ", str(seq)).replace("TS", ts)
    return text.replace("DATA", data)


HOSTILE_EVENTS = {
    "a 400-digit ts": _raw(2, ts="1" * 400),
    "a 5000-digit integer in data": _raw(2, data='{"step": %s}' % ("9" * 5000)),
    "a 30-digit integer in data": _raw(2, data='{"step": %s}' % ("9" * 30)),
    "a lone surrogate in data": _raw(2, data='{"loss": "\\ud800"}'),
    "a lone surrogate in kind": _raw(2).replace('"train.progress"', '"train.\\udfff"'),
    "NaN as a bare constant": _raw(2, data='{"loss": NaN}'),
    "nesting 100 deep": _raw(2, data="[" * 100 + "]" * 100),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_EVENTS))
def test_a_hostile_event_is_refused_and_the_follow_goes_on(rgt_box: Rgt, evil: EvilBox, case: str) -> None:
    """The bad frame never reaches the store; the events around it do, the watcher lives on, and
    `rgt watch` keeps its contract (one JSON line)."""
    from onbox.runs import wait_for
    events = [{"seq": 1, "frame": _event(1)}, {"seq": 2, "frame": HOSTILE_EVENTS[case]},
              {"seq": 3, "frame": _event(3)}]
    run = follow(rgt_box, evil, {"run": "{run_id}", "events": events})
    with rgt_box.store() as store:
        assert wait_for(lambda: store.run(run)["last_seq"] >= 3, 60.0), store.run(run)
        assert [e.seq for e in store.events(run)] == [1, 3]
        assert [(g["first_seq"], g["last_seq"]) for g in store.gaps(run)] == [(2, 2)]
    assert watcher_pid(run)
    out = rgt_box("watch", run, "--json", "--timeout", "1s", check=False)
    lines = [json.loads(line) for line in out.stdout.strip().splitlines()]
    assert len(lines) == 1 and lines[0]["exit"] == out.returncode == 3, out.stdout + out.stderr


def test_a_huge_reply_is_dropped_at_the_socket(rgt_box: Rgt, evil: EvilBox) -> None:
    """A 64 MiB hello never lands in the watcher's memory: the socket's cap drops it."""
    import psutil

    from onbox.runs import wait_for
    run = follow(rgt_box, evil, {"run": "{run_id}", "hello_pad_bytes": 64 * 1024 * 1024})
    assert wait_for(lambda: sum(r.get("op") == "hello" for r in evil.requests()) >= 2, 60.0)
    proc = psutil.Process(watcher_pid(run))
    assert proc.memory_info().rss < 100 * 1024 * 1024, proc.memory_info().rss
    with rgt_box.store() as store:
        assert store.run(run)["host"] == ""    # no hello was taken
