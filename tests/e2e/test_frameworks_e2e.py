"""Stock Hugging Face Trainer, Lightning and torchrun jobs, end to end.

Each job is one of tests/frameworks/ (no rgt code in it), launched with `rgt launch local` (one
through the test sshd) in its own working directory, so a framework's default output directory
lands where a user's would. Each case asserts the exact wake (`rgt watch` exit code and event
kind) and, for a healthy run, that pull + verify pass and `rgt teardown --plan` shows the gate open
only after them. Jobs are tiny (tens of steps); every wait polls with a deadline.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import pytest

from tests.e2e.rgtbox import ONBOX, TEST_ONBOX_ARGS, Rgt
from tests.helpers import REPO, rgt_cmd, wait_until

pytestmark = pytest.mark.e2e

FRAMEWORKS = REPO / "tests" / "frameworks"
HF = [sys.executable, str(FRAMEWORKS / "hf_tiny.py")]
LIGHTNING = [sys.executable, str(FRAMEWORKS / "lightning_tiny.py")]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(FRAMEWORKS / "ddp_tiny.py")]
# The sidecar stays a little after the job, so custody commits the last (directory) checkpoint.
LINGER = "--onbox-arg=--sidecar-linger=8s"
WATCH_S = 240  # a bound on one `rgt watch`; it ends sooner on the wake
UNIT_RE = r"checkpoint-(\d+)"


@functools.cache
def launch_has_cwd() -> bool:
    """Part F's `rgt launch --cwd`; without it the job runs in rgt's own working directory."""
    out = subprocess.run(rgt_cmd("launch", "--help"), capture_output=True, text=True, timeout=60)
    return "--cwd" in out.stdout


def rgt_at(rgt: Rgt, cwd: Path, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(rgt_cmd(*args), env=rgt.env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout_s)


def launch(rgt: Rgt, host: str, job_dir: Path, command: Sequence[str], *onbox: str) -> str:
    """`rgt launch HOST` of `command` with its working directory `job_dir`; the run id."""
    job_dir.mkdir(parents=True, exist_ok=True)
    where = ["--cwd", str(job_dir)] if launch_has_cwd() else []
    args = ["launch", host, "--root", str(rgt.root), "--json", *where, *TEST_ONBOX_ARGS, LINGER, *onbox,
            "--", *command]
    out = rgt_at(rgt, job_dir, *args)
    assert out.returncode == 0, f"rgt launch exited {out.returncode}: {out.stderr}"
    run = str(json.loads(out.stdout.strip().splitlines()[-1])["run_id"])
    rgt.runs.append(run)
    return run


def watch(rgt: Rgt, run: str) -> Tuple[int, Dict[str, Any]]:
    out = subprocess.run(rgt_cmd("watch", run, "--timeout", f"{WATCH_S - 20}s", "--json"), env=rgt.env,
                         cwd=REPO, capture_output=True, text=True, timeout=WATCH_S)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return out.returncode, (json.loads(lines[-1]) if lines else {"stderr": out.stderr})


def rgt_json(rgt: Rgt, *args: str) -> Tuple[int, Dict[str, Any], str]:
    out = subprocess.run(rgt_cmd(*args, "--json"), env=rgt.env, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return out.returncode, (json.loads(lines[-1]) if lines else {}), out.stderr


def stored(rgt: Rgt, run: str, kind: str) -> List[Any]:
    with rgt.store() as s:
        return list(s.events(run, kind_prefix=kind))


def sidecar_stopped(rgt: Rgt, run: str) -> None:
    wait_until(lambda: stored(rgt, run, "sidecar.stopping"), 60, f"the sidecar of {run} to stop")


def kind_of(record: Dict[str, Any]) -> Any:
    return (record.get("event") or {}).get("kind")


def gate(rgt: Rgt, run: str) -> Dict[str, Any]:
    _, plan, err = rgt_json(rgt, "teardown", run, "--plan")
    assert "gate" in plan, err
    return dict(plan["gate"])


def woke_closed(rgt: Rgt, run: str) -> Dict[str, Any]:
    """`rgt watch` exits 0 on the run's run.closed, its line naming the final manifest."""
    code, record = watch(rgt, run)
    assert code == 0 and kind_of(record) == "run.closed", record
    sha = str((record["event"]["data"].get("manifest") or {}).get("sha256"))
    assert sha[:12] in record["explain"], record
    return record


def pull_verify_open(rgt: Rgt, run: str, dest: Path) -> Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any]]:
    """Pull, verify, and the plan's gate; each must pass (the gate closed before the pull). Called
    straight after the wake, with no wait for the sidecar: the pull is the run's final one."""
    before = gate(rgt, run)
    assert not before["open"], before
    code, pulled, err = rgt_json(rgt, "pull", run, "--to", str(dest))
    assert code == 0, f"pull: {err}"
    assert pulled["final"] is True, pulled
    code, report, err = rgt_json(rgt, "verify", run)
    assert code == 0 and report["ok"], f"verify: {err} {json.dumps(report)[:2000]}"
    after = gate(rgt, run)
    assert after["open"], after
    return pulled, report, after


