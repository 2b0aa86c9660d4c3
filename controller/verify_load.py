"""The safe-load proof of a pulled run: every file we know how to load must load, safely.

- `.safetensors`: parsed by controller.stcheck in this process (header and spans only). With
  check_finite the tensors are also counted for NaN/Inf in the seam child (torch.frombuffer).
- torch files (`.pt`, `.pth`, `.ckpt`; `.bin` or any other name holding a torch zip or a pickle):
  `torch.load(weights_only=True)` in a child process (controller.safeload) that caps its own
  address space and is killed at `timeout_s`. Under a torch older than 2.10 pickle files are
  refused before any child starts, unless trust_pickle. There is no weights_only=False path.
- anything else: "not loadable: unknown format", which does not fail. A checkpoint-kind `.bin`
  that holds neither a torch zip nor a pickle is loaded as torch anyway, and so fails.

A checkpoint-kind file that loads but holds no tensors fails ("holds no tensors").
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from controller import safeload, stcheck
from controller.verify_identity import Progress

UNKNOWN = "not loadable: unknown format"
TORCH_SUFFIXES = frozenset({".pt", ".pth", ".ckpt"})
DEFAULT_TIMEOUT_S = 300.0
BASE_ADDRESS_SPACE = 2 << 30  # what a child needs for Python + torch before the file (~0.7 GiB measured)
MAX_LOAD_WORKERS = 4  # each child holds torch (~0.3-0.6 GiB resident)
_ROOT = str(Path(__file__).resolve().parent.parent)
# -I: no user site, no PYTHON* variables, no script directory on sys.path; _ROOT makes
# `controller` importable whether or not the package is installed.
_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from controller.safeload import main; " \
        "sys.exit(main(sys.argv[2:]))"
_CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}


@dataclasses.dataclass
class LoadResult:
    status: str  # "ok" | "failed" | "unknown" | "skipped"
    reason: Optional[str] = None  # the one-line why (failed/skipped), or UNKNOWN
    detail: Dict[str, Any] = dataclasses.field(default_factory=dict)  # tensors, dtypes, ...
    note: Optional[str] = None  # e.g. the --trust-pickle statement

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


def seam_command(path: Path, fmt: str, finite: bool, trust_pickle: bool,
                 max_address_space: int) -> List[str]:
    """The argv of the seam child that loads one file."""
    argv = [sys.executable, "-I", "-c", _BOOT, _ROOT, os.path.abspath(path), "--format", fmt,
            "--max-address-space", str(max_address_space)]
    if finite:
        argv.append("--finite")
    if trust_pickle:
        argv.append("--trust-pickle")
    return argv


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def run_seam(argv: Sequence[str], timeout_s: float, limit: int) -> Dict[str, Any]:
    """Run one seam child; its JSON result, or {"ok": False, "error": why} when it gave none."""
    env = {**os.environ, **_CHILD_ENV}
    try:
        proc = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout_s, env=env, cwd="/")
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout_s:g}s: the loader was killed"}
    lines = [ln for ln in proc.stdout.decode("utf-8", "replace").splitlines() if ln.strip()]
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:
        result = None
    if proc.returncode == 0 and isinstance(result, dict):
        return result
    mib = limit >> 20
    if proc.returncode < 0:
        why = (f"loader died ({_signal_name(proc.returncode)}); under its {mib} MiB address-space "
               "limit that usually means the file needs more memory than allowed")
    else:
        err = [ln for ln in proc.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
        why = f"loader failed (exit {proc.returncode}): {err[-1][:300] if err else 'no output'}"
    return {"ok": False, "error": why}


def _interpret(result: Dict[str, Any], kind: str, limit: int) -> LoadResult:
    detail = {k: result[k] for k in ("format", "torch", "tensors", "elements", "dtypes", "nonfinite")
              if result.get(k) is not None}
    if not result.get("ok"):
        error = str(result.get("error") or "load failed")
        if result.get("error_type") == "MemoryError":
            error = f"out of memory under the {limit >> 20} MiB address-space limit"
        elif result.get("error_type") == "ImportError":  # torch itself could not be mapped
            error = f"{error} (under a {limit >> 20} MiB address-space limit)"
        return LoadResult("failed", error, detail)
    if kind == "checkpoint" and not result.get("tensors"):
        return LoadResult("failed", "holds no tensors", detail)
    bad = result.get("nonfinite") or 0
    if bad:
        names = ", ".join(result.get("nonfinite_names") or [])
        return LoadResult("failed", f"{bad} non-finite values (NaN/Inf) in {names}", detail)
    return LoadResult("ok", None, detail, note=result.get("note"))


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    trust_pickle: bool = False
    check_finite: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_bytes: Optional[int] = None  # None: BASE_ADDRESS_SPACE + 3 x file size


def load_one(path: Path, kind: str, opts: LoadOptions) -> LoadResult:
    """The safe-load proof of one file whose identity already passed.

    Only checkpoints must load. An include that will not load safely (a Hugging Face
    `training_args.bin` pickles a class, `rng_state.pth` numpy state) is proven by its
    identity alone, and the report says so instead of failing the pull.
    """
    result = _load_one(path, kind, opts)
    if kind != "checkpoint" and result.status == "failed":
        return LoadResult("unknown", f"identity only (an include that does not load safely: {result.reason})",
                          result.detail, result.note)
    return result


def _load_one(path: Path, kind: str, opts: LoadOptions) -> LoadResult:
    try:
        fmt = detect_format(path, kind)
        size = path.stat().st_size
    except OSError as e:
        return LoadResult("failed", f"unreadable: {e.strerror or e}")
    if fmt == "unknown":
        return LoadResult("unknown", UNKNOWN)
    limit = opts.memory_bytes or BASE_ADDRESS_SPACE + 3 * size
    note = None
    if fmt == "safetensors":
        try:
            layout = stcheck.parse_path(path)
        except (stcheck.HeaderError, OSError) as e:
            return LoadResult("failed", f"safetensors: {e}", {"format": fmt})
        if kind == "checkpoint" and not layout.tensors:
            return LoadResult("failed", "holds no tensors", {"format": fmt, "tensors": 0})
        if not opts.check_finite:
            return LoadResult("ok", None, {"format": fmt, "tensors": len(layout.tensors),
                                           "elements": sum(t.elements for t in layout.tensors),
                                           "dtypes": layout.dtypes()})
    else:
        allowed, note = safeload.pickle_gate(torch_version(), opts.trust_pickle)
        if not allowed:
            return LoadResult("failed", note, {"format": fmt})
    argv = seam_command(path, fmt, opts.check_finite, opts.trust_pickle, limit)
    result = _interpret(run_seam(argv, opts.timeout_s, limit), kind, limit)
    result.note = note or result.note
    return result


def prove_loads(files: Dict[str, Path], kinds: Dict[str, str], opts: LoadOptions,
                workers: Optional[int] = None,
                progress: Optional[Progress] = None) -> Dict[str, LoadResult]:
    """{relative path: LoadResult} for files (relative path -> absolute path), a few at a time."""
    n = max(1, min(workers or os.cpu_count() or 1, MAX_LOAD_WORKERS, len(files) or 1))
    out: Dict[str, LoadResult] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="rgt-load") as pool:
        futures = {pool.submit(load_one, full, kinds[rel], opts): rel for rel, full in files.items()}
        try:
            for fut in concurrent.futures.as_completed(futures):
                out[futures[fut]] = fut.result()
                if progress is not None:
                    progress("load", len(out), len(files))
        except BaseException:  # Ctrl-C: start no further loads
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return out
