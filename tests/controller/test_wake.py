"""controller.wake.policy: what is material, the policy and its layers, and what a wake says."""
from __future__ import annotations

import json
import time
from typing import Any, Dict

import pytest

from controller import render
from controller.runs import explain
from controller.store.db import LocalEvent
from controller.wake import policy as wake
from controller.wake.policy import Policy, classify, judge
from protocol import Event

RUN = "train-7f3a"
NOW = 1_700_000_000.0


def ev(kind: str, sev: str = "warn", seq: int = 5, ts: float = NOW - 5, **data: Any) -> Event:
    return Event(run=RUN, host="box1", seq=seq, ts=ts, kind=kind, sev=sev, data=data)


def local(kind: str, sev: str = "warn", id: int = 4, **data: Any) -> LocalEvent:
    return LocalEvent(id=id, run=RUN, ts=NOW - 5, kind=kind, sev=sev, data=data)


NAN = dict(state="onset", name="loss", value="nan", step=350, epoch=None, source="metrics")
P = Policy()


def window_around(t: float) -> str:
    """A one-hour quiet window that holds t in local time, whatever the test machine's zone."""
    lt = time.localtime(t)
    start = (lt.tm_hour * 60 + lt.tm_min - 30) % 1440
    end = (start + 60) % 1440
    return f"{start // 60:02d}:{start % 60:02d}-{end // 60:02d}:{end % 60:02d}"


# ---- what is material ---------------------------------------------------------------


def test_a_nan_onset_wakes_with_its_keys_explanation_and_next_command() -> None:
    w = classify(ev("train.nonfinite", "critical", seq=123, **NAN), P, NOW, {})
    assert w is not None
    assert w.key == "seq:123"
    assert w.condition == "cond:train.nonfinite:loss"
    assert w.explain == "loss is NaN at step 350 (metrics)"
    assert w.next == f"rgt events {RUN} --kind train."
    assert w.event["seq"] == 123 and w.event["data"]["value"] == "nan"
    assert w.clean_exit is None
    assert w.record(NOW)["exit"] == 10


@pytest.mark.parametrize("event", [
    ev("train.nonfinite", "info", **{**NAN, "state": "cleared"}),   # the same kind, cleared
    ev("disk.ok", "info", path="/data", state="cleared"),            # a separate clear kind
    ev("gpu.throttle_cleared", "info", gpu=0),
    ev("job.progressing", "info", state="cleared"),
    ev("train.progress", "info", step=3, scalars={"loss": 1.0}),      # telemetry
    ev("heartbeat", "warn"),                                          # telemetry, whatever its sev
    ev("ckpt.saved", "info", path="c/a.pt"),                          # info, no state change
    ev("job.started", "info", pid=3),
])
def test_clears_telemetry_and_info_do_not_wake(event: Event) -> None:
    assert classify(event, P, NOW, {}) is None


def test_link_events_never_wake_by_themselves() -> None:
    assert judge(local("link.lost"), P, NOW, {}).reason == "link"


def test_sidecar_silent_wakes_and_its_clear_does_not() -> None:
    w = classify(local("sidecar.silent", state="onset", silent_s=95.0, heartbeat_interval_s=30.0),
                 P, NOW, {})
    assert w is not None and w.key == "local:4"
    assert w.explain.startswith("the link is up but no heartbeat for 3 intervals (95 s): ")
    assert "paused spot instance" in w.explain
    assert w.event["seq"] is None and w.event["id"] == 4 and w.event["origin"] == "controller"
    assert classify(local("sidecar.silent", "info", state="cleared"), P, NOW, {}) is None
    # material even when the policy asks for critical only: the controller's own signal
    assert classify(local("sidecar.silent", state="onset"), Policy(min_sev="critical"), NOW, {})


def test_an_escalation_is_its_own_condition() -> None:
    onset = ev("disk.low", "warn", path="/data", resource="bytes", state="onset")
    worse = ev("disk.low", "critical", seq=9, path="/data", resource="bytes", state="escalated")
    first = classify(onset, P, NOW, {})
    assert first is not None
    woken = {first.key: NOW, first.condition: NOW}
    second = classify(worse, P, NOW + 1, woken)
    assert second is not None and second.condition == first.condition + ":escalated"


# ---- job exits --------------------------------------------------------------------


