"""The controller's capability packages and the arrows allowed between them (docs/ARCHITECTURE.md §2).

Each package of controller/ is one capability; the ground floor (the modules directly in controller/) is
what every capability may use. The rules below are the layout: a new arrow is a design decision, made
here on purpose, never by accident in a module.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parent.parent
CONTROLLER = REPO / "controller"
GROUND = "ground"

# package -> the packages it may import (the ground floor is always allowed, except from the ground floor).
ALLOWED: Dict[str, Set[str]] = {
    GROUND: set(),
    "store": set(),
    "verify": set(),
    "box": {"store", "runs"},
    "install": {"box", "store", "verify"},
    "follow": {"box", "store", "runs"},
    "runs": {"store"},
    "wake": {"store", "runs", "queue"},
    "pull": {"box", "store", "verify"},
    "teardown": {"box", "store", "pull", "runs", "verify"},
    "queue": {"box", "store", "follow", "runs"},
    "daemon": {"box", "follow", "queue", "runs", "store"},
    "rehearse": {"runs", "verify"},
    "resume": {"box", "store", "pull", "runs"},
    "insight": {"box", "store"},
    "cli": {"box", "follow", "insight", "install", "pull", "queue", "rehearse", "resume", "runs", "store",
            "teardown", "verify", "wake"},
}


def package_of(module: str) -> str:
    """controller.store.db -> store; controller.paths -> ground."""
    parts = module.split(".")
    if len(parts) >= 3 or (len(parts) == 2 and (CONTROLLER / parts[1]).is_dir()):
        return parts[1]
    return GROUND


def imports(path: Path) -> Iterator[Tuple[int, str]]:
    """(line, module) for every absolute import of a controller module in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "controller":
                for alias in node.names:
                    yield node.lineno, f"controller.{alias.name}"
            elif node.module.startswith("controller."):
                yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("controller."):
                    yield node.lineno, alias.name


def modules() -> Iterator[Tuple[Path, str]]:
    for path in sorted(CONTROLLER.rglob("*.py")):
        yield path, ".".join(path.relative_to(REPO).with_suffix("").parts)


def test_every_package_is_in_the_table() -> None:
    found = {p.name for p in CONTROLLER.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert found - {"data"} == set(ALLOWED) - {GROUND}


def test_packages_import_only_what_the_layout_allows() -> None:
    wrong = []
    for path, module in modules():
        mine = package_of(module)
        for line, target in imports(path):
            theirs = package_of(target)
            if theirs == mine or (theirs == GROUND and mine != GROUND):
                continue
            if theirs not in ALLOWED[mine]:
                wrong.append(f"{path.relative_to(REPO)}:{line} ({mine}) imports {target} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_only_cli_imports_click() -> None:
    wrong = [f"{path.relative_to(REPO)}:{line}" for path, module in modules() if package_of(module) != "cli"
             for line, name in _top_imports(path) if name == "click"]
    assert not wrong, wrong


def test_command_modules_never_import_each_other() -> None:
    """cli/base and cli/progress are what commands share; cli/main finds the commands by name, lazily."""
    shared = {"controller.cli.base", "controller.cli.progress"}
    wrong = []
    for path in sorted((CONTROLLER / "cli").glob("*.py")):
        for line, target in imports(path):
            if target.startswith("controller.cli.") and target not in shared:
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert not wrong, wrong


def _top_imports(path: Path) -> Iterator[Tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


@pytest.mark.parametrize("mine, target", [("store", "controller.box.ssh"), ("runs", "controller.box.ssh"),
                                          ("wake", "controller.box.ssh"), (GROUND, "controller.store.db")])
def test_the_table_refuses_the_arrows_the_design_forbids(mine: str, target: str) -> None:
    assert package_of(target) not in ALLOWED[mine]
