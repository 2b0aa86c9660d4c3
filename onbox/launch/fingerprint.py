"""What a run was made of, for `rgt compare`: rgt/fingerprint.json next to run.json.

    write_fingerprint(run_dir, argv, cwd, env, python) -> dict     (the launcher, after run.json)
    build_fingerprint(argv, cwd, env, python, run_dir) -> dict     (the same, without writing)

The document holds:

- `configs`: every config file the command names. A candidate is an argument itself, the value of
  `--flag VALUE` / `--flag=VALUE`, or the VALUE of `KEY=VALUE`; it counts when it resolves (relative
  to cwd) to an existing file ending .yaml/.yml/.json/.toml/.cfg/.ini. Each entry has the slot that
  named it (`--config`, `KEY`, or `#0`, `#1`... for bare arguments), the path as given and resolved,
  size, sha256 (of the bytes on disk) and the text when it is at most 256 KiB. The text is recorded
  with secret-looking values masked (onbox/launch/redact.py rules, plus `key: value` / `key = value` lines
  under a secret-looking key). A file named through a secret-looking slot or with a secret-looking
  name (`--credentials creds.json`, `secrets.yaml`) is listed as skipped, without hash or text.
- `seed`: seed and determinism settings: `args` (`--seed 1`, `--seed=1`, `trainer.seed=1`,
  `--deterministic`) and `env`, the values of PYTHONHASHSEED, CUBLAS_WORKSPACE_CONFIG,
  CUDA_LAUNCH_BLOCKING and other seed- or determinism-named variables. No other variable's value is
  ever recorded.
- `packages`: the job interpreter's Python version and every installed distribution with its
  version (`python -c` reading each one's METADATA head, at most 10 s; a failure is recorded in `error`).
- `gpu`: what rgt/preflight.json says about the GPUs (driver, count, names when the report has
  them), or None when there is no report.
- `errors`: whatever went wrong while building it. Nothing here raises: a fingerprint that fails
  must not stop a launch.

Standard library only (it runs in the launcher on the box's Python, 3.9 and up).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from onbox.launch.redact import MASK, is_secret_name, redact_text, secret_values
from onbox.runs import read_json, utc_iso, write_json_atomic

log = logging.getLogger(__name__)

FINGERPRINT_VERSION = 1
FINGERPRINT_NAME = "fingerprint.json"
CONFIG_SUFFIXES = (".yaml", ".yml", ".json", ".toml", ".cfg", ".ini")
MAX_TEXT_BYTES = 256 << 10
MAX_CONFIGS = 16
MAX_VALUE_CHARS = 200
PACKAGES_TIMEOUT_S = 10.0
# Variables whose values are recorded by name; other seed/determinism names are found by _env_kind.
DETERMINISM_ENV = frozenset({
    "PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "CUDA_LAUNCH_BLOCKING", "TF_DETERMINISTIC_OPS",
    "TF_CUDNN_DETERMINISTIC", "NVIDIA_TF32_OVERRIDE", "PL_SEED_WORKERS", "TORCH_DETERMINISTIC",
})
_ASSIGN_ARG = re.compile(r"^[+~]{0,2}(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)=(?P<value>.*)$", re.DOTALL)
# A `key: value` or `key = value` line (YAML, TOML, INI, JSON) whose value may need masking.
_KEY_LINE = re.compile(r"^(?P<head>\s*(?:-\s+)?(?P<q>[\"']?)(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)(?P=q)"
                       r"\s*[:=]\s*)(?P<value>\S.*)$")
# Words in a file's name that keep it out of the fingerprint (besides onbox.launch.redact's secret names).
_SECRET_FILE_WORDS = frozenset({"secret", "secrets", "credential", "credentials", "password", "passwords",
                                "token", "tokens", "auth", "keys", "apikeys", "env"})
_TRUTHY = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False,
           "on": True, "off": False}

# The job interpreter lists its distributions; runs on anything from 3.6 on. Each one's Name and
# Version come from the head of its METADATA (PKG-INFO for an egg): importlib.metadata parses the
# whole file, description and all, ~90 ms of CPU for a venv with torch and a framework, paid by
# every launch. Where a name is installed twice along sys.path, the first is the one imported and
# the one listed. Anything unexpected falls back to importlib.metadata (pkg_resources before 3.8).
_PACKAGES_SCRIPT = """\
import json, os, sys

