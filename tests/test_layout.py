"""The import rules between the five packages are enforced by ruff, per package; prove the lint bites."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

REPO = Path(__file__).resolve().parent.parent
RUFF = Path(sys.executable).parent / "ruff"


def lint(path: str, source: str) -> subprocess.CompletedProcess:
    """ruff on `source` as if it were the file `path` (config resolved for that path)."""
    return subprocess.run([str(RUFF), "check", "--select", "TID251", "--stdin-filename", path, "-"],
                          input=source, capture_output=True, text=True, cwd=REPO, timeout=60)


@pytest.mark.parametrize("path, source", [
    ("protocol/x.py", "import onbox\n"),
    ("protocol/x.py", "from controller import cli\n"),
    ("protocol/x.py", "import profiles\n"),
    ("protocol/x.py", "import zmq\n"),
    ("rgtlib/x.py", "import protocol\n"),
    ("rgtlib/x.py", "from onbox import runs\n"),
    ("rgtlib/x.py", "import controller.render\n"),
    ("rgtlib/x.py", "import click\n"),
    ("profiles/x.py", "import protocol\n"),
    ("onbox/x.py", "from controller.store.db import Store\n"),
    ("controller/x.py", "import onbox.sidecar.journal\n"),
    ("onbox/sidecar/server.py", "import zmq\n"),
    ("onbox/x.py", "import pynvml\n"),
    ("onbox/x.py", "import torch\n"),
    ("controller/x.py", "import psutil\n"),
    ("onbox/sidecar/transport.py", "import zmq  # noqa: TID251\nimport controller\n"),
])
def test_forbidden_imports_fail_the_lint(path: str, source: str) -> None:
    out = lint(path, source)
    assert out.returncode == 1 and "TID251" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("path, source", [
    ("onbox/x.py", "import protocol\n"),
    ("controller/x.py", "from protocol import Event\n"),
    ("onbox/x.py", "from rgtlib import hashing\n"),
    ("controller/x.py", "import rgtlib.hashing\n"),
    ("onbox/sidecar/transport.py", "import zmq  # noqa: TID251\n"),
])
def test_allowed_imports_pass(path: str, source: str) -> None:
    assert lint(path, source).returncode == 0


def test_nothing_heavy_happens_at_import_time() -> None:
    """No module-level call into the outside world: importing every module binds, opens and
    initializes nothing (checked by importing them all in a fresh interpreter)."""
    modules = sorted(
        ".".join(p.relative_to(REPO).with_suffix("").parts)
        for pkg in ("protocol", "rgtlib", "onbox", "controller", "profiles")
        for p in (REPO / pkg).rglob("*.py") if p.name != "__main__.py"  # `python -m` entry points run
    )
    code = ("import sys, threading, logging\n"
            f"for m in {modules!r}: __import__(m.removesuffix('.__init__'))\n"
            "assert threading.active_count() == 1, threading.enumerate()\n"
            "assert not logging.getLogger().handlers\n"
            "assert 'torch' not in sys.modules and 'pynvml' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("package", ["protocol", "rgtlib"])
def test_the_ground_floor_imports_only_the_standard_library(package: str) -> None:
    stdlib = set(sys.stdlib_module_names)
    for path in (REPO / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in stdlib, f"{path.name} imports {name}"


# onbox/'s packages and the arrows allowed between them (docs/ARCHITECTURE.md §2.2). The modules
# directly in onbox/ are its ground floor (errors, fsutil, runs, stop, report, hints, scheduler, xid,
# strays, callrunner), which every package may use; the two arrows out of it are named here.
ONBOX_GROUND = "ground"
ONBOX_ALLOWED = {
    ONBOX_GROUND: {"sources", "custody"},  # xid: sources.gpu's recovery actions; runs: custody's manifest
    "sources": set(),
    "detectors": {"sources"},
    "integrations": set(),
    "custody": {"sources"},
    "monitors": {"detectors", "sources"},
    "deadman": {"custody", "launch"},
    "launch": {"custody", "deadman", "monitors", "sources"},
    "sidecar": {"custody", "deadman", "launch", "monitors", "sources"},
    "cli": {"custody", "deadman", "launch", "monitors", "sidecar", "sources"},
}


def _onbox_package(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 3 or (len(parts) == 2 and (REPO / "onbox" / parts[1]).is_dir()):
        return parts[1]
    return ONBOX_GROUND


def _onbox_imports(path: Path) -> List[Tuple[int, str]]:
    found: List[Tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "onbox":
                found += [(node.lineno, f"onbox.{a.name}") for a in node.names]
            elif node.module.startswith("onbox."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("onbox.")]
    return found


def test_every_onbox_package_is_in_the_table() -> None:
    found = {p.name for p in (REPO / "onbox").iterdir() if (p / "__init__.py").is_file()}
    assert found - {"data"} == set(ONBOX_ALLOWED) - {ONBOX_GROUND}


def test_onbox_packages_import_only_what_the_layout_allows() -> None:
    wrong = []
    for path in sorted((REPO / "onbox").rglob("*.py")):
        mine = _onbox_package(".".join(path.relative_to(REPO).with_suffix("").parts))
        for line, target in _onbox_imports(path):
            theirs = _onbox_package(target)
            if theirs == mine or (theirs == ONBOX_GROUND and mine != ONBOX_GROUND):
                continue
            if theirs not in ONBOX_ALLOWED[mine]:
                wrong.append(f"{path.relative_to(REPO)}:{line} ({mine}) imports {target} ({theirs})")
    assert not wrong, "\n".join(wrong)


FORBIDDEN = [("sources", "monitors"), ("detectors", "monitors"), ("custody", "sidecar"),
             ("monitors", "custody"), ("deadman", "cli")]


@pytest.mark.parametrize("mine, theirs", FORBIDDEN)
def test_the_onbox_table_refuses_the_arrows_the_layout_forbids(mine: str, theirs: str) -> None:
    assert theirs not in ONBOX_ALLOWED[mine]


def test_every_file_marked_slow_exists() -> None:
    """make test-fast leaves out tests/conftest.py's SLOW_FILES: a renamed file must not fall out
    of that list silently (and so come back into the quick loop with its minutes)."""
    from tests.conftest import SLOW_FILES

    here = Path(__file__).resolve().parent
    assert sorted(f for f in SLOW_FILES if not (here / f).is_file()) == []
