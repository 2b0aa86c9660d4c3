"""`rgt-onbox launch`: start one training job, detached, with its sidecar, under gates.

    launch(LaunchOptions(command=[...], ...)) -> LaunchResult

In order (the gates live in onbox/launch/gates.py): work out the run (id, project,
`<root>/<project>/active/<run-id>`; a bare `--run-id` that exists under another project is that
run), refuse when the disk cannot hold it (free space below
`ckpt_copies` x the newest checkpoint's size plus `min_free_bytes`, and too few free inodes), run the
pre-flight health check (a FAIL refuses; the report goes to rgt/preflight.json), take the run's
launch lock, refuse while the run's job still runs (recorded pid AND start time), retire the previous
attempt of a relaunched run (its supervisor is stopped and its exit/stop/job records move to
rgt/attempts/<n>/), write run.json atomically (command redacted, environment by name only), start
the job wrapper (onbox/launch/supervise.py `job`, its own session) and wait for rgt/job.json, then start the
sidecar supervisor (`sidecar`, its own session) and wait for rgt/supervisor.pid.

The job gets RGT_RUN_ID, RGT_RUN_DIR, RGT_CKPT_DIR, RGT_METRICS, RGT_RESUME_FROM (--resume-from's
file once verified and recorded by onbox/launch/resume.py, else the manifest's newest good one),
RGT_DURABLE_DIR (when given) and PYTHONUNBUFFERED=1 on top of the launcher's environment, the box's
secrets (onbox/launch/secrets.py, unless `secrets=False`; run.json records their names only) and the
`--env NAME=VALUE` (or `--env NAME`: passed on from the launcher's environment) pairs, which win over
both. The wrapper receives the job's argv and environment through a pipe, so neither lands in any
command line we create; the wrapper and supervisor themselves run without the launcher's secret-named
variables.

The CLI's body (rendering, exit codes, --wait) is onbox/cli/launch.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import profiles
from protocol import PACKAGE_VERSION
from protocol.ids import is_run_id, new_run_id

import onbox
from onbox.custody import manifest
from onbox.deadman import daemon, lease
from onbox.launch import resume as resumeimport
from onbox.launch.env import (
    Interpreter,
    InterpreterMissing,
    add_pylib,
    apply_profile,
    choose_interpreter,
    job_pylib,
    old_python_note,
)
from onbox.launch.fingerprint import write_fingerprint
from onbox.launch.gates import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    Health,
    LaunchError,
    LaunchRefused,
    LaunchUsageError,
    Stat,
    check_disk,
    newest_checkpoint,
    refuse_if_running,
    retire_previous,
    run_preflight,
    take_lock,
)
from onbox.launch.nodes import NodeError, identify, stream_id
from onbox.launch.redact import contains_secret, is_secret_name, redact_argv, redact_text, secret_values
from onbox.launch.secrets import maskable, read_secrets
from onbox.runs import (
    JobRecord,
    RunPaths,
    default_root,
    read_json,
    utc_iso,
    wait_for,
    write_atomic,
    write_json_atomic,
)
from onbox.sources import slurm

RESERVED_ENV = ("RGT_RUN_ID", "RGT_RUN_DIR", "RGT_CKPT_DIR", "RGT_METRICS", "RGT_RESUME_FROM", "RGT_NODE",
                "RGT_DURABLE_DIR")
START_TIMEOUT_S = 15.0



@dataclasses.dataclass
class LaunchOptions:
    command: Sequence[str]
    root: Optional[Path] = None            # default $RGT_ROOT or ~/rgt-runs
    project: Optional[str] = None          # default: the run's existing project, else cwd's name
    run_id: Optional[str] = None           # default: UTC timestamp + 6 hex digits
    profile: Optional[str] = None          # recorded; profiles come later
    ckpt_dir: Optional[Path] = None        # default <run>/checkpoints
    metrics: Optional[Path] = None         # default <run>/metrics.jsonl
    durable_dir: Optional[Path] = None     # recorded and exported as RGT_DURABLE_DIR
    env: Sequence[str] = ()                # "NAME=VALUE" or "NAME" (from our environment) for the job
    secrets: bool = True                   # export the box's secrets (onbox/launch/secrets.py) to the job
    cwd: Optional[Path] = None             # default: code_dir, else the launcher's; relative: from code_dir
    code_dir: Optional[Path] = None        # where `rgt launch --code` synced the code (recorded)
    python: Optional[str] = None           # the job's interpreter (launchenv.choose_interpreter)
    preflight: bool = True
    preflight_s: float = 3.0
    probe: str = "auto"                    # GPU source of the pre-flight and the sidecar
    min_free_bytes: int = 1 << 30
    ckpt_copies: float = 3.0
    sidecar: bool = True
    sidecar_linger_s: float = 300.0
    serve_args: Sequence[str] = ()         # extra `rgt-onbox serve` options (tests: --heartbeat 1)
    # `--wait` (a scheduler's step): a SIGTERM to every process of the step lets the supervisor and
    # the sidecar stay until the job's exit is journaled (onbox/launch/supervise.py).
    finish_on_term: bool = False
    watch: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # run.json "watch" (settings.py)
    # The box's dead-man lease (onbox/deadman/lease.py): armed for this TTL by the launch, None leaves it
    # as it is (the CLI's default is 2 h; a library caller opts in).
    deadman_ttl_s: Optional[float] = None
    deadman_idle_s: float = 30 * 60.0
    deadman_max_hours: Optional[float] = None
    # Multi-node (onbox/launch/nodes.py): this launch is node NODE of run `run_id`; "auto" reads the
    # scheduler.
    node: Optional[str] = None
    # Seconds a preemption leaves between SIGTERM and SIGKILL; default: the profile's [spot] grace_s.
    preempt_grace_s: Optional[float] = None
    # `rgt resume`: a checkpoint pushed from another box, its SHA-256 and step, and the run it continues.
    resume_from: Optional[Path] = None
    resume_sha256: Optional[str] = None
    resume_step: Optional[int] = None
    resumes: Optional[str] = None


@dataclasses.dataclass
class LaunchResult:
    run_id: str
    project: str
    run_dir: Path
    pid: int                               # the job wrapper: what the sidecar watches
    job_pid: Optional[int]
    sidecar_supervisor_pid: Optional[int]
    attempt: int
    command: List[str]                     # redacted
    resume_from: Optional[Path] = None
    preflight: str = "skipped"
    warnings: List[str] = dataclasses.field(default_factory=list)
    secrets: List[str] = dataclasses.field(default_factory=list)   # names of the secrets exported
    group: Optional[str] = None                                    # multi-node: the logical run id
    node: Optional[str] = None

    @property
    def train_log(self) -> Path:
        return self.run_dir / "train.log"

    def to_dict(self) -> Dict[str, Any]:
        return {"run_id": self.run_id, "run_dir": str(self.run_dir), "pid": self.pid,
                "sidecar_supervisor_pid": self.sidecar_supervisor_pid, "project": self.project,
                "job_pid": self.job_pid, "attempt": self.attempt, "train_log": str(self.train_log),
                "resume_from": str(self.resume_from) if self.resume_from else None,
                "preflight": self.preflight, "warnings": self.warnings, "secrets": self.secrets,
                "group": self.group, "node": self.node}


@dataclasses.dataclass
class _Plan:
    run_id: str
    project: str
    paths: RunPaths
    cwd: Path
    ckpt_dir: Path
    metrics: Path
    durable_dir: Optional[Path]
    env_set: Dict[str, str]
    secrets: List[str]
    existing: bool
    profile_record: Optional[Dict[str, object]] = None   # what --profile applied (run.json)
    group: Optional[str] = None                          # multi-node: the logical run id
    node: Optional[str] = None
    nodes: Optional[int] = None
    secret_env: Dict[str, str] = dataclasses.field(default_factory=dict)  # the box's secrets, for the job
    notes: List[str] = dataclasses.field(default_factory=list)            # warnings found while planning


# ---- planning -----------------------------------------------------------------------------------




def _safe_name(text: str, fallback: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:64]
    return name if is_run_id(name) else fallback


def _checked(value: str, what: str) -> str:
    if not is_run_id(value):
        raise LaunchUsageError(f"{what} {value!r} must be 1-128 of A-Z a-z 0-9 . _ - (starting alphanumeric, "
                               "no '..')")
    return value


def _env_pairs(pairs: Sequence[str], environ: Mapping[str, str]) -> Dict[str, str]:
    """`--env NAME=VALUE`, or `--env NAME` to pass NAME on from the launcher's environment."""
    out: Dict[str, str] = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise LaunchUsageError(f"--env takes NAME=VALUE or NAME, got {name[:20]!r}...")
        if name in RESERVED_ENV:
            raise LaunchUsageError(f"--env {name} is set by the launcher itself")
        if not eq and name not in environ:
            raise LaunchUsageError(f"--env {name}: not set in this environment")
        out[name] = value if eq else environ[name]
    return out


