"""`rgt-onbox`: the sidecar's command line.

Commands are thin: parse, call one function, render, map errors to exit codes
(0 ok, 1 runtime error, 2 usage error). Logging is configured here and only here.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import click
from protocol import PACKAGE_VERSION

from onbox.errors import OnboxError
from onbox.sidecar.journal import JournalError

log = logging.getLogger("onbox")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s rgt-onbox %(levelname)s %(name)s: %(message)s")


def _fail(message: str, hint: str = "", code: int = 1) -> click.exceptions.Exit:
    click.echo(f"error: {message}", err=True)
    if hint:
        click.echo(f"hint: {hint}", err=True)
    return click.exceptions.Exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(PACKAGE_VERSION, prog_name="rgt-onbox")
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """The remote-gpu-trainer sidecar: watches one training run on this box."""
    ctx.obj = {"debug": debug}


@main.command()
@click.option("--run-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The run directory (<root>/<project>/active/<run-id>).")
@click.option("--run-id", default="", help="Run id (default: run.json's id, else the directory name).")
@click.option("--host", default="", help="Host name carried in events (default: this machine's).")
@click.option("--pid", "job_pid", type=int, default=None, help="The training job's pid to watch.")
@click.option("--gpu", "gpu", default="auto", show_default=True, metavar="auto|none|fake:SCENARIO",
              help="GPU source: NVML when present, off, or a scripted scenario (tests, demos).")
@click.option("--watch", "watch_paths", multiple=True, type=click.Path(path_type=Path),
              help="Also watch this filesystem's space (repeatable); the run dir's is always watched.")
@click.option("--gpu-interval", "gpu_interval_s", type=click.FloatRange(min=0.05), default=2.0,
              show_default=True, help="Seconds between GPU samples (gpu.sample aggregates 30 s of them).")
@click.option("--no-kmsg", is_flag=True, help="Do not read Xids from /dev/kmsg (NVML events only).")
@click.option("--heartbeat", "heartbeat_s", type=click.FloatRange(min=0.05), default=30.0,
              show_default=True, help="Seconds between heartbeat events.")
@click.option("--tcp", default=None, metavar="127.0.0.1:PORT",
              help="Opt-in TCP instead of unix sockets: control on PORT, events on PORT+1. "
                   "Needs --curve-dir.")
@click.option("--curve-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="CURVE keys for --tcp: server keypair, and allowed client certificates in authorized/.")
@click.option("--synthetic", "synthetic_count", type=click.IntRange(min=0), default=0, hidden=True,
              help="Tests/benchmarks: emit synthetic events until the journal's seq reaches N.")
@click.option("--synthetic-rate", "synthetic_rate", type=click.FloatRange(min=0), default=0.0, hidden=True)
@click.option("--synthetic-delay", "synthetic_delay", type=click.FloatRange(min=0), default=0.0, hidden=True)
@click.option("--journal-rotate-bytes", type=click.IntRange(min=4096), default=16 << 20, hidden=True)
@click.option("--stacks-budget", "stacks_budget_s", type=click.FloatRange(min=1, max=600), default=8.0,
              show_default=True, metavar="SECONDS",
              help="The longest a stall's onset waits for the job's Python stacks (py-spy).")
@click.option("--finish-on-term", is_flag=True,
              help="A first SIGTERM/SIGINT stops once the job's exit is journaled, a second at once "
                   "(`launch --wait` sets it: a scheduler ending a step signals every process).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.pass_context
def serve(ctx: click.Context, run_dir: Path, run_id: str, host: str, job_pid: Optional[int],
          gpu: str, watch_paths: Tuple[Path, ...], gpu_interval_s: float, no_kmsg: bool,
          heartbeat_s: float,
          tcp: Optional[str], curve_dir: Optional[Path], synthetic_count: int,
          synthetic_rate: float, synthetic_delay: float, journal_rotate_bytes: int, stacks_budget_s: float,
          finish_on_term: bool, log_level: str) -> None:
    """Journal and publish this run's events until SIGTERM/SIGINT.

    Events go to <run-dir>/rgt/events.jsonl and out over unix sockets in a 0700
    directory; <run-dir>/rgt/endpoints.json says where.
    """
    _setup_logging("debug" if ctx.obj["debug"] else log_level)
    from onbox.sidecar.server import Sidecar, SidecarConfig
    from onbox.sidecar.transport import load_curve_server, parse_tcp

    try:
        tcp_bind = parse_tcp(tcp) if tcp else None
        if tcp_bind and curve_dir is None:
            raise _fail("--tcp needs --curve-dir: plain TCP is never offered",
                        "or leave --tcp off and reach the sidecar through its unix sockets", 2)
        curve = load_curve_server(curve_dir) if (tcp_bind and curve_dir) else None
        sidecar = Sidecar(SidecarConfig(
            run_dir=run_dir, run_id=run_id, host=host, heartbeat_s=heartbeat_s, tcp=tcp_bind,
            curve=curve, job_pid=job_pid, gpu=gpu, gpu_sample_s=gpu_interval_s, watch_paths=watch_paths,
            kmsg=not no_kmsg,
            synthetic_count=synthetic_count,
            synthetic_rate_hz=synthetic_rate, synthetic_delay_s=synthetic_delay,
            journal_rotate_bytes=journal_rotate_bytes, stacks_budget_s=stacks_budget_s))
    except OnboxError as e:
        raise _fail(str(e), code=2) from None
    _install_signals(_first_finishes(sidecar.finish, sidecar.stop) if finish_on_term else sidecar.stop)
    try:
        sidecar.start()
    except (OnboxError, JournalError) as e:
        raise _fail(str(e)) from None
    log.info("serving run %s (boot %s)", sidecar.run_id, sidecar.boot_id)
    try:
        sidecar.serve()
    finally:
        sidecar.close()


@main.command()
@click.option("--gpu", "gpu_index", type=click.IntRange(min=0), default=None, metavar="N",
              help="Check only GPU N (default: all).")
@click.option("--seconds", type=click.FloatRange(min=0.5, max=600), default=5.0, show_default=True,
              help="How long to sample.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of a table.")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Check the disk and memory headroom where this run writes (default: here).")
@click.option("--probe", default="auto", hidden=True, metavar="auto|none|fake:SCENARIO",
              help="GPU source (tests and demos use a scripted scenario).")
def health(gpu_index: Optional[int], seconds: float, as_json: bool, run_dir: Optional[Path],
           probe: str) -> None:
    """Pre-flight: sample the box for a few seconds and judge each check.

    PASS / WARN / FAIL per check: Xid history, throttle, temperature, ECC, row
    remap, GPU lost, foreign VRAM holders, disk, memory headroom. Exit 0 on
    pass or warn, 2 on fail. Without a GPU or driver the GPU checks say so
    (SKIP) and the rest still run.
    """
    from onbox.monitors.preflight import run_health

    try:
        code = run_health(gpu_index, seconds, as_json, run_dir, sys.stdout, gpu=probe)
    except OnboxError as e:
        raise _fail(str(e), code=2) from None
    if code:
        raise click.exceptions.Exit(code)


@main.command()
@click.argument("source", default="-", metavar="[FILE|-]")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: the Xids and a summary.")
def xids(source: str, as_json: bool) -> None:
    """Classify the Xid lines of a saved kernel log, or of stdin (paste `dmesg` output).

    One record per Xid: code, PCI id, pid, class and what to do on a rented box.
    Exit 2 if any Xid means the GPU or box can no longer be trusted.
    """
    from onbox.cli.xids import run_xids

    code = run_xids(source, as_json, sys.stdin, sys.stdout, sys.stderr)
    if code:
        raise click.exceptions.Exit(code)


_root_option = click.option(
    "--root", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Where runs live: <root>/<project>/active/<run-id> (default: $RGT_ROOT, else ~/rgt-runs).")


@main.command(context_settings={"allow_interspersed_args": False})
@_root_option
@click.option("--project", default=None,
              help="Project name (default: an existing run's, else this directory's name).")
@click.option("--run-id", default=None,
              help="Run id (default: UTC time + random). An existing run id is resumed in place.")
@click.option("--profile", default=None,
              help="Platform profile (profiles/NAME.toml): its interpreter, proxy hook and mirror variables.")
@click.option("--ckpt-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the job writes checkpoints: RGT_CKPT_DIR (default: <run>/checkpoints).")
@click.option("--metrics", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The job's metrics file: RGT_METRICS (default: <run>/metrics.jsonl).")
@click.option("--durable-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Storage that outlives the box: checkpoints are copied there and re-hashed.")
@click.option("--durable-policy", type=click.Choice(["all", "last"]), default=None,
              help="Copy every checkpoint (all, the default) or keep copying the newest (last).")
@click.option("--env", "env", multiple=True, metavar="NAME[=VALUE]",
              help="Set for the job (repeatable); NAME alone passes it on from this environment, "
                   "the way to hand over a secret. Names are recorded, never values.")
@click.option("--no-secrets", is_flag=True,
              help="Do not export the box's secrets (~/.rgt/secrets, from `rgt secret push`) to the job.")
@click.option("--watch-scalar", "scalars", multiple=True, metavar="NAME",
              help="A metric to watch (repeatable; default: loss): non-finite, spikes, stuck at 0.")
@click.option("--log-regex", default=None,
              help="Regex with named groups (step, epoch, scalars) for train.log.")
@click.option("--stall-floor", "stall_floor_s", type=click.FloatRange(min=0.05), default=None,
              metavar="SECONDS", help="Shortest silence that counts as a stall (default 300).")
@click.option("--stall-grace", "stall_grace_s", type=click.FloatRange(min=0), default=None,
              metavar="SECONDS", help="Start-up time before the first steps (default 900).")
@click.option("--expected-steps", type=click.IntRange(min=1), default=None,
              help="Warn when the job finishes far sooner.")
@click.option("--expected-seconds", type=click.FloatRange(min=1), default=None,
              help="Warn when the job finishes far sooner.")
@click.option("--stale-after", "stale_after_s", type=click.FloatRange(min=1), default=None,
              metavar="SECONDS", help="Warn when no good checkpoint is this old.")
@click.option("--no-preflight", is_flag=True, help="Launch without the pre-flight health check.")
@click.option("--python", "python", default=None, metavar="PATH",
              help="The job's Python: a command starting with python/python3/pythonX.Y runs with it "
                   "(default: the profile's, else python3 on PATH).")
@click.option("--cwd", default=None, metavar="DIR",
              help="The job's working directory (default: --code-dir, else this one; relative: from it).")
@click.option("--code-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where `rgt launch --code` put the code (recorded; the default working directory).")
@click.option("--min-free", default="1GiB", show_default=True,
              help="Free disk kept on top of the checkpoint budget.")
@click.option("--ckpt-copies", type=click.FloatRange(min=0), default=3.0, show_default=True,
              help="Free disk needed, in sizes of the newest checkpoint.")
@click.option("--sidecar-linger", default="5m", show_default=True,
              help="Keep the sidecar serving this long after the job's exit is reported.")
@click.option("--deadman", "deadman_ttl", default="2h", show_default=True, metavar="TTL|off",
              envvar="RGT_DEADMAN", show_envvar=True,
              help="Arm the box's dead-man lease for TTL (the controller renews it); off leaves it be.")
@click.option("--deadman-idle", default="30m", show_default=True,
              help="The dead-man holds while a run's metrics, train.log or checkpoints changed within this.")
@click.option("--max-hours", type=click.FloatRange(min=0, min_open=True), default=None,
              help="A hard budget for the dead-man: act after this many hours whatever the runs do.")
@click.option("--node", default=None, metavar="NAME|auto",
              help="Multi-node: this is node NAME of --run-id (auto: from SLURM_NODEID, "
                   "JOB_COMPLETION_INDEX or NODE_RANK). Its stream is <run-id>.<node>.")
@click.option("--preempt-grace", "preempt_grace_s", type=click.FloatRange(min=0), default=None,
              metavar="SECONDS", help="Grace a preemption gives (default: the profile's [spot] grace_s).")
@click.option("--resume-from", type=click.Path(path_type=Path), default=None, metavar="FILE|DIR",
              help="Resume from this checkpoint, a file or a directory unit such as HF's checkpoint-N "
                   "(pushed by `rgt resume`): hashed, recorded, RGT_RESUME_FROM.")
@click.option("--resume-sha256", default=None, metavar="HEX",
              help="The SHA-256 of the --resume-from file, or a directory's unit digest; refused when "
                   "it differs.")
@click.option("--resume-step", type=click.IntRange(min=0), default=None,
              help="The step of --resume-from: a job that starts far below it is train.restarted_from_zero.")
@click.option("--resumes", default=None, metavar="RUN",
              help="The run this one continues (recorded in run.json).")
@click.option("--wait", is_flag=True,
              help="Stay until the job ends and exit with its status, passing SIGTERM on "
                   "(srun, a container's command).")
@click.option("--no-sidecar", is_flag=True,
              help="Start no sidecar here: one runs elsewhere (a Kubernetes sidecar container).")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object: run_id, run_dir, pid, sidecar_supervisor_pid, ...")
@click.option("--probe", default="auto", hidden=True, metavar="auto|none|fake:SCENARIO",
              help="GPU source of the pre-flight and the sidecar (tests and demos).")
@click.option("--preflight-seconds", type=click.FloatRange(min=0.5, max=600), default=3.0, hidden=True)
@click.option("--serve-arg", "serve_args", multiple=True, hidden=True,
              help="Extra `rgt-onbox serve` argument (tests: --heartbeat 1).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def launch(root: Optional[Path], project: Optional[str], run_id: Optional[str], profile: Optional[str],
           ckpt_dir: Optional[Path], metrics: Optional[Path], durable_dir: Optional[Path],
           durable_policy: Optional[str], env: Tuple[str, ...], no_secrets: bool, scalars: Tuple[str, ...],
           log_regex: Optional[str], stall_floor_s: Optional[float], stall_grace_s: Optional[float],
           expected_steps: Optional[int], expected_seconds: Optional[float],
           stale_after_s: Optional[float], no_preflight: bool, python: Optional[str], cwd: Optional[str],
           code_dir: Optional[Path], min_free: str, ckpt_copies: float,
           sidecar_linger: str, deadman_ttl: str, deadman_idle: str, max_hours: Optional[float],
           node: Optional[str], preempt_grace_s: Optional[float], resume_from: Optional[Path],
           resume_sha256: Optional[str], resume_step: Optional[int], resumes: Optional[str], wait: bool,
           no_sidecar: bool, as_json: bool,
           probe: str, preflight_seconds: float,
           serve_args: Tuple[str, ...], command: Tuple[str, ...]) -> None:
    """Start COMMAND detached, with its sidecar, and return.

        rgt-onbox launch [OPTIONS] -- python train.py --lr 3e-4

    Makes <root>/<project>/active/<run-id> (run.json, train.log, rgt/), refuses when the
    disk cannot hold the run, the pre-flight fails or the run is still running, and starts
    the job in its own session with RGT_RUN_ID, RGT_RUN_DIR, RGT_CKPT_DIR, RGT_METRICS and
    RGT_RESUME_FROM set, plus every secret pushed to this box (`rgt secret push`; names
    recorded, never values). Never put a secret in COMMAND: push it, or export it and pass --env NAME.
    It also arms the box's dead-man lease (--deadman, default 2h) and starts its daemon.
    Exit 0 launched, 1 failed, 2 bad usage, 3 refused.
    """
    from rgtlib.units import parse_duration, parse_size

    from onbox.cli.launch import run_launch
    from onbox.launch.launcher import LaunchOptions


    try:
        min_free_bytes = parse_size(min_free)
        linger_s = parse_duration(sidecar_linger)
        ttl_s = None if deadman_ttl.strip().lower() == "off" else parse_duration(deadman_ttl)
        idle_s = parse_duration(deadman_idle)
        if (ttl_s is not None and ttl_s <= 0) or idle_s <= 0:
            raise ValueError("--deadman and --deadman-idle take a duration above 0 (or --deadman off)")
    except ValueError as e:
        raise _fail(str(e), code=2) from None
    watch = {"scalars": list(scalars) or None, "log_regex": log_regex, "stall_floor_s": stall_floor_s,
             "stall_grace_s": stall_grace_s, "expected_steps": expected_steps,
             "expected_seconds": expected_seconds, "stale_after_s": stale_after_s,
             "durable_policy": durable_policy}
    opts = LaunchOptions(
        command=list(command), root=root, project=project, run_id=run_id, profile=profile,
        ckpt_dir=ckpt_dir, metrics=metrics, durable_dir=durable_dir, env=list(env), secrets=not no_secrets,
        preflight=not no_preflight, preflight_s=preflight_seconds, probe=probe,
        min_free_bytes=min_free_bytes, ckpt_copies=ckpt_copies, sidecar_linger_s=linger_s,
        serve_args=list(serve_args), watch=watch, deadman_ttl_s=ttl_s, deadman_idle_s=idle_s,
        deadman_max_hours=max_hours, node=node, preempt_grace_s=preempt_grace_s, resume_from=resume_from,
        resume_sha256=resume_sha256, resume_step=resume_step, resumes=resumes, sidecar=not no_sidecar,
        python=python, cwd=Path(cwd) if cwd else None, code_dir=code_dir)
    code = run_launch(opts, as_json, sys.stdout, sys.stderr, wait=wait)
    if code:
        raise click.exceptions.Exit(code)


@main.command()
@click.argument("run")
@_root_option
@click.option("--grace", default="30s", show_default=True, help="Time between SIGTERM and SIGKILL.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: the outcome and the exit.")
def stop(run: str, root: Optional[Path], grace: str, as_json: bool) -> None:
    """Stop RUN's job: SIGTERM to its process group, SIGKILL what is left after --grace.

    RUN is a run id, <project>/<run-id> or a run directory. Only the job this run
    recorded (pid and start time) is signalled, never the sidecar; rgt/stop.json says the
    stop was asked for. Exit 0 when stopped (or not running), 1 when it cannot be.
    """
    from rgtlib.units import parse_duration

    from onbox.runs import default_root, resolve_run
    from onbox.stop import render_stop, stop_run

    try:
        grace_s = parse_duration(grace)
    except ValueError as e:
        raise _fail(str(e), code=2) from None
    try:
        result = stop_run(resolve_run(root or default_root(), run), grace_s)
    except OnboxError as e:
        raise _fail(str(e), "rgt-onbox ps lists the runs on this box") from None
    except PermissionError as e:
        raise _fail(f"not allowed to signal the job: {e}") from None
    render_stop(result, as_json, sys.stdout)
    if result.outcome == "refused":
        raise click.exceptions.Exit(1)


@main.command()
@_root_option
@click.option("--run", "only", default=None, metavar="RUN",
              help="Only run RUN and, for a multi-node run, each of its node streams (RUN.<node>).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: {root, runs: [...]}.")
def ps(root: Optional[Path], only: Optional[str], as_json: bool) -> None:
    """Runs on this box: state (running, stopping, exited code N, vanished), job pid,
    sidecar up/down, last event seq."""
    from onbox.runs import default_root, list_runs, read_json, render_ps, run_dirs, run_status

    where = root or default_root()
    if only is None:
        statuses = list_runs(where)
    else:  # a node stream's run.json names its group (onbox/launch/nodes.py)
        statuses = [run_status(d) for d in run_dirs(where)
                    if d.name == only or (read_json(d / "run.json") or {}).get("group") == only]
    render_ps(statuses, where, as_json, sys.stdout)


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--node", default=None, metavar="NAME|auto",
              help="Follow node NAME's stream, <RUN_DIR>.<NAME> (auto: as `launch --node auto`).")
@click.option("--wait-start", default="10m", show_default=True,
              help="How long to wait for the launcher's rgt/job.json before giving up.")
@click.option("--linger", default="1m", show_default=True,
              help="Keep serving this long after the job's exit is journaled.")
@click.option("--gpu", default="auto", show_default=True, metavar="auto|none|fake:SCENARIO",
              help="The sidecar's GPU source.")
@click.option("--serve-arg", "serve_args", multiple=True, hidden=True,
              help="Extra `rgt-onbox serve` argument (tests: --heartbeat 1).")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.pass_context
def follow(ctx: click.Context, run_dir: Path, node: Optional[str], wait_start: str, linger: str, gpu: str,
           serve_args: Tuple[str, ...], log_level: str) -> None:
    """Serve a run started elsewhere with `launch --no-sidecar`, in the foreground, until its job ends.

    For a Kubernetes sidecar container that mounts the run volume and shares the pod's
    process namespace. Waits for RUN_DIR/rgt/job.json, then keeps the run's sidecar up
    (restarted if it dies). Exit 0 once the job's exit is journaled (a first SIGTERM waits
    for that), 1 when no job appeared within --wait-start, 2 on bad usage.
    """
    _setup_logging("debug" if ctx.obj["debug"] else log_level)
    from rgtlib.units import parse_duration

    from onbox.sidecar.follow import Follower, FollowError, FollowUsageError, lower_priority, resolve_run_dir

    try:
        wait_s, linger_s = parse_duration(wait_start), parse_duration(linger)
        target = resolve_run_dir(run_dir, node)
    except (ValueError, FollowUsageError) as e:
        raise _fail(str(e), code=2) from None
    lower_priority()
    follower = Follower(target, wait_start_s=wait_s, linger_s=linger_s,
                        serve_args=["--gpu", gpu, *serve_args])
    _install_signals(follower.signal)
    try:
        result = follower.run()
    except FollowError as e:
        raise _fail(str(e), e.hint) from None
    if result.wrapper_pid is not None and not result.reported:
        click.echo(f"warning: the job in {target} ended without its exit journaled; see rgt/sidecar.log",
                   err=True)


def _first_finishes(finish: Callable[[], None], stop: Callable[[], None]) -> Callable[[], None]:
    """A stop callback that calls `finish` the first time and `stop` after."""
    calls: List[int] = []

    def on_signal() -> None:
        calls.append(1)
        (finish if len(calls) == 1 else stop)()

    return on_signal


def _install_signals(stop: Any) -> None:
    """One place for signals: TERM/INT stop cleanly, HUP is ignored (SSH logout),
    XFSZ is ignored so RLIMIT_FSIZE gives EFBIG (handled) instead of killing us."""
    if threading.current_thread() is not threading.main_thread():
        return

    def _on_stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        stop()

    signal.signal(signal.SIGTERM, _on_stop)
    signal.signal(signal.SIGINT, _on_stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _add_pull_commands() -> None:
    from onbox.cli.pull import close_command, manifest_command

    main.add_command(manifest_command)
    main.add_command(close_command)


def _add_journal_command() -> None:
    from onbox.cli.journal import journal_command

    main.add_command(journal_command)


def _add_deadman_commands() -> None:
    from onbox.cli.deadman import deadman_group

    main.add_command(deadman_group)


_add_pull_commands()
_add_journal_command()
_add_deadman_commands()


def run() -> None:  # pragma: no cover - console entry
    try:
        main(standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)
