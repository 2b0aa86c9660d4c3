"""`rgt-onbox journal`: a run's journal read from its files with no sidecar, in pages, across
rotated files, leaving out a torn last line and lines that are not events."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from onbox.sidecar.journal import CURRENT, Journal, read_page
from protocol import decode_event
from tests.helpers import REPO


def journal(run_dir: Path, events: int, **kw: object) -> None:
    j = Journal(run_dir / "rgt", run_dir.name, "box", **kw)  # type: ignore[arg-type]
    j.open()
    for i in range(events):
        j.append("train.progress", {"step": i, "pad": "x" * 50})
    j.close()


def seqs(lines: List[bytes]) -> List[int]:
    return [decode_event(line).seq for line in lines]


def test_pages_cross_the_rotated_files_from_any_seq(tmp_path: Path) -> None:
    journal(tmp_path / "r1", 200, rotate_bytes=2048)
    rgt = tmp_path / "r1" / "rgt"
    assert len(list(rgt.glob("events.*.jsonl"))) > 5
    whole = read_page(rgt, 0)
    assert seqs(whole.lines) == list(range(1, 201)) and whole.last_seq == 200 and not whole.more
    for since in (1, 37, 99, 150, 199):   # each from inside some rotated file, or the current one
        assert seqs(read_page(rgt, since).lines) == list(range(since + 1, 201)), since
    page = read_page(rgt, 10, limit=25)
    assert seqs(page.lines) == list(range(11, 36)) and page.last_seq == 35 and page.more
    budget = sum(len(line) for line in page.lines[:3]) + 1
    cut = read_page(rgt, 10, max_bytes=budget)
    assert seqs(cut.lines) == [11, 12, 13] and cut.more
    nothing = read_page(rgt, 200)
    assert nothing.lines == [] and nothing.last_seq == 200 and not nothing.more


def test_a_torn_last_line_and_foreign_lines_are_left_out(tmp_path: Path) -> None:
    journal(tmp_path / "r1", 5)
    current = tmp_path / "r1" / "rgt" / CURRENT
    first, *rest = current.read_bytes().splitlines(keepends=True)
    current.write_bytes(first + b"not an event\n" + b"".join(rest) + b'{"v":1,"run":"r1","ho')
    page = read_page(current.parent, 0)
    assert seqs(page.lines) == [1, 2, 3, 4, 5] and page.bad_lines == 1 and not page.more


def test_a_journal_whose_current_file_is_empty_still_reads_the_rotated_ones(tmp_path: Path) -> None:
    journal(tmp_path / "r1", 60, rotate_bytes=2048)
    rgt = tmp_path / "r1" / "rgt"
    tail = (rgt / CURRENT).read_bytes()
    (rgt / CURRENT).write_bytes(b"")   # as just after a rotation
    expected = list(range(31, 61 - len(tail.splitlines())))
    assert seqs(read_page(rgt, 30).lines) == expected


def rgt_onbox(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "onbox.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_the_command_prints_lines_or_one_json_page_and_says_when_there_is_no_journal(tmp_path: Path) -> None:
    run_dir = tmp_path / "proj" / "active" / "r1"
    journal(run_dir, 30)
    out = rgt_onbox("journal", str(run_dir), "--since", "20")
    assert out.returncode == 0, out.stderr
    assert [json.loads(line)["seq"] for line in out.stdout.splitlines()] == list(range(21, 31))
    out = rgt_onbox("journal", "r1", "--root", str(tmp_path), "--since", "5", "--limit", "10", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["run"] == "r1" and doc["since"] == 5 and doc["last_seq"] == 15 and doc["more"] is True
    assert [json.loads(e)["seq"] for e in doc["events"]] == list(range(6, 16))
    assert "--since 15" in rgt_onbox("journal", str(run_dir), "--limit", "15").stderr
    bare = tmp_path / "proj" / "active" / "r2"
    (bare / "rgt").mkdir(parents=True)
    out = rgt_onbox("journal", str(bare))
    assert out.returncode == 1 and "has no journal" in out.stderr
    out = rgt_onbox("journal", "nope", "--root", str(tmp_path))
    assert out.returncode == 1 and "error:" in out.stderr


@pytest.mark.parametrize("since", ["-1", "x"])
def test_a_bad_since_is_a_usage_error(tmp_path: Path, since: str) -> None:
    run_dir = tmp_path / "proj" / "active" / "r1"
    journal(run_dir, 1)
    assert rgt_onbox("journal", str(run_dir), "--since", since).returncode == 2
