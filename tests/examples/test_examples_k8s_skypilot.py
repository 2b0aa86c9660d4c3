"""The Kubernetes and SkyPilot examples: their structure, then their commands run for real here.

The pod spec's two container commands run as two processes sharing a temporary "volume" (the pod's
paths become temporary ones, the image's training script a short job in the working directory);
the SkyPilot task's `run` block runs under bash with the variables SkyPilot sets, once on "machine
A" and once more, as a spot recovery, on "machine B" with only the durable "bucket" in common.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import yaml

from onbox.runs import ProcRef, end_process, read_json, run_status
from onbox.sidecar.journal import read_all
from onbox.stop import stop_run
from tests.helpers import REPO, wait_until

EXAMPLES = REPO / "examples"
SCHEDULER_VARS = ("SLURM_NODEID", "SLURM_NNODES", "JOB_COMPLETION_INDEX", "SKYPILOT_NODE_RANK",
                  "SKYPILOT_NUM_NODES", "NODE_RANK", "GROUP_RANK", "RGT_NODES", "WORLD_NODES", "RGT_ROOT")
# The fields of a SkyPilot task YAML (docs.skypilot.co, reference/yaml-spec), top level and resources.
SKY_TOP = {"name", "workdir", "num_nodes", "resources", "envs", "secrets", "volumes", "file_mounts", "setup",
           "run", "config"}
SKY_RESOURCES = {"infra", "cloud", "region", "zone", "accelerators", "accelerator_args", "cpus", "memory",
                 "instance_type", "use_spot", "disk_size", "disk_tier", "network_tier", "ports", "image_id",
                 "labels", "autostop", "any_of", "ordered", "job_recovery"}

# The "image's" train.py: metrics, one checkpoint (saved atomically), what it resumed from; it ends
# when the test writes RUN_DIR/go (or after two minutes, should a test die first).
TRAIN_PY = """\
import json, os, threading
run_dir = os.environ["RGT_RUN_DIR"]
resume = os.environ.get("RGT_RESUME_FROM")
with open(os.path.join(run_dir, "job-env.json"), "w") as f:
    json.dump({"resume": resume, "run_id": os.environ["RGT_RUN_ID"], "node": os.environ.get("RGT_NODE")}, f)
first = 4 if resume else 1
with open(os.environ["RGT_METRICS"], "a") as f:
    for step in range(first, first + 3):
        f.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\\n")
ckpt = os.path.join(os.environ["RGT_CKPT_DIR"], "ckpt-%d.bin" % (first + 2))
with open(ckpt + ".tmp", "wb") as f:
    f.write(b"weights at step %d " % (first + 2) * 512)
os.replace(ckpt + ".tmp", ckpt)
go, tick = os.path.join(run_dir, "go"), threading.Event()
for _ in range(2400):
    if os.path.exists(go):
        break
    tick.wait(0.05)
"""


class Box:
    """Processes a test starts, and the runs they make; everything left is ended by pid at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.work = tmp / "work"
        self.work.mkdir()
        (self.work / "train.py").write_text(TRAIN_PY)
        self.procs: List[subprocess.Popen[bytes]] = []
        self.run_dirs: List[Path] = []

    def env(self, home: Path, extra: Dict[str, str]) -> Dict[str, str]:
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in SCHEDULER_VARS}
        path = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        return {**env, "HOME": str(home), "PATH": path, "PYTHONPATH": str(REPO), **extra}

    def start(self, argv: List[str], cwd: Path, env: Dict[str, str], log: str) -> subprocess.Popen[bytes]:
        with open(self.tmp / log, "ab") as out:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.tmp / name
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def end(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for run_dir in self.run_dirs:
            if run_status(run_dir).state in ("running", "stopping"):
                stop_run(run_dir, 2.0)
            sup = read_json(run_dir / "rgt" / "supervisor.json") or {}
            for ref in (ProcRef.from_dict(sup), ProcRef.from_dict(sup.get("sidecar"))):
                end_process(ref, 10.0)  # a launched supervisor lingers for a controller: end it


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    b = Box(tmp_path)
    try:
        yield b
    finally:
        b.end()


def kinds(run_dir: Path) -> List[str]:
    rgt = run_dir / "rgt"
    return [e["kind"] for e in read_all(rgt)] if rgt.is_dir() else []


# ---- reading the pod specs ------------------------------------------------------------------------


def k8s_docs(name: str) -> List[Dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / "kubernetes" / name).read_text()) if d]


