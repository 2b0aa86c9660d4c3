"""The torch seam of pull verification, run as a child process, never imported by the controller
for loading:

    python -m controller.verify.safeload PATH [--format torch|safetensors] [--role ROLE] [--finite]
                                       [--trust-pickle] [--max-address-space BYTES]
    python -m controller.verify.safeload --batch [...] < [{"path", "format", "role", "finite"}, ...]

--batch loads many files in one process (one torch import per verification): before each it writes
`rgt-safeload: starting I` to stderr, after it one JSON line with "index": I to stdout, so a crash of
the process names the file it was on. ROLE is controller.verify.roles': a "companion" loads with
weights_only=True plus its explicit allow-list (numpy's RNG types for rng_state*.pth); NaN/Inf are
counted for "weights" only, and in a file with a "state_dict" only there.

It caps its own address space first (before torch is imported or the file is opened), then loads
PATH and prints exactly one JSON line on stdout:

    {"ok": bool, "format", "torch": "2.13.0+cpu", "tensors": int, "elements": int,
     "dtypes": {"float32": 4, ...}, "nonfinite": int | null, "nonfinite_names": [...],
     "error": str | null, "error_type": str | null, "refused": bool, "note": str | null}

torch files load with `torch.load(weights_only=True, mmap=True, map_location="cpu")` (no mmap for
the legacy non-zip format, which torch cannot map). There is no weights_only=False path anywhere,
with or without --trust-pickle: that flag only lifts the refusal of pickle files under a torch
older than MIN_SAFE_TORCH, whose weights_only unpickler has known CVEs.

safetensors files are parsed by rgtlib.safetensors_header; with --finite every floating tensor
is viewed through torch.frombuffer over a private mapping of the file and counted, in bounded chunks.

The controller runs this with a timeout, so a hostile file can neither hang nor exhaust it.
Importing this module imports nothing heavy: torch is imported inside main().
"""
from __future__ import annotations

import argparse
import importlib
import json
import mmap
import re
import resource
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from rgtlib import safetensors_header

from controller.verify import roles as verify_roles

MIN_SAFE_TORCH = (2, 10)  # weights_only has known CVEs below this
CHUNK_ELEMENTS = 1 << 24  # finite check: at most this many elements (and a bool mask) at a time
MAX_NAMES = 5
MAX_ERROR_CHARS = 400
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# safetensors dtype -> torch dtype attribute; absent in an older torch means "not checked".
_ST_TORCH_DTYPES = {
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}


