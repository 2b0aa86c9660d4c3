"""What the launcher changes about a job's start: its interpreter, the profile's proxy hook and mirror
variables, and the PYTHONPATH entry that makes `from onbox import report` import in the job's Python.

The profile is applied when `--profile NAME` is given. Nothing here overrides what the user set:
a variable already in the launcher's environment or given with `--env` wins over the profile's.

The interpreter (choose_interpreter): `--python PATH`, else the profile's scripts.python (when it is
on this box), else `python3` on the job's PATH. A command whose first word is a bare `python`,
`python3` or `pythonX.Y` runs with it (a versioned word with no --python or profile is looked up as
written); a command given by path, or another program (torchrun), runs as written. Missing: an error
naming it and the fix, before anything starts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import protocol
import rgtlib
from profiles import Profile
from protocol import PACKAGE_VERSION

import onbox

# `source` the hook, say so on stderr (train.log) if it failed, then become the job.
_HOOK_SCRIPT = ('. "$0" >/dev/null 2>&1 || echo "rgt: the proxy hook $0 failed; starting without it" >&2; '
                'exec "$@"')


@dataclasses.dataclass
class Applied:
    argv: List[str]
    env: Dict[str, str]            # profile variables to add to the job's environment
    notes: List[str]               # what was applied or skipped, for the launcher's output
    record: Dict[str, object]      # for run.json: names and paths only, never values


def apply_profile(profile: Profile, argv: Sequence[str], user_env: Mapping[str, str]) -> Applied:
    """The proxy hook and the mirror variables; the interpreter is choose_interpreter()'s (below)."""
    s = profile.scripts
    out = list(argv)
    notes: List[str] = []
    record: Dict[str, object] = {"name": profile.name}
    if s.proxy_hook:
        if os.path.exists(s.proxy_hook):
            out = ["/bin/sh", "-c", _HOOK_SCRIPT, s.proxy_hook, *out]
            record["proxy_hook"] = s.proxy_hook
        else:
            notes.append(f"profile {profile.name}: proxy hook {s.proxy_hook} not found; not sourced")
    env = {k: v for k, v in s.env.items() if k not in user_env}
    record["env_names"] = sorted(env)
    return Applied(argv=out, env=env, notes=notes, record=record)


# ---- the job's interpreter ----------------------------------------------------------------------

PYTHON_NAME = re.compile(r"^python[0-9.]*$")
MIN_PYTHON = (3, 9)
_PROBE = "import sys; print('%d.%d.%d' % tuple(sys.version_info[:3]))"


class InterpreterMissing(Exception):
    """The job's interpreter (or its command) is not there; the message names it and the fix."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


@dataclasses.dataclass
class Interpreter:
    """Which Python runs the job, and why (run.json "interpreter")."""

    path: Optional[str]            # absolute; None when the command runs no Python and none is on PATH
    source: str                    # "--python", "profile", "PATH" or "command" (the command's own path)
    replaced: Optional[str] = None  # the command word it replaced (`python`, `python3.11`), if any
    version: Optional[str] = None

    def record(self) -> Dict[str, object]:
        return dataclasses.asdict(self)


def _find(name: str, path_env: Optional[str], cwd: Path) -> Optional[str]:
    """`name` as an absolute executable path: a word with a slash from the job's cwd, else on PATH."""
    if "/" in name:
        full = os.path.join(str(cwd), os.path.expanduser(name))
        return os.path.abspath(full) if os.path.isfile(full) and os.access(full, os.X_OK) else None
    return shutil.which(name, path=path_env)


def _missing(name: str, host: str) -> InterpreterMissing:
    return InterpreterMissing(f"{name} not found on {host}: pass --python /path/to/python or install it",
                              "the job's Python is --python, else the profile's scripts.python, else "
                              "python3 on the box's PATH (`command -v python3` there)")


