"""`rgt install HOST`: put this exact version of the package on a box, without needing its index.

    install(store, host, InstallOptions(...), progress=...) -> InstallResult

Steps, each reported on `progress` (stderr in the CLI):

1. build   this package's wheel from the source tree rgt runs from (controller.install.build; cached), or
           take --wheel FILE;
2. probe   the box's Python (--python, else the host profile's scripts.python, else python3) in one
           round trip (controller.box.probe): version (Requires-Python of our wheel, 3.9+), marker
           environment, accepted wheel tags, what is already installed and copied;
3. resolve which wheels the box needs (controller.install.wheels: Requires-Dist with markers judged for the
           box, plus py-spy, optional: the sidecar dumps a hung job's stacks with it) from
           --wheelhouse DIRs and the cache <state>/wheelhouse; pip fetches the missing ones HERE
           into that cache for the box's Python version and platform (needs an index here, not
           there; --no-download skips it). Still missing: refused, naming them, unless --index;
4. copy    the wheels the box lacks (by name, size and SHA-256) to ~/.rgt/wheels;
5. venv    `PY -m venv VENV` when VENV/bin/python is missing (VENV: --venv, else ~/.rgt/venv);
6. install `VENV/bin/python -m pip install --no-index --find-links WHEELS remote-gpu-trainer==V`
           (and py-spy when shipped); only with --index, and said on progress, a dependency missing
           there is asked of the box's own index (it may have a mirror);
7. verify  `VENV/bin/rgt-onbox --version` prints exactly our version, then record it in the venv
           (.rgt-install.json) and in the store (Store.set_installed).

Idempotent: when the venv's record names our version and wheel hash, steps 4-6 do nothing and
step 7 still runs. Reaching the box and the version check are controller.box.handle's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import profiles
from protocol import PACKAGE_VERSION
from rgtlib.units import human_bytes

from controller import paths
from controller.box import probe as boxprobe
from controller.box.handle import Box, BoxError, VersionMismatch, check_version
from controller.box.ssh import LocalShell, Shell, Ssh
from controller.install import build
from controller.install.wheels import (
    Requirement,
    Resolution,
    Wheel,
    WheelError,
    best,
    python_admits,
    resolve,
)
from controller.render import printable
from controller.store.db import Store
from controller.verify.identity import hash_file

DEFAULT_VENV = "~/.rgt/venv"
WHEELS_DIR = "~/.rgt/wheels"
_MISSING_DIST = re.compile(r"No matching distribution found for ([^\s(]+)")
# Shipped when a wheel for the box exists (or downloads): the sidecar dumps a hung job's stacks with it.
OPTIONAL = (Requirement.parse("py-spy>=0.3"),)
Progress = Callable[[str], None]


class InstallError(BoxError):
    """The install cannot go on; `hint` is the next step for a person."""


@dataclasses.dataclass
class InstallOptions:
    venv: Optional[str] = None               # default: ~/.rgt/venv
    python: Optional[str] = None             # default: the profile's scripts.python, else python3
    wheelhouses: Sequence[Path] = ()         # besides <state>/wheelhouse
    wheel: Optional[Path] = None             # our wheel, instead of building it
    download: bool = True                    # pip download missing wheels here, into <state>/wheelhouse
    index: bool = False                      # let the box's pip ask its own index for what is missing
    no_index_fallback: bool = True           # kept for callers of old; the default now (see `index`)


@dataclasses.dataclass
class InstallResult:
    host: str
    version: str
    venv: str
    onbox: str
    python: str
    already: bool                            # nothing needed installing
    copied_files: int
    copied_bytes: int
    used_index: bool                         # the box's own index supplied something
    recorded: bool                           # the store holds the install record
    elapsed_s: float
    shipped: Tuple[str, ...] = ()            # the wheels the box installs from (names)
    warnings: Tuple[str, ...] = ()           # e.g. py-spy not shipped

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _word(path: str) -> str:
    """A path as shell text: quoted, except that a leading ~/ still expands on the box."""
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


def _tail(data: bytes, lines: int = 4) -> str:
    """The box's last stderr lines for one message, escaped (render.printable)."""
    kept = [ln.strip() for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
    return " | ".join(printable(ln) for ln in kept[-lines:])[-600:]


def _sha256(path: Path) -> str:
    return hash_file(path)[1]


# ---- the steps ----------------------------------------------------------------------------------


def _python_for(host: Dict[str, Any], given: Optional[str]) -> str:
    if given:
        return given
    if host.get("profile"):
        try:
            python = profiles.load(str(host["profile"]), profiles.directory()).scripts.python
        except profiles.ProfileError as e:
            raise InstallError(str(e), "fix the host's profile (rgt hosts add ... --replace)") from e
        if python:
            return python
    return "python3"


def _probe(shell: Shell, python: str, venv: str, name: str) -> boxprobe.BoxPython:
    done = shell.run(boxprobe.command(_word(python), venv, WHEELS_DIR), check=False, timeout_s=120)
    if done.returncode == 127:
        raise InstallError(f"no Python at {python!r} on {name} (exit 127: {_tail(done.stderr, 1)})",
                           hint="pass --python PATH, or set scripts.python in the host's profile")
    if done.returncode != 0:
        raise InstallError(f"{python} on {name} failed the probe (exit {done.returncode}): "
                           f"{_tail(done.stderr)}", hint="pass --python with a Python 3.9+ on the box")
    try:
        return boxprobe.parse(done.stdout, python, name)
    except boxprobe.ProbeError as e:
        raise InstallError(e.message, e.hint) from e


def _check_python(box: boxprobe.BoxPython, ours: Wheel, python: str, name: str) -> None:
    needs = ours.metadata()[3] or ">=3.9"
    if not python_admits(needs, box.version_text):
        raise InstallError(f"{python} on {name} is Python {box.version_text}; "
                           f"{build.PROJECT} needs Python {needs}",
                           hint="pass --python with the path of a newer Python on the box")


def _download(missing: Sequence[Tuple[Requirement, str]], box: boxprobe.BoxPython, dest: Path,
              progress: Progress) -> Optional[str]:
    """pip download the missing wheels here for the box's Python and platforms (needs an index here);
    each on its own, so that one without a wheel does not keep the others out. The failures, or None."""
    plats = list(dict.fromkeys(t.split("-", 2)[2] for t in box.tags if not t.endswith("-any")))
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
            "--disable-pip-version-check", "-d", str(dest),
            "--python-version", box.version_text, "--implementation", "cp"]
    for plat in plats[:64]:
        base += ["--platform", plat]
    progress(f"download: {', '.join(str(r) for r, _ in missing)} into {dest} (for Python {box.version_text})")
    dest.mkdir(parents=True, exist_ok=True)
    failed: List[str] = []
    for req, _ in missing:
        try:
            done = subprocess.run([*base, str(req)], stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=600, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            failed.append(f"{req}: {e}")
            continue
        if done.returncode != 0:
            failed.append(f"{req}: {_tail(done.stderr, 1)}")
    return "; ".join(failed)[:600] or None


def _resolve(ours: Wheel, box: boxprobe.BoxPython, opts: InstallOptions,
             progress: Progress) -> Resolution:
    local = paths.state_dir() / "wheelhouse"
    houses = [*opts.wheelhouses, local]
    failure: Optional[str] = None
    try:
        res = resolve(ours.path, houses, box.markers, box.tags, OPTIONAL)
        for _ in range(5 if opts.download else 0):  # a downloaded wheel may need more
            todo = [*res.missing, *res.optional_missing]
            if not todo:
                break
            failure = _download(todo, box, local, progress)
            again = resolve(ours.path, houses, box.markers, box.tags, OPTIONAL)
            if len(again.wheels) == len(res.wheels):
                res = again
                break
            res = again
    except WheelError as e:
        raise InstallError(f"cannot work out the box's wheels: {e}") from e
    res.missing = [(req, by) for req, by in res.missing if not _on_box(req, box)]
    if res.missing:
        what = "; ".join(f"{req} (needed by {by})" for req, by in res.missing)
        where = ", ".join(str(h) for h in houses)
        why = f"; pip download here failed: {failure}" if failure else "" if opts.download else \
            " (--no-download)"
        if not opts.index:
            raise InstallError(
                f"no wheel for the box's Python {box.version_text} here for: {what} (looked in {where}{why})",
                hint="pass --wheelhouse DIR with those wheels (pip download --only-binary=:all: "
                     "--python-version X.Y --platform ...), or --index to let the box's pip use its "
                     "own index for them")
        progress(f"resolve: no wheel here for {what}; --index: the box's own index will be asked")
    return res


def _on_box(req: Requirement, box: boxprobe.BoxPython) -> bool:
    """A wheel for `req` that an earlier install left on the box (pip there checks its own needs)."""
    there = []
    for name in box.wheels:
        try:
            there.append(Wheel.from_path(Path(name)))
        except WheelError:
            continue
    return best([w for w in there if w.name == req.name], req, box.tags) is not None


def _copy(shell: Shell, box: boxprobe.BoxPython, wheels: Sequence[Wheel],
          progress: Progress) -> Tuple[int, int]:
    todo = [w.path for w in wheels
            if box.wheels.get(w.path.name) != (w.path.stat().st_size, _sha256(w.path))]
    if not todo:
        progress(f"copy: nothing new ({len(wheels)} wheels already in {box.wheels_dir})")
        return 0, 0
    size = sum(p.stat().st_size for p in todo)
    files = f"{len(todo)} file{'s' if len(todo) != 1 else ''}"
    progress(f"copy: {files}, {human_bytes(size)} to {box.wheels_dir}")
    shell.put(todo, box.wheels_dir)
    return len(todo), size


def _venv(shell: Shell, box: boxprobe.BoxPython, python: str, progress: Progress) -> None:
    if box.venv_python:
        progress(f"venv: {box.venv} exists")
        return
    progress(f"venv: creating {box.venv}")
    done = shell.run(f"{_word(python)} -I -m venv {shlex.quote(box.venv)}", check=False, timeout_s=300)
    if done.returncode != 0:
        hint = ("install the venv module there (apt install python3-venv), or pass --python with a "
                "Python that has it" if b"ensurepip" in done.stderr + done.stdout else None)
        raise InstallError(f"{python} -m venv {box.venv} failed (exit {done.returncode}): "
                           f"{_tail(done.stderr + done.stdout)}", hint)


def _pip_install(shell: Shell, box: boxprobe.BoxPython, ours: Wheel, opts: InstallOptions,
                 progress: Progress, force: bool, extra: Sequence[str] = ()) -> bool:
    """Install offline (with `extra`: the optional wheels shipped, py-spy); with --index once more
    with the box's index when only a dependency was missing.
    `force`: this version is there already (from other sources, or broken), so pip must replace
    it. Returns whether the index was used."""
    # -I: neither the working directory nor PYTHONPATH may make pip think it is installed already
    pip = (f"{shlex.quote(box.venv + '/bin/python')} -I -m pip install -q --no-cache-dir "
           f"--disable-pip-version-check --find-links {shlex.quote(box.wheels_dir)}")
    target = shlex.quote(f"{build.PROJECT}=={PACKAGE_VERSION}")
    line = f"{pip} --no-index {target}" + "".join(f" {shlex.quote(name)}" for name in extra)
    if force:  # pip would call the same version number satisfied
        line += f" && {pip} --no-index --no-deps --force-reinstall " \
                f"{shlex.quote(box.wheels_dir + '/' + ours.path.name)}"
    progress(f"install: {build.PROJECT}=={PACKAGE_VERSION} from {box.wheels_dir} (no index)")
    done = shell.run(line, check=False, timeout_s=900)
    if done.returncode == 0:
        return False
    missing = _MISSING_DIST.findall(done.stderr.decode("utf-8", "replace"))
    if not missing:
        raise InstallError(f"pip install on the box failed (exit {done.returncode}): {_tail(done.stderr)}")
    if not opts.index:
        raise InstallError(
            f"the box has no wheel for {', '.join(missing)}, and its own index is not used without --index",
            hint="pass --wheelhouse DIR holding a wheel for it, or --index to let the box's pip fetch it")
    progress(f"install: no wheel for {', '.join(missing)}; --index: retrying once with the box's own index")
    done = shell.run(line.replace(" --no-index", ""), check=False, timeout_s=900)
    if done.returncode != 0:
        raise InstallError(f"pip install with the box's index failed too (exit {done.returncode}): "
                           f"{_tail(done.stderr)}",
                           hint="pass --wheelhouse DIR with wheels for the box's Python")
    return True


def _write_record(shell: Shell, box: boxprobe.BoxPython, sha256: str, wheel_name: str,
                  now: float) -> None:
    doc = {"version": PACKAGE_VERSION, "wheel": wheel_name, "sha256": sha256, "installed_at": now}
    target = shlex.quote(f"{box.venv}/{boxprobe.MARKER_FILE}")
    shell.run(f"cat > {target}", input=json.dumps(doc).encode(), timeout_s=60)


@contextlib.contextmanager
def _session(shell: Union[Ssh, LocalShell]) -> Iterator[None]:
    """One ssh master for the whole install. It is never stopped here: a watcher may have
    added its forwards meanwhile, and the master ends itself once idle (ssh.MASTER_IDLE_S)."""
    if isinstance(shell, Ssh):
        shell.start_master()
    yield


def _put_on_box(shell: Shell, box: boxprobe.BoxPython, ours: Wheel, python: str, opts: InstallOptions,
                progress: Progress, force: bool,
                warnings: List[str]) -> Tuple[int, int, bool, Tuple[str, ...]]:
    """Steps 3-6: (files copied, bytes copied, whether the box's index was used, the wheels shipped)."""
    res = _resolve(ours, box, opts, progress)
    for req, _ in res.optional_missing:
        warnings.append(f"no {req} wheel for the box's Python {box.version_text} here: a hung job's stacks "
                        "come only from the integrations' faulthandler dump (pass --wheelhouse DIR with it)")
        progress(f"resolve: {warnings[-1]}")
    copied = _copy(shell, box, res.wheels, progress)
    _venv(shell, box, python, progress)
    extra = [str(r.name) for r in OPTIONAL if any(w.name == r.name for w in res.wheels)]
    used_index = _pip_install(shell, box, ours, opts, progress, force, extra)
    return copied[0], copied[1], used_index, tuple(sorted(w.name for w in res.wheels))


def _escaped(progress: Progress) -> Progress:
    """progress with every line escaped (render.printable): the lines name the box's paths,
    interpreter and versions, which the box reports itself."""
    return lambda line: progress(printable(line))


def install(store: Store, host_name: str, opts: InstallOptions, *, progress: Progress = print,
            shell: Optional[Union[Ssh, LocalShell]] = None,
            clock: Callable[[], float] = time.time) -> InstallResult:
    """Put this version on the box (see the module doc). Raises InstallError, VersionMismatch (both
    BoxError), BuildError, SshError. Each progress line is escaped before `progress` sees it."""
    began = time.monotonic()
    progress = _escaped(progress)
    target = Box.of(store, host_name, shell)
    host = target.record
    if opts.wheel is not None:
        built = build.given_wheel(opts.wheel)
        progress(f"build: using {built.path}")
    else:
        built = build.package_wheel(paths.state_dir() / "wheels")
        progress(f"build: {built.path.name} ({'cached' if built.cached else 'built'}, "
                 f"source {built.source_hash[:12]})")
    ours = Wheel.from_path(built.path)
    ours_sha = _sha256(ours.path)
    python = _python_for(host, opts.python)
    shell = target.shell
    with _session(shell):
        box = _probe(shell, python, opts.venv or DEFAULT_VENV, host_name)
        _check_python(box, ours, python, host_name)
        where = f" ({box.executable})" if box.executable != python else ""
        progress(f"probe: {python} is Python {box.version_text}{where}; "
                 f"{len(box.tags)} wheel tags ({box.tags_from}), best {box.tags[0] if box.tags else '-'}")
        record = box.record or {}
        already = box.venv_python and record.get("version") == PACKAGE_VERSION \
            and record.get("sha256") == ours_sha
        onbox = f"{box.venv}/bin/rgt-onbox"
        copied: Tuple[int, int, bool, Tuple[str, ...]] = (0, 0, False, ())
        warnings: List[str] = []
        if already:
            progress(f"install: {build.PROJECT} {PACKAGE_VERSION} is already in {box.venv}")
            try:
                version = check_version(shell, shlex.quote(onbox), host_name)
            except VersionMismatch as e:
                progress(f"verify: {e.message}; installing again")
                already = False
        if not already:
            copied = _put_on_box(shell, box, ours, python, opts, progress,
                                 force=record.get("version") == PACKAGE_VERSION, warnings=warnings)
            version = check_version(shell, shlex.quote(onbox), host_name)
            _write_record(shell, box, ours_sha, ours.path.name, clock())
        progress(f"verify: {onbox} --version says {version}")
    recorded = _record(store, host_name, {"version": version, "venv": box.venv, "onbox": onbox,
                                          "python": box.version_text, "installed_at": clock(),
                                          "wheel_sha256": ours_sha})
    return InstallResult(host=host_name, version=version, venv=box.venv, onbox=onbox,
                         python=box.version_text, already=already, copied_files=copied[0],
                         copied_bytes=copied[1], used_index=copied[2], recorded=recorded,
                         shipped=copied[3], warnings=tuple(warnings),
                         elapsed_s=round(time.monotonic() - began, 3))


def _record(store: Store, host_name: str, installed: Dict[str, Any]) -> bool:
    if host_name not in {str(h["name"]) for h in store.hosts()}:
        return False  # `local` without a stored row: nothing to record it on
    store.set_installed(host_name, installed)
    return True


__all__ = ["DEFAULT_VENV", "InstallError", "InstallOptions", "InstallResult", "install"]