def version_tuple(version: str) -> Optional[Tuple[int, int]]:
    """(major, minor) of "2.13.0+cpu"; None for a version we cannot read."""
    m = re.match(r"\s*(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def pickle_gate(torch_version: Optional[str], trust_pickle: bool) -> Tuple[bool, Optional[str]]:
    """(may a pickle file be loaded with weights_only=True, a note for the report).

    Below MIN_SAFE_TORCH (or an unreadable version) the answer is no unless trust_pickle; the note
    says why either way. A new enough torch loads with no note.
    """
    need = ".".join(map(str, MIN_SAFE_TORCH))
    if torch_version is None:
        return False, "torch is not installed: pickle checkpoints cannot be loaded"
    parsed = version_tuple(torch_version)
    if parsed is not None and parsed >= MIN_SAFE_TORCH:
        return True, None
    why = f"torch {torch_version} is older than {need}: its weights_only unpickler has known CVEs"
    if trust_pickle:
        return True, f"{why}; loaded (weights_only=True) anyway because of --trust-pickle"
    return False, f"{why}; refused (upgrade torch to >= {need}, or pass --trust-pickle for a file you made)"


def limit_address_space(max_bytes: Optional[int]) -> None:
    """Cap this process's address space (RLIMIT_AS); never raises the hard limit."""
    if not max_bytes:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        max_bytes = min(max_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (max_bytes, hard))


def weights_only_reason(message: str) -> str:
    """The line of torch's UnpicklingError that names what was refused, without torch's advice to
    rerun with weights_only=False (which this tool never does)."""
    lines = [ln.strip() for ln in _ANSI.sub("", message).splitlines() if ln.strip()]
    for ln in lines:
        if "GLOBAL" in ln or "Unsupported" in ln or "WeightsUnpickler error" in ln:
            ln = ln.split("WeightsUnpickler error: ", 1)[-1]
            return ln.split(" Please use", 1)[0].strip()  # drop the advice to allowlist it
    useful = [ln for ln in lines if "weights_only" not in ln
              and not ln.startswith(("Weights only load failed", "Check the documentation", "(1)", "(2)"))]
    return useful[0] if useful else "weights_only=True refused the file"


# ---- walking what was loaded ---------------------------------------------------------------------


class _Tally:
    def __init__(self, torch: Any, finite: bool) -> None:
        self.torch = torch
        self.finite = finite
        self.tensors = 0
        self.elements = 0
        self.dtypes: Dict[str, int] = {}
        self.nonfinite = 0
        self.nonfinite_names: List[str] = []

    def count(self, dtype: str, elements: int) -> None:
        self.tensors += 1
        self.elements += elements
        self.dtypes[dtype] = self.dtypes.get(dtype, 0) + 1

    def add(self, name: str, t: Any, dtype: Optional[str] = None) -> None:
        self.count(dtype or str(t.dtype).replace("torch.", ""), int(t.numel()))
        if self.finite and (t.is_floating_point() or t.is_complex()):
            bad = self._count_nonfinite(t)
            if bad:
                self.nonfinite += bad
                if len(self.nonfinite_names) < MAX_NAMES:
                    self.nonfinite_names.append(name)

    def _count_nonfinite(self, t: Any) -> int:
        flat = t.reshape(-1)
        bad = 0
        for start in range(0, flat.numel(), CHUNK_ELEMENTS):
            chunk = flat[start:start + CHUNK_ELEMENTS]
            if chunk.dtype.itemsize == 1 and chunk.is_floating_point():  # float8: no isfinite kernel
                chunk = chunk.to(self.torch.float32)
            bad += int((~self.torch.isfinite(chunk)).sum())
        return bad

    def walk(self, obj: Any, name: str = "", seen: Optional[Set[int]] = None, check: bool = True) -> None:
        """Count every tensor under obj; NaN/Inf are counted only where `check` (the weights)."""
        seen = set() if seen is None else seen
        if isinstance(obj, self.torch.Tensor):
            finite, self.finite = self.finite, self.finite and check
            try:
                self.add(name or "<root>", obj)
            finally:
                self.finite = finite
            return
        if not isinstance(obj, (dict, list, tuple)) or id(obj) in seen:
            return
        seen.add(id(obj))
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            self.walk(value, f"{name}.{key}" if name else str(key), seen, check)

    def walk_weights(self, obj: Any) -> None:
        """Walk a loaded weights file: with a weights key (a Lightning .ckpt's "state_dict"),
        NaN/Inf count only under it, never in callback, loop or optimizer state."""
        key = next((k for k in verify_roles.WEIGHT_KEYS if isinstance(obj, dict) and k in obj
                    and isinstance(obj[k], (dict, self.torch.Tensor))), None)
        if key is None:
            self.walk(obj)
            return
        seen: Set[int] = set()
        self.walk(obj[key], key, seen, True)
        for k, v in obj.items():
            if k != key:
                self.walk(v, str(k), seen, False)

    def result(self) -> Dict[str, Any]:
        return {"tensors": self.tensors, "elements": self.elements, "dtypes": self.dtypes,
                "nonfinite": self.nonfinite if self.finite else None,
                "nonfinite_names": self.nonfinite_names}


def _allowed_globals(names: Sequence[str]) -> List[Any]:
    """The objects of the dotted names an allow-list gives (those this environment has)."""
    out = []
    for dotted in names:
        module, _, attr = dotted.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue
    return out


def _load_torch(torch: Any, path: Path, finite: bool, role: str = verify_roles.WEIGHTS) -> Dict[str, Any]:
    with open(path, "rb") as f:
        is_zip = f.read(4) == b"PK\x03\x04"
    allowed = verify_roles.allow_list(path.name) if role == verify_roles.COMPANION else ()
    with torch.serialization.safe_globals(_allowed_globals(allowed)):
        obj = torch.load(str(path), weights_only=True, mmap=is_zip, map_location="cpu")
    tally = _Tally(torch, finite and role == verify_roles.WEIGHTS)
    tally.walk_weights(obj)
    out = tally.result()
    out["allow_list"] = list(allowed)
    return out


def _load_safetensors(torch: Any, path: Path, finite: bool) -> Dict[str, Any]:
    layout = safetensors_header.parse_path(path)
    tally = _Tally(torch, finite)
    if not finite:
        for span in layout.tensors:
            tally.count(span.dtype, span.elements)
        return tally.result()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        for span in layout.tensors:
            attr = _ST_TORCH_DTYPES.get(span.dtype)
            dtype = getattr(torch, attr, None) if attr else None
            if dtype is None or span.elements == 0:  # ints, bools, packed sub-byte floats
                tally.count(span.dtype, span.elements)
                continue
            t = torch.frombuffer(mm, dtype=dtype, count=span.elements,
                                 offset=layout.data_start + span.begin)
            tally.add(span.name, t, span.dtype)
            del t
    return tally.result()


def run(path: Path, fmt: str, finite: bool, trust_pickle: bool,
        role: str = verify_roles.WEIGHTS) -> Dict[str, Any]:
    """Load `path` as `fmt` in its role; the JSON-able result (never raises for a bad file)."""
    out: Dict[str, Any] = {"ok": False, "format": fmt, "torch": None, "error": None,
                           "error_type": None, "refused": False, "note": None}
    try:
        try:
            import torch  # noqa: TID251 -- this module is the torch seam
        except ImportError as e:
            out.update(error=f"import torch failed: {e}"[:MAX_ERROR_CHARS], error_type="ImportError")
            return out
        torch.set_num_threads(1)
        out["torch"] = str(torch.__version__)
        if fmt == "torch":
            allowed, out["note"] = pickle_gate(out["torch"], trust_pickle)
            if not allowed:
                out.update(refused=True, error=out["note"], error_type="Refused")
                return out
            out.update(_load_torch(torch, path, finite, role))
        else:
            out.update(_load_safetensors(torch, path, finite))
        out["ok"] = True
    except BaseException as e:  # the one boundary: whatever the file does, report it
        text = str(e)
        if type(e).__name__ == "UnpicklingError":
            text = f"weights_only=True refused it: {weights_only_reason(text)}"
        out.update(error=text[:MAX_ERROR_CHARS] or type(e).__name__, error_type=type(e).__name__)
    return out


STARTING = "rgt-safeload: starting "  # + the index of the file, on stderr, before each load


def run_batch(items: Sequence[Dict[str, Any]], trust_pickle: bool) -> None:
    """Load each item ({"path", "format", "role", "finite"}) in turn: a "starting I" line on stderr
    before it (so a crash names its file), then its result with "index": I on stdout."""
    for i, item in enumerate(items):
        sys.stderr.write(f"{STARTING}{i}\n")
        sys.stderr.flush()
        result = run(Path(str(item.get("path"))), str(item.get("format") or "torch"),
                     bool(item.get("finite")), trust_pickle, str(item.get("role") or verify_roles.WEIGHTS))
        result["index"] = i
        sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
        sys.stdout.flush()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controller.verify.safeload")
    parser.add_argument("path", type=Path, nargs="?")
    parser.add_argument("--batch", action="store_true",
                        help="Read a JSON list of {path, format, role, finite} on stdin; one JSON line each.")
    parser.add_argument("--format", choices=("torch", "safetensors"), default="torch")
    parser.add_argument("--role", default=verify_roles.WEIGHTS)
    parser.add_argument("--finite", action="store_true")
    parser.add_argument("--trust-pickle", action="store_true")
    parser.add_argument("--max-address-space", type=int, default=None, metavar="BYTES")
    args = parser.parse_args(argv)
    limit_address_space(args.max_address_space)
    if args.batch:
        items = json.loads(sys.stdin.read() or "[]")
        items = [x for x in items if isinstance(x, dict)] if isinstance(items, list) else []
        run_batch(items, args.trust_pickle)
        return 0
    if args.path is None:
        parser.error("give PATH or --batch")
    result = run(args.path, args.format, args.finite, args.trust_pickle, args.role)
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
