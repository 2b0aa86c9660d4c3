"""controller.insight.explain and `rgt explain`: the scorer, event -> entry, the command, and `rgt watch`'s
entry."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from click.testing import CliRunner, Result

from controller.cli import watch as cli_watch
from controller.cli.base import RgtGroup
from controller.cli.explain import explain_command
from controller.insight import explain
from controller.insight.catalog import default_catalog
from controller.insight.explain import entry_for_event, parse_query
from controller.insight.words import tokenize
from controller.store.db import Store
from protocol import Event

# ---- acceptance: problems described the way people write them --------------------------------
# Written as a person would report them (a chat message, an issue title, a pasted error line),
# not copied from the catalog. Each names the entry that answers it.
DESCRIPTIONS: List[Tuple[str, str]] = [
    ("after a few hundred iterations my training loss just prints nan", "nan-loss"),
    ("with float16 autocast the activations get enormous and the loss turns to inf", "nan-fp16-overflow"),
    ("moved the model from bfloat16 to half precision and now every output is NaN", "nan-precision-switch"),
    ("I use autocast with fp16 but never set up a scaler, and the loss goes nan", "nan-missing-gradscaler"),
    ("around step 12k the loss shot up out of nowhere and only partly recovered", "loss-spike"),
    ("amp skips the optimizer step every single iteration and the loss scale keeps shrinking",
     "fp16-scaler-collapse"),
    ("relaunched after the crash and it started counting from epoch 1 again instead of epoch 40",
     "resume-from-zero"),
    ("resumed from my saved model but the loss is way higher than before, as if adam forgot everything",
     "weights-only-checkpoint"),
    ("first iteration runs fine, then CUDA out of memory on the second one", "oom-step-two"),
    ("it runs out of GPU memory the very first time loss.backward() is called", "oom-first-backward"),
    ("training is fine memory-wise but validation blows up with CUDA OOM", "oom-eval-only"),
    ("the terminal just says Killed, no python traceback, exit status 137", "cgroup-oom-killed"),
    ("on an 8 GPU node one worker died and the other seven just sit there forever", "nccl-one-rank-crashed"),
    ("multi-node run freezes and after exactly half an hour the process group watchdog times out",
     "nccl-30min-timeout"),
    ("gpu usage bounces between 20 and 60 percent, I think loading batches is the bottleneck",
     "starved-gpu-dataloader"),
    ("nvidia-smi says 0% utilization the whole time but the iteration counter keeps going up",
     "zero-gpu-util-steps-advance"),
    ("the card sits at 88 C, clocks keep dropping and throughput is 30% lower than yesterday",
     "thermal-throttle"),
    ("torch.save fails with no space left on device halfway through the epoch", "disk-full"),
    ("df -h shows a third used but I cannot create new files, df -i says 100%", "inode-exhaustion"),
    ("loading the latest checkpoint: PytorchStreamReader failed reading zip archive",
     "non-atomic-checkpoint"),
    ("wandb dashboard shows no runs at all, I never logged in on the server", "tracker-offline-no-key"),
    ("train.log has not changed in 40 minutes yet new checkpoint files keep appearing",
     "log-frozen-buffering"),
    ("the python process is simply gone, the log ends after epoch 3 with no error message",
     "vanished-process"),
    ("eval mAP is exactly 0.0 every time while the training loss goes down nicely", "metric-zero"),
    ("nvidia-smi says unable to determine the device handle, and dmesg has Xid 79", "xid-79-fell-off-bus"),
    ("kernel log shows Xid 13 and my script died with an illegal memory access", "xid-application"),
    ("one card reports an uncorrectable double bit memory error, xid 48", "xid-48-uncorrectable-ecc"),
    ("my ssh connection dropped and the training died together with it", "killed-by-sighup"),
    ("the spot instance was reclaimed and the job got SIGTERM", "sigterm-preempted"),
    ("steps per second fell from 10 to 1, top shows hundreds of threads and load average over 400",
     "thread-oversubscription"),
    ("driver logged a GSP RPC timeout, xid 119, and the job hangs", "xid-gpu-reset"),
    ("the machine rebooted on its own overnight and my run is gone", "vanished-after-reboot"),
    ("torchrun on two nodes hangs forever during init_process_group", "nccl-init-hang"),
    ("every process of torchrun ends up on cuda:0 and the others GPUs are empty", "every-rank-on-gpu0"),
    ("the checkpoint file that was just written is 0 bytes", "ckpt-zero-bytes"),
    ("I can't reach the box anymore, ssh times out, is my training dead?", "link-lost"),
    ("grad norm explodes and then everything is nan in mixed precision training", "nan-fp16-overflow"),
    ("after I restored training, the learning rate went back to the warmup value", "lr-schedule-reset"),
    ("my DDP job hangs when rank 0 runs validation and the other ranks wait", "collective-desync"),
    ("dmesg says NVRM: Xid 31 and the job crashed", "xid-application"),
    ("the container's memory limit was hit and the kernel killed python", "cgroup-oom-killed"),
    ("python prints nothing to the log file until the script ends", "log-frozen-buffering"),
    ("box ran out of disk while writing checkpoints, now latest.pth is broken", "disk-full"),
    ("after the crash latest.pt.tmp is lying around and latest.pt will not load", "non-atomic-checkpoint"),
    ("something invisible occupies 20 GB on GPU 2, no pid shown anywhere", "oom-zombie-vram"),
    ("gpu clocks are being held down by a power brake", "power-brake-throttle"),
    ("uncontained ECC error xid 95", "xid-memory-fatal"),
    ("NVLink error on the 8 gpu box, training hung", "xid-nvlink"),
    ("/ is at 100% because of ~/.cache while /workspace is nearly empty", "root-disk-full"),
    ("dataset download from the hub is stuck and the file is not growing", "hf-download-stall"),
    ("wandb.init never returns on my autodl box", "tracker-init-hang"),
    ("Missing key(s) in state_dict module.encoder", "state-dict-prefix-mismatch"),
    ("the run finished in 2 hours when it usually takes 8", "short-run"),
    ("rented an H100 but float32 matmuls barely beat my old 2080", "fp32-without-tf32"),
    ("no kernel image is available for execution on the device after installing torch",
     "cuda-driver-mismatch"),
    ("the job stopped with signal 6 and core dumped", "job-aborted"),
    ("two copies of the training are running on the same gpu and both are slow", "second-job-on-gpu"),
    ("under DDP the loss pattern repeats identically every epoch, shuffling seems off", "data-order-repeats"),
    ("model never learns anything, predictions no better than guessing", "no-learning"),
    ("host RAM keeps growing every epoch until the container limit", "host-memory-near-limit"),
]


def test_descriptions_find_the_right_entry_in_the_top_3() -> None:
    index = explain.default_index()
    assert len(DESCRIPTIONS) >= 30
    misses = []
    for text, wanted in DESCRIPTIONS:
        assert default_catalog().get(wanted) is not None, wanted
        got = [h.entry.id for h in index.search(text, 3)]
        if wanted not in got:
            misses.append(f"{wanted!r} not in {got} for {text!r}")
    for miss in misses:
        print("MISS", miss)
    assert len(misses) <= 0.1 * len(DESCRIPTIONS), "\n".join(misses)


# ---- the text pipeline ----------------------------------------------------------------------


def test_tokenize_joins_phrases_merges_synonyms_and_stems() -> None:
    def t(text: str) -> List[str]:
        return [tok.term for tok in tokenize(text)]

    assert t("ran Out of GPU memory") == t("OOM")
    assert len(set(t("hung stuck frozen stalled"))) == 1
    assert len(set(t("crashes crashed crashing"))) == 1
    assert t("the job is at the") == ["job"]
    assert t("df -i") == t("inodes")
    assert t("card at 88 C") == t("gpu hot")
    assert [tok.word for tok in tokenize("Frozen GPU")] == ["frozen", "gpu"]  # what the person wrote


def test_search_is_explainable_and_ordered() -> None:
    hits = explain.default_index().search("NaN loss with fp16", 5)
    assert hits and [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    for hit in hits:
        assert hit.matched, hit
        assert set(hit.matched) <= {"nan", "loss", "fp16"}
    assert explain.default_index().search("zzzz qqqq", 3) == []


# ---- events -> entries ----------------------------------------------------------------------


@pytest.mark.parametrize("kind, data, wanted", [
    ("gpu.xid", {"code": 79, "class": "node_reboot", "fatal": True}, "xid-79-fell-off-bus"),
    ("gpu.xid", {"code": 13, "class": "application", "fatal": False}, "xid-application"),
    ("gpu.xid", {"code": 13, "class": "gpu_reset", "fatal": True}, "xid-gpu-reset"),   # the driver's verdict
    ("gpu.xid", {"code": 48, "class": "memory", "fatal": True}, "xid-48-uncorrectable-ecc"),
    ("gpu.xid", {"code": 95, "class": "memory", "fatal": True}, "xid-memory-fatal"),
    ("gpu.xid", {"code": 4242, "class": "unknown"}, "xid-unknown"),
    ("gpu.lost", {"evidence": "sample"}, "xid-79-fell-off-bus"),
    ("job.exited", {"code": 1, "signal": None, "oom_killed": False, "vanished": False}, "job-crashed"),
    ("job.exited", {"code": 137, "signal": None, "oom_killed": True, "vanished": False}, "cgroup-oom-killed"),
    ("job.exited", {"code": None, "oom_killed": True, "vanished": True}, "cgroup-oom-killed"),
    ("job.exited", {"code": None, "oom_killed": False, "vanished": True, "evidence": {"rebooted": True}},
     "vanished-after-reboot"),
    ("job.exited", {"code": None, "oom_killed": False, "vanished": True, "evidence": {"rebooted": False}},
     "vanished-process"),
    ("job.exited", {"code": 0, "final_ok": True, "oom_killed": False, "vanished": False}, "job-finished"),
    ("job.exited", {"code": 0, "final_ok": False, "oom_killed": False, "vanished": False},
     "finished-but-failed"),
    ("job.exited", {"code": None, "signal": 1, "oom_killed": False, "vanished": False}, "killed-by-sighup"),
    ("job.exited", {"code": None, "signal": 15, "oom_killed": False, "vanished": False}, "sigterm-preempted"),
    ("job.exited", {"code": None, "signal": 9, "oom_killed": False, "vanished": False}, "killed-sigkill"),
    ("job.exited", {"code": 143, "signal": None, "stop_requested": True}, "stopped-by-request"),
    ("job.exited", {"code": None, "signal": 15, "stop_requested": True}, "stopped-by-request"),
    ("verify.done", {"ok": False}, "verify-failed"),
    ("train.nonfinite", {"name": "loss", "value": "nan"}, "nan-loss"),
    ("mem.pressure", {"state": "oom_kill"}, "cgroup-oom-killed"),
    ("mem.pressure", {"state": "onset", "used_pct": 93}, "host-memory-near-limit"),
    ("disk.low", {"resource": "inodes"}, "inode-exhaustion"),
    ("disk.low", {"resource": "bytes"}, "disk-full"),
    ("gpu.throttle", {"reasons": ["HwSlowdown", "HwThermalSlowdown"]}, "thermal-throttle"),
    ("gpu.throttle", {"reasons": ["HwPowerBrakeSlowdown"]}, "power-brake-throttle"),
    ("gpu.throttle", {"reasons": ["HwSlowdown"]}, "gpu-throttle"),
    ("gpu.ecc", {"reason": "row_remap_failure"}, "gpu-row-remap-failure"),
    ("job.stalled", {"verdict": "hung"}, "stall-gpu-busy"),
    ("job.stalled", {"verdict": "idle"}, "stall-gpu-idle"),
    ("job.stalled", {"verdict": "unknown"}, "stall-no-progress"),
    ("ckpt.suspect", {"code": "zero_bytes"}, "ckpt-zero-bytes"),
    ("ckpt.suspect", {"code": "tmp_left"}, "non-atomic-checkpoint"),
    ("sidecar.degraded", {"part": "nvml"}, "nvml-degraded"),
    ("sidecar.degraded", {"source": "controller", "error": "boom"}, "controller-watcher-failed"),
    ("train.slow", {"verdict": "data-bound"}, "starved-gpu-dataloader"),
    ("link.lost", {}, "link-lost"),
    ("deadman.fired", {"action": "shutdown"}, "deadman-fired"),
])
def test_entry_for_event(kind: str, data: Dict[str, Any], wanted: str) -> None:
    assert entry_for_event(kind, data) == wanted


def test_an_unknown_kind_has_no_entry() -> None:
    assert entry_for_event("gpu.melted", {"code": 1}) is None


# ---- queries ----------------------------------------------------------------------------------


def test_parse_query_modes() -> None:
    assert parse_query(["gpu.xid", "79"]).data == {"code": 79}
    q = parse_query(["job.exited", "oom_killed=true", "code=137", "why=oops"])
    assert (q.mode, q.kind) == ("kind", "job.exited")
    assert dict(q.data) == {"oom_killed": True, "code": 137, "why": "oops"}
    assert (parse_query(["XID 79"]).kind, parse_query(["xid", "79"]).data) == ("gpu.xid", {"code": 79})
    assert parse_query(["nan-loss"]).mode == "id"
    assert parse_query(["loss", "is", "nan"]).mode == "text"
    for bad in ([], ["  "], ["job.exited", "oom"]):
        with pytest.raises(explain.QueryError):
            parse_query(bad)


def test_kind_queries_put_what_the_data_picks_first() -> None:
    ids = [h.entry.id for h in explain.rank_for_kind("job.exited", {"oom_killed": True})]
    assert ids[0] == "cgroup-oom-killed" and "job-crashed" in ids[:2]
    assert "job-finished" in ids   # code unknown: not contradicted, still listed
    plain = [h.entry.id for h in explain.rank_for_kind("job.exited")]
    assert plain[0] == "job-crashed"
    assert "job-finished" not in [h.entry.id for h in explain.rank_for_kind("job.exited", {"code": 1})]


# ---- the command ------------------------------------------------------------------------------


def run_explain(args: List[str]) -> Result:
    rgt = RgtGroup("rgt")   # how controller/cli/main.py serves the command: error:/hint: lines, exit codes
    rgt.add_command(explain_command)
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]  # click 8.1
    except TypeError:
        runner = CliRunner()
    return runner.invoke(rgt, ["explain", *args])


def test_text_query_prints_cause_fix_and_matched_words() -> None:
    result = run_explain(["my", "loss", "turned", "NaN", "with", "fp16", "autocast", "--top", "2"])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("cause ") == 2 and "fix   - " in result.stdout
    assert "score" in result.stdout and "fp16" in result.stdout
    assert "1. nan-" in result.stdout


def test_json_answer_has_the_documented_shape() -> None:
    result = run_explain(["job.exited", "oom_killed=true", "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["mode"] == "kind" and doc["query"] == "job.exited oom_killed=true"
    first = doc["entries"][0]
    assert first["id"] == "cgroup-oom-killed" and first["matched"] == ["kind=job.exited", "oom_killed=true"]
    assert set(first) >= {"id", "title", "score", "matched", "cause", "fix", "kinds", "symptoms", "signals"}
    assert len(doc["entries"]) == 3


def test_an_entry_id_answers_with_that_entry() -> None:
    result = run_explain(["xid-79-fell-off-bus", "--json"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 0 and doc["mode"] == "id"
    assert [e["id"] for e in doc["entries"]] == ["xid-79-fell-off-bus"]
    human = run_explain(["xid", "79"])
    assert human.exit_code == 0 and human.stdout.startswith("1. xid-79-fell-off-bus")


def test_nothing_matches_exits_1_with_a_hint() -> None:
    result = run_explain(["qwxzzv", "--json"])
    assert result.exit_code == 1
    assert json.loads(result.stdout)["entries"] == []
    assert "error: nothing in the catalog matches" in result.stderr and "hint: " in result.stderr


@pytest.mark.parametrize("args", [[], ["job.exited", "oom"], ["--top", "0", "nan"], ["--list", "nan"]])
def test_usage_errors_exit_2(args: List[str]) -> None:
    result = run_explain(args)
    assert result.exit_code == 2, result.output
    assert "error: " in result.stderr


def test_list_names_every_entry() -> None:
    result = run_explain(["--list", "--json"])
    assert result.exit_code == 0
    assert len(json.loads(result.stdout)["entries"]) == len(default_catalog().entries)


# ---- rgt watch carries the entry ----------------------------------------------------------------

RUN = "train-7f3a"


def ev(seq: int, kind: str, sev: str = "info", **data: Any) -> Event:
    return Event(run=RUN, host="box1", seq=seq, ts=time.time() - 100 + seq, kind=kind, sev=sev, data=data)


@pytest.fixture
def store(home: Path) -> Iterator[Store]:
    with Store.open() as s:
        s.upsert_run(RUN, host="box1")
        s.apply(RUN, [ev(1, "sidecar.started"), ev(2, "job.started", pid=42), ev(3, "heartbeat")], 3)
        yield s


def run_watch(args: List[str]) -> Result:
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:
        runner = CliRunner()
    return runner.invoke(cli_watch.watch_command, args, catch_exceptions=False)


def test_watch_names_the_entry_of_the_event_that_woke_it(store: Store) -> None:
    store.apply(RUN, [ev(4, "gpu.xid", "critical", code=79, gpu=0, **{"class": "node_reboot"})], 4)
    result = run_watch([RUN, "--timeout", "10s"])
    assert result.exit_code == 10
    record = json.loads(result.stdout)
    assert record["event"]["kind"] == "gpu.xid"
    assert record["entry"] == "xid-79-fell-off-bus" and record["see"] == "rgt explain xid-79-fell-off-bus"
    assert "why: rgt explain xid-79-fell-off-bus" in result.stderr


def test_watch_entry_for_a_nan(store: Store) -> None:
    nan = ev(4, "train.nonfinite", "critical", state="onset", name="loss", value="nan", step=3)
    store.apply(RUN, [nan], 4)
    record = json.loads(run_watch([RUN, "--json", "--timeout", "10s"]).stdout)
    assert record["entry"] == "nan-loss"


def test_with_entry_leaves_other_records_alone() -> None:
    timeout = {"exit": 3, "runs": [RUN], "status": {}, "event": None}
    assert cli_watch.with_entry(timeout) == {**timeout, "entry": None}   # the key is always there
    unknown = {"exit": 10, "event": {"kind": "gpu.melted", "data": {}}}
    assert cli_watch.with_entry(unknown) == {**unknown, "entry": None}