# ---- Hugging Face Trainer -------------------------------------------------------------------------


def test_hf_default_output_dir_rotation_pull_verify_and_the_gate(rgt_local: Rgt, tmp_path: Path) -> None:
    """Stock HF: output_dir "out" under the job's cwd (not $RGT_CKPT_DIR), save_total_limit=2 with
    four saves five seconds apart (a save lives ~10 s before the rotation deletes it: room for the
    5 s location scan plus the 2 s settle even on a loaded machine). Custody finds the place,
    records each save once, the rotation is the job's own, and the gate opens only after pull +
    verify."""
    rgt = rgt_local
    run = launch(rgt, "local", tmp_path / "job",
                 [*HF, "--steps", "40", "--save-every", "10", "--log-every", "5", "--step-seconds", "0.5"])
    woke_closed(rgt, run)   # no wait for the sidecar after it: run.closed is the end
    assert sorted(p.name for p in (tmp_path / "job" / "out").iterdir()) == ["checkpoint-30", "checkpoint-40"]

    location = stored(rgt, run, "ckpt.location")
    saved = stored(rgt, run, "ckpt.saved")
    assert location, "custody never reported the job's output_dir (ckpt.location)"
    assert "out" in json.dumps(location[0].data), location[0].data
    assert saved and location[0].seq < saved[0].seq
    assert len(saved) == 4, [e.data.get("path") for e in saved]  # one per save, never one per file
    assert not stored(rgt, run, "ckpt.suspect"), [e.data for e in stored(rgt, run, "ckpt.suspect")]
    removed = stored(rgt, run, "ckpt.removed")
    names = json.dumps([e.data for e in removed])
    assert "checkpoint-10" in names and "checkpoint-20" in names, names
    assert all(e.data.get("by") == "job" for e in removed), [e.data for e in removed]

    pulled, report, plan_gate = pull_verify_open(rgt, run, tmp_path / "pulled")
    reports = json.dumps([pulled, report, plan_gate])
    assert "rotated" in reports and "checkpoint-10" in reports, reports[:3000]
    assert "missing" not in json.dumps(report.get("proofs", {}).get("identity", {})), report["proofs"]
    assert (tmp_path / "pulled" / "rgt" / "external").exists() and \
        any(p.name == "checkpoint-40" for p in (tmp_path / "pulled").rglob("checkpoint-40"))


def test_hf_a_last_save_as_the_job_ends_is_in_the_pull_straight_after_the_wake_over_the_sshd(
        rgt_box: Rgt) -> None:
    """The case of issue 44: 300 fast steps, a save every 50, two kept: checkpoint-300 is written
    (and checkpoint-200 rotated away) in the job's last moments. The wake waits for the close-out,
    so a pull with no pause after it holds checkpoint-300, verify passes and the gate opens. Over
    the sshd: the laptop's cwd is not the job's."""
    rgt = rgt_box
    assert rgt.box is not None   # a profile, so that `rgt teardown --plan` has an action to gate
    rgt("hosts", "add", "box", "--ssh", rgt.box.alias, "--onbox", ONBOX, "--profile", "generic-ssh",
        "--replace")
    job = rgt.root.parent / "hf-job"
    run = launch(rgt, "box", job, [*HF, "--steps", "300", "--save-every", "50", "--log-every", "10"])
    record = woke_closed(rgt, run)
    data = record["event"]["data"]
    assert data["final_ok"] is True and data["incomplete"] == [], data
    assert data["manifest"]["checkpoints"] == 2, data   # the two HF kept
    pull_verify_open(rgt, run, rgt.root.parent / "laptop" / "pulled")
    units = {p.name for p in (rgt.root.parent / "laptop" / "pulled").rglob("checkpoint-*")}
    assert units == {"checkpoint-250", "checkpoint-300"}, units


def onsets(rgt: Rgt, run: str) -> Dict[str, Dict[str, Any]]:
    """The stored train.nonfinite onsets of `run`, by metric name."""
    return {str(e.data.get("name")): dict(e.data) for e in stored(rgt, run, "train.nonfinite")
            if e.data.get("state") == "onset"}


def test_hf_nan_under_the_default_nan_inf_filter_wakes(rgt_local: Rgt, tmp_path: Path) -> None:
    """logging_nan_inf_filter=True (the default) hides the NaN loss: the Trainer logs a finite,
    frozen one. grad_norm still says it: exit 10 on train.nonfinite, naming grad_norm, never loss."""
    run = launch(rgt_local, "local", tmp_path / "job",
                 [*HF, "--steps", "40", "--nan-at", "10", "--log-every", "2", "--save-every", "1000"])
    code, record = watch(rgt_local, run)
    assert code == 10 and kind_of(record) == "train.nonfinite", record
    sidecar_stopped(rgt_local, run)   # the job ran to its end: every onset it had is stored
    found = onsets(rgt_local, run)
    assert "grad_norm" in found and "loss" not in found, found
    assert found["grad_norm"]["reason"] in ("frozen_loss", "persisted"), found
    assert found["grad_norm"]["step"] is not None and found["grad_norm"]["step"] > 10, found


