"""`rgt-onbox manifest` and `rgt-onbox close`: the box half of pull, verify and the teardown gate.

Thin click commands (added to the `rgt-onbox` group by onbox/cli/main.py): parse, call one function,
render, map errors to exit codes (0 ok, 1 failed closed / refused / quarantined, 2 usage).
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import click

from onbox.errors import OnboxError

_root_option = click.option(
    "--root", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Where runs live: <root>/<project>/active/<run-id> (default: $RGT_ROOT, else ~/rgt-runs).")


def _fail(message: str, hint: str = "", code: int = 1) -> click.exceptions.Exit:
    click.echo(f"error: {message}", err=True)
    if hint:
        click.echo(f"hint: {hint}", err=True)
    return click.exceptions.Exit(code)


def _find(root: Optional[Path], run: str, sealed_too: bool) -> Path:
    """RUN among the active runs; with `sealed_too` also <root>/<project>/export/<run-id>."""
    from protocol.ids import is_run_id

    from onbox.runs import RunError, default_root, resolve_run

    where = root or default_root()
    try:
        return resolve_run(where, run)
    except RunError as e:
        if sealed_too:
            project, _, run_id = run.rpartition("/")
            if is_run_id(run_id) and (not project or is_run_id(project)):
                found = sorted(where.expanduser().glob(f"{project or '*'}/export/{run_id}"))
                if len(found) == 1 and found[0].is_dir():
                    return found[0].resolve()
        raise _fail(str(e), "rgt-onbox ps lists the runs on this box") from None


@click.command("manifest")
@click.argument("run")
@_root_option
@click.option("--include", "includes", multiple=True, metavar="GLOB",
              help="Also list the files this glob (relative to the run dir) matches; it must match one. "
                   "Repeatable; added to the defaults (metrics.jsonl, run.json, train.log, "
                   "rgt/manifest.jsonl, rgt/exit.json, eval/**).")
@click.option("--roster", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="List exactly these files besides the checkpoints: one relative path per line; "
                   "every one must exist.")
@click.option("--gate", is_flag=True,
              help="Write nothing: show the box's current checkpoint set for the teardown gate.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: path, sha256 and counts.")
@click.option("--print", "print_doc", is_flag=True, help="Print the whole manifest JSON.")
@click.option("--wait-closed", "wait_closed", type=float, default=0.0, metavar="SECONDS",
              help="While the job has exited and the sidecar is still closing the run (committing the "
                   "last checkpoints: the manifest is not final yet), wait up to this long for it. Still "
                   "closing then: exit 75 and write nothing; the JSON says what is pending.")
def manifest_command(run: str, root: Optional[Path], includes: Tuple[str, ...], roster: Optional[Path],
                     gate: bool, as_json: bool, print_doc: bool, wait_closed: float) -> None:
    """Write RUN's rgt/PULL_MANIFEST.json: every recorded checkpoint and the declared files,
    with size and SHA-256 (custody hashes reused while the file is unchanged).

    Fails closed (exit 1, nothing written) when a recorded checkpoint or a roster entry is
    missing, an --include matches nothing, or a path leads out of the run dir. Exit 2 on usage.
    """
    from onbox.custody.gateview import gate_view
    from onbox.custody.pullmanifest import MANIFEST_REL, ManifestError, build_manifest, save_manifest

    if includes and roster is not None:
        raise _fail("--include and --roster do not mix: a roster lists every file itself", code=2)
    if gate and (includes or roster is not None or print_doc):
        raise _fail("--gate writes nothing and takes no --include, --roster or --print", code=2)
    if as_json and print_doc:
        raise _fail("--json and --print do not mix", code=2)
    run_dir = _find(root, run, sealed_too=True)
    if gate:
        view = gate_view(run_dir)
        if as_json:
            click.echo(json.dumps(view))
        else:
            click.echo(f"run {view['run_id']}: {len(view['checkpoints'])} recorded checkpoint(s), "
                       f"{len(view['unrecorded'])} unrecorded, {len(view['missing'])} missing, "
                       f"{len(view['partials'])} partial")
            for entry in view["unrecorded"]:
                click.echo(f"  unrecorded ({entry['reason']}): {entry['path']}")
        return
    close = _wait_closed(run_dir, wait_closed, as_json)
    try:
        doc = build_manifest(run_dir, roster=roster, extra_includes=includes)
        path = save_manifest(run_dir, doc)
    except ManifestError as e:
        raise _fail(str(e), "nothing was written; fix the run dir or the roster and run it again") from None
    except OSError as e:
        raise _fail(f"cannot write the manifest: {e}") from None
    files = doc["files"]
    ckpts = sum(1 for f in files if f["kind"] == "checkpoint")
    if print_doc:
        sys.stdout.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    elif as_json:
        click.echo(json.dumps({
            "run_id": doc["run_id"], "run_dir": str(run_dir), "path": str(path), "rel_path": MANIFEST_REL,
            "sha256": doc["sha256"], "files": len(files), "checkpoints": ckpts,
            "includes": len(files) - ckpts,
            "total_bytes": doc["total_bytes"], "hashed_now": sum(1 for f in files if f["hashed"] == "now"),
            "final": close["final"], "close": close}))
    else:
        from rgtlib.units import human_bytes

        click.echo(f"wrote {path}")
        click.echo(f"  {len(files)} files ({ckpts} checkpoints), {human_bytes(doc['total_bytes'])}, "
                   f"sha256 {doc['sha256']}")
        click.echo(f"  {'final: the run is closed' if close['final'] else 'not final: ' + close['state']}")


def _wait_closed(run_dir: Path, wait_s: float, as_json: bool) -> Dict[str, Any]:
    """The run's close state (onbox.runs.close_state) once it is not "closing", waiting up to
    wait_s; still closing then: exit 75 (the JSON, or a line, says what is pending)."""
    from onbox.runs import close_state

    deadline = time.monotonic() + max(0.0, wait_s)
    pause = threading.Event()
    while True:
        state = close_state(run_dir)
        if state["state"] != "closing" or wait_s <= 0:
            return state
        if time.monotonic() >= deadline:
            break
        pause.wait(min(0.1, max(0.0, deadline - time.monotonic())))
    if as_json:
        click.echo(json.dumps({"run_dir": str(run_dir), "final": False, "close": state}))
    else:
        click.echo(f"still closing: {len(state.get('pending') or [])} unit(s) pending, "
                   f"{state.get('pending_bytes')} bytes left, eta {state.get('eta_s')} s", err=True)
    sys.exit(75)


@click.command("close")
@click.argument("run")
@_root_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object: outcome, export dir, problems.")
def close_command(run: str, root: Optional[Path], as_json: bool) -> None:
    """Seal RUN: active/<run-id> -> export/.partial/<run-id> -> export/<run-id>, read-only.

    Refused while the job or the sidecar runs, when the export exists or lies on another
    filesystem. A fresh PULL_MANIFEST.json is written and every file hashed again; a run that
    fails that goes to quarantine/<run-id> with QUARANTINE.json. Exit 0 sealed, 1 refused or
    quarantined, 2 usage.
    """
    from onbox.custody.closeout import close_run, render_close

    run_dir = _find(root, run, sealed_too=False)
    try:
        result = close_run(run_dir)
    except (OnboxError, OSError) as e:
        raise _fail(f"close failed: {e}") from None
    render_close(result, as_json, sys.stdout, sys.stderr)
    if result.outcome != "sealed":
        raise click.exceptions.Exit(1)


__all__ = ["close_command", "manifest_command"]
