"""render.table: the one layout of the columns of text the commands print (compare, reconcile,
profile, a multi-node status). Escaping itself is tested in test_printable.py."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.render import printable, summarize, table

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True)


def test_columns_are_as_wide_as_their_widest_cell_two_spaces_apart() -> None:
    text = table(("NAME", "KIND", "NOTE"), [("a", "local", "x"), ("longer-name", "ssh", "yy")])
    assert text.split("\n") == ["NAME         KIND   NOTE",
                                "a            local  x",
                                "longer-name  ssh    yy"]


def test_the_last_column_is_not_padded_and_no_line_ends_in_spaces() -> None:
    text = table(("A", "LAST"), [("x", "a much longer last cell"), ("y", ""), ("z", "ends in space ")])
    assert text.split("\n") == ["A  LAST", "x  a much longer last cell", "y", "z  ends in space"]


def test_indent_starts_every_line_and_no_newline_ends_the_text() -> None:
    text = table(("K", "V"), [("a", "1")], indent="  ")
    assert text == "  K  V\n  a  1"


def test_headers_alone_when_there_are_no_rows() -> None:
    assert table(("METRIC", "STEP", "A"), []) == "METRIC  STEP  A"


def test_a_single_column_is_just_its_cells() -> None:
    assert table(("X",), [("long one",), ("b",)]) == "X\nlong one\nb"


def test_max_widths_cut_long_cells_with_an_ellipsis_but_never_the_headers() -> None:
    text = table(("W", "NAME", "REST"), [("abcdefghijkl", "short", "not cut at all, however long")],
                 max_widths=(5, None))
    assert text.split("\n") == ["W      NAME   REST",
                                "ab...  short  not cut at all, however long"]
    assert table(("HEADERLONG", "B"), [("abcdef", "b")], max_widths=(4,)) == "HEADERLONG  B\na...        b"


def test_a_cut_is_the_same_as_summarys() -> None:
    long = "k=" + "v" * 100
    assert table(("X",), [(long,)], max_widths=(30,)).split("\n")[1] == summarize({"k": "v" * 100}, 30)


def test_hostile_cells_are_escaped_before_the_columns_are_measured() -> None:
    text = table(("NODE", "STATE"), [("n\x1b[2J1", "running"), ("n2", "fail\u202eed")])
    lines = text.split("\n")
    assert lines == ["NODE       STATE", "n\\x1b[2J1  running", "n2         fail\\u{202e}ed"]
    assert all(printable(line) == line for line in lines)
    assert len({line.index(line.split()[1]) for line in lines}) == 1  # the second column lines up


def test_an_escape_is_cut_after_escaping_so_no_half_escape_is_left_raw() -> None:
    (_, row) = table(("X",), [("\x1b" * 10,)], max_widths=(9,)).split("\n")
    assert row == "\\x1b\\x..." and printable(row) == row


# Space is the only whitespace here: lines end without it, and a column that ends in other white
# space (U+3000, say) before empty cells would be stripped too, which this check does not model.
CELL = st.text(st.characters(blacklist_categories=("Cs", "Zs", "Zl", "Zp"), whitelist_characters=" "),
               max_size=12)


@SETTINGS
@given(st.integers(1, 5).flatmap(lambda n: st.tuples(
    st.lists(CELL, min_size=n, max_size=n), st.lists(st.lists(CELL, min_size=n, max_size=n), max_size=4))))
def test_every_column_starts_where_its_header_does(grid: tuple) -> None:
    headers, rows = grid
    lines = table(headers, rows).split("\n")
    assert len(lines) == 1 + len(rows) and all(printable(line) == line for line in lines)
    shown = [[printable(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in shown) for i in range(len(headers) - 1)]
    starts = [sum(widths[:i]) + 2 * i for i in range(len(headers))]
    for line, cells in zip(lines, shown):
        assert line == line.rstrip(" ")
        padded = line.ljust(starts[-1] + 100)
        for cell, at, width in zip(cells, starts, widths):
            assert padded[at:at + width] == cell.ljust(width)
            assert padded[at + width:at + width + 2] == "  "
        assert padded[starts[-1]:].rstrip(" ") == cells[-1].rstrip(" ")