def head(path):
    name = version = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                break
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key == "name" and name is None:
                name = value.strip()
            elif key == "version" and version is None:
                version = value.strip()
    return name, version

def scan():
    dists = {}
    for entry in sys.path:
        where = entry or "."
        try:
            names = sorted(os.listdir(where))
        except OSError:
            continue
        for n in names:
            low = n.lower()
            if not low.endswith((".dist-info", ".egg-info")):
                continue
            path = os.path.join(where, n)
            if os.path.isdir(path):
                path = os.path.join(path, "METADATA" if low.endswith(".dist-info") else "PKG-INFO")
            try:
                name, version = head(path)
            except OSError:
                continue
            if name and version and name not in dists:
                dists[name] = version
    if not dists:
        raise LookupError("no distribution found along sys.path")
    return dists

try:
    dists = scan()
except Exception:
    try:
        from importlib import metadata
        dists = {(d.metadata["Name"] or ""): d.version for d in metadata.distributions()}
    except ImportError:
        import pkg_resources
        dists = {d.project_name: d.version for d in pkg_resources.working_set}
print(json.dumps({"python": sys.version.split()[0], "distributions": dists}))
"""

Runner = Callable[..., "subprocess.CompletedProcess[bytes]"]


# ---- names --------------------------------------------------------------------------------------


def _words(name: str) -> List[str]:
    return [w for w in re.split(r"[-_.+~]+", name.strip("-+~").lower()) if w]


def name_kind(name: str) -> Optional[str]:
    """"seed" for seed-named flags and keys (--seed, trainer.seed, RANDOM_SEED, PYTHONHASHSEED),
    "determinism" for determinism settings (--deterministic, CUBLAS_WORKSPACE_CONFIG), else None."""
    words = _words(name)
    if not words:
        return None
    if words[-1] == "seed" or "".join(words).endswith("seed"):
        return "seed"
    if any(w.startswith("determinis") for w in words) or name.upper() in DETERMINISM_ENV:
        return "determinism"
    return None


def _env_kind(name: str) -> Optional[str]:
    return None if is_secret_name(name) else name_kind(name)


def _is_option(arg: str) -> bool:
    return arg.startswith("-") and arg not in ("-", "--") and not re.match(r"^-[0-9.]", arg)


def _secret_file(slot: str, path: Path) -> bool:
    return (is_secret_name(slot) or is_secret_name(path.stem)
            or any(w in _SECRET_FILE_WORDS for w in _words(path.stem)))


def _short(value: str, secrets: Sequence[str]) -> str:
    return redact_text(value, secrets)[:MAX_VALUE_CHARS]


# ---- arguments: config files and seeds ----------------------------------------------------------


def _candidates(argv: Sequence[str]) -> List[Tuple[str, str]]:
    """(slot, value) pairs an argument list offers as config files, in order."""
    out: List[Tuple[str, str]] = []
    bare = 0
    previous: Optional[str] = None
    for arg in argv[1:]:
        if _is_option(arg):
            name, eq, value = arg.partition("=")
            if eq:
                out.append((name, value))
            previous = None if eq else name
            continue
        m = _ASSIGN_ARG.match(arg)
        if m is not None and not arg.startswith(("/", ".")):
            out.append((m.group("name"), m.group("value")))
        elif previous is not None:
            out.append((previous, arg))
        else:
            out.append((f"#{bare}", arg))
            bare += 1
        previous = None
    return out


def _mask_config(text: str, secrets: Sequence[str]) -> str:
    lines = []
    for line in redact_text(text, secrets).splitlines(keepends=True):
        m = _KEY_LINE.match(line.rstrip("\r\n"))
        if m is not None and is_secret_name(m.group("name")) and MASK not in m.group("value"):
            ending = line[len(line.rstrip("\r\n")):]
            line = f"{m.group('head')}{MASK}{ending}"
        lines.append(line)
    return "".join(lines)


def _config_entry(slot: str, given: str, path: Path, secrets: Sequence[str]) -> Dict[str, Any]:
    entry: Dict[str, Any] = {"slot": slot, "arg": _short(given, secrets), "path": str(path),
                             "format": path.suffix.lower().lstrip(".")}
    if _secret_file(slot, path):
        entry["skipped"] = "secret-looking name: not hashed, not read"
        return entry
    data = path.read_bytes()
    entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest(), text=None)
    if len(data) > MAX_TEXT_BYTES:
        entry["text_skipped"] = f"larger than {MAX_TEXT_BYTES} bytes"
        return entry
    try:
        entry["text"] = _mask_config(data.decode("utf-8"), secrets)
    except UnicodeDecodeError:
        entry["text_skipped"] = "not UTF-8"
    return entry


def find_configs(argv: Sequence[str], cwd: Path, secrets: Sequence[str] = (),
                 errors: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """The config files `argv` names (see the module doc), each once, at most MAX_CONFIGS."""
    found: List[Dict[str, Any]] = []
    seen = set()
    for slot, value in _candidates(argv):
        if not value.lower().endswith(CONFIG_SUFFIXES) or len(found) >= MAX_CONFIGS:
            continue
        try:
            path = (Path(cwd) / os.path.expanduser(value)).resolve()
            if path in seen or not path.is_file():
                continue
            seen.add(path)
            found.append(_config_entry(slot, value, path, secrets))
        except (OSError, ValueError) as e:
            if errors is not None:
                errors.append(f"config {_short(value, secrets)}: {type(e).__name__}: {e}")
    return found


def _flag_value(argv: Sequence[str], i: int, kind: str) -> Tuple[Any, int]:
    """The value of the option argv[i] (no `=`): the next argument, or True for a bare flag."""
    nxt = argv[i + 1] if i + 1 < len(argv) else None
    if nxt is None or _is_option(nxt):
        return True, i + 1
    if kind == "determinism" and nxt.lower() not in _TRUTHY:
        return True, i + 1  # `--deterministic train.py`: a flag before a positional
    return nxt, i + 2


def seed_args(argv: Sequence[str], secrets: Sequence[str] = ()) -> List[Dict[str, Any]]:
    """Seed and determinism settings on the command line: [{"name", "value", "kind"}], in order."""
    out: List[Dict[str, Any]] = []
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            break
        if _is_option(arg):
            name, eq, value = arg.partition("=")
            kind = name_kind(name)
            if kind is None or is_secret_name(name):
                i += 1
                continue
            found: Any = value
            if eq:
                i += 1
            else:
                found, i = _flag_value(argv, i, kind)
        else:
            m = _ASSIGN_ARG.match(arg)
            i += 1
            kind = name_kind(m.group("name")) if m else None
            if m is None or kind is None or is_secret_name(m.group("name")):
                continue
            name, found = m.group("name"), m.group("value")
        out.append({"name": name, "value": _short(found, secrets) if isinstance(found, str) else found,
                    "kind": kind})
    return out


def seed_env(env: Mapping[str, str], secrets: Sequence[str] = ()) -> Dict[str, str]:
    """The values of seed and determinism variables; no other variable's value."""
    return {k: _short(v, secrets) for k, v in sorted(env.items()) if _env_kind(k) is not None}


