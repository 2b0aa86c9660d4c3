"""controller.runs.status and `rgt status` / `rgt policy`: the summary of a run, against a real store file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest
from click.testing import CliRunner, Result

from controller.cli import watch as cli_watch
from controller.runs import status
from controller.store.db import Store
from protocol import Event

RUN = "train-7f3a"
REF = "train-base"
NOW = 1_700_000_000.0
HOSTILE = "/data\x1b[2J"
SHA = "3fa2b1c4d5e6" + "0" * 52


def ev(seq: int, kind: str, sev: str = "info", run: str = RUN, age_s: float = 0.0, **data: Any) -> Event:
    return Event(run=run, host="box1", seq=seq, ts=NOW - age_s, kind=kind, sev=sev, data=data)


def progress(seq: int, step: Any, loss: Any, age_s: float, run: str = RUN, **extra: Any) -> Event:
    return ev(seq, "train.progress", run=run, age_s=age_s, step=step, scalars={"loss": loss, "acc": 0.5},
              **extra)


EVENTS = [
    ev(1, "sidecar.started", age_s=900),
    ev(2, "job.started", age_s=890, pid=42),
    progress(3, 100, 1.2, 800),
    ev(4, "gpu.sample", age_s=30, gpu=0, utilization_gpu_pct={"min": 90, "mean": 95.5, "max": 99},
       memory_used_bytes={"min": 1, "mean": 2, "max": 70 << 30}, memory_total_bytes=80 << 30,
       temperature_c={"min": 60, "mean": 70, "max": 78}, power_mw={"min": 1, "mean": 400_000, "max": 2},
       clock_event_reason_names=[]),
    ev(5, "disk.sample", age_s=60, filesystems=[{"path": HOSTILE, "avail_bytes": 12 << 30,
                                                 "total_bytes": 100 << 30, "used_pct": 88.0,
                                                 "inodes_used_pct": 3.0, "eta_to_full_s": None}]),
    ev(6, "ckpt.saved", age_s=120, path="checkpoints/step_350.pt", size=5 << 20, sha256=SHA, step=350),
    ev(7, "gpu.throttle", "warn", age_s=100, gpu=0, state="onset", reasons=["hw_slowdown"]),
    ev(8, "disk.low", "warn", age_s=90, path="/data", resource="bytes", state="onset", used_pct=96.0),
    ev(9, "disk.ok", age_s=50, path="/data", resource="bytes", state="cleared"),
    ev(10, "gpu.xid", "warn", age_s=40, gpu=0, code=13, xid_name="Graphics Engine Exception"),
    progress(11, 400, 0.8, 20, steps_per_s=2.0, data_age_s=1.5),
    ev(12, "heartbeat", age_s=10),
]


@pytest.fixture
def store(home: Path) -> Iterator[Store]:
    with Store.open() as s:
        s.upsert_run(REF, host="box0")
        s.apply(REF, [progress(i, i * 100, 2.0 - i * 0.1, 5000 - i, run=REF) for i in range(1, 8)], 7)
        s.upsert_run(RUN, host="box1", meta={"expected_steps": 1000})
        s.apply(RUN, EVENTS, 12)
        s.add_local_event(RUN, "link.lost", "warn", {"reason": "timeout"}, ts=NOW - 300)
        s.add_local_event(RUN, "link.restored", "info", {}, ts=NOW - 200)
        yield s


def test_summary_of_a_running_run(store: Store) -> None:
    s = status.summarize(store, RUN, now=NOW)
    assert s["state"] == "running"
    assert s["step"] == 400 and s["steps_per_s"] == 2.0
    assert s["expected_steps"] == 1000 and s["progress_pct"] == 40.0 and s["eta_s"] == 300.0
    assert s["scalars"]["loss"] == {"value": 0.8, "data_age_s": 21.5}
    assert s["progress_age_s"] == 20.0 and s["box_data_age_s"] == 1.5
    gpu = s["gpus"][0]
    assert gpu["util_pct"] == 95.5 and gpu["memory_used_bytes"] == 70 << 30 and gpu["age_s"] == 30.0
    assert s["gpu_health"]["state"] == "warn"
    assert s["checkpoint"] == {"path": "checkpoints/step_350.pt", "step": 350, "size_bytes": 5 << 20,
                               "sha256_prefix": "3fa2b1c4d5e6", "age_s": 120.0, "durable": False}
    assert s["disk"]["filesystems"][0]["avail_bytes"] == 12 << 30 and s["disk"]["age_s"] == 60.0
    # the throttle is still open; the disk condition was cleared by disk.ok
    opened = [(c["kind"], c["ident"], c["age_s"]) for c in s["open_conditions"]]
    assert opened == [("gpu.throttle", "0", 100.0)]
    assert [p["kind"] for p in s["recent_problems"]] == ["gpu.xid"]
    assert s["link"] == {"state": "up", "since_ts": NOW - 200, "age_s": 200.0}
    assert s["heartbeat_age_s"] == 10.0
    assert s["events"]["stored"] == 12 and s["events"]["warn"] == 4 and s["events"]["local"] == 2
    assert s["gaps"] == [] and s["missing_events"] == 0 and s["ref"] is None
    json.dumps(s, allow_nan=False)


def test_reference_at_the_same_step(store: Store) -> None:
    s = status.summarize(store, RUN, REF, now=NOW)
    ref = s["ref"]
    assert ref["run"] == REF and ref["by"] == "step" and ref["at"] == 400
    loss = ref["metrics"]["loss"]
    assert loss["ref_at"] == 400 and loss["ref_value"] == pytest.approx(1.6)
    assert loss["diff"] == pytest.approx(-0.8) and loss["rel_diff"] == pytest.approx(-0.5)


def test_reference_between_two_logged_steps_is_interpolated_at_the_same_step(store: Store) -> None:
    store.apply(RUN, [progress(13, 450, 0.7, 5)], 13)
    loss = status.summarize(store, RUN, REF, now=NOW)["ref"]["metrics"]["loss"]
    assert loss["ref_at"] == 450 and loss["how"] == "interpolated" and "interpolated" in loss["note"]
    assert loss["ref_value"] == pytest.approx(1.55) and loss["diff"] == pytest.approx(0.7 - 1.55)


def test_reference_by_epoch_when_steps_are_missing(home: Path) -> None:
    with Store.open() as s:
        s.apply(REF, [ev(i, "train.progress", run=REF, epoch=float(i), scalars={"acc": 0.1 * i})
                      for i in range(1, 5)], 4)
        s.apply(RUN, [ev(1, "train.progress", epoch=2.5, scalars={"acc": 0.3})], 1)
        ref = status.summarize(s, RUN, REF, now=NOW)["ref"]
    assert ref["by"] == "epoch" and ref["metrics"]["acc"]["ref_at"] == 2.5
    assert ref["metrics"]["acc"]["diff"] == pytest.approx(0.3 - 0.25)


def test_a_nan_loss_has_no_difference(store: Store) -> None:
    store.apply(RUN, [progress(13, 420, "nan", 5)], 13)
    loss = status.summarize(store, RUN, REF, now=NOW)["ref"]["metrics"]["loss"]
    assert loss["value"] == "nan" and loss["diff"] is None and loss["rel_diff"] is None


@pytest.mark.parametrize("extra, state, reason", [
    ([ev(13, "job.exited", code=0, final_ok=True)], "finished", "finished cleanly"),
    ([ev(13, "job.exited", "warn", code=0, final_ok=False, final_reasons=["loss is NaN"]),
      ev(14, "sidecar.stopping")], "failed (final)", "loss is NaN"),  # the sidecar ends after the job
    ([ev(13, "sidecar.stopping")], "lost contact", "the sidecar stopped and no job exit is stored"),
    ([ev(13, "job.exited", "warn", code=0, final_ok=False, final_reasons=["sync failed"])],
     "failed (final)", "but the run failed: sync failed"),
    ([ev(13, "job.exited", "warn", code=137, signal=9, oom_killed=True)], "failed (oom)", "OOM-killed"),
    ([ev(13, "job.exited", "warn", code=143)], "preempted", "no stop was asked for"),
    ([ev(13, "job.exited", "warn", code=None, signal=15, stop_requested=True)], "stopped by request",
     "stopped by request (rgt stop)"),
    ([ev(13, "job.stalled", "warn", state="onset", verdict="hung", idle_s=700.0, budget_s=300.0)],
     "stalled", "no progress for 700 s"),
    ([ev(13, "job.stalled", "warn", state="onset", verdict="idle"),
      ev(14, "job.progressing", state="cleared")],
     "running", "no job exit stored"),
])
def test_states(store: Store, extra: List[Event], state: str, reason: str) -> None:
    store.apply(RUN, extra, extra[-1].seq)
    s = status.summarize(store, RUN, now=NOW)
    assert s["state"] == state and reason in s["state_reason"]


def test_unknown_without_events_and_link_states(home: Path) -> None:
    with Store.open() as s:
        s.upsert_run(RUN, host="box1")
        summary = status.summarize(s, RUN, now=NOW)
        assert summary["state"] == "launched" and summary["link"]["state"] == "unknown"
        s.apply(RUN, [ev(1, "job.started")], 1)
        s.add_local_event(RUN, "link.lost", "warn", {}, ts=NOW - 60)
        down = status.summarize(s, RUN, now=NOW)
        assert down["link"]["state"] == "down" and "says nothing about the job" in down["state_reason"]
        s.add_local_event(RUN, "link.restored", "info", {}, ts=NOW - 30)
        s.add_local_event(RUN, "sidecar.silent", "warn", {"state": "onset"}, ts=NOW - 10)
        assert status.summarize(s, RUN, now=NOW)["link"]["state"] == "silent"


def test_gaps_and_new_job_attempts(store: Store) -> None:
    store.record_gap(RUN, 20, 24, "not in the sidecar's journal")
    store.apply(RUN, [ev(13, "train.nonfinite", "critical", name="loss", state="onset", value="nan"),
                      ev(14, "job.started", pid=43)], 14)
    s = status.summarize(store, RUN, now=NOW)
    assert s["missing_events"] == 5 and s["gaps"][0]["first_seq"] == 20
    assert all(not c["kind"].startswith("train.") for c in s["open_conditions"])


def test_render_is_one_screen_and_escapes_box_text(store: Store) -> None:
    text = status.render(status.summarize(store, RUN, REF, now=NOW))
    assert "\x1b" not in text
    assert "/data\\x1b[2J" in text
    assert "step 400/1,000 (40.0%), 2 steps/s, ETA 300 s" in text
    assert "sha256 3fa2b1c4d5e6" in text and "vs ref    train-base: loss 1.6 at step 400" in text
    assert len(text.splitlines()) < 25


def test_one_line(store: Store) -> None:
    line = status.one_line(status.summarize(store, RUN, now=NOW))
    assert line == "running, step 400/1,000, loss 0.8  acc 0.5  (22 s old), link up"


# ---- the commands ------------------------------------------------------------------


def invoke(command: Any, args: List[str]) -> Result:
    return CliRunner().invoke(command, args, catch_exceptions=False)


def test_status_command_json_shape(store: Store) -> None:
    result = invoke(cli_watch.status_command, [RUN, "--json", "--ref", REF])
    assert result.exit_code == 0, result.output
    obj = json.loads(result.output)
    for key in ("run", "state", "state_reason", "step", "epoch", "steps_per_s", "eta_s", "scalars",
                "gpus", "gpu_health", "checkpoint", "disk", "open_conditions", "link", "events", "gaps",
                "ref"):
        assert key in obj
    assert obj["ref"]["metrics"]["loss"]["ref_at"] == 400
    assert obj["disk"]["filesystems"][0]["path"] == HOSTILE   # the JSON keeps the raw value


def test_status_command_every_run_newest_first(store: Store) -> None:
    text = invoke(cli_watch.status_command, []).output
    assert text.index(f"run {RUN}") < text.index(f"run {REF}")
    assert "\x1b" not in text
    runs = json.loads(invoke(cli_watch.status_command, ["--json"]).output)["runs"]
    assert [r["run"] for r in runs] == [RUN, REF]


def test_policy_command_changes_and_shows(store: Store) -> None:
    out = invoke(cli_watch.policy_command, ["--default", "--mute", "gpu.*", "--quiet", "23:00-07:00",
                                            "--json"])
    assert out.exit_code == 0, out.output
    shown: Dict[str, Any] = json.loads(out.output)
    assert shown["scope"] == "*" and shown["stored"] == {"mute": ["gpu."], "quiet": ["23:00-07:00"]}
    out = invoke(cli_watch.policy_command, [RUN, "--add", "gpu.xid", "--link-budget", "15m", "--json"])
    shown = json.loads(out.output)
    assert shown["stored"] == {"add": ["gpu.xid"], "link_budget_s": 900.0}
    assert shown["effective"]["mute"] == ["gpu."] and shown["effective"]["add"] == ["gpu.xid"]
    assert store.policy(RUN) == {"add": ["gpu.xid"], "link_budget_s": 900.0}
    off = json.loads(invoke(cli_watch.policy_command, [RUN, "--quiet", "off", "--json"]).output)
    assert off["stored"]["quiet"] == [] and off["effective"]["quiet"] == []   # the default's are off
    assert invoke(cli_watch.policy_command, [RUN, "--reset", "--json"]).exit_code == 0
    assert store.policy(RUN) == {}
    assert "min_sev    warn" in invoke(cli_watch.policy_command, []).output


@pytest.mark.parametrize("args", [["--quiet", "25:00-01:00"], ["--flap-window", "soon"],
                                  [RUN, "--default"], ["--mute", "job.exited"]])
def test_policy_command_usage_errors(store: Store, args: List[str]) -> None:
    result = CliRunner().invoke(cli_watch.policy_command, args)
    assert result.exit_code == 2, result.output


def test_the_box_dead_man_shows_as_its_newest_relayed_record(store: Store) -> None:
    assert status.summarize(store, RUN, now=NOW)["deadman"] is None
    store.apply(RUN, [ev(13, "deadman.armed", age_s=60, ttl_s=7200.0),
                      ev(14, "deadman.expiring", "warn", age_s=30, minutes_left=5),
                      ev(15, "deadman.fired", "critical", age_s=10, action="stop", outcome="done")], 15)
    s = status.summarize(store, RUN, now=NOW)
    assert s["deadman"]["kind"] == "deadman.fired" and s["deadman"]["state"] == "fired: stop (done)"
    assert "deadman   fired: stop (done) (10 s ago" in status.render(s)