def _env_warnings(pairs: Sequence[str]) -> List[str]:
    return [f"--env {name} with a value puts a secret on a command line; export {name}, pass --env {name}"
            for name, eq, _ in (p.partition("=") for p in pairs) if eq and is_secret_name(name)]


def _job_cwd(opts: LaunchOptions) -> Path:
    """--cwd (relative: from --code-dir, else the launcher's), else --code-dir, else the launcher's."""
    base = Path(opts.code_dir).expanduser() if opts.code_dir else Path(os.getcwd())
    if opts.code_dir and not base.is_dir():
        raise LaunchUsageError(f"--code-dir {opts.code_dir}: no such directory on {_host()}")
    cwd = (base / Path(opts.cwd).expanduser()) if opts.cwd else base
    if not cwd.is_dir():
        raise LaunchUsageError(f"--cwd {opts.cwd}: no such directory on {_host()} ({cwd})",
                               "name a directory that exists there (relative: from the synced code)")
    return cwd.resolve()


def _plan(opts: LaunchOptions, environ: Mapping[str, str]) -> _Plan:
    if not opts.command:
        raise LaunchUsageError("no command to run", "rgt-onbox launch [OPTIONS] -- python train.py ...")
    root = Path(opts.root).expanduser() if opts.root else default_root(dict(environ))
    root = root.resolve()
    cwd = _job_cwd(opts)
    run_id = _checked(opts.run_id, "run id") if opts.run_id else new_run_id()
    group, node, nodes = None, None, None
    if opts.node:
        if not opts.run_id:
            raise LaunchUsageError("--node needs --run-id: every node of the run must name the same run",
                                   "rgt-onbox launch --run-id RUN --node auto -- ...")
        try:
            node, nodes = identify(opts.node, environ)
        except NodeError as e:
            raise LaunchUsageError(str(e)) from e
        group, run_id = run_id, _checked(stream_id(run_id, node), "run id")
    project = _checked(opts.project, "project") if opts.project else None
    if project is None and opts.run_id:
        found = sorted(p.parent.parent.name for p in root.glob(f"*/active/{run_id}") if p.is_dir())
        if len(found) > 1:
            raise LaunchUsageError(f"run {run_id} exists in several projects ({', '.join(found)})",
                                   "name the one to resume with --project")
        project = found[0] if found else None
    code = Path(opts.code_dir) if opts.code_dir else None
    project = project or _safe_name(code.parent.name if code and code.name == "code" else cwd.name, "default")
    paths = RunPaths(root / project / "active" / run_id)
    env_set = _env_pairs(opts.env, environ)
    notes: List[str] = []
    secret_env = read_secrets(environ=environ, warn=notes.append, reserved=RESERVED_ENV) \
        if opts.secrets else {}
    found_secrets = maskable(secret_env.values(), secret_values({**environ, **env_set}))
    return _Plan(run_id=run_id, project=project, paths=paths, cwd=cwd,
                 ckpt_dir=Path(opts.ckpt_dir).expanduser().resolve() if opts.ckpt_dir
                 else paths.run_dir / "checkpoints",
                 metrics=Path(opts.metrics).expanduser().resolve() if opts.metrics
                 else paths.run_dir / "metrics.jsonl",
                 durable_dir=Path(opts.durable_dir).expanduser().resolve() if opts.durable_dir else None,
                 env_set=env_set, secrets=found_secrets, existing=paths.run_dir.exists(),
                 secret_env=secret_env, notes=notes, group=group, node=node, nodes=nodes)


