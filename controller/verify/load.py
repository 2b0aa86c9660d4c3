"""The safe-load proof of a pulled run: every file we know how to load must load, safely.

Each file's role (controller.verify.roles, from its name) decides how:

- `.safetensors`: parsed by rgtlib.safetensors_header in this process (header and spans
  only). With a finite check the tensors are also counted for NaN/Inf in the seam child (torch.frombuffer).
- torch files (`.pt`, `.pth`, `.ckpt`; `.bin` or any other name holding a torch zip or a pickle):
  `torch.load(weights_only=True)` (companions: plus their explicit allow-list) in ONE child process
  per verification (controller.verify.safeload --batch) that caps its own address space; each file has
  `timeout_s`, and a child that dies or hangs is charged to the file it had started (its "starting I"
  line) and a fresh child goes on with the rest. Under a torch older than 2.10 pickle files are
  refused before any child starts, unless trust_pickle. There is no weights_only=False path.
- training_args.bin: identity only, its pickle parsed for the globals it names (never run).
- `*.json`: parsed as JSON here.
- anything else: "not loadable: unknown format", which does not fail. A checkpoint-kind `.bin`
  that holds neither a torch zip nor a pickle is loaded as torch anyway, and so fails.

A weights file that loads but holds no tensors fails ("holds no tensors"); one with NaN/Inf (where
it was checked) fails unless allow_nonfinite, and its count stays in the detail either way.

An include (a file the manifest does not call a checkpoint) that does not load safely is only
"identity only", unless it lies in a checkpoint (`strict`: inside a checkpoint unit, whatever the
box calls it): there it fails like a checkpoint file, since an eval or a resume would load it.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from rgtlib import safetensors_header

from controller.verify import roles as verify_roles
from controller.verify import safeload
from controller.verify.identity import Progress
from controller.verify.roles import CODE_PICKLE, COMPANION, JSON, OTHER, WEIGHTS

UNKNOWN = "not loadable: unknown format"
TORCH_SUFFIXES = frozenset({".pt", ".pth", ".ckpt"})
DEFAULT_TIMEOUT_S = 300.0
BASE_ADDRESS_SPACE = 2 << 30  # what a child needs for Python + torch before the file (~0.7 GiB measured)
MAX_JSON_BYTES = 64 << 20
MAX_CODE_PICKLE_BYTES = 16 << 20
_ROOT = str(Path(__file__).resolve().parents[2])
# -I: no user site, no PYTHON* variables, no script directory on sys.path; _ROOT makes
# `controller` importable whether or not the package is installed.
_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from controller.verify.safeload import main; " \
        "sys.exit(main(sys.argv[2:]))"
Popen = Callable[..., "subprocess.Popen[bytes]"]
_CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}


@dataclasses.dataclass
class LoadResult:
    status: str  # "ok" | "failed" | "unknown" | "skipped"
    reason: Optional[str] = None  # the one-line why (failed/skipped), or UNKNOWN
    detail: Dict[str, Any] = dataclasses.field(default_factory=dict)  # tensors, dtypes, ...
    note: Optional[str] = None  # e.g. the --trust-pickle statement
    method: str = ""  # verify_roles.method_text: "weights", "safe-load (allow-list: ...)", "identity only"
    nonfinite: Optional[int] = None  # NaN/Inf counted in the weights; None: not checked
    nonfinite_names: List[str] = dataclasses.field(default_factory=list)

    @property
    def text(self) -> str:
        """"ok", or the reason, for the report's per-file "load" field."""
        return "ok" if self.status == "ok" else (self.reason or self.status)


