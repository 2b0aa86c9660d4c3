"""Sealing a run (the run directory's export/ and quarantine/ layout):

    <root>/<project>/active/<run-id>  ->  export/.partial/<run-id>  ->  export/<run-id>
                                                  `-> quarantine/<run-id> (+ QUARANTINE.json)

Refused, with nothing moved, while the job, its wrapper, the sidecar or its supervisor runs (or a
launch of the run holds its lock), when export/<run-id> exists (a sealed export is never
overwritten: any change needs a new run id), when an earlier close left export/.partial/<run-id>,
and when export/ is on another filesystem than active/ (sealing is one atomic rename; a copy would be
mirroring, not closure).

Otherwise the run is renamed into export/.partial/ first, so nothing reaches it by its active path
any more, and validated there: a fresh rgt/PULL_MANIFEST.json is written (it fails closed on a
missing checkpoint or a path that leads outside) and every file it lists is hashed again. A valid
candidate is made read-only (files 0444, directories 0555; symlinks untouched) and renamed to
export/<run-id>; an invalid one is renamed to quarantine/<run-id> (or <run-id>--N when taken) with
a QUARANTINE.json naming the problems. Quarantine is not trash: nothing is ever deleted here.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
from pathlib import Path
from typing import IO, Any, Callable, Dict, List, Optional

from rgtlib import lockfile

from onbox.custody import pullmanifest
from onbox.fsutil import fsync_dir, write_json_atomic
from onbox.runs import JobRecord, RunPaths, group_members, run_status, utc_iso

QUARANTINE_FILE = "QUARANTINE.json"

Rename = Callable[[Any, Any], None]


@dataclasses.dataclass
class CloseResult:
    run_id: str
    project: str
    run_dir: str
    outcome: str                          # sealed | refused | quarantined
    detail: str
    export_dir: Optional[str] = None
    quarantine_dir: Optional[str] = None
    manifest_sha256: Optional[str] = None
    files: Optional[int] = None
    total_bytes: Optional[int] = None
    problems: List[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


class _Refused(Exception):
    pass


def _lock(path: Path, what: str) -> Optional[int]:
    """Hold `path`'s flock (a launch or a sidecar holds it while it works); None when it is absent."""
    try:
        return lockfile.take(path, create=False)
    except FileNotFoundError:
        return None
    except lockfile.Held as e:
        raise _Refused(f"{what} holds {path.name}" + (f" (pid {e.holder})" if e.holder else "")) from None


def _refuse_if_running(run_dir: Path) -> None:
    status = run_status(run_dir)
    if status.state in ("running", "stopping"):
        raise _Refused(f"the job is {status.state} (pid {status.pid}); stop it first (rgt-onbox stop)")
    if status.sidecar_alive or status.supervisor_alive:
        raise _Refused("the sidecar or its supervisor is still running; it ends once the job's exit "
                       "is reported and its linger is over")
    job = JobRecord.read(RunPaths(run_dir))
    if job is not None and job.pgid is not None and not (job.job and job.job.recycled()):
        left = group_members(job.pgid)
        if left:
            raise _Refused(f"processes of the job's group {job.pgid} still run: {left[:10]}")


