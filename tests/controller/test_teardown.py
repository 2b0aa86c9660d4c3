"""`rgt teardown`: the plan's facts, the verified-pull gate and its reasons, the typed yes, and a
profile command that runs once with only its named credential.

The box is the test sshd (its files are this machine's, so the run dir is made here directly);
PULL_VERIFIED.json files are written by hand in `rgt verify`'s schema.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import pytest
from click.testing import CliRunner, Result

from controller.cli.base import RgtGroup
from controller.cli.pull import teardown_command
from controller.runs import life
from controller.store.db import Store
from controller.teardown import gate as teardown
from onbox.custody import manifest
from onbox.custody.pullmanifest import build_manifest
from protocol import Event
from tests.sshbox import SshBox, sshbox

__all__ = ["sshbox"]

RUN = "run-a"
ONBOX = shlex.join([sys.executable, "-m", "onbox.cli"])
RECORDER = """\
import json, sys
raw = open("/proc/self/environ", "rb").read().decode()
env = dict(item.split("=", 1) for item in raw.split("\\0") if "=" in item)
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"argv": sys.argv[2:], "env": env}) + "\\n")
print("destroyed instance", sys.argv[3])
"""


def profile_text(command: str) -> str:
    return f'''name = "recorder"
kind = "ssh-rental"
meter_stop_action = "stop"

[surface]
meter_stop = "stop in the console stops the meter."
danger_clocks = ["A stopped box is deleted after 3 days."]

[actions.stop]
stops_meter = true
deletes = "nothing"
still_bills = "the disk"
reversible = true
console = ["Open the console.", "Click stop."]
verified = "2026-06"
source = "test facts"

[actions.destroy]
stops_meter = true
deletes = "the box and its disks"
reversible = false
command = {json.dumps(command)}
credentials_env = ["FAKE_API_KEY"]
verified = "2020-01"
'''


class Rig:
    def __init__(self, tmp: Path, box: SshBox) -> None:
        self.tmp = tmp
        self.box = box
        self.record = tmp / "recorded.jsonl"
        self.run_dir = box.home / "runs" / "proj" / "active" / RUN
        self.pulled = tmp / "pulled"

    def store(self) -> Store:
        return Store.open()

    def checkpoint(self, step: int, data: Optional[bytes] = None, record: bool = True) -> str:
        rel = f"checkpoints/step{step:06d}.bin"
        path = self.run_dir / rel
        payload = data if data is not None else os.urandom(1000 + step)
        path.write_bytes(payload)
        if record:
            st = path.stat()
            digest = hashlib.sha256(payload).hexdigest()
            manifest.append(self.run_dir, manifest.Record(rel, st.st_size, digest, st.st_mtime_ns, st.st_ino,
                                                          step, "other", time.time()))
        return rel

    def fake_pull(self, ok: bool = True, bound: bool = True) -> Dict[str, Any]:
        """A pulled dir as `rgt pull` + `rgt verify` leave it, and the pull.done event."""
        doc = build_manifest(self.run_dir)
        shutil.rmtree(self.pulled, ignore_errors=True)
        for f in doc["files"]:
            (self.pulled / f["path"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.run_dir / f["path"], self.pulled / f["path"])
        (self.pulled / "rgt" / "PULL_MANIFEST.json").write_text(json.dumps(doc, indent=1))
        report = {"schema": "rgt.pull_verified", "version": 1, "ok": ok, "run_id": RUN,
                  "manifest_sha256": doc["sha256"] if bound else "0" * 64,
                  "verified_at": "2026-11-30T00:00:00Z",
                  "proofs": {}, "files": [{"path": f["path"], "size": f["size"], "sha256": f["sha256"],
                                           "identity": "ok"} for f in doc["files"]]}
        (self.pulled / "rgt" / "PULL_VERIFIED.json").write_text(json.dumps(report))
        with self.store() as s:
            s.add_local_event(RUN, "pull.done", "info",
                              {"dest": str(self.pulled), "manifest_sha256": doc["sha256"]})
        return doc

    def recorded(self) -> List[Dict[str, Any]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]


@pytest.fixture
def rig(tmp_path: Path, sshbox: SshBox, monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    monkeypatch.setenv("RGT_HOME", str(tmp_path / "rgt-home"))
    monkeypatch.setenv("RGT_SSH_CONFIG", str(sshbox.config_file))
    profiles_dir = tmp_path / "profiles"
    profiles_dir.mkdir()
    monkeypatch.setenv("RGT_PROFILES_DIR", str(profiles_dir))
    r = Rig(tmp_path, sshbox)
    script = tmp_path / "recorder.py"
    script.write_text(RECORDER)
    command = shlex.join([sys.executable, str(script), str(r.record)]) + \
        " --instance {instance_id} --run {run_id} --host {host}"
    (profiles_dir / "recorder.toml").write_text(profile_text(command))
    (r.run_dir / "rgt").mkdir(parents=True)
    (r.run_dir / "checkpoints").mkdir()
    (r.run_dir / "run.json").write_text(json.dumps({"id": RUN}))
    r.checkpoint(100)
    r.checkpoint(200)
    with r.store() as s:
        s.add_host("box", ssh=sshbox.alias, profile="recorder", onbox=ONBOX)
        s.upsert_run(RUN, host="", target="box", run_dir=str(r.run_dir))
        s.apply(RUN, [job_event(1, "job.started"), job_event(2, "job.exited", code=0, final_ok=True)], 2)
    yield r


def job_event(seq: int, kind: str, run: str = RUN, **data: Any) -> Event:
    return Event(run=run, host="box", seq=seq, ts=time.time() - 100 + seq, kind=kind, sev="info", data=data)


def rgt(*args: str, input: Optional[str] = None) -> Result:
    group = RgtGroup("rgt")
    group.add_command(teardown_command)
    return CliRunner().invoke(group, list(args), input=input)


def plan(today: datetime.date = datetime.date(2026, 12, 1)) -> teardown.Plan:
    with Store.open() as s:
        return teardown.plan(s, RUN, today=today)


# ---- the plan --------------------------------------------------------------------------------


def test_the_plan_states_each_actions_facts_and_warns_when_a_stamp_is_older_than_six_months(rig: Rig) -> None:
    p = plan(datetime.date(2026, 12, 1))
    stop, destroy = p.action("stop"), p.action("destroy")
    facts = (stop.stops_meter, stop.deletes, stop.still_bills, stop.reversible)
    assert facts == (True, "nothing", "the disk", True)
    assert stop.meter_stop and not destroy.meter_stop
    assert stop.age_months == 6 and stop.warning is None  # six months is not older than six
    assert destroy.warning and "2020-01" in destroy.warning and "provider's current page" in destroy.warning
    assert p.danger_clocks == ["A stopped box is deleted after 3 days."]
    assert plan(datetime.date(2027, 1, 1)).action("stop").warning  # seven months: stale
    assert p.gate.code == "not_verified" and not p.gate.open

    out = rgt("teardown", RUN, "--plan")
    assert out.exit_code == 0, out.output
    for needle in ("gate: CLOSED: not verified", "danger clock: A stopped box is deleted after 3 days.",
                   "deletes: the box and its disks", "still bills: the disk", "verified 2020-01",
                   "WARNING: these facts were verified 2020-01", "1. Open the console.",
                   "now: REFUSED (refused while the gate is closed: not verified",
                   "now: allowed (reversible and deletes nothing"):
        assert needle in out.stdout, (needle, out.stdout)
    as_json = json.loads(rgt("teardown", RUN, "--plan", "--json").stdout)
    assert as_json["gate"]["open"] is False and [a["name"] for a in as_json["actions"]] == ["stop", "destroy"]
    with Store.open() as s:
        assert s.local_events(RUN, kind_prefix="teardown.planned")[-1].data["gate"] == "closed"


# ---- the gate --------------------------------------------------------------------------------


def test_a_covering_verified_pull_opens_the_gate_and_a_later_checkpoint_closes_it(rig: Rig) -> None:
    rig.fake_pull()
    gate = plan().gate
    assert gate.open and gate.code == "open" and gate.checkpoints == 2, gate
    assert plan().action("destroy").allowed

    new = rig.checkpoint(300)
    gate = plan().gate
    assert not gate.open and gate.code == "new_checkpoint" and new in gate.reason, gate
    out = rgt("teardown", RUN, "--plan")
    assert f"gate: CLOSED: new checkpoint {new}" in out.stdout

    rig.fake_pull()  # pulled and verified again: open again
    assert plan().gate.open
    rig.checkpoint(300, data=b"rewritten")  # same path, new bytes, a newer record
    gate = plan().gate
    assert gate.code == "changed_checkpoint" and new in gate.reason, gate


def test_an_unreachable_box_keeps_the_gate_closed(rig: Rig) -> None:
    rig.fake_pull()
    assert plan().gate.open
    rig.box.stop()
    try:
        gate = plan().gate
    finally:
        rig.box.start()
    assert not gate.open and gate.code == "box_unreachable" and "unreachable" in gate.reason, gate


def view(checkpoints: Dict[str, Dict[str, Any]], **extra: Any) -> Dict[str, Any]:
    return {"checkpoints": checkpoints, "unrecorded": [], "missing": [], "partials": [], **extra}


def test_every_closed_gate_names_its_reason(rig: Rig) -> None:
    doc = rig.fake_pull()
    ck = {f["path"]: {"sha256": f["sha256"], "size": f["size"]}
          for f in doc["files"] if f["kind"] == "checkpoint"}
    first = sorted(ck)[0]

    def judge(v: Any, where: Optional[Path] = rig.pulled) -> teardown.Gate:
        def fn() -> Dict[str, Any]:
            if isinstance(v, Exception):
                raise v
            return dict(v)
        return teardown.judge(RUN, where, fn)

    assert judge(view(ck)).open
    assert judge(view(ck), None).code == "not_verified"
    assert judge(view(ck), rig.tmp).code == "not_verified"  # a dir without PULL_VERIFIED.json
    assert judge(teardown.TeardownError("box: unreachable: Connection refused")).code == "box_unreachable"
    assert judge({"what": "not a gate view"}).code == "box_unreachable"
    assert judge(view({**ck, "checkpoints/x.bin": {"sha256": "a" * 64}})).code == "new_checkpoint"
    assert judge(view({**ck, first: {"sha256": "b" * 64}})).code == "changed_checkpoint"
    gone = judge(view({**ck, "checkpoints/old.bin": {"sha256": "c" * 64}}, missing=["checkpoints/old.bin"]))
    assert gone.code == "missing_checkpoint" and "checkpoints/old.bin" in gone.reason
    unrec = judge(view(ck, unrecorded=[{"path": "checkpoints/late.bin", "size": 5, "reason": "no_record"}]))
    assert unrec.code == "unrecorded_checkpoint" and "checkpoints/late.bin" in unrec.reason
    part = judge(view(ck, partials=["checkpoints/step000300.bin.tmp"]))
    assert part.code == "partial_checkpoint" and "step000300.bin.tmp" in part.reason
    (rig.pulled / first).unlink()  # the pulled copy is gone since it was verified
    assert judge(view(ck)).code == "local_copy_changed"

    rig.fake_pull(ok=False)
    assert judge(view(ck)).code == "verify_failed"
    rig.fake_pull(bound=False)
    assert judge(view(ck)).code == "not_bound"


def test_the_gate_stays_closed_while_the_job_runs_and_says_to_stop_it_first(rig: Rig) -> None:
    rig.fake_pull()
    assert plan().gate.open
    with Store.open() as s:   # relaunched in place: a new attempt, with no exit stored yet
        s.apply(RUN, [job_event(3, "job.started")], 3)
    gate = plan().gate
    assert not gate.open and gate.code == "job_running", gate
    assert f"stop the job first: `rgt stop {RUN}`" in gate.reason
    out = rgt("teardown", RUN, "--plan")
    assert "gate: CLOSED: the job has not ended" in out.stdout and f"rgt stop {RUN}" in out.stdout
    with Store.open() as s:
        s.apply(RUN, [job_event(4, "job.exited", code=143, signal=None)], 4)
    assert plan().gate.open   # ended (however): the pull covers its checkpoints again
    odd = "run-a;echo x"   # a run id a shell would split is quoted in the plan
    running = life.Life(life.RUNNING, "running", "no job exit stored")
    assert "`rgt stop 'run-a;echo x'`" in teardown.judge(odd, None, lambda: {}, running).reason


def test_the_runs_own_launch_profile_comes_before_the_hosts(rig: Rig, tmp_path: Path) -> None:
    other = (tmp_path / "profiles" / "recorder.toml").read_text().replace('name = "recorder"',
                                                                          'name = "other"')
    other = other.replace("[actions.destroy]", "[actions.release]")
    (tmp_path / "profiles" / "other.toml").write_text(other)
    assert [a.name for a in plan().actions] == ["stop", "destroy"]   # the host's profile
    with Store.open() as s:
        s.record_launch(RUN, {"command": ["python", "t.py"], "profile": "other", "host": "box"})
    p = plan()
    assert p.profile == "other" and [a.name for a in p.actions] == ["stop", "release"]


# ---- running an action -----------------------------------------------------------------------


def test_a_destructive_action_is_refused_while_the_gate_is_closed(rig: Rig,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_API_KEY", "k")
    out = rgt("teardown", RUN, "--action", "destroy", "--yes", RUN, "--instance-id", "i-1")
    assert out.exit_code == 1 and "refused while the gate is closed: not verified" in out.stderr, out.stderr
    rig.fake_pull()
    rig.checkpoint(300)  # written after the pull
    out = rgt("teardown", RUN, "--action", "destroy", "--yes", RUN, "--instance-id", "i-1")
    assert out.exit_code == 1 and "new checkpoint checkpoints/step000300.bin" in out.stderr, out.stderr
    assert rig.recorded() == []


@pytest.mark.parametrize("args, typed", [(["--yes", "run-b"], None), (["--yes", "run"], None),
                                         ([], "run-b\n"), ([], "")])
def test_a_wrong_or_missing_typed_run_id_refuses(rig: Rig, monkeypatch: pytest.MonkeyPatch,
                                                 args: Sequence[str], typed: Optional[str]) -> None:
    monkeypatch.setenv("FAKE_API_KEY", "k")
    rig.fake_pull()
    out = rgt("teardown", RUN, "--action", "destroy", "--instance-id", "i-1", *args, input=typed)
    assert out.exit_code == 1 and "does not match" in out.stderr, out.stderr
    assert rig.recorded() == []


def test_with_the_gate_open_the_command_runs_once_with_only_its_named_credential(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    rig.fake_pull()
    monkeypatch.setenv("OTHER_SECRET", "must-not-leak")
    out = rgt("teardown", RUN, "--action", "destroy", "--yes", RUN, "--instance-id", "i-123")
    assert out.exit_code == 1 and "FAKE_API_KEY is not set" in out.stderr and rig.recorded() == []
    out = rgt("teardown", RUN, "--action", "destroy", "--yes", RUN)
    assert out.exit_code == 1 and "--instance-id" in out.stderr and rig.recorded() == []

    monkeypatch.setenv("FAKE_API_KEY", "secret-1")
    out = rgt("teardown", RUN, "--action", "destroy", "--instance-id", "i-123", input=f"{RUN}\n")
    assert out.exit_code == 0, out.stderr
    assert "destroyed instance i-123" in out.stdout
    runs = rig.recorded()
    assert len(runs) == 1
    assert runs[0]["argv"] == ["--instance", "i-123", "--run", RUN, "--host", "box"]
    assert set(runs[0]["env"]) == {"PATH", "HOME", "FAKE_API_KEY"}
    assert runs[0]["env"]["FAKE_API_KEY"] == "secret-1"
    with Store.open() as s:
        ran = s.local_events(RUN, kind_prefix="teardown.ran")
    assert len(ran) == 1
    assert ran[0].data == {"action": "destroy", "mode": "command", "ok": True, "exit_code": 0, "gate": "open"}
    assert "secret-1" not in json.dumps(ran[0].data)


def test_a_reversible_stop_that_deletes_nothing_may_run_with_the_gate_closed(rig: Rig) -> None:
    assert not plan().gate.open
    out = rgt("teardown", RUN, "--action", "stop", "--yes", "run-b")
    assert out.exit_code == 1 and "does not match" in out.stderr  # still needs the typed yes
    out = rgt("teardown", RUN, "--action", "stop", "--yes", RUN, "--json")
    assert out.exit_code == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["mode"] == "console" and result["console"] == ["Open the console.", "Click stop."]
    assert result["ok"] is None and result["gate"]["open"] is False
    human = rgt("teardown", RUN, "--action", "stop", "--yes", RUN)
    assert "1. Open the console." in human.stdout and "2. Click stop." in human.stdout
    assert rig.recorded() == []


def test_plan_and_action_are_one_or_the_other(rig: Rig) -> None:
    assert rgt("teardown", RUN).exit_code == 2
    assert rgt("teardown", RUN, "--plan", "--action", "stop").exit_code == 2
    out = rgt("teardown", RUN, "--action", "reboot", "--yes", RUN)
    assert out.exit_code == 1 and "no action 'reboot'" in out.stderr and "stop, destroy" in out.stderr


# ---- the local copy is re-proven before a destructive action ----------------------------------


def test_a_same_size_overwrite_of_a_verified_copy_closes_the_gate(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from controller.verify import units as verify_units
    from controller.verify.identity import hash_file
    from controller.verify.prove import verify
    from tests.controller.verifykit import make_run

    monkeypatch.setattr(verify_units, "newest_units", lambda steps: [])  # no seam child needed here
    pulled = make_run(tmp_path)
    report = verify(pulled)
    assert report.ok, report.failures()
    ck = {f.path: {"sha256": f.sha256, "size": f.size} for f in report.files if f.kind == "checkpoint"}
    path = sorted(ck)[-1]
    full = pulled / path
    data = full.read_bytes()
    hashed: List[Path] = []

    def counting(p: Path) -> Any:
        hashed.append(p)
        return hash_file(p)
    monkeypatch.setattr(teardown, "hash_file", counting, raising=False)

    def judge() -> teardown.Gate:
        return teardown.judge("run-abc", pulled, lambda: view(ck))

    assert judge().open
    full.write_bytes(bytes(b ^ 0xFF for b in data))  # other bytes, same size
    assert full.stat().st_size == ck[path]["size"]
    gate = judge()
    assert not gate.open and gate.code == "local_copy_changed", gate
    assert gate.reason.startswith(f"the pulled copy of {path} in {pulled} changed since it was verified: "
                                  "its bytes changed since they were verified (sha256 now "), gate.reason
    assert gate.problems == [gate.reason]

    full.write_bytes(data)  # the verified bytes again: a changed stat means hashing again, and it matches
    hashed.clear()
    assert judge().open and hashed == [full]
    assert verify(pulled).ok  # pinned afresh: a gate over unchanged copies hashes nothing
    hashed.clear()
    assert judge().open and hashed == []