def test_job_exits_always_wake_and_say_how_they_ended() -> None:
    clean = ev("job.exited", "info", code=0, signal=None, oom_killed=False, final_ok=True)
    w = classify(clean, P, NOW, {}, job_started_at=NOW - 5 - 1204)
    assert w is not None and w.clean_exit is True and w.record(NOW)["exit"] == 0
    assert w.explain == "the job finished cleanly (code 0) after 1,204 s"
    assert w.next == f"rgt status {RUN} && rgt pull {RUN}"
    failed = classify(ev("job.exited", code=3), P, NOW, {}, job_started_at=NOW - 5 - 1204)
    assert failed is not None and failed.clean_exit is False and failed.record(NOW)["exit"] == 10
    assert failed.explain == "the job exited with code 3 after 1,204 s"


@pytest.mark.parametrize("data, text, clean", [
    ({"code": 137, "oom_killed": True}, "the job was OOM-killed (code 137)", False),
    ({"code": None, "signal": 9}, "the job was killed by signal 9 (SIGKILL)", False),
    ({"code": None, "vanished": True, "oom_killed": True}, "vanished without an exit record (OOM", False),
    ({"code": 0, "final_ok": False, "final_reasons": ["a durable checkpoint copy failed"]},
     "but the run failed: a durable checkpoint copy failed", False),
    ({"code": 0}, "finished cleanly", True),
])
def test_job_exit_variants(data: Dict[str, Any], text: str, clean: bool) -> None:
    event = ev("job.exited", **data)
    assert wake.finished_cleanly(event) is clean
    w = classify(event, Policy(min_sev="critical", quiet=(window_around(NOW),)), NOW, {})
    assert w is not None and text in w.explain   # neither min_sev nor quiet hours hold an exit back


def test_finished_cleanly_is_only_for_exits() -> None:
    assert wake.finished_cleanly(ev("train.nonfinite", **NAN)) is None


def test_job_exited_cannot_be_muted() -> None:
    for kind in ("job.exited", "run.closed"):
        with pytest.raises(ValueError, match="job.exited and run.closed cannot be muted"):
            Policy.from_dict({"mute": [kind]})
    w = classify(ev("job.exited", code=1), Policy.from_dict({"mute": ["job."]}), NOW, {})
    assert w is not None


def test_an_exit_with_a_close_out_waits_for_run_closed() -> None:
    """The run ends on run.closed (custody final); the raw exit wakes only when the close was cut."""
    exited = ev("job.exited", code=0, final_ok=True, closing=True)
    assert wake.judge(exited, Policy(), NOW, {}).reason == "closing"
    assert wake.judge(ev("job.exited", code=1, closing=True), Policy(), NOW, {}).reason == "closing"
    cut = wake.judge(exited, Policy(), NOW, {}, context=wake.Context(cut=True))
    assert cut.wake is not None and cut.wake.clean_exit is True
    manifest = {"sha256": "ab" * 32, "files": 3, "checkpoints": 2}
    closed = wake.judge(ev("run.closed", code=0, final_ok=True, manifest=manifest), Policy(), NOW, {})
    assert closed.wake is not None and closed.wake.clean_exit is True
    assert "final manifest abababababab (2 checkpoint(s), 3 files)" in closed.wake.explain
    bad = wake.judge(ev("run.closed", code=0, final_ok=False, final_reasons=["x"]), Policy(), NOW, {})
    assert bad.wake is not None and bad.wake.clean_exit is False


# ---- woken, flapping --------------------------------------------------------------


def test_an_event_that_woke_once_never_wakes_again() -> None:
    event = ev("train.nonfinite", "critical", **NAN)
    assert judge(event, P, NOW, {"seq:5": NOW - 9999}).reason == "woken"
    assert judge(event, P, NOW, {"absorbed:seq:5": NOW}).reason == "absorbed"


def test_a_flapping_condition_wakes_once_per_window() -> None:
    again = ev("train.nonfinite", "critical", seq=40, **NAN)
    assert judge(again, P, NOW, {"cond:train.nonfinite:loss": NOW - 60}).reason == "flapping"
    assert classify(again, P, NOW, {"cond:train.nonfinite:loss": NOW - 1801}) is not None
    assert classify(again, Policy(flap_window_s=30), NOW, {"cond:train.nonfinite:loss": NOW - 60})
    # another name is another condition
    other = ev("train.nonfinite", "critical", seq=41, **{**NAN, "name": "val_loss"})
    assert classify(other, P, NOW, {"cond:train.nonfinite:loss": NOW - 60}) is not None


