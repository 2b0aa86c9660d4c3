"""This package's own wheel, built from the source tree rgt runs from, cached until the source changes.

    package_wheel(cache_dir) -> Built(path, version, source_hash, cached)

The source tree is the directory above the `controller` package when it holds this project's
pyproject.toml (a clone, or `pip install -e .`). The files that make the wheel (pyproject.toml,
README, licence and the packages listed in pyproject's `packages.find`) are hashed; the wheel is
cached in <cache_dir>/<version>-<hash>/ (the newest few are kept) and rebuilt only when one of them
changed. The build runs `python -m pip wheel --no-deps --no-build-isolation` on a copy of exactly
those files, so nothing is written into the source tree and a stale build/ directory can never leak
into the wheel; it needs setuptools here, and no index.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from protocol import PACKAGE_VERSION

from controller.install.wheels import Wheel, WheelError, normalize

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10 controllers
    import tomli as tomllib

PROJECT = "remote-gpu-trainer"
BUILD_TIMEOUT_S = 300.0
KEEP_BUILDS = 5
_TOP_FILES = ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "README.md", "README.rst",
              "LICENSE", "LICENSE.txt", "LICENCE")
_DEFAULT_PACKAGES = ("protocol", "rgtlib", "onbox", "controller", "profiles")


class BuildError(Exception):
    """The wheel cannot be had; `hint` says what a person can do."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclasses.dataclass(frozen=True)
class Built:
    path: Path
    version: str
    source_hash: str        # "" for a wheel given with --wheel
    cached: bool            # True when no build ran


def source_root(anchor: Optional[Path] = None) -> Path:
    """The source tree rgt runs from; BuildError when it runs from an installed wheel."""
    here = Path(anchor) if anchor is not None else Path(__file__).resolve().parents[2]
    pyproject = here / "pyproject.toml"
    try:
        name = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {}).get("name")
    except (OSError, tomllib.TOMLDecodeError):
        name = None
    if name != PROJECT:
        raise BuildError(
            f"rgt runs from {here}, which is not a {PROJECT} source tree (no pyproject.toml naming it), "
            "so it cannot build the package for the box",
            hint=f"install rgt from a clone (git clone ...; pip install -e .), or pass --wheel FILE "
                 f"(a {PROJECT} {PACKAGE_VERSION} wheel)")
    return here


def _packages(root: Path) -> Tuple[str, ...]:
    doc = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    find = doc.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    names = sorted({str(p).split(".")[0].rstrip("*") for p in find.get("include", [])} - {""})
    return tuple(names) or _DEFAULT_PACKAGES


def source_files(root: Path) -> List[Path]:
    """The files the wheel is made of, relative to root, sorted."""
    out = [Path(name) for name in _TOP_FILES if (root / name).is_file()]
    for package in _packages(root):
        for dirpath, dirnames, filenames in os.walk(root / package):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            for name in filenames:
                if not name.endswith((".pyc", ".pyo")) and not name.startswith("."):
                    out.append(Path(dirpath, name).relative_to(root))
    return sorted(out)


def source_hash(root: Path, files: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for rel in files:
        data = (root / rel).read_bytes()
        digest.update(f"{rel.as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def _cached(where: Path) -> Optional[Path]:
    found = sorted(where.glob("*.whl")) if where.is_dir() else []
    return found[0] if len(found) == 1 else None


def _run_pip_wheel(src: Path, out: Path) -> None:
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "--disable-pip-version-check", "--no-cache-dir", "-q", "-w", str(out), str(src)]
    env = {**os.environ, "PIP_NO_INDEX": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, env=env,
                              timeout=BUILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        raise BuildError(f"building the wheel took over {BUILD_TIMEOUT_S:g}s") from e
    if done.returncode != 0:
        text = (done.stderr or done.stdout).decode("utf-8", "replace")
        tail = " | ".join(line.strip() for line in text.splitlines() if line.strip())[-800:]
        hint = ("rgt builds without build isolation: pip install 'setuptools>=68' here"
                if "setuptools" in text or "BackendUnavailable" in text else
                "pip is needed here to build the wheel" if "No module named pip" in text else None)
        raise BuildError(f"building the {PROJECT} wheel failed (exit {done.returncode}): {tail}", hint)


def _copy_sources(root: Path, files: Sequence[Path], dest: Path) -> None:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)


def package_wheel(cache_dir: Path, root: Optional[Path] = None) -> Built:
    """The wheel of this exact source tree (see the module doc)."""
    root = source_root(root)
    files = source_files(root)
    digest = source_hash(root, files)
    entry = cache_dir / f"{PACKAGE_VERSION}-{digest[:16]}"
    found = _cached(entry)
    if found is not None:
        return Built(found, PACKAGE_VERSION, digest, cached=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=cache_dir) as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "out"
        _copy_sources(root, files, src)
        _run_pip_wheel(src, out)
        built = _cached(out)
        if built is None:
            raise BuildError(f"pip wheel left no single wheel in {out}")
        _check_wheel(built, "the wheel built from the source tree")
        try:
            os.replace(out, entry)  # whole-or-nothing; another rgt may have won the race
        except OSError:
            if _cached(entry) is None:
                raise
    wheel = _cached(entry)
    assert wheel is not None
    _prune(cache_dir, keep=entry)
    return Built(wheel, PACKAGE_VERSION, digest, cached=False)


def _prune(cache_dir: Path, keep: Path, entries: int = KEEP_BUILDS) -> None:
    """Drop all but the newest `entries` cached builds (each source change makes one)."""
    builds = sorted((p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".")),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    for old in builds[entries:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def _check_wheel(path: Path, what: str) -> None:
    try:
        name, version = Wheel.from_path(path).metadata()[:2]
    except WheelError as e:
        raise BuildError(f"{what}: {e}") from e
    if normalize(name) != PROJECT:
        raise BuildError(f"{what} ({path.name}) is {name!r}, not {PROJECT}")
    if version != PACKAGE_VERSION:
        raise BuildError(f"{what} ({path.name}) is version {version}, but this rgt is {PACKAGE_VERSION}: "
                         "the box must run the same version as the controller",
                         hint="restart rgt after a version change, or give the wheel of this version")


def given_wheel(path: Path) -> Built:
    """A wheel the user passed with --wheel, checked to be this package at this version."""
    _check_wheel(path, f"--wheel {path}")
    return Built(path, PACKAGE_VERSION, "", cached=True)


__all__ = ["PROJECT", "BuildError", "Built", "given_wheel", "package_wheel", "source_files",
           "source_hash", "source_root"]