def pod_spec(doc: Dict[str, Any]) -> Dict[str, Any]:
    spec: Dict[str, Any] = doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]
    return spec


def workload(name: str) -> Dict[str, Any]:
    return next(d for d in k8s_docs(name) if d["kind"] in ("Pod", "Job"))


def roles(spec: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the training container, the sidecar container), told apart by the command they run."""
    def runs(c: Dict[str, Any], what: str) -> bool:
        return f"rgt-onbox {what}" in " ".join(c.get("command", []))

    trainer = [c for c in spec["containers"] if runs(c, "launch")]
    sidecar = [c for c in spec["containers"] if runs(c, "follow")]
    assert len(trainer) == 1 and len(sidecar) == 1 and len(spec["containers"]) == 2
    return trainer[0], sidecar[0]


def words(container: Dict[str, Any]) -> List[str]:
    """The `sh -c` script of a container, as the shell splits it (before expanding variables)."""
    command = container["command"]
    assert command[:2] == ["sh", "-c"]
    return shlex.split(command[2].replace("\\\n", " "))


def option(argv: List[str], name: str) -> Optional[str]:
    return argv[argv.index(name) + 1] if name in argv else None


def env_of(container: Dict[str, Any]) -> Dict[str, str]:
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def mounts(container: Dict[str, Any]) -> Dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}


@pytest.mark.parametrize("name", ["pod.yaml", "indexed-job.yaml"])
def test_pod_spec_shares_the_run_volume_and_the_process_namespace(name: str) -> None:
    spec = pod_spec(workload(name))
    assert spec["shareProcessNamespace"] is True and spec["restartPolicy"] == "Never"
    trainer, sidecar = roles(spec)
    launch, follow = words(trainer), words(sidecar)
    assert launch[:3] == ["exec", "rgt-onbox", "launch"] and follow[:3] == ["exec", "rgt-onbox", "follow"]
    assert "--wait" in launch and "--no-sidecar" in launch and launch[-2:] == ["--", "$@"]
    assert [option(launch, o) for o in ("--root", "--project", "--run-id")] == \
        ["$RGT_ROOT", "$RGT_PROJECT", "$RGT_RUN"]
    assert follow[3] == "$RGT_ROOT/$RGT_PROJECT/active/$RGT_RUN"  # the directory launch makes
    assert ("--node" in launch) == ("--node" in follow)
    shared = set(mounts(trainer).items()) & set(mounts(sidecar).items())
    assert shared, "no volume mounted at the same path in both containers"
    volumes = {v["name"] for v in spec["volumes"]}
    assert {n for n, _ in shared} <= volumes
    for var in ("RGT_ROOT", "RGT_PROJECT", "RGT_RUN"):
        assert env_of(trainer)[var] == env_of(sidecar)[var], var
    root = env_of(trainer)["RGT_ROOT"]
    assert any(root == path or root.startswith(path.rstrip("/") + "/") for _, path in shared)
    assert float(option(launch, "--preempt-grace") or 0) == spec["terminationGracePeriodSeconds"]
    assert "nvidia.com/gpu" in trainer["resources"]["limits"]
    assert "nvidia.com/gpu" not in sidecar.get("resources", {}).get("limits", {})


def test_indexed_job_names_one_node_per_pod() -> None:
    docs = k8s_docs("indexed-job.yaml")
    service = next(d for d in docs if d["kind"] == "Service")
    job = next(d for d in docs if d["kind"] == "Job")
    spec = pod_spec(job)
    trainer, sidecar = roles(spec)
    assert job["spec"]["completionMode"] == "Indexed"
    nodes = int(env_of(trainer)["RGT_NODES"])
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nodes
    assert option(words(trainer), "--node") == option(words(sidecar), "--node") == "auto"
    assert service["spec"]["clusterIP"] == "None" and spec["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    head = f"--master-addr={job['metadata']['name']}-0.{service['metadata']['name']}"
    assert head in trainer["args"] and f"--nnodes={nodes}" in trainer["args"]


# ---- running the pod's two containers here --------------------------------------------------------


def container_env(box: Box, container: Dict[str, Any], mount: str, volume: Path,
                  extra: Dict[str, str]) -> Dict[str, str]:
    """The container's variables with its volume paths moved under `volume`; no linger after the job."""
    env = {name: str(volume) + value[len(mount):] if value.startswith(mount) else value
           for name, value in env_of(container).items()}
    if "RGT_FOLLOW_LINGER" in env:
        env["RGT_FOLLOW_LINGER"] = "0"
    return box.env(box.tmp / "home", {**env, **extra})