def choose_interpreter(argv: Sequence[str], asked: Optional[str], profile_python: Optional[str],
                       path_env: Optional[str], cwd: Path, host: str,
                       notes: List[str]) -> Tuple[List[str], Interpreter]:
    """The job's argv with a bare `python`/`python3`/`pythonX.Y` first word replaced by the chosen
    interpreter (--python, else the profile's, else python3 on PATH; a versioned word is looked up
    as written), and the choice. InterpreterMissing, naming what is missing, when it is not there."""
    out, first = list(argv), argv[0]
    bare = "/" not in first and bool(PYTHON_NAME.match(first))
    choice: Optional[Tuple[str, str]] = None
    if asked:
        choice = (asked, "--python")
    elif profile_python:
        if _find(profile_python, path_env, cwd):
            choice = (profile_python, "profile")
        else:
            notes.append(f"the profile's interpreter {profile_python} is not on this box; "
                         "using python3 from PATH")
    if choice is None:
        choice = ("python3" if first in ("python", "python3") or not bare else first, "PATH")
    found = _find(choice[0], path_env, cwd)
    if found is None and choice[0] == "python3" and first == "python" and not asked:
        found = _find("python", path_env, cwd)   # an image with only `python` (a conda env)
    if found is None and (bare or asked):
        raise _missing(choice[0], host)
    if bare and found:
        out[0] = found
        return out, Interpreter(found, choice[1], first, _version(found, host))
    if _find(first, path_env, cwd) is None:
        raise InterpreterMissing(f"{first} not found on {host}", "install it there, or give its full path; "
                                 "a relative path is taken from the job's working directory (--cwd)")
    if "/" in first and PYTHON_NAME.match(os.path.basename(first)):
        found, source = _find(first, path_env, cwd), "command"
        return out, Interpreter(found, source, None, _version(found, host) if found else None)
    return out, Interpreter(found, choice[1], None, _version(found, host) if asked and found else None)


def _version(python: str, host: str) -> Optional[str]:
    """The interpreter's version, run once (it must start); None when it answers something else."""
    try:
        done = subprocess.run([python, "-c", _PROBE], stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        raise InterpreterMissing(f"{python} does not run on {host}: {e}",
                                 "pass --python with a working Python") from e
    if done.returncode != 0:
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise InterpreterMissing(f"{python} does not run on {host} (exit {done.returncode}): {tail[0][:200]}",
                                 "pass --python with a working Python")
    text = done.stdout.decode("ascii", "replace").strip()
    return text if re.match(r"^\d+\.\d+\.\d+$", text) else None


def old_python_note(interp: Interpreter) -> List[str]:
    if interp.version and tuple(int(x) for x in interp.version.split(".")[:2]) < MIN_PYTHON:
        return [f"{interp.path} is Python {interp.version}: `from onbox import report` and "
                "onbox.integrations need 3.9+ and will not import in this job"]
    return []


# ---- `from onbox import report` in the job's own Python -----------------------------------------


def _package_dirs() -> List[Path]:
    return [Path(str(pkg.__file__)).resolve().parent for pkg in (onbox, protocol, rgtlib)]


def _tree_digest(dirs: Sequence[Path]) -> str:
    """What identifies this copy of the packages: every file's name, size and mtime."""
    h = hashlib.sha256(PACKAGE_VERSION.encode())
    for top in dirs:
        for here, subdirs, files in os.walk(top):
            subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
            for name in sorted(f for f in files if not f.endswith((".pyc", ".pyo"))):
                st = os.stat(os.path.join(here, name))
                rel = os.path.relpath(os.path.join(here, name), top.parent)
                h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:12]


def job_pylib(root: Path) -> Path:
    """<root>/.rgt/pylib/<version>-<digest>/: a directory holding ONLY the pure-Python `onbox`,
    `protocol` and `rgtlib` packages (copied once per version and source state, then renamed into
    place), which the launcher appends to the job's PYTHONPATH. Nothing is installed into the job's
    environment. OSError when it cannot be made (the launch goes on and says so)."""
    dirs = _package_dirs()
    final = Path(root) / ".rgt" / "pylib" / f"{PACKAGE_VERSION}-{_tree_digest(dirs)}"
    if all((final / d.name / "__init__.py").is_file() for d in dirs):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=str(final.parent)))
    try:
        for d in dirs:
            shutil.copytree(d, tmp / d.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "onbox" / "__init__.py").is_file():  # not another launch that won the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def add_pylib(env: Dict[str, str], pylib: Path) -> None:
    """Append `pylib` to the job's PYTHONPATH, after the user's own entries (it never shadows them)."""
    own = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*own, str(pylib)])
