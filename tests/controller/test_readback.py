"""A journal page read back from the box is its claim: checked event by event before anything of
it is stored (controller.follow.readback)."""
from __future__ import annotations

import json
from typing import Any, Dict, List

import pytest

from controller import trust as boxtrust
from controller.follow import readback
from protocol import Event, encode_event

RUN = "run-rb"


def line(seq: int, *, run: str = RUN, host: str = "box", kind: str = "heartbeat") -> str:
    ev = Event(run=run, host=host, seq=seq, ts=1000.0 + seq, kind=kind, sev="info", data={})
    return encode_event(ev).decode()


def page(lines: List[Any], more: Any = False) -> Dict[str, Any]:
    return {"run": RUN, "since": 0, "last_seq": 0, "more": more, "bad_lines": 0, "events": lines}


def test_a_good_page_gives_its_events_and_gaps_name_what_the_journal_lacks() -> None:
    got = readback.checked(page([line(3), line(4), line(7)], more=True), RUN, "box", 2)
    assert [e.seq for e in got.events] == [3, 4, 7] and got.more and not got.refused
    assert readback.gaps(got, 2) == [(5, 6)]
    assert readback.gaps(got, 0) == [(1, 2), (5, 6)]
    assert "read back" in readback.reason(got)


def test_undecodable_lines_are_refused_one_by_one_and_their_seqs_become_a_gap() -> None:
    bad = json.dumps({"v": 1, "run": RUN, "host": "box", "seq": 2, "kind": "Not A Kind!"})
    got = readback.checked(page([line(1), bad, 17, "x" * (readback.MAX_LINE_CHARS + 1), line(3)]), RUN, "", 0)
    assert [e.seq for e in got.events] == [1, 3] and len(got.refused) == 3
    assert readback.gaps(got, 0) == [(2, 2)] and readback.reason(got).startswith("refused at the boundary")


def test_another_runs_events_are_dropped_and_counted() -> None:
    got = readback.checked(page([line(1), line(2, run="other-run"), line(3)]), RUN, "box", 0)
    assert [e.seq for e in got.events] == [1, 3] and got.foreign == 1


@pytest.mark.parametrize("doc, since, why", [
    ([], 0, "not an object"),
    ({"events": "no"}, 0, "not an object"),
    (page([line(1)], more="yes"), 0, "boolean `more`"),
    (page([line(1)] * (readback.MAX_PAGE_EVENTS + 1)), 0, "over"),
    (page([line(1), line(2, host="elsewhere")]), 0, "a run is bound to its box"),
    (page([line(2), line(2)]), 0, "seqs must rise"),
    (page([line(5)]), 5, "seqs must rise"),          # at or below the seq asked after
])
def test_a_page_that_is_no_page_or_lies_about_the_run_is_refused_whole(doc: Any, since: int,
                                                                        why: str) -> None:
    with pytest.raises(boxtrust.Untrusted, match=why):
        readback.checked(doc, RUN, "box", since)