# ---- Lightning --------------------------------------------------------------------------------------


def test_lightning_csv_healthy_pull_verify_and_the_gate(rgt_local: Rgt, tmp_path: Path) -> None:
    rgt = rgt_local
    run = launch(rgt, "local", tmp_path / "job",
                 [*LIGHTNING, "--logger", "csv", "--steps", "40", "--save-every", "10", "--log-every", "5"])
    woke_closed(rgt, run)   # save_top_k=2: the last save lands as the job ends
    progress = stored(rgt, run, "train.progress")
    assert any(isinstance(e.data.get("step"), int) for e in progress), [e.data for e in progress[-3:]]
    assert stored(rgt, run, "ckpt.saved"), "no Lightning checkpoint was recorded"
    pull_verify_open(rgt, run, tmp_path / "pulled")


def test_lightning_save_top_k_pulled_straight_after_the_wake_over_the_sshd(rgt_box: Rgt) -> None:
    """ModelCheckpoint(save_top_k=2) on the sshd box, 60 fast steps, a save every 10: the two the job
    kept at its end (it saves, then deletes the worse, in its last moments) are exactly what the
    pull right after the wake brings home, verified, with the gate open."""
    rgt = rgt_box
    assert rgt.box is not None
    rgt("hosts", "add", "box", "--ssh", rgt.box.alias, "--onbox", ONBOX, "--profile", "generic-ssh",
        "--replace")
    job = rgt.root.parent / "lightning-job"
    run = launch(rgt, "box", job, [*LIGHTNING, "--logger", "csv", "--steps", "60", "--save-every", "10",
                                   "--log-every", "5"])
    data = woke_closed(rgt, run)["event"]["data"]
    assert data["final_ok"] is True and data["manifest"]["checkpoints"] == 2, data
    pulled = rgt.root.parent / "laptop" / "pulled"
    pull_verify_open(rgt, run, pulled)
    kept = {p.name for p in job.rglob("*.ckpt")}
    assert len(kept) == 2 and {p.name for p in pulled.rglob("*.ckpt")} == kept, kept


def test_lightning_nan_wakes(rgt_local: Rgt, tmp_path: Path) -> None:
    run = launch(rgt_local, "local", tmp_path / "job",
                 [*LIGHTNING, "--logger", "csv", "--steps", "300", "--nan-at", "10", "--log-every", "2",
                  "--save-every", "1000"])
    code, record = watch(rgt_local, run)
    assert code == 10 and kind_of(record) == "train.nonfinite", record


# ---- torchrun -----------------------------------------------------------------------------------------


def test_torchrun_a_crashed_rank_is_a_job_exit(rgt_local: Rgt, tmp_path: Path) -> None:
    run = launch(rgt_local, "local", tmp_path / "job",
                 [*TORCHRUN, "--steps", "400", "--crash-rank", "1", "--crash-at", "15"])
    code, record = watch(rgt_local, run)
    assert code == 10 and kind_of(record) == "run.closed", record
    assert record["event"]["data"].get("code") not in (0, None), record


def test_torchrun_a_hung_rank_is_a_stall_with_stacks_naming_the_collective(rgt_local: Rgt,
                                                                          tmp_path: Path) -> None:
    run = launch(rgt_local, "local", tmp_path / "job",
                 [*TORCHRUN, "--steps", "100000", "--hang-rank", "1", "--hang-at", "20", "--log-every", "2"],
                 "--onbox-arg=--stall-floor=3", "--onbox-arg=--stall-grace=120",
                 # the native dumps that show DDP's all_reduce take seconds on a loaded machine
                 "--onbox-arg=--serve-arg=--stacks-budget=120")
    code, record = watch(rgt_local, run)
    assert code == 10 and kind_of(record) == "job.stalled", record

    # A machine loaded enough to starve both ranks for the 3 s floor before the hang gives a stall
    # that clears; the hang's own stall follows it. The verdict is read from that one.
    def named() -> List[Any]:
        return [e for e in stored(rgt_local, run, "job.stalled")
                if "collective" in str(e.data.get("verdict"))]
    stalled = wait_until(named, 180, "a stored job.stalled naming the collective")[0]
    data = stalled.data
    assert data.get("stacks"), f"job.stalled carries no stacks: {data}"
    stacks = json.dumps(data["stacks"])
    assert "ddp_tiny.py" in stacks, stacks[:2000]
    assert data["verdict"] == "hung in a collective on rank 1", data
    assert data["hang"]["ranks_elsewhere"] == [1] and data["hang"]["ranks_waiting"] == [0], data


def test_torchrun_through_the_sshd_a_crashed_rank_is_a_job_exit(rgt_box: Rgt, tmp_path: Path) -> None:
    run = launch(rgt_box, "box", rgt_box.root.parent / "ddp-job",
                 [*TORCHRUN, "--steps", "400", "--crash-rank", "0", "--crash-at", "10"])
    code, record = watch(rgt_box, run)
    assert code == 10 and kind_of(record) == "run.closed", record