def _git(cwd: Path, *args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", "-C", str(cwd), *args], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=3, check=False,
                              env={**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.decode(errors="replace").strip() if done.returncode == 0 else None


def _host() -> str:
    return _safe_name(os.uname().nodename.split(".")[0], "host")


def _interpreter(opts: LaunchOptions, profile: Optional[profiles.Profile], environ: Mapping[str, str],
                 plan: _Plan) -> Tuple[List[str], Interpreter]:
    """The job's argv with its chosen interpreter (onbox/launch/env.py); a usage error naming a
    missing one."""
    path_env = {**environ, **plan.secret_env, **plan.env_set}.get("PATH")
    try:
        return choose_interpreter(opts.command, opts.python, profile.scripts.python if profile else None,
                                  path_env, plan.cwd, _host(), plan.notes)
    except InterpreterMissing as e:
        raise LaunchUsageError(str(e), e.hint) from e


def _apply_profile(profile: Optional[profiles.Profile], argv: List[str], environ: Mapping[str, str],
                   plan: _Plan, env: Dict[str, str], interp: Interpreter) -> Tuple[List[str], List[str]]:
    """The job's argv under the profile (proxy hook), its variables added to `env`; PYTHONPATH gets the
    directory that holds only `onbox` and `protocol` (launchenv.job_pylib), after the user's entries."""
    notes = old_python_note(interp)
    try:
        add_pylib(env, job_pylib(plan.paths.run_dir.parent.parent.parent))
    except OSError as e:
        notes.append(f"`from onbox import report` will not import in the job: {e}")
    if profile is None:
        return argv, notes
    applied = apply_profile(profile, argv, {**environ, **plan.secret_env, **plan.env_set})
    env.update(applied.env)
    plan.profile_record = {**applied.record, **({"python": interp.path} if interp.source == "profile"
                                                  else {})}
    return applied.argv, notes + applied.notes


def _preempt_grace(opts: LaunchOptions, profile: Optional[profiles.Profile]) -> Optional[float]:
    """What the wrapper records as the grace a preemption gave (job.preempted): --preempt-grace,
    else the profile's [spot] grace_s, else unknown."""
    if opts.preempt_grace_s is not None:
        return opts.preempt_grace_s
    return profile.spot.grace_s if profile is not None else None


def _job_env(plan: _Plan, environ: Mapping[str, str], resume: Optional[Path]) -> Dict[str, str]:
    env = {k: v for k, v in environ.items() if k not in RESERVED_ENV}
    env.update(plan.secret_env)
    env.update(plan.env_set)
    env.update({"RGT_RUN_ID": plan.group or plan.run_id, "RGT_RUN_DIR": str(plan.paths.run_dir),
                "RGT_CKPT_DIR": str(plan.ckpt_dir), "RGT_METRICS": str(plan.metrics),
                "PYTHONUNBUFFERED": "1"})
    if resume is not None:
        env["RGT_RESUME_FROM"] = str(resume)
    if plan.node is not None:
        env["RGT_NODE"] = plan.node
    if plan.durable_dir is not None:
        env["RGT_DURABLE_DIR"] = str(plan.durable_dir)
    return env


def _scheduler(env: Mapping[str, str]) -> Optional[Dict[str, Any]]:
    job = slurm.from_env(env)
    return job.to_dict() if job else None


def _run_json(plan: _Plan, opts: LaunchOptions, display: List[str], env: Mapping[str, str], attempt: int,
              resume: Optional[Path], preflight: str, interp: Interpreter,
              taken: Optional[resumeimport.Taken] = None) -> str:
    prev = read_json(plan.paths.run_json) or {}
    sha = _git(plan.cwd, "rev-parse", "HEAD")
    dirty = _git(plan.cwd, "status", "--porcelain", "--untracked-files=no") if sha else None
    doc = {
        "v": 1, "id": plan.run_id, "project": plan.project, "command": display,
        "command_line": shlex.join(display), "cwd": str(plan.cwd), "profile": opts.profile,
        "host": _host(), "started_at": prev.get("started_at") or utc_iso(), "launched_at": utc_iso(),
        "attempt": attempt, "git_sha": sha, "git_dirty": None if dirty is None else bool(dirty),
        "python": interp.path, "launcher_python": sys.executable, "interpreter": interp.record(),
        "code_dir": str(Path(opts.code_dir).resolve()) if opts.code_dir else None,
        "job_pythonpath": env.get("PYTHONPATH"),
        "env_names": sorted(env), "env_set": sorted(plan.env_set), "ckpt_dir": str(plan.ckpt_dir),
        "metrics": str(plan.metrics), "durable_dir": str(plan.durable_dir) if plan.durable_dir else None,
        "resume_from": str(resume) if resume else None, "preflight": preflight, "resumes": opts.resumes,
        "resume": taken.record() if taken else None,  # a checkpoint from elsewhere (onbox/launch/resume.py)
        "profile_applied": plan.profile_record, "secrets": sorted(plan.secret_env),  # names only
        "package_version": PACKAGE_VERSION,
        "group": plan.group, "node": plan.node, "nodes": plan.nodes,
        # The scheduler's job this attempt runs in (Slurm: ids only), for the preemption reason and stop.
        "scheduler": _scheduler(env),
        # Only the lease settings this launch asked for; the lease itself is ~/.rgt/deadman.json.
        "deadman": None if opts.deadman_ttl_s is None else {
            "ttl_s": opts.deadman_ttl_s, "idle_s": opts.deadman_idle_s, "max_hours": opts.deadman_max_hours},
        # What the sidecar watches (onbox/launch/settings.py); a restarted sidecar reads it again.
        "watch": {"metrics": str(plan.metrics), "ckpt_dir": str(plan.ckpt_dir),
                  "durable_dir": str(plan.durable_dir) if plan.durable_dir else None,
                  **{k: v for k, v in opts.watch.items() if v is not None}},
    }
    text = json.dumps(doc, indent=1) + "\n"
    return redact_text(text, plan.secrets) if contains_secret(text, plan.secrets) else text


# ---- starting the processes ---------------------------------------------------------------------


def _quiet_env(environ: Mapping[str, str]) -> Dict[str, str]:
    """The environment of the wrapper and the supervisor: the launcher's, without secret-named
    variables, and able to import this very package (a checkout run without installing it too)."""
    env = {k: v for k, v in environ.items() if not is_secret_name(k) and k not in RESERVED_ENV}
    here = str(Path(onbox.__file__).resolve().parent.parent)  # where `import onbox` finds this one
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [environ.get("PYTHONPATH")])])
    return env