# ---- the interpreter and the GPU ----------------------------------------------------------------


def _quiet_env(env: Mapping[str, str]) -> Dict[str, str]:
    return {k: v for k, v in env.items() if not is_secret_name(k)}


def list_packages(python: Optional[str], env: Mapping[str, str], cwd: Path,
                  timeout_s: float = PACKAGES_TIMEOUT_S,
                  run: Runner = subprocess.run) -> Dict[str, Any]:
    """{"python", "distributions": {name: version}, "error"} of the job's interpreter."""
    out: Dict[str, Any] = {"interpreter": python, "python": None, "distributions": {}, "error": None}
    if not python:
        out["error"] = "no interpreter known"
        return out
    try:
        done = run([python, "-c", _PACKAGES_SCRIPT], cwd=str(cwd), env=_quiet_env(env),
                   stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        out["error"] = f"listing the packages took over {timeout_s:g}s"
        return out
    except OSError as e:
        out["error"] = f"could not run {python}: {e.strerror or e}"
        return out
    try:
        doc = json.loads(done.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
        dists = doc["distributions"]
    except (ValueError, IndexError, KeyError, TypeError):
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
        out["error"] = f"{python} exited {done.returncode}" + (f": {tail[0][:200]}" if tail else "")
        return out
    out["python"] = doc.get("python")
    out["distributions"] = {re.sub(r"[-_.]+", "-", str(k)).lower(): str(v)
                            for k, v in sorted(dists.items()) if k}
    return out


def gpu_facts(run_dir: Path) -> Optional[Dict[str, Any]]:
    """The GPU part of rgt/preflight.json: driver, count, names (when the report has them)."""
    report = read_json(Path(run_dir) / "rgt" / "preflight.json")
    if report is None or not isinstance(report.get("gpu"), dict):
        return None
    gpu = report["gpu"]
    names = gpu.get("names")
    if not isinstance(names, list):
        names = sorted({str(c["name"]) for c in report.get("checks", [])
                        if isinstance(c, dict) and c.get("name")})
    return {"available": gpu.get("available"), "driver_version": gpu.get("driver_version"),
            "devices": gpu.get("devices"), "names": [str(n) for n in names]}


# ---- the document -------------------------------------------------------------------------------


def _part(errors: List[str], what: str, fn: Callable[[], Any], default: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # a fingerprint boundary: record it, never stop the launch
        log.debug("fingerprint %s failed", what, exc_info=True)
        errors.append(f"{what}: {type(e).__name__}: {e}"[:300])
        return default


def build_fingerprint(argv: Sequence[str], cwd: Path, env: Mapping[str, str], python: Optional[str],
                      run_dir: Path, *, packages_timeout_s: float = PACKAGES_TIMEOUT_S) -> Dict[str, Any]:
    """The fingerprint document (see the module doc). Never raises."""
    errors: List[str] = []
    secrets: List[str] = _part(errors, "secrets", lambda: secret_values(env), [])
    argv = list(argv)
    doc: Dict[str, Any] = {"v": FINGERPRINT_VERSION, "created_at": utc_iso()}
    doc["configs"] = _part(errors, "configs", lambda: find_configs(argv, Path(cwd), secrets, errors), [])
    doc["seed"] = {"args": _part(errors, "seed args", lambda: seed_args(argv, secrets), []),
                   "env": _part(errors, "seed env", lambda: seed_env(env, secrets), {})}
    doc["packages"] = _part(errors, "packages", lambda: list_packages(
        python, env, Path(cwd), packages_timeout_s), {"error": "failed", "distributions": {}})
    doc["gpu"] = _part(errors, "gpu", lambda: gpu_facts(Path(run_dir)), None)
    doc["errors"] = errors
    return doc


def write_fingerprint(run_dir: Path, argv: Sequence[str], cwd: Path, env: Mapping[str, str],
                      python: Optional[str], **kwargs: Any) -> Dict[str, Any]:
    """Build the fingerprint and write <run_dir>/rgt/fingerprint.json atomically. Never raises:
    a write failure is logged and left in the returned document's `errors`."""
    doc = build_fingerprint(argv, cwd, env, python, run_dir, **kwargs)
    try:
        rgt = Path(run_dir) / "rgt"
        rgt.mkdir(parents=True, exist_ok=True)
        write_json_atomic(rgt / FINGERPRINT_NAME, doc)
    except Exception as e:  # the launch goes on without a fingerprint
        log.warning("could not write the run's fingerprint: %s", e)
        doc["errors"].append(f"write: {type(e).__name__}: {e}"[:300])
    return doc