def test_later_wakes_of_a_condition_get_fresh_keys() -> None:
    woken = {"cond:x:": 100.0}
    assert wake.mark_key("cond:x:", woken) == "cond:x:#2"
    woken["cond:x:#2"] = 500.0
    assert wake.last_woken("cond:x:", woken) == 500.0
    assert wake.last_woken("cond:y:", woken) is None
    flap = ev("gpu.throttle", gpu=0, state="onset")
    assert judge(flap, P, 600.0, {"cond:gpu.throttle:0": 100.0, "cond:gpu.throttle:0#2": 500.0}
                 ).reason == "flapping"


# ---- policy: add, mute, min_sev, quiet ----------------------------------------------


def test_add_makes_a_kind_material_and_mute_silences_one() -> None:
    saved = ev("ckpt.saved", "info", path="c/a.pt")
    assert classify(saved, Policy.from_dict({"add": ["ckpt.saved"]}), NOW, {}) is not None
    assert classify(saved, Policy.from_dict({"add": ["ckpt.*"]}), NOW, {}) is not None
    xid = ev("gpu.xid", code=13, gpu=0)
    assert judge(xid, Policy.from_dict({"mute": ["gpu."]}), NOW, {}).reason == "muted"
    # the most specific pattern decides
    assert classify(xid, Policy.from_dict({"mute": ["gpu."], "add": ["gpu.xid"]}), NOW, {})


def test_min_sev() -> None:
    throttle = ev("gpu.throttle", "warn", gpu=0, state="onset")
    lost = ev("gpu.lost", "critical", gpu=0, evidence="sample")
    critical_only = Policy(min_sev="critical")
    assert judge(throttle, critical_only, NOW, {}).reason == "below_min_sev"
    assert classify(lost, critical_only, NOW, {}) is not None
    started = ev("sidecar.capability", "info")
    assert classify(started, Policy(min_sev="info"), NOW, {}) is not None


def test_quiet_hours_hold_back_all_but_critical_events_and_exits() -> None:
    quiet = Policy(quiet=(window_around(NOW),))
    assert judge(ev("gpu.throttle", gpu=0, state="onset"), quiet, NOW, {}).reason == "quiet"
    assert classify(ev("gpu.lost", "critical", gpu=0), quiet, NOW, {}) is not None
    assert classify(ev("gpu.throttle", gpu=0, state="onset"), quiet, NOW + 3 * 3600, {}) is not None


def test_quiet_windows_may_cross_midnight() -> None:
    assert wake.in_window("22:00-07:00", 23 * 60)
    assert wake.in_window("22:00-07:00", 6 * 60 + 59)
    assert not wake.in_window("22:00-07:00", 7 * 60)
    assert not wake.in_window("22:00-07:00", 12 * 60)
    assert wake.in_window("00:00-24:00", 12 * 60)


