"""controller.trust, the boundary: a run id or a path a box sends is refused, or it is one the laptop
may use (a run id by the grammar, a path that stays under its root). Unit cases and properties."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller import trust as boxtrust
from controller.trust import Untrusted
from protocol.ids import is_run_id

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True)

# Text that reaches the dangerous corners: separators, dots, NUL, C0/C1 controls, escapes, non-ASCII.
NASTY = st.text(alphabet=st.sampled_from(list("a0Z._-/\\ ~$") + ["\x00", "\n", "\r", "\x1b", "\x7f", "\x85",
                                                                    "\x9b", "é", "\u202e"]), max_size=40)
ANY = st.one_of(NASTY, st.text(max_size=140))
PIECES = st.lists(st.sampled_from(["..", ".", "", "a", "b.c", "/", "x\x00", "\x1b[2J", "~", "run-1"]),
                  min_size=1, max_size=6).map("/".join)


def under(path: Path, root: Path) -> bool:
    base = root.resolve()
    return path == base or base in path.parents


# ---- run ids -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["20240601T120000Z-1a2b3c", "run-1", "a", "abl-0-ffffff", "r.n0", "A_b-9"])
def test_run_ids_by_the_grammar_pass(value: str) -> None:
    assert boxtrust.run_id(value) == value


@pytest.mark.parametrize("value", ["", "..", "../x", "a/../b", "/abs", "/tmp/x", "a/b", "-rf", ".hidden",
                                   "a..b", "x\x00", "x\n", "\x1b[2J", "a b", "é", "x" * 129, None, 7, b"run"])
def test_anything_else_is_refused_as_a_run_id(value: object) -> None:
    with pytest.raises(Untrusted, match="is not a run id"):
        boxtrust.run_id(value)


@SETTINGS
@given(ANY)
def test_a_string_is_refused_or_is_a_run_id_that_names_one_file_under_the_root(value: str) -> None:
    root = Path("/nonexistent-rgt-root")
    try:
        got = boxtrust.run_id(value)
    except Untrusted:
        assert not is_run_id(value)
        return
    assert got == value and is_run_id(got)
    path = boxtrust.contained(root, f"{got}.lock")
    assert path.parent == root.resolve() and path.name == f"{got}.lock"


def test_expect_run_refuses_another_run_and_a_bad_id() -> None:
    assert boxtrust.expect_run("r1", "r1") == "r1"
    with pytest.raises(Untrusted, match="answered for run 'r2', not the 'r1' that was asked for"):
        boxtrust.expect_run("r2", "r1")
    with pytest.raises(Untrusted, match="is not a run id"):
        boxtrust.expect_run("../r1", "r1")


# ---- laptop paths: contained -----------------------------------------------------------------------


@pytest.mark.parametrize("part", ["..", "../x", "a/../../x", "a/..", "/etc/passwd", "/", "", "x\x00y", "a\nb",
                                  "\x1b]52;c;x\x07", "a\\..\\..\\x", "\x9bx"])
def test_contained_refuses_escapes_and_controls(tmp_path: Path, part: str) -> None:
    with pytest.raises(Untrusted):
        boxtrust.contained(tmp_path, part)


def test_contained_accepts_what_stays_under_the_root(tmp_path: Path) -> None:
    assert boxtrust.contained(tmp_path, "a", "b/c.pt") == tmp_path.resolve() / "a" / "b" / "c.pt"
    assert boxtrust.contained(tmp_path, ".") == tmp_path.resolve()


def test_a_symlink_out_of_the_root_is_refused_and_one_inside_it_is_not(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "out").symlink_to(outside)
    (root / "abs").symlink_to("/etc")
    (root / "inner").mkdir()
    (root / "in").symlink_to(root / "inner")
    for rel in ("out", "out/x", "abs/passwd"):
        with pytest.raises(Untrusted, match="leads out of"):
            boxtrust.contained(root, rel)
    assert boxtrust.contained(root, "in/x") == (root / "inner" / "x").resolve()


@SETTINGS
@given(st.lists(st.one_of(ANY, PIECES), min_size=1, max_size=3))
def test_any_parts_are_refused_or_lead_under_the_root(tmp_path_factory: pytest.TempPathFactory,
                                                      parts: List[str]) -> None:
    root = tmp_path_factory.getbasetemp() / "prop-root"
    root.mkdir(exist_ok=True)
    try:
        path = boxtrust.contained(root, *parts)
    except Untrusted:
        return
    assert under(path, root)
    assert not any(p.startswith("/") or ".." in p.split("/") or "\x00" in p for p in parts)


@SETTINGS
@given(st.one_of(ANY, PIECES))
def test_a_symlinked_root_still_holds_every_accepted_path(tmp_path_factory: pytest.TempPathFactory,
                                                          part: str) -> None:
    base = tmp_path_factory.getbasetemp()
    real = base / "real-root"
    real.mkdir(exist_ok=True)
    (real / "up").unlink(missing_ok=True)
    os.symlink("..", real / "up")          # a symlink inside the root that leads out of it
    link = base / "linked-root"
    if not link.is_symlink():
        link.symlink_to(real)
    try:
        path = boxtrust.contained(link, part)
    except Untrusted:
        return
    assert under(path, real)


# ---- box paths ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,why", [("proj/active/r", "not an absolute path"),
                                       ("", "not an absolute path"), (None, "not an absolute path"),
                                       ("/a/../r", "'..'"), ("/a/x\n/r", "control characters"),
                                       ("/" + "x" * 5000, "at most")])
def test_box_paths_must_be_absolute_and_clean(value: object, why: str) -> None:
    with pytest.raises(Untrusted, match=why):
        boxtrust.box_path(value)


@SETTINGS
@given(ANY)
def test_a_box_path_is_refused_or_absolute_without_dotdot_or_controls(value: str) -> None:
    try:
        got = boxtrust.box_path(value)
    except Untrusted:
        return
    assert got.startswith("/") and ".." not in got.split("/")
    assert not any(ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f for c in got)


# ---- launch answers ------------------------------------------------------------------------------------


def test_a_launch_answer_names_the_run_asked_for_and_a_dir_named_after_it() -> None:
    good = {"run_id": "r1", "run_dir": "/runs/p/active/r1", "pid": 42}
    assert boxtrust.launch_answer(good, "r1")["run_dir"] == "/runs/p/active/r1"
    node = {"run_id": "r1.n0", "run_dir": "/runs/p/active/r1.n0", "group": "r1", "node": "n0"}
    assert boxtrust.launch_answer(node, "r1")["run_id"] == "r1.n0"
    hostile = [({**good, "run_id": "r2"}, "not the 'r1'"),
               ({**good, "run_id": "../r1"}, "is not a run id"),
               ({**good, "run_dir": "/home/u/.ssh"}, "is not named after run"),
               ({**good, "run_dir": "runs/r1"}, "not an absolute path"),
               ({**good, "pid": 10 ** 400}, "pid"),
               ({**node, "group": "r9"}, "not the 'r1'"),
               ({**node, "node": "../n0", "run_id": "r1.../n0"}, "node name")]
    for answer, why in hostile:
        with pytest.raises(Untrusted, match=why):
            boxtrust.launch_answer(answer, "r1")