def _log_tail(plan: _Plan, lines: int = 5) -> str:
    try:
        text = plan.paths.train_log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return redact_text(" | ".join(text), plan.secrets)[-500:]


def _start_job(plan: _Plan, spec: Dict[str, Any], environ: Mapping[str, str],
               python: str) -> JobRecord:
    argv = [python, "-m", "onbox.launch.supervise", "job", "--run-dir", str(plan.paths.run_dir)]
    with open(plan.paths.train_log, "ab") as log:  # the wrapper's own errors land in train.log
        proc = subprocess.Popen(argv, cwd=str(plan.paths.run_dir), env=_quiet_env(environ),
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log,
                                start_new_session=True, close_fds=True)
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass

    def started() -> Optional[JobRecord]:
        job = JobRecord.read(plan.paths)
        if job is not None and job.wrapper is not None and job.wrapper.pid == proc.pid:
            return job
        return None

    job = wait_for(lambda: started() or proc.poll() is not None, START_TIMEOUT_S, 0.02)
    job = started()
    if job is None:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        raise LaunchError(f"the job wrapper did not start (train.log: {_log_tail(plan)})",
                          "see train.log in the run directory")
    if job.job is None:
        error = (read_json(plan.paths.exit_json) or {}).get("error", "")
        raise LaunchError(redact_text(f"the job did not start: {error}", plan.secrets),
                          "check the command and the working directory")
    return job