@pytest.mark.parametrize("layer, message", [
    ({"nope": 1}, "unknown policy key"),
    ({"min_sev": "loud"}, "min_sev must be one of"),
    ({"quiet": ["25:00-07:00"]}, "HH:MM-HH:MM"),
    ({"quiet": ["22:00-22:00"]}, "empty"),
    ({"quiet": "22:00-07:00"}, "list"),
    ({"flap_window_s": -1}, "at least"),
    ({"link_budget_s": "15m"}, "number of seconds"),
    ({"add": ["gpu.xid"], "mute": ["gpu.xid"]}, "both added and muted"),
    ({"add": ["has space"]}, "not a kind"),
    ({"add": ["*"]}, "not a kind"),
])
def test_bad_policies_are_refused_with_the_reason(layer: Dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Policy.from_dict(layer)


def test_policy_round_trips_and_layers_merge_most_specific_last() -> None:
    p = Policy.from_dict({"add": ["ckpt.saved"], "quiet": ["22:00-07:00"], "flap_window_s": 60})
    assert Policy.from_dict(p.to_dict()) == p
    json.dumps(p.to_dict())
    everyone = {"mute": ["gpu.throttle"], "quiet": ["22:00-07:00"], "min_sev": "critical"}
    this_run = {"add": ["gpu.throttle"], "min_sev": "warn"}
    command_line = {"mute": ["ckpt."], "link_budget_s": 5}
    m = wake.merged(everyone, this_run, command_line)
    assert m.add == ("gpu.throttle",) and m.mute == ("ckpt.",)
    assert m.min_sev == "warn" and m.quiet == ("22:00-07:00",) and m.link_budget_s == 5.0
    assert m.flap_window_s == 1800.0
    assert wake.merged() == Policy()


# ---- what a wake says -----------------------------------------------------------------


@pytest.mark.parametrize("kind, sev, data, text", [
    ("job.stalled", "warn", dict(state="onset", verdict="hung", idle_s=612.3, budget_s=300.0,
                                 gpu_util_pct=98.0, step=4000),
     "no progress for 612 s (budget 300 s) at step 4,000; verdict hung, GPU 98% busy"),
    ("gpu.xid", "critical", dict(gpu=0, pci="0000:3b:00.0", code=79, xid_name="GPU has fallen off the bus"),
     "Xid 79 (GPU has fallen off the bus) on GPU 0 (0000:3b:00.0)"),
    ("gpu.lost", "critical", dict(gpu=1, evidence="sample"), "GPU 1 was lost (evidence: sample)"),
    ("gpu.ecc", "critical", dict(gpu=0, reason="uncorrected_rose", volatile_uncorrected_delta=2,
                                 aggregate_uncorrected_delta=1), "uncorrected ECC errors rose on GPU 0 (+2"),
    ("disk.low", "warn", dict(state="onset", path="/data", resource="bytes", used_pct=96.1,
                              avail_bytes=3 << 30, eta_to_full_s=1200),
     "disk /data is 96.1% full (bytes): 3.0 GiB free, full in ~1,200 s"),
    ("mem.pressure", "warn", dict(state="onset", used_pct=93.0, used_bytes=15 << 30, limit_bytes=16 << 30),
     "job memory at 93% of its limit (15.0 GiB of 16.0 GiB)"),
    ("mem.pressure", "critical", dict(state="oom_kill", oom_kill_delta=1), "OOM-killed a process"),
    ("ckpt.suspect", "warn", dict(path="checkpoints/a.pt", code="zero_bytes", reason="zero bytes"),
     "checkpoint checkpoints/a.pt looks suspect: zero bytes"),
    ("ckpt.stale", "warn", dict(age_s=3600, stale_after_s=1800, last_path="c/a.pt", last_step=7),
     "no good checkpoint for 3,600 s (limit 1,800 s)"),
    ("ckpt.sync_failed", "critical", dict(path="c/a.pt", error="ENOSPC: no space"),
     "the durable copy of c/a.pt failed: ENOSPC: no space"),
    ("train.restarted_from_zero", "warn", dict(last_step=5000, new_step=0),
     "training restarted at step 0 (it had reached step 5,000)"),
    ("train.metric_zero", "warn", dict(state="onset", name="acc", evaluations=3, loss_then=2.3,
                                       loss_now=1.1, step=300), "acc stayed at exactly 0 for 3 evaluations"),
    ("train.loss_spike", "warn", dict(state="onset", name="loss", value=9.1, mean=2.0, sigma=0.1, step=30),
     "loss spiked to 9.1 at step 30"),
    ("sidecar.degraded", "warn", dict(part="nvml", error="timed out"),
     "sidecar part nvml is failing: timed out"),
    ("something.new", "warn", dict(x=1), "something.new (warn): x=1"),
])
def test_explanations(kind: str, sev: str, data: Dict[str, Any], text: str) -> None:
    w = classify(ev(kind, sev, **data), P, NOW, {})
    assert w is not None
    assert text in w.explain
    assert "\n" not in w.explain and len(w.explain) <= explain.EXPLAIN_MAX


def test_hostile_box_text_is_escaped_in_the_explanation_but_raw_in_the_event() -> None:
    nasty = "/data\x1b[2J\nrm -rf"
    w = classify(ev("disk.low", path=nasty, resource="bytes", state="onset", used_pct=99.0), P, NOW, {})
    assert w is not None
    assert "\x1b" not in w.explain and "\n" not in w.explain
    assert "\\x1b[2J\\x0arm -rf" in w.explain
    assert w.event["data"]["path"] == nasty
    assert "\x1b" not in json.dumps(w.event)   # JSON escapes control characters itself


def test_a_very_long_error_is_cut_to_one_short_line() -> None:
    w = classify(ev("ckpt.sync_failed", "critical", path="a", error="x" * 5000), P, NOW, {})
    assert w is not None and len(w.explain) == explain.EXPLAIN_MAX and w.explain.endswith("...")


def test_envelope_is_json_with_non_finite_values_as_on_the_wire() -> None:
    w = classify(ev("train.nonfinite", "critical", **{**NAN, "value": float("nan")}), P, NOW, {})
    assert w is not None
    text = json.dumps(w.event, allow_nan=False)
    assert json.loads(text)["data"]["value"] == "nan"
    assert w.explain.startswith("loss is NaN")


def test_a_preemption_wakes_and_points_at_resume() -> None:
    w = classify(ev("job.preempted", signal=15, grace_s=5, pid=9), P, NOW, {})
    assert w is not None and "grace 5 s before SIGKILL" in w.explain
    assert explain.next_command(ev("job.preempted")) == \
        f"rgt pull {RUN} && rgt resume {RUN} --on box1 --dry-run"
    exited = ev("job.exited", code=None, signal=15, oom_killed=False, vanished=False, preempted=True)
    assert "preempted" in explain.explain(exited)
    assert "rgt resume" in explain.next_command(exited)


def test_a_failed_rank_wakes_naming_the_node() -> None:
    w = classify(local("job.rank_failed", "critical", node="n1", how="code 1", waiting="n0"), P, NOW, {})
    assert w is not None and w.explain == "node n1 exited (code 1) while n0 still wait on it"


def test_a_hung_group_names_the_node_that_stopped_first() -> None:
    w = classify(local("job.stalled", state="onset", verdict="hung", scope="all nodes", first_node="n1",
                       idle_s=40.0, budget_s=30.0), P, NOW, {})
    assert w is not None and w.explain.endswith("verdict hung on every node; n1 stopped first")


# ---- odd stored data: a watch must still end with its wake -------------------------

HUGE = 10 ** 400          # what a hostile box stored before the codec bounded integers
HUGER = 10 ** 5000        # past Python's own 4300-digit str() limit
ODD = dict(step=HUGE, value=HUGER, name="loss\ud800", idle_s=HUGE, budget_s=HUGER, bytes=HUGE,
           used_bytes=HUGER, pids=[HUGER, 1], code=HUGER, signal=HUGE, gpu=HUGER, pci=HUGER,
           silent_s=HUGE, heartbeat_interval_s=1e-300, final_reasons=[HUGER], avail_bytes=HUGER,
           stacks=[{"pid": HUGER, "threads": [{"frames": [HUGER]}]}], reason=HUGER)


@pytest.mark.parametrize("kind", sorted(explain._TEMPLATES) + ["job.exited", "some.future.kind"])
def test_explain_never_raises_on_odd_stored_data(kind: str) -> None:
    text = explain.explain(ev(kind, "critical", **ODD), job_started_at=NOW - 100)
    assert text and "\n" not in text and len(text) <= explain.EXPLAIN_MAX
    text.encode("utf-8")  # printable: no lone surrogate reaches the terminal
    w = classify(ev(kind, "critical", **ODD), P, NOW, {})
    if w is not None:
        assert w.explain == text or kind == "job.exited"


def test_huge_numbers_are_shown_by_their_size() -> None:
    assert render.number(HUGE) == "(an integer of 1,329 bits)"
    assert render.seconds(HUGER) == "(an integer of 16,610 bits) s"
    assert render.size(-HUGE) == "(an integer of 1,329 bits) B"
    assert render.number((1 << 64) - 1) == "18,446,744,073,709,551,615"
    assert explain.signal_name(HUGE) == "(an integer of 1,329 bits)"
    assert explain.explain(ev("train.nonfinite", "critical", **{**NAN, "step": HUGE})) == (
        "loss is NaN at step (an integer of 1,329 bits) (metrics)")
    assert explain.explain(ev("job.exited", "warn", code=HUGER)) == (
        "the job exited with code (an integer of 16,610 bits)")


class Unreadable(dict):  # type: ignore[type-arg]
    """Stored data that fails whatever reads it."""

    def items(self) -> Any:
        raise RuntimeError("unreadable")

    def get(self, *_: Any) -> Any:
        raise RuntimeError("unreadable")


@pytest.mark.parametrize("kind", ["some.future.kind", "gpu.xid", "job.exited"])
def test_explain_of_data_it_cannot_show_says_so(kind: str) -> None:
    odd = Event(run=RUN, host="box1", seq=1, ts=NOW, kind=kind, sev="warn", data=Unreadable())
    assert explain.explain(odd) == f"{kind} (warn): its data could not be shown (RuntimeError)"
