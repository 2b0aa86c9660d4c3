"""Prove a pulled run before anything on the box may be destroyed: trust artifacts, not log lines.

    report = verify(run_dir)            # <run_dir>/rgt/PULL_MANIFEST.json by default
    report.ok                           # every proof that ran passed
    report.path                         # <run_dir>/rgt/PULL_VERIFIED.json, written atomically

Three named proofs, each one separate in the report:

1. identity (controller.verify.identity): the manifest hashes to its own sha256; the roster is
   exact (no file missing, none extra, no rsync leftovers); every size and SHA-256 matches.
2. safe_load (controller.verify.load): files whose identity passed load safely: safetensors by our
   own parser, torch files with weights_only=True (a companion: plus its explicit allow-list) in
   ONE limited child process per verification; each file's "method" says how it was proven
   ("weights", "safe-load (allow-list: ...)", "identity only"). The newest checkpoint's weights
   are checked for NaN/Inf by default (every checkpoint's with check_finite); a non-finite one
   fails unless allow_nonfinite, and is named in "nonfinite" either way.
3. metric (controller.verify.metric), only with eval_cmd: the newest checkpoint's recomputed metric
   matches what the run reported for its step. The eval runs on a view holding only the files of
   that checkpoint that passed (`_eval_refusal`): one that failed, or was never proven safe to load
   (a pickle of code, a file that did not load), is withheld and named in the result, never shown.

A file inside a checkpoint unit that fails safe load fails the proof whatever the box calls it
(`_strict`): an include there is loaded by an eval or a resume like the checkpoint itself. The
box's custody log (the pulled rgt/manifest.jsonl) is read for its live suspect lines, saves the
box itself judged bad: each fails identity ("suspect"), since the pull cannot hold that save as
proven. Each file's "stat" pins the hash to the file it was taken of (verify_identity.pin_of), for
the teardown gate.

Files are grouped by checkpoint unit (controller.verify.units: "units", one row per checkpoint-N/
or .ckpt). Checkpoints the job rotated away (the manifest's "removed", by "job") are gone on
purpose: named in "rotated_away", never a failure; removed by anything else, they fail identity.

The report is always written, passing or not, so a failed verification replaces an earlier pass
and the teardown gate must read its "ok" and "manifest_sha256"; a proof whose checking raised
fails with the error as its reason (an interrupt writes that failing report, then goes on). Its
shape is `Report.to_dict()`.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import protocol

from controller.verify import load as verify_load
from controller.verify import metric as verify_metric
from controller.verify import roles as verify_roles
from controller.verify import units as verify_units
from controller.verify.identity import (
    MANIFEST_REL,
    VERIFIED_REL,
    Identity,
    Manifest,
    ManifestError,
    Progress,
    hash_files,
    load_manifest,
    prove_identity,
    stated_sha256,
)
from controller.verify.load import LoadOptions, LoadResult
from controller.verify.metric import DEFAULT_EVAL_TIMEOUT_S, DEFAULT_METRIC, DEFAULT_TOLERANCE, MetricResult

SCHEMA = "rgt.pull_verified"
VERSION = 1
PROOFS = ("identity", "safe_load", "metric")


class VerifyError(Exception):
    """verify() cannot run at all (no such directory); a failing proof is a Report, not this."""


@dataclasses.dataclass
class FileReport:
    path: str
    kind: str
    step: Optional[int]
    size: Optional[int]
    sha256: Optional[str]
    identity: str  # "ok" | reason
    load: str = "skipped"  # "ok" | reason | "skipped: ..." | verify_load.UNKNOWN
    metric: Optional[str] = None  # "ok" | reason | "skipped: ..."; None without an eval
    load_detail: Dict[str, Any] = dataclasses.field(default_factory=dict)
    unit: Optional[str] = None  # the checkpoint (checkpoint-N dir, .ckpt) it belongs to
    method: str = ""  # "weights" | "safe-load (allow-list: ...)" | "identity only (...)"
    nonfinite: Optional[int] = None  # NaN/Inf in its weights; None: not checked
    stat: Optional[Dict[str, int]] = None  # verify_identity.pin_of the file that was hashed

    def failures(self) -> List[str]:
        """One line per proof this file failed: `path: proof: why`."""
        lines = [] if self.identity == "ok" else [f"{self.path}: identity: {self.identity}"]
        if self.load not in ("ok", verify_load.UNKNOWN) and not self.load.startswith(("skipped",
                                                                                     "identity only")):
            lines.append(f"{self.path}: safe_load: {self.load}")
        if self.metric not in (None, "ok") and not self.metric.startswith("skipped"):
            lines.append(f"{self.path}: metric: {self.metric}")
        return lines


@dataclasses.dataclass
class Report:
    ok: bool
    run_id: Optional[str]
    manifest_sha256: Optional[str]
    manifest_path: str
    verified_at: str
    proofs: Dict[str, Dict[str, Any]]
    files: List[FileReport]
    tools: Dict[str, Optional[str]]
    elapsed_s: float = 0.0
    path: Optional[Path] = None  # where PULL_VERIFIED.json was written
    units: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    rotated_away: List[str] = dataclasses.field(default_factory=list)  # by the job: gone on purpose
    removed_other: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    nonfinite: List[str] = dataclasses.field(default_factory=list)  # files whose weights hold NaN/Inf
    suspect: List[Dict[str, str]] = dataclasses.field(default_factory=list)  # the box's custody refused

    def failures(self) -> List[str]:
        """Every failure as one line: the proof-level ones, then `path: proof: why` per file."""
        lines = [f"{name}: {p['reason']}" for name, p in self.proofs.items()
                 if p.get("status") == "failed" and p.get("reason")]
        for f in self.files:
            lines.extend(f.failures())
        extra = self.proofs["identity"].get("extra", [])
        lines.extend(f"{x['path']}: identity: {x['reason']}" for x in extra)
        lines.extend(f"{r['path']}: identity: removed from the box by something other than the job's "
                     f"rotation ({r['reason'] or 'no reason given'}): suspect" for r in self.removed_other)
        lines.extend(f"{s['path']}: identity: the box's custody recorded this checkpoint as suspect "
                     f"({s['code']}: {s['reason']}), so no pull proves it" for s in self.suspect)
        return lines

    def to_dict(self) -> Dict[str, Any]:
        return {"schema": SCHEMA, "version": VERSION, "ok": self.ok, "run_id": self.run_id,
                "manifest_sha256": self.manifest_sha256, "manifest_path": self.manifest_path,
                "verified_at": self.verified_at, "proofs": self.proofs,
                "files": [dataclasses.asdict(f) for f in self.files], "tools": self.tools,
                "elapsed_s": round(self.elapsed_s, 3), "units": self.units, "rotated_away": self.rotated_away,
                "removed_other": self.removed_other, "nonfinite": self.nonfinite, "suspect": self.suspect}


def _tools(torch: Optional[str]) -> Dict[str, Optional[str]]:
    backend = "openssl" if type(hashlib.sha256()).__module__ == "_hashlib" else "builtin"
    return {"rgt": protocol.__version__, "python": platform.python_version(), "torch": torch,
            "safetensors": "rgtlib.safetensors_header (own parser)",
            "hashlib": f"{backend} ({ssl.OPENSSL_VERSION})" if backend == "openssl" else backend}


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _proof(failed: int, reason: Optional[str] = None, **counts: Any) -> Dict[str, Any]:
    status = "failed" if failed or reason else "passed"
    return {"status": status, "ok": status == "passed", "reason": reason, "failed": failed, **counts}


def _skipped(reason: str) -> Dict[str, Any]:
    return {"status": "skipped", "ok": None, "reason": reason}


def _relative_manifest(run_dir: Path, manifest_path: Path) -> Optional[str]:
    try:
        return manifest_path.resolve().relative_to(run_dir.resolve()).as_posix()
    except ValueError:
        return None


def _identity_stage(run_dir: Path, manifest: Manifest, manifest_rel: Optional[str],
                    workers: Optional[int], progress: Optional[Progress]
                    ) -> Tuple[List[FileReport], Dict[str, Any]]:
    found, extras = prove_identity(run_dir, manifest, manifest_rel, workers, progress)
    units = verify_units.units_of(manifest.entries)
    files = []
    for e in manifest.entries:
        got = found.get(e.path, Identity(reason="not checked"))
        files.append(FileReport(path=e.path, kind=e.kind, step=e.step, size=got.size, sha256=got.sha256,
                                identity=got.reason or "ok", unit=units.get(e.path), stat=got.pin))
    failed = sum(1 for f in files if f.identity != "ok")
    _, other = verify_units.rotation(manifest.removed)
    failed += len(other)
    empty = None if files else "the manifest lists no files: refusing to prove an empty pull"
    proof = _proof(failed + len(extras), empty, files=len(files), passed=len(files) - failed,
                   extra=[{"path": p, "reason": r} for p, r in sorted(extras.items())],
                   bytes=sum(e.size for e in manifest.entries))
    return files, proof


def _custody_suspects(run_dir: Path, files: List[FileReport], proof: Dict[str, Any]) -> List[Dict[str, str]]:
    """The live suspect lines of the pulled custody log (only once its identity passed); each one
    fails identity."""
    log = next((f for f in files if f.path == verify_units.CUSTODY_REL and f.identity == "ok"), None)
    if log is None:
        return []
    with open(Path(run_dir, *verify_units.CUSTODY_REL.split("/")), "rb") as fh:
        raw = fh.read(verify_units.MAX_CUSTODY_BYTES)
    found = verify_units.custody_suspects(raw)
    if found:
        proof.update(status="failed", ok=False, failed=proof["failed"] + len(found))
    proof["suspect"] = found
    return found


def _strict(files: Sequence[FileReport]) -> Set[str]:
    """Files that lie in a checkpoint (its unit, or under a unit directory), whatever their kind."""
    dirs = {f.unit for f in files if f.unit and f.unit != f.path}
    return {f.path for f in files if f.kind == "checkpoint" or f.unit is not None
            or any(f.path.startswith(d.rstrip("/") + "/") for d in dirs)}


def _load_stage(run_dir: Path, files: List[FileReport], opts: LoadOptions, workers: Optional[int],
                progress: Optional[Progress], newest: Sequence[str], spawn: verify_load.Popen
                ) -> Dict[str, Any]:
    todo = {f.path: Path(run_dir, *f.path.split("/")) for f in files if f.identity == "ok"}
    finite = {f.path for f in files if f.unit is not None and f.unit in newest}
    results = verify_load.prove_loads(todo, {f.path: f.kind for f in files}, opts, workers, progress,
                                      finite=finite, popen=spawn, strict=_strict(files))
    notes = sorted({r.note for r in results.values() if r.note})
    for f in files:
        r = results.get(f.path, LoadResult("skipped", "skipped: identity failed"))
        f.load, f.load_detail, f.method, f.nonfinite = r.text, r.detail, r.method, r.nonfinite
    count: Dict[str, int] = {}
    for r in results.values():
        count[r.status] = count.get(r.status, 0) + 1
    return _proof(count.get("failed", 0), loaded=count.get("ok", 0), unknown_format=count.get("unknown", 0),
                  skipped=len(files) - len(results), notes=notes, check_finite=opts.check_finite,
                  finite_checked=sorted(newest) if not opts.check_finite else "every checkpoint",
                  allow_nonfinite=opts.allow_nonfinite, trust_pickle=opts.trust_pickle,
                  timeout_s=opts.timeout_s)


def _eval_refusal(f: FileReport) -> Optional[str]:
    """Why a file is kept out of the eval's view; None when it may be given: it passed identity
    and loaded safely, or it is hashed metadata of no loadable format (tokenizer files, text)."""
    if f.identity != "ok":
        return f"failed identity ({f.identity})"
    if f.load == "ok":
        return None
    if f.load == verify_load.UNKNOWN and verify_roles.role_of(f.path, f.kind) == verify_roles.OTHER:
        return None
    if f.load.startswith("skipped"):
        return f"never checked ({f.load})"
    if f.load.startswith("identity only") or f.load == verify_load.UNKNOWN:
        return f"not proven safe to load ({f.load})"
    return f"failed safe load ({f.load})"


def _metric_stage(run_dir: Path, files: List[FileReport], eval_cmd: str, metric: str, tolerance: float,
                  every: bool, timeout_s: float, progress: Optional[Progress]) -> Dict[str, Any]:
    by_path = {f.path: f for f in files}
    units = {f.path: f.unit for f in files}
    ckpts = [(f.path, f.step) for f in files if f.kind == "checkpoint"]
    todo = verify_metric.targets(ckpts, every)
    for f in files:
        if f.kind == "checkpoint":
            f.metric = "skipped: no step" if f.step is None else "skipped: not the newest checkpoint"
    if not todo:
        why = "no checkpoint with a step in the manifest" if ckpts else "no checkpoint in the manifest"
        return _proof(0, f"nothing to evaluate: {why}", evaluated=[])
    metrics_file = Path(run_dir) / verify_metric.METRICS_FILE
    reported = verify_metric.reported_values(metrics_file, metric) if metrics_file.is_file() else None
    results: List[MetricResult] = []
    for i, target in enumerate(todo):
        unproved = [p for p in target.files if by_path[p].identity != "ok" or by_path[p].load != "ok"]
        if every and reported is not None and target.step not in reported and i < len(todo) - 1:
            res = verify_metric.not_compared(target, metric, reported)
        elif unproved:
            res = MetricResult(target.step, target.ckpt, False,
                               f"not evaluated: {unproved[0]} failed identity or safe load")
        else:
            paths = verify_metric.members(target, units)
            refused = {p: why for p in paths for why in [_eval_refusal(by_path[p])] if why is not None}
            pins = {p: by_path[p].stat for p in paths}
            res = verify_metric.evaluate_in_view(run_dir, target, eval_cmd, metric, tolerance, reported,
                                                 timeout_s, paths, refused, pins)
        results.append(res)
        for p in target.files:
            by_path[p].metric = "ok" if res.ok and res.compared else res.reason
        if progress is not None:
            progress("metric", i + 1, len(todo))
    failed = sum(1 for r in results if not r.ok)
    notes = [f"withheld from the eval of step {r.step}: {w['path']}: {w['reason']}"
             for r in results for w in r.withheld]
    return _proof(failed, metric=metric, tolerance=tolerance, newest_only=not every,
                  evaluated=[r.to_dict() for r in results], notes=notes)


def write_report(run_dir: Path, report: Report) -> Path:
    """Write <run_dir>/rgt/PULL_VERIFIED.json atomically (temp file, fsync, rename, fsync dir)."""
    final = Path(run_dir, *VERIFIED_REL.split("/"))
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    data = (json.dumps(report.to_dict(), indent=2, sort_keys=True) + "\n").encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with open(fd, "wb", closefd=True) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return final


def verify(run_dir: Path, manifest_path: Optional[Path] = None, *, eval_cmd: Optional[str] = None,
           eval_metric: Optional[str] = None, tolerance: float = DEFAULT_TOLERANCE,
           trust_pickle: bool = False, check_finite: bool = False, workers: Optional[int] = None,
           load_timeout_s: float = verify_load.DEFAULT_TIMEOUT_S, load_memory_bytes: Optional[int] = None,
           progress: Optional[Progress] = None, eval_all: bool = False,
           eval_timeout_s: float = DEFAULT_EVAL_TIMEOUT_S, write: bool = True,
           clock: Callable[[], float] = time.time, allow_nonfinite: bool = False,
           spawn: verify_load.Popen = subprocess.Popen) -> Report:
    """Run every proof on the pulled `run_dir` and write PULL_VERIFIED.json (unless write=False).

    Raises VerifyError when run_dir is not a directory, and verify_metric.EvalCommandError for an
    eval_cmd without {ckpt}; every other problem is a failing proof in the returned Report.
    """
    run_dir = Path(os.path.abspath(run_dir))  # the seam child runs in "/"
    if not run_dir.is_dir():
        raise VerifyError(f"{run_dir} is not a directory")
    if eval_cmd is not None:
        verify_metric.build_argv(eval_cmd, Path("ckpt"))  # a bad template fails before any work
    started = time.monotonic()
    manifest_path = Path(manifest_path) if manifest_path else Path(run_dir, *MANIFEST_REL.split("/"))
    report = Report(ok=False, run_id=None, manifest_sha256=None, manifest_path=str(manifest_path),
                    verified_at=_iso(clock()), proofs={}, files=[], tools=_tools(verify_load.torch_version()))
    stage = ["identity"]  # the proof being checked, for a failure raised while checking it
    interrupted: Optional[BaseException] = None
    try:
        try:
            manifest = load_manifest(manifest_path)
        except ManifestError as e:
            report.manifest_sha256 = stated_sha256(manifest_path)
            report.proofs = {"identity": _proof(1, str(e), extra=[]),
                             "safe_load": _skipped("the manifest failed"),
                             "metric": _skipped("the manifest failed")}
        else:
            opts = LoadOptions(trust_pickle, check_finite, load_timeout_s, load_memory_bytes, allow_nonfinite)
            _prove(report, run_dir, manifest, manifest_path, opts, stage, workers, progress, spawn,
                   (eval_cmd, eval_metric or DEFAULT_METRIC, tolerance, eval_all, eval_timeout_s))
    except BaseException as e:  # whatever checking raised, the report says so and fails
        report.proofs[stage[0]] = _proof(1, f"checking raised {type(e).__name__}: {str(e)[:300]}"
                                         " (verification did not finish)")
        for name in PROOFS:
            report.proofs.setdefault(name, _skipped(f"{stage[0]} did not finish"))
        if not isinstance(e, Exception):
            interrupted = e
    report.ok = all(report.proofs[name]["status"] != "failed" for name in PROOFS)
    report.elapsed_s = time.monotonic() - started
    if write:
        try:
            report.path = write_report(run_dir, report)
        except OSError:
            if interrupted is None:
                raise
    if interrupted is not None:
        raise interrupted
    return report


def _prove(report: Report, run_dir: Path, manifest: Manifest, manifest_path: Path, opts: LoadOptions,
           stage: List[str], workers: Optional[int], progress: Optional[Progress], spawn: verify_load.Popen,
           evaluation: Tuple[Optional[str], str, float, bool, float]) -> None:
    """Fill the report's proofs in order; `stage[0]` names the one being checked."""
    report.run_id, report.manifest_sha256 = manifest.run_id, manifest.sha256
    files, identity = _identity_stage(run_dir, manifest, _relative_manifest(run_dir, manifest_path),
                                      workers, progress)
    report.files = files
    report.proofs["identity"] = identity
    report.suspect = _custody_suspects(run_dir, files, identity)
    steps = verify_units.unit_steps(manifest.entries, {f.path: f.unit for f in files})
    newest = verify_units.newest_units(steps)
    report.rotated_away, other = verify_units.rotation(manifest.removed)
    report.removed_other = [{"path": r.path, "sha256": r.sha256, "by": r.by, "reason": r.reason,
                             "ts": r.ts} for r in other]
    stage[0] = "safe_load"
    report.proofs["safe_load"] = _load_stage(run_dir, files, opts, workers, progress, newest, spawn)
    report.units = verify_units.summarize(files, steps, newest)
    report.nonfinite = [f.path for f in files if f.nonfinite]
    stage[0] = "metric"
    eval_cmd, metric, tolerance, every, timeout_s = evaluation
    report.proofs["metric"] = (
        _skipped("no eval command") if eval_cmd is None else
        _metric_stage(run_dir, files, eval_cmd, metric, tolerance, every, timeout_s, progress))


__all__ = ["PROOFS", "FileReport", "Report", "VerifyError", "hash_files", "verify", "write_report"]