def _start_supervisor(plan: _Plan, opts: LaunchOptions, wrapper_pid: int, environ: Mapping[str, str],
                      python: str) -> Tuple[Optional[int], List[str]]:
    argv = [python, "-m", "onbox.launch.supervise", "sidecar", "--run-dir", str(plan.paths.run_dir),
            "--pid", str(wrapper_pid), "--linger", f"{opts.sidecar_linger_s:g}",
            *(["--finish-on-term"] if opts.finish_on_term else []), "--",
            "--gpu", opts.probe, *opts.serve_args]
    with open(plan.paths.supervisor_log, "ab") as log:
        proc = subprocess.Popen(argv, cwd=str(plan.paths.run_dir), env=_quiet_env(environ),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)

    def written() -> bool:
        try:
            return plan.paths.supervisor_pid.read_text().strip() == str(proc.pid)
        except OSError:
            return False

    wait_for(lambda: written() or proc.poll() is not None, START_TIMEOUT_S, 0.02)
    if written():
        return proc.pid, []
    return None, [f"the sidecar supervisor did not start (see {plan.paths.supervisor_log}); "
                  "the job runs unwatched"]


def _arm_deadman(opts: LaunchOptions, plan: _Plan, environ: Mapping[str, str], python: str) -> List[str]:
    """Arm the box's dead-man lease for this launch and make sure its daemon runs; a failure is a
    warning, never a failed launch (the job already runs)."""
    if opts.deadman_ttl_s is None:
        return []
    root = str(plan.paths.run_dir.parent.parent.parent)
    paths = lease.paths_for(environ)
    try:
        lease.arm(paths, ttl_s=opts.deadman_ttl_s, idle_s=opts.deadman_idle_s,
                    max_hours=opts.deadman_max_hours, profile=opts.profile, root=root, by="launch",
                    now=time.time(), environ=environ)
    except (OSError, lease.DeadmanError) as e:
        return [f"the dead-man lease could not be armed: {e}"]
    state = daemon.ensure_daemon(paths, environ, python)
    return [] if state["running"] else [f"the dead-man daemon is not running: {state['reason']}"]