def run_pod(box: Box, spec: Dict[str, Any], extra: Dict[str, str], stream: str,
            args: Optional[List[str]] = None) -> Path:
    trainer, sidecar = roles(spec)
    name, mount = next(iter(set(mounts(trainer).items()) & set(mounts(sidecar).items())))
    volume = box.tmp / "volumes" / name
    t_env = container_env(box, trainer, mount, volume, extra)
    s_env = container_env(box, sidecar, mount, volume, extra)
    run_dir = Path(t_env["RGT_ROOT"]) / t_env["RGT_PROJECT"] / "active" / stream
    box.run_dirs.append(run_dir)
    side = box.start(sidecar["command"] + sidecar.get("args", []), box.tmp, s_env, "sidecar.log")
    train = box.start(trainer["command"] + (args or trainer.get("args", [])), box.work, t_env, "trainer.log")
    wait_until(lambda: {"job.started", "train.progress"} <= set(kinds(run_dir)), 60,
               "the sidecar container to journal the job")
    (run_dir / "go").write_text("")
    assert train.wait(60) == 0, box.log("trainer.log")
    assert side.wait(60) == 0, box.log("sidecar.log")
    return run_dir


def test_pod_containers_run_here_and_the_sidecar_serves_the_run(box: Box) -> None:
    spec = pod_spec(workload("pod.yaml"))
    trainer, _ = roles(spec)
    assert trainer["args"][:2] == ["python", "train.py"]  # the short job in box.work stands in for it
    run_dir = run_pod(box, spec, {}, env_of(trainer)["RGT_RUN"])
    names = kinds(run_dir)
    assert names.index("job.started") < names.index("train.progress") < names.index("job.exited")
    exited = next(e for e in read_all(run_dir / "rgt") if e["kind"] == "job.exited")
    assert exited["data"]["code"] == 0
    sup = read_json(run_dir / "rgt" / "supervisor.json") or {}
    assert sup.get("state") == "done"  # the follow container's supervisor, not a launched one
    assert (read_json(run_dir / "run.json") or {}).get("profile") == "kubernetes"


def test_indexed_job_pod_follows_its_own_node_stream(box: Box) -> None:
    job = workload("indexed-job.yaml")
    spec = pod_spec(job)
    trainer, _ = roles(spec)
    run = env_of(trainer)["RGT_RUN"]
    run_dir = run_pod(box, spec, {"JOB_COMPLETION_INDEX": "1"}, f"{run}.n1", args=["python", "train.py"])
    assert "job.exited" in kinds(run_dir)
    doc = read_json(run_dir / "run.json") or {}
    assert (doc.get("group"), doc.get("node"), doc.get("nodes")) == (run, "n1", 2)
    seen = json.loads((run_dir / "job-env.json").read_text())
    assert (seen["run_id"], seen["node"]) == (run, "n1")