def _make_read_only(top: Path, include_top: bool) -> None:
    for base, dirs, files in os.walk(top, topdown=False):
        for name in files:
            path = os.path.join(base, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                os.chmod(path, 0o444)
        for name in dirs:
            path = os.path.join(base, name)
            if not os.path.islink(path):
                os.chmod(path, 0o555)
    if include_top:
        os.chmod(top, 0o555)


def _free_name(parent: Path, run_id: str) -> Path:
    candidate, n = parent / run_id, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = parent / f"{run_id}--{n}"
    return candidate


def _validate(partial: Path, result: CloseResult) -> List[str]:
    """Write a fresh manifest and hash every listed file again; the problems (empty when valid)."""
    try:
        path = pullmanifest.write_manifest(partial)
        doc = json.loads(path.read_text())
    except (pullmanifest.ManifestError, OSError, ValueError) as e:
        return [f"manifest: {e}"]
    result.manifest_sha256 = doc.get("sha256")
    result.files, result.total_bytes = len(doc.get("files", [])), doc.get("total_bytes")
    return pullmanifest.check_files(partial, doc)


def _quarantine(partial: Path, qroot: Path, result: CloseResult, rename: Rename) -> None:
    target = _free_name(qroot, result.run_id)
    try:
        qroot.mkdir(parents=True, exist_ok=True)
        rename(partial, target)
    except OSError as e:
        result.outcome = "refused"
        result.detail = (f"validation failed and moving it to {target} failed too ({e}); "
                         f"it is left in {partial}")
        return
    fsync_dir(qroot)
    fsync_dir(partial.parent)
    write_json_atomic(target / QUARANTINE_FILE, {
        "schema": "rgt.quarantine", "version": 1, "run_id": result.run_id, "project": result.project,
        "reason": "validation failed at close", "problems": result.problems, "from": result.run_dir,
        "quarantined_at": utc_iso(), "manifest_sha256": result.manifest_sha256})
    result.outcome, result.quarantine_dir = "quarantined", str(target)
    result.detail = f"validation failed ({len(result.problems)} problem(s)); moved to {target}"


def close_run(run_dir: Path, *, rename: Optional[Rename] = None) -> CloseResult:
    """Seal one run (see the module doc); never raises for a refusal: read `outcome`.
    `rename` defaults to os.rename (looked up per call)."""
    rename = rename or os.rename
    run_dir = Path(os.path.abspath(run_dir))
    project_dir = run_dir.parent.parent
    result = CloseResult(run_dir.name, project_dir.name, str(run_dir), "refused", "")
    export_root = project_dir / "export"
    export, partial = export_root / run_dir.name, export_root / ".partial" / run_dir.name
    locks: List[int] = []
    try:
        if run_dir.parent.name != "active" or not run_dir.is_dir():
            raise _Refused(f"{run_dir} is not a run under <root>/<project>/active/")
        _refuse_if_running(run_dir)  # the clearest reason first; the locks close the races
        for name, what in (("launch.lock", "a launch of this run"), ("sidecar.lock", "a sidecar")):
            fd = _lock(run_dir / "rgt" / name, what)
            if fd is not None:
                locks.append(fd)
        if os.path.lexists(export):
            raise _Refused(f"{export} exists: a sealed export is never overwritten "
                           "(relaunch under a new run id)")
        if os.path.lexists(partial):
            raise _Refused(f"{partial} exists: an earlier close was interrupted; "
                           "look at it before closing again")
        partial.parent.mkdir(parents=True, exist_ok=True)
        if os.stat(partial.parent).st_dev != os.stat(run_dir).st_dev:
            raise _Refused(f"{export_root} is on another filesystem than {run_dir.parent}: sealing needs "
                           "one atomic rename (a copy would be mirroring, not closure)")
        try:
            rename(run_dir, partial)
        except OSError as e:
            if e.errno == errno.EXDEV:
                raise _Refused(f"{export_root} is on another filesystem than {run_dir.parent}: sealing "
                               "needs one atomic rename (a copy would be mirroring, not closure)") from None
            raise _Refused(f"cannot move {run_dir} to {partial}: {e}") from None
        fsync_dir(run_dir.parent)
        fsync_dir(partial.parent)
        result.problems = _validate(partial, result)
        if result.problems:
            _quarantine(partial, project_dir / "quarantine", result, rename)
            return result
        _seal(partial, export, result, rename)
    except _Refused as e:
        result.outcome, result.detail = "refused", str(e)
    finally:
        for fd in locks:
            os.close(fd)
    return result


def _seal(partial: Path, export: Path, result: CloseResult, rename: Rename) -> None:
    _make_read_only(partial, include_top=False)  # the top dir keeps its write bit until renamed
    if os.path.lexists(export):
        raise _Refused(f"{export} appeared while closing; the candidate stays in {partial}")
    try:
        rename(partial, export)
    except OSError as e:
        raise _Refused(f"cannot rename {partial} to {export}: {e}; the candidate stays there") from None
    fsync_dir(export.parent)
    fsync_dir(partial.parent)
    os.chmod(export, 0o555)
    result.outcome, result.export_dir = "sealed", str(export)
    result.detail = f"sealed into {export}"


def render_close(result: CloseResult, as_json: bool, out: IO[str], err: IO[str]) -> None:
    if as_json:
        out.write(json.dumps(result.to_dict()) + "\n")
        return
    name = f"{result.project}/{result.run_id}"
    if result.outcome == "sealed":
        out.write(f"sealed {name} -> {result.export_dir}\n"
                  f"  {result.files} files, {result.total_bytes} bytes, "
                  f"manifest sha256 {result.manifest_sha256}\n")
        return
    err.write(f"error: {name} not sealed: {result.detail}\n")
    for line in result.problems[:20]:
        err.write(f"  {line}\n")
    if result.outcome == "quarantined":
        err.write(f"hint: the reason is in {result.quarantine_dir}/{QUARANTINE_FILE}; nothing was deleted\n")
