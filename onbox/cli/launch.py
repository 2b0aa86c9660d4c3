"""`rgt-onbox launch`'s body: launch (onbox/launch/launcher.py), print the result or `error:` and
`hint:` lines, return the exit code; with `--wait`, stay until the job ends (onbox/launch/wait.py).

Exit codes: 0 launched (with --wait: the job's own exit status), 1 failed, 2 bad usage, 3 refused
by a gate (disk, pre-flight, still running, another launch of the run in progress).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
from typing import IO, TYPE_CHECKING, Any, Optional

from onbox.launch.launcher import EXIT_FAILED, EXIT_OK, LaunchError, LaunchOptions, LaunchResult, launch
from onbox.launch.redact import redact_text, secret_values

if TYPE_CHECKING:
    from onbox.launch.wait import Forwarder


def render_launch(result: LaunchResult, as_json: bool, out: IO[str]) -> None:
    if as_json:
        out.write(json.dumps(result.to_dict()) + "\n")
        return
    command = shlex.join(result.command).replace("\r", "\\r").replace("\n", "\\n")
    rows = [("command", command), ("run dir", str(result.run_dir)),
            ("train log", str(result.train_log)),
            ("job pid", f"{result.pid} (wrapper; the job is pid {result.job_pid}, in its own process group)"),
            ("sidecar", f"supervisor pid {result.sidecar_supervisor_pid}" if result.sidecar_supervisor_pid
             else "not running")]
    if result.resume_from:
        rows.append(("resume", str(result.resume_from)))
    if result.secrets:
        rows.append(("secrets", ", ".join(result.secrets) + " (names only)"))
    rows.append(("preflight", result.preflight))
    out.write(f"launched run {result.run_id} (project {result.project}, attempt {result.attempt})\n")
    for name, value in rows:
        out.write(f"  {name:<10} {value}\n")


def run_launch(opts: LaunchOptions, as_json: bool, stdout: IO[str], stderr: IO[str], wait: bool = False,
               **kwargs: Any) -> int:
    """The CLI body: launch, print the result (or `error:`/`hint:` lines), return the exit code;
    with `wait`, the job's own exit status once it ended (onbox/launch/wait.py)."""
    if not wait:
        return _launch_and_report(opts, as_json, stdout, stderr, None, **kwargs)
    from onbox.launch.wait import Forwarder

    opts = dataclasses.replace(opts, finish_on_term=True)
    with Forwarder() as forwarder:  # before the launch: a stop that comes at once still reaches the job
        return _launch_and_report(opts, as_json, stdout, stderr, forwarder, **kwargs)


def _launch_and_report(opts: LaunchOptions, as_json: bool, stdout: IO[str], stderr: IO[str],
                       forwarder: Optional[Forwarder], **kwargs: Any) -> int:
    try:
        result = launch(opts, **kwargs)
    except (LaunchError, OSError) as e:
        pairs = dict(p.partition("=")[::2] for p in opts.env)
        known = secret_values({**os.environ, **(kwargs.get("environ") or {}), **pairs})
        stderr.write(f"error: {redact_text(str(e), known)}\n")
        hint = e.hint if isinstance(e, LaunchError) else ""
        if hint:
            stderr.write(f"hint: {redact_text(hint, known)}\n")
        return e.exit_code if isinstance(e, LaunchError) else EXIT_FAILED
    render_launch(result, as_json, stdout)
    for warning in result.warnings:
        stderr.write(f"warning: {warning}\n")
    if forwarder is not None:
        stdout.flush()
        from onbox.launch.wait import wait_for_job

        return wait_for_job(result.run_dir, result.pid, sidecar=opts.sidecar, forwarder=forwarder)
    if not as_json:
        stderr.write(f"hint: follow it: tail -f {result.train_log}; stop it: rgt-onbox stop "
                     f"{result.project}/{result.run_id}\n")
    return EXIT_OK


__all__ = ["render_launch", "run_launch"]
