"""docs/ARCHITECTURE.md stays true to the tree: its sections are there, every repository path it
names exists, and it cites nothing outside the repository.

Module docstrings point into the document by section ("docs/ARCHITECTURE.md §3"), so the nine
numbered headings are part of its contract. A path is anything in inline code or a fenced block
that starts with one of the repository's top-level directories (`onbox/sidecar/journal.py`,
`controller/follow/`, `profiles/*.toml`); braces expand (`a/{b,c}.py`) and globs must match.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Iterator, List

import pytest

from tests.helpers import CITED_SAMPLES, OUTSIDE_DOCUMENT

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "ARCHITECTURE.md"
TOP = ("protocol", "rgtlib", "onbox", "controller", "profiles", "tests", "scripts", "bench", "examples",
       "docs")
SECTIONS = 9

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"(?<![\w/.<>$~{-])(?:" + "|".join(TOP) + r")/[\w.*{},/-]*")
_BRACES = re.compile(r"\{([^{}]*)\}")
# Documents that live outside this repository, and the words that name them.
# Stricter than the rule for help texts: no workspace path, no URL, not even the words "seed" and
# "inventory".
_OUTSIDE = re.compile(OUTSIDE_DOCUMENT + r"|/work/|seed|inventory|https?://", re.I)


def _text() -> str:
    assert DOC.is_file(), f"{DOC.relative_to(REPO)} is missing"
    return DOC.read_text(encoding="utf-8")


def _expand(path: str) -> List[str]:
    """a/{b,c}.py -> [a/b.py, a/c.py]; a path without braces is itself."""
    parts = _BRACES.split(path)
    literal, choices = parts[0::2], [group.split(",") for group in parts[1::2]]
    out = []
    for picked in itertools.product(*choices):
        out.append("".join(lit + pick for lit, pick in itertools.zip_longest(literal, picked, fillvalue="")))
    return out


def named_paths(text: str) -> Iterator[str]:
    """Every repository path the document names in code, once each, in order."""
    code = [m.group(0) for m in _FENCE.finditer(text)]
    code += [m.group(1) for m in _INLINE.finditer(_FENCE.sub("", text))]
    seen = set()
    for span in code:
        for match in _PATH.finditer(span):
            for path in _expand(match.group(0).rstrip(".,:;")):
                if path not in seen:
                    seen.add(path)
                    yield path


def _exists(path: str) -> bool:
    if any(c in path for c in "*?["):
        return any(REPO.glob(path.rstrip("/")))
    return (REPO / path).exists()


def test_the_document_has_its_numbered_sections_in_order() -> None:
    headings = re.findall(r"^## (\d+)\. \S", _text(), re.M)
    assert headings == [str(n) for n in range(1, SECTIONS + 1)], headings


def test_every_path_it_names_exists() -> None:
    paths = list(named_paths(_text()))
    assert any(p.startswith("controller/") for p in paths) and any(p.startswith("onbox/") for p in paths)
    missing = [p for p in paths if not _exists(p)]
    assert not missing, f"docs/ARCHITECTURE.md names {len(missing)} path(s) not in the tree: {missing}"


def test_it_cites_nothing_outside_the_repository() -> None:
    found = sorted({m.group(0) for m in _OUTSIDE.finditer(_text())})
    assert not found, f"docs/ARCHITECTURE.md cites outside the repository: {found}"


@pytest.mark.parametrize("text, expected", [
    ("see `onbox/sidecar/journal.py` and `controller/{paths,render}.py`.",
     ["onbox/sidecar/journal.py", "controller/paths.py", "controller/render.py"]),
    ("```\n    controller/follow/watcher.py: the watcher\n```\n", ["controller/follow/watcher.py"]),
    ("`<run>/rgt/sock/` and `python -m onbox.cli` and plain onbox/x.py", []),
    ("`profiles/*.toml`, `tests/`", ["profiles/*.toml", "tests/"]),
])
def test_the_path_reader(text: str, expected: List[str]) -> None:
    assert list(named_paths(text)) == expected


def test_a_missing_path_and_a_citation_are_caught(tmp_path: Path) -> None:
    assert not _exists("onbox/no_such_module.py") and not _exists("profiles/*.nothing")
    assert _exists("profiles/*.toml") and _exists("onbox/sidecar/journal.py") and _exists("controller/")
    assert _OUTSIDE.search(CITED_SAMPLES[-1]) and not _OUTSIDE.search("the teardown gate")