def torch_version() -> Optional[str]:
    """The installed torch's version, without importing torch; None when it is not installed."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_format(path: Path, kind: str) -> str:
    """"safetensors", "torch" or "unknown" for a file, from its name and then its leading bytes."""
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in TORCH_SUFFIXES:
        return "torch"
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04" and _zip_holds_pickle(path):
        return "torch"
    if suffix == ".bin":
        is_pickle = len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5
        return "torch" if is_pickle or kind == "checkpoint" else "unknown"
    return "unknown"


def _zip_holds_pickle(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as zf:
            return any(n == "data.pkl" or n.endswith("/data.pkl") for n in zf.namelist())
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return False



@dataclasses.dataclass(frozen=True)
class LoadOptions:
    trust_pickle: bool = False
    check_finite: bool = False  # every weights file; else only those prove_loads is told to check
    timeout_s: float = DEFAULT_TIMEOUT_S  # per file
    memory_bytes: Optional[int] = None  # None: BASE_ADDRESS_SPACE + 3 x the largest file
    allow_nonfinite: bool = False  # NaN/Inf in weights is reported, not failed


def seam_command(max_address_space: int, trust_pickle: bool) -> List[str]:
    """The argv of the seam child that loads a batch of files (the list comes on its stdin)."""
    argv = [sys.executable, "-I", "-c", _BOOT, _ROOT, "--batch",
            "--max-address-space", str(max_address_space)]
    if trust_pickle:
        argv.append("--trust-pickle")
    return argv


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


@dataclasses.dataclass
class _Job:
    """One file for the seam child."""

    rel: str
    path: Path
    fmt: str
    role: str
    finite: bool
    size: int


class _Child:
    """One seam child over a list of jobs: its results as they come, the file it died or hung on."""

    def __init__(self, argv: Sequence[str], jobs: Sequence[_Job], timeout_s: float, limit: int,
                 popen: Popen) -> None:
        self.jobs, self.timeout_s, self.limit = list(jobs), timeout_s, limit
        self.results: List[Dict[str, Any]] = []
        self.err_tail: List[str] = []
        items = [{"path": os.path.abspath(j.path), "format": j.fmt, "role": j.role, "finite": j.finite}
                 for j in jobs]
        with tempfile.TemporaryFile() as stdin:
            stdin.write(json.dumps(items).encode())
            stdin.seek(0)
            self.proc = popen(list(argv), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, **_CHILD_ENV}, cwd="/")

    def _line(self, stream: str, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").strip()
        if not text:
            return
        if stream == "err":
            if not text.startswith(safeload.STARTING):
                self.err_tail = (self.err_tail + [text])[-5:]
            return
        try:
            obj = json.loads(text)
        except ValueError:
            return
        if isinstance(obj, dict) and obj.get("index") == len(self.results):
            self.results.append(obj)

    def run(self) -> Optional[Dict[str, Any]]:
        """Read until every job answered or the child ended; the failure of the job it was on, if any."""
        assert self.proc.stdout is not None and self.proc.stderr is not None
        streams = {self.proc.stdout.fileno(): "out", self.proc.stderr.fileno(): "err"}
        bufs = {"out": b"", "err": b""}
        deadline = time.monotonic() + self.timeout_s
        try:
            with selectors.DefaultSelector() as sel:
                for fd in streams:
                    sel.register(fd, selectors.EVENT_READ)
                while streams:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return {"ok": False,
                                "error": f"timed out after {self.timeout_s:g}s: the loader was killed"}
                    for key, _ in sel.select(left):
                        fd = key.fd
                        name = streams[fd]
                        chunk = os.read(fd, 1 << 16)
                        if not chunk:
                            sel.unregister(fd)
                            del streams[fd]
                            continue
                        *lines, bufs[name] = (bufs[name] + chunk).split(b"\n")
                        before = len(self.results)
                        for ln in lines:
                            self._line(name, ln)
                        if len(self.results) > before:
                            deadline = time.monotonic() + self.timeout_s
            for name, rest in bufs.items():
                self._line(name, rest)
            rc = self.proc.wait()
        finally:
            self._end()
        return None if len(self.results) >= len(self.jobs) else self._died(rc)

    def _died(self, rc: int) -> Dict[str, Any]:
        mib = self.limit >> 20
        if rc < 0:
            why = (f"loader died ({_signal_name(rc)}) on this file; under its {mib} MiB address-space "
                   "limit that usually means the file needs more memory than allowed")
        else:
            last = self.err_tail[-1][:300] if self.err_tail else "no output"
            why = f"loader failed (exit {rc}) on this file: {last}"
        return {"ok": False, "error": why}

    def _end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


def run_jobs(jobs: Sequence[_Job], opts: LoadOptions, popen: Popen = subprocess.Popen
             ) -> Dict[str, Dict[str, Any]]:
    """{rel: the child's result} for every job: one child for them all, a fresh one only after a
    child died or hung (on the file it had started, which gets the failure)."""
    out: Dict[str, Dict[str, Any]] = {}
    start = 0
    while start < len(jobs):
        todo = jobs[start:]
        limit = opts.memory_bytes or BASE_ADDRESS_SPACE + 3 * max(j.size for j in todo)
        child = _Child(seam_command(limit, opts.trust_pickle), todo, opts.timeout_s, limit, popen)
        failure = child.run()
        for job, res in zip(todo, child.results):
            out[job.rel] = {**res, "limit": limit}
        start += len(child.results)
        if failure is not None:
            out[jobs[start].rel] = {**failure, "limit": limit}
            start += 1
    return out


def _interpret(result: Dict[str, Any], kind: str, limit: int, role: str = WEIGHTS,
               allow_nonfinite: bool = False) -> LoadResult:
    detail = {k: result[k] for k in ("format", "torch", "tensors", "elements", "dtypes", "nonfinite")
              if result.get(k) is not None}
    method = verify_roles.method_text(role, tuple(result.get("allow_list") or ()))
    if not result.get("ok"):
        error = str(result.get("error") or "load failed")
        if result.get("error_type") == "MemoryError":
            error = f"out of memory under the {limit >> 20} MiB address-space limit"
        elif result.get("error_type") == "ImportError":  # torch itself could not be mapped
            error = f"{error} (under a {limit >> 20} MiB address-space limit)"
        return LoadResult("failed", error, detail, method=method)
    if kind == "checkpoint" and role == WEIGHTS and not result.get("tensors"):
        return LoadResult("failed", "holds no tensors", detail, method=method)
    bad = result.get("nonfinite")
    names = [str(n) for n in result.get("nonfinite_names") or []]
    res = LoadResult("ok", None, detail, note=result.get("note"), method=method,
                     nonfinite=bad if isinstance(bad, int) else None, nonfinite_names=names)
    if bad and not allow_nonfinite:
        res.status, res.reason = "failed", f"{bad} non-finite values (NaN/Inf) in {', '.join(names)}"
    return res


def _read_capped(path: Path, cap: int) -> Optional[bytes]:
    with open(path, "rb") as f:
        raw = f.read(cap + 1)
    return raw if len(raw) <= cap else None


def _here(rel: str, path: Path, kind: str, role: str) -> Optional[LoadResult]:
    """The proof of a file that needs no child (JSON, training_args.bin, other), else None."""
    method = verify_roles.method_text(role)
    if role == JSON:
        raw = _read_capped(path, MAX_JSON_BYTES)
        if raw is None:
            return LoadResult("unknown", f"identity only (JSON larger than {MAX_JSON_BYTES >> 20} MiB: "
                              "not parsed)", method="identity only")
        try:
            json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            if kind != "checkpoint":
                return LoadResult("unknown", f"identity only (not JSON: {str(e)[:120]})",
                                  method="identity only")
            return LoadResult("failed", f"not JSON: {str(e)[:200]}", method=method)
        return LoadResult("ok", None, {"format": "json"}, method=method)
    if role == CODE_PICKLE:
        raw = _read_capped(path, MAX_CODE_PICKLE_BYTES)
        if raw is None:
            return LoadResult("failed", f"larger than {MAX_CODE_PICKLE_BYTES >> 20} MiB: refused, not loaded",
                              method="identity only")
        passed, text = verify_roles.code_pickle_verdict(raw)
        method = verify_roles.method_text(role, detail=text if passed else None)
        return LoadResult("unknown" if passed else "failed", f"identity only ({text})" if passed else text,
                          {"format": "pickle"}, method=method)
    return None


def _plan_one(rel: str, path: Path, kind: str, opts: LoadOptions, finite: bool
              ) -> Tuple[Optional[LoadResult], Optional[_Job]]:
    """(a result already known, or the job for the child)."""
    role = verify_roles.role_of(rel, kind)
    try:
        done = _here(rel, path, kind, role)
        if done is not None:
            return done, None
        fmt = detect_format(path, kind)
        size = path.stat().st_size
    except OSError as e:
        return LoadResult("failed", f"unreadable: {e.strerror or e}"), None
    if fmt == "unknown":
        return LoadResult("unknown", UNKNOWN, method="identity only"), None
    if role == OTHER:
        role = WEIGHTS if kind == "checkpoint" else COMPANION
    method = verify_roles.method_text(role)
    finite = finite and role == WEIGHTS
    if fmt == "safetensors":
        try:
            layout = safetensors_header.parse_path(path)
        except (safetensors_header.HeaderError, OSError) as e:
            return LoadResult("failed", f"safetensors: {e}", {"format": fmt}, method=method), None
        if kind == "checkpoint" and role == WEIGHTS and not layout.tensors:
            return LoadResult("failed", "holds no tensors", {"format": fmt, "tensors": 0},
                              method=method), None
        if not finite:
            return LoadResult("ok", None, {"format": fmt, "tensors": len(layout.tensors),
                                           "elements": sum(t.elements for t in layout.tensors),
                                           "dtypes": layout.dtypes()}, method=method), None
    else:
        allowed, note = safeload.pickle_gate(torch_version(), opts.trust_pickle)
        if not allowed:
            return LoadResult("failed", note, {"format": fmt}, method=method), None
    return None, _Job(rel, path, fmt, role, finite, size)


def prove_loads(files: Dict[str, Path], kinds: Dict[str, str], opts: LoadOptions,
                workers: Optional[int] = None, progress: Optional[Progress] = None,
                finite: Optional[Set[str]] = None, popen: Popen = subprocess.Popen,
                strict: Optional[Set[str]] = None) -> Dict[str, LoadResult]:
    """{relative path: LoadResult} for files (relative path -> absolute path). `finite`: the files
    whose weights are checked for NaN/Inf (default: every one with opts.check_finite, else none).
    `strict`: includes that lie in a checkpoint, whose failure is never softened to identity only.
    Every file that needs torch goes to one seam child (`workers` is unused: kept for callers)."""
    out: Dict[str, LoadResult] = {}
    jobs: List[_Job] = []
    for rel, full in files.items():
        check = opts.check_finite or (finite is not None and rel in finite)
        done, job = _plan_one(rel, full, kinds[rel], opts, check)
        if done is not None:
            out[rel] = done
        elif job is not None:
            jobs.append(job)
    if progress is not None and out:
        progress("load", len(out), len(files))
    note = safeload.pickle_gate(torch_version(), opts.trust_pickle)[1] if any(
        j.fmt == "torch" for j in jobs) else None
    by_rel = {j.rel: j for j in jobs}
    for rel, raw in run_jobs(jobs, opts, popen).items():
        job = by_rel[rel]
        result = _interpret(raw, kinds[rel], int(raw.get("limit") or 0), job.role, opts.allow_nonfinite)
        result.note = (note if job.fmt == "torch" else None) or result.note
        out[rel] = result
    for rel, res in out.items():
        if kinds[rel] != "checkpoint" and res.status == "failed" and rel not in (strict or ()) and \
                verify_roles.role_of(rel, kinds[rel]) not in (COMPANION, CODE_PICKLE):
            out[rel] = LoadResult("unknown", "identity only (an include that does not load safely: "
                                  f"{res.reason})", res.detail, res.note, method="identity only")
    if progress is not None:
        progress("load", len(out), len(files))
    return out