# ---- the whole launch ---------------------------------------------------------------------------


def launch(opts: LaunchOptions, *, environ: Optional[Mapping[str, str]] = None, stat: Stat = os.statvfs,
           health: Optional[Health] = None, python: str = sys.executable) -> LaunchResult:
    """Start the job and its sidecar (see the module doc). Raises LaunchError and its kinds."""
    environ = dict(os.environ if environ is None else environ)
    plan = _plan(opts, environ)
    request = resumeimport.requested(opts.resume_from, opts.resume_sha256, opts.resume_step, opts.resumes)
    try:  # a bad profile is refused before anything starts
        profile = profiles.load(opts.profile, profiles.directory(environ)) if opts.profile else None
    except profiles.ProfileError as e:
        raise LaunchUsageError(str(e), "name one of the profiles in profiles/") from e
    display = redact_argv(opts.command, plan.secrets)
    chosen, interp = _interpreter(opts, profile, environ, plan)
    check_disk(plan.paths.run_dir, plan.ckpt_dir, plan.existing, opts.ckpt_copies, opts.min_free_bytes, stat)
    if plan.existing and plan.paths.rgt.is_dir():
        refuse_if_running(plan.paths)  # early, before the pre-flight's seconds; checked again locked
    report = run_preflight(plan.paths, opts.preflight_s, opts.probe, health) if opts.preflight else None
    plan.paths.rgt.mkdir(parents=True, exist_ok=True)
    lock_fd = take_lock(plan.paths)
    try:
        refuse_if_running(plan.paths)
        attempt = retire_previous(plan.paths)
        if report is not None:
            write_json_atomic(plan.paths.preflight_json, report)
        plan.ckpt_dir.mkdir(parents=True, exist_ok=True)
        plan.metrics.parent.mkdir(parents=True, exist_ok=True)
        taken = resumeimport.take(plan.paths.run_dir, plan.ckpt_dir, request) if request else None
        resume = taken.path if taken else manifest.newest_good(plan.paths.run_dir)
        env = _job_env(plan, environ, resume)
        argv, profile_notes = _apply_profile(profile, chosen, environ, plan, env, interp)
        preflight = str(report.get("result")) if report else "skipped"
        doc = _run_json(plan, opts, display, env, attempt, resume, preflight, interp, taken)
        write_atomic(plan.paths.run_json, doc)
        spec = {"argv": argv, "cwd": str(plan.cwd), "env": env, "display": shlex.join(display),
                "run_id": plan.run_id, "attempt": attempt,
                "preempt_grace_s": _preempt_grace(opts, profile)}
        job = _start_job(plan, spec, environ, python)
        assert job.wrapper is not None
        sup_pid, warnings = (_start_supervisor(plan, opts, job.wrapper.pid, environ, python)
                             if opts.sidecar else (None, ["no sidecar here: rgt-onbox follow serves it"]))
    finally:
        os.close(lock_fd)
    # What `rgt compare` diffs beyond run.json (config files, seeds, packages, the GPU), written once
    # the job runs: listing the job interpreter's packages must not delay it. Never raises.
    write_fingerprint(plan.paths.run_dir, list(opts.command), plan.cwd, env, interp.path)
    warnings += _arm_deadman(opts, plan, environ, python)
    warnings[:0] = plan.notes + _env_warnings(opts.env) + profile_notes
    if display != list(opts.command):
        warnings.insert(0, "the command holds secret-looking values (*** above); the job's command line "
                           "is visible to every user of this box: pass them through the environment")
    if report is not None and report.get("result") == "WARN":
        warnings.insert(0, "pre-flight WARN: " + "; ".join(
            str(c.get("detail")) for c in report.get("checks", []) if c.get("status") == "WARN")[:300])
    return LaunchResult(run_id=plan.run_id, project=plan.project, run_dir=plan.paths.run_dir,
                        pid=job.wrapper.pid, job_pid=job.job.pid if job.job else None,
                        sidecar_supervisor_pid=sup_pid, attempt=attempt, command=display,
                        resume_from=resume, preflight=preflight,
                        warnings=[redact_text(w, plan.secrets) for w in warnings],
                        secrets=sorted(plan.secret_env), group=plan.group, node=plan.node)


__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_REFUSED", "EXIT_USAGE", "LaunchError", "LaunchOptions",
           "LaunchRefused", "LaunchResult", "LaunchUsageError", "check_disk", "launch", "new_run_id",
           "newest_checkpoint", "run_preflight"]