# ---- SkyPilot ------------------------------------------------------------------------------------


def sky_task() -> Dict[str, Any]:
    task: Dict[str, Any] = yaml.safe_load((EXAMPLES / "skypilot" / "train.yaml").read_text())
    return task


def test_skypilot_task_installs_rgt_and_runs_through_launch() -> None:
    task = sky_task()
    assert set(task) <= SKY_TOP, set(task) - SKY_TOP
    assert set(task["resources"]) <= SKY_RESOURCES, set(task["resources"]) - SKY_RESOURCES
    assert task["resources"]["accelerators"]
    setup = task["setup"]
    assert "pip install remote-gpu-trainer" in setup and "pip install rgt-wheel/remote_gpu_trainer-" in setup
    run = shlex.split(task["run"].replace("\\\n", " "), comments=True)
    at = run.index("rgt-onbox")
    assert run[at + 1] == "launch" and "--wait" in run[at:] and option(run[at:], "--node") == "auto"
    assert option(run[at:], "--run-id") == "$RGT_RUN" and "RGT_RUN" in task["envs"]
    durable = task["envs"]["RGT_DURABLE"]
    assert any(durable.startswith(mount.rstrip("/") + "/") for mount in task["file_mounts"])


def sky_run(box: Box, task: Dict[str, Any], machine: str, bucket: Path) -> Tuple[Path, Any]:
    """The task's `run` block on one "machine" (its own HOME, so its own ~/rgt-runs)."""
    envs = {k: str(v) for k, v in task["envs"].items()}
    mount = next(m for m in task["file_mounts"] if envs["RGT_DURABLE"].startswith(m))
    envs["RGT_DURABLE"] = str(bucket) + envs["RGT_DURABLE"][len(mount):]
    env = box.env(box.tmp / machine, {**envs, "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "1"})
    run_dir = box.tmp / machine / "rgt-runs" / envs["RGT_PROJECT"] / "active" / f"{envs['RGT_RUN']}.n0"
    box.run_dirs.append(run_dir)
    proc = box.start(["bash", "-c", task["run"]], box.work, env, f"{machine}.log")
    return run_dir, proc


def test_skypilot_run_block_runs_here_and_a_recovery_resumes_from_the_bucket(box: Box) -> None:
    task = sky_task()
    bucket = box.tmp / "bucket"
    run_dir, proc = sky_run(box, task, "machine-a", bucket)
    wait_until(lambda: "ckpt.durable" in kinds(run_dir), 60, "the checkpoint's copy on the bucket")
    (run_dir / "go").write_text("")
    assert proc.wait(60) == 0, box.log("machine-a.log")
    doc = read_json(run_dir / "run.json") or {}
    assert (doc.get("group"), doc.get("node"), doc.get("nodes")) == (task["envs"]["RGT_RUN"], "n0", 1)
    assert {"job.started", "train.progress", "job.exited"} <= set(kinds(run_dir))
    saved = next(e for e in read_all(run_dir / "rgt") if e["kind"] == "ckpt.durable")["data"]
    copy = Path(saved["durable_path"])
    assert copy.is_relative_to(bucket) and hashlib.sha256(copy.read_bytes()).hexdigest() == saved["sha256"]

    # Spot recovery: the same block on a fresh machine; only the bucket survived.
    again, proc = sky_run(box, task, "machine-b", bucket)
    wait_until(lambda: (again / "job-env.json").exists(), 60, "the recovered job to start")
    (again / "go").write_text("")
    assert proc.wait(60) == 0, box.log("machine-b.log")
    resume = json.loads((again / "job-env.json").read_text())["resume"]
    assert resume and Path(resume).is_relative_to(again) and Path(resume).name == copy.name
    assert hashlib.sha256(Path(resume).read_bytes()).hexdigest() == saved["sha256"]
    taken = (read_json(again / "run.json") or {}).get("resume") or {}
    assert taken.get("sha256") == saved["sha256"] and taken.get("source") == str(copy)
