"""The numbers a document claims for a metric: reading Markdown, LaTeX and plain text.

    claims = read_claims(Path("paper/results.tex"))   # [Claim(line, col, metric, shown, ...)]

controller.insight.reconcile compares them with the evidence; this module only reads, by rules a person
can predict.

Where: a `.tex`/`.latex` file is LaTeX, anything else Markdown (plain text is Markdown without
markup). Blanked first, columns kept: fenced code, inline `code`, HTML comments, link targets
(Markdown); `%` comments, verbatim/lstlisting/minted, `\\verb`, the arguments of \\ref, \\cite,
\\label, \\url... (LaTeX); bare URLs. How numbers, metric names, prose claims and their context
are read: controller/insight/claims_text.py.

Tables: Markdown (header row, `|---|` row, body rows) and LaTeX tabular, tabular*, tabularx,
longtable, array (rows end at `\\\\`, cells at `&`, `\\multicolumn{n}` spans n columns; a header
row names a metric and holds no number, and a number-free row above it adds its words, like
`Set5`, to the columns it spans). Each number in a body cell under a metric header claims that
metric (a header naming k metrics, `PSNR/SSIM`, takes the cell's first k numbers); a `%` in the
header makes the column percent. A table without metric headers is prose, row by row. `rows`
(`--rows`) keeps only the body rows whose label matches, so baselines need no evidence.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

from controller.insight.claims_text import (
    Claim,
    Doc,
    Mention,
    mentions,
    numbers,
    prose_claims,
    step_named,
    without_numbers,
)

LATEX_SUFFIXES = (".tex", ".latex", ".ltx")


# ---- tables --------------------------------------------------------------------------------


@dataclasses.dataclass
class Cell:
    start: int  # offset in the document
    text: str
    span: int = 1


@dataclasses.dataclass
class Column:
    metrics: List[Mention]
    words: str
    percent: bool
    step: bool


_STEP_HEADER = re.compile(r"\W*(step|iter(ation)?|epoch)s?\W*", re.I)


def _columns(cells: Sequence[Cell], above: Optional[Sequence[Cell]] = None) -> Dict[int, Column]:
    """Column index -> Column for a header row; `above` is a number-free row over it (dataset names)."""
    extra = {i: c.text for i, c in _placed(above or [], spread=True)}
    return {i: Column(mentions(c.text), f"{extra.get(i, '')} {c.text}", "%" in c.text,
                      bool(_STEP_HEADER.fullmatch(c.text))) for i, c in _placed(cells, spread=True)}


def _placed(cells: Sequence[Cell], spread: bool = False) -> List[Tuple[int, Cell]]:
    """(column index, cell) for each cell, or with spread for every column each cell covers."""
    out: List[Tuple[int, Cell]] = []
    i = 0
    for cell in cells:
        out.extend((i + k, cell) for k in range(cell.span if spread else 1))
        i += cell.span
    return out


def row_claims(doc: Doc, header: Dict[int, Column], cells: Sequence[Cell]) -> List[Claim]:
    """Claims of one body row under a header with metric columns."""
    placed = _placed(cells)
    label = " ".join(c.text for j, c in placed if not (header.get(j) and header[j].metrics))
    if doc.rows is not None and not doc.rows.search(label):
        return []
    step = step_named(label, 0)
    label = without_numbers(label, numbers(label))
    for j, c in placed:
        col = header.get(j)
        nums = numbers(c.text)
        if col is not None and col.step and nums:
            step = ("epoch" if "epoch" in col.words.lower() else "step", nums[0].value)
    out = []
    for j, c in placed:
        col = header.get(j)
        if col is None or not col.metrics:
            continue
        nums = numbers(c.text)
        if len(col.metrics) > 1 and len(nums) < len(col.metrics):
            continue
        for m, n in zip(col.metrics, nums[:len(col.metrics)]):
            context = f"{col.words} {label}"
            out.append(doc.claim(c.start, n, m.metric, m.text, "table", context, step, col.percent))
    return out


# ---- Markdown ------------------------------------------------------------------------------

_MD_DELIM = re.compile(r"\s*\|?\s*:?-{3,}:?\s*(?:\|\s*:?-{3,}:?\s*)*\|?\s*")
_PIPE = re.compile(r"(?<!\\)\|")


def _md_cells(doc: Doc, line_no: int) -> List[Cell]:
    start = doc.starts[line_no]
    line = doc.lines[line_no]
    cuts = [x.start() for x in _PIPE.finditer(line)]
    bounds = [-1, *cuts, len(line)]
    cells = [Cell(start + a + 1, line[a + 1:b]) for a, b in zip(bounds, bounds[1:])]
    if cells and not cells[0].text.strip() and line.lstrip().startswith("|"):
        cells = cells[1:]
    if cells and not cells[-1].text.strip() and line.rstrip().endswith("|"):
        cells = cells[:-1]
    return cells


def markdown_claims(doc: Doc) -> List[Claim]:
    """Claims of a cleaned Markdown (or text) document: tables with metric headers, then prose."""
    n_lines, out, i = len(doc.starts), [], 0
    while i < n_lines:
        line = doc.lines[i]
        after = doc.lines[i + 1] if i + 1 < n_lines else ""
        if "|" in line and "|" in after and _MD_DELIM.fullmatch(after):
            header = _columns(_md_cells(doc, i))
            j = i + 2
            while j < n_lines and "|" in doc.lines[j] and doc.lines[j].strip():
                j += 1
            if any(c.metrics for c in header.values()):
                for k in range(i + 2, j):
                    out.extend(row_claims(doc, header, _md_cells(doc, k)))
                i = j
                continue
        out.extend(prose_claims(doc, doc.starts[i], line))
        i += 1
    return out


# ---- LaTeX -----------------------------------------------------------------------------------

_TABULAR = re.compile(r"\\begin\{(tabular\*?|tabularx|longtable|array)\}")
_ROW_END = re.compile(r"\\\\(?:\s*\[[^\]\n]*\])?")
_AMP = re.compile(r"(?<!\\)&")
_MULTICOLUMN = re.compile(r"\\multicolumn\{(\d+)\}\{[^}]*\}")
_ARG = re.compile(r"\s*(?:\[[^\]]*\]\s*)?\{(?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*\}")


def _skip_args(text: str, pos: int, groups: int) -> int:
    """The offset after `groups` {..} arguments (each after an optional [..]) from pos."""
    for _ in range(groups):
        x = _ARG.match(text, pos)
        pos = x.end() if x else pos
    return pos


def _latex_rows(doc: Doc, raw: str, start: int, end: int) -> List[List[Cell]]:
    rows, pos = [], start
    for x in [*_ROW_END.finditer(doc.text, start, end), None]:
        stop = x.start() if x else end
        cells, a = [], pos
        for cut in [*(m.start() for m in _AMP.finditer(doc.text, pos, stop)), stop]:
            span = _MULTICOLUMN.search(raw, a, cut)
            cells.append(Cell(a, doc.text[a:cut], int(span.group(1)) if span else 1))
            a = cut + 1
        if any(c.text.strip() for c in cells):
            rows.append(cells)
        pos = x.end() if x else end
    return rows


def _tabular_claims(doc: Doc, raw: str, start: int, end: int) -> List[Claim]:
    out: List[Claim] = []
    header: Optional[Dict[int, Column]] = None
    above: Optional[List[Cell]] = None
    for cells in _latex_rows(doc, raw, start, end):
        has_number = any(numbers(c.text) for c in cells)
        if not has_number and any(mentions(c.text) for c in cells):
            header = _columns(cells, above)
        elif not has_number:
            above = cells
        elif header is not None:
            out.extend(row_claims(doc, header, cells))
        else:
            joined = doc.text[cells[0].start:cells[-1].start + len(cells[-1].text)]
            out.extend(prose_claims(doc, cells[0].start, joined))
    return out


def latex_claims(doc: Doc, raw: str) -> List[Claim]:
    """Claims of a cleaned LaTeX document: tabular environments, then the prose around them."""
    out: List[Claim] = []
    table_lines: Set[int] = set()
    for x in _TABULAR.finditer(doc.text):
        body = _skip_args(doc.text, x.end(), 2 if x.group(1) in ("tabular*", "tabularx") else 1)
        close = doc.text.find(f"\\end{{{x.group(1)}}}", body)
        close = len(doc.text) if close < 0 else close
        out.extend(_tabular_claims(doc, raw, body, close))
        table_lines.update(range(doc.where(x.start())[0], doc.where(close)[0] + 1))
    for i in range(len(doc.starts)):
        if i + 1 not in table_lines:
            out.extend(prose_claims(doc, doc.starts[i], doc.lines[i]))
    return out


# ---- cleaning ------------------------------------------------------------------------------

_URL = re.compile(r"(?:https?|ftp)://\S+|\bdoi:\S+|\barXiv:\S+", re.I)
_MD_BLANK = (re.compile(r"<!--.*?-->", re.S), re.compile(r"(`+)[^\n]*?\1"),
             re.compile(r"(?<=\])\([^)\n]*\)"), re.compile(r"<[a-z]+://[^>\n]*>", re.I))
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_TEX_BLANK = (
    re.compile(r"(?<!\\)%[^\n]*"),
    re.compile(r"\\begin\{(verbatim\*?|lstlisting|minted|comment)\}.*?\\end\{\1\}", re.S),
    re.compile(r"\\verb\*?(.).*?\1"),
    re.compile(r"\\(?:ref|eqref|autoref|cref|Cref|pageref|cite[tp]?|citeauthor|label|url|href|"
               r"includegraphics|input|include|bibliography)\*?(?:\[[^\]]*\])*\{[^}]*\}"),
    re.compile(r"\\(?:hline|toprule|midrule|bottomrule|addlinespace|cline\{[^}]*\}|"
               r"cmidrule(?:\([^)]*\))?\{[^}]*\})"),
    re.compile(r"\\multicolumn\{\d+\}\{[^}]*\}|\\multirow\{\d+\}\{[^}]*\}"),
)


def _blank(chars: List[str], start: int, end: int) -> None:
    for i in range(start, end):
        if chars[i] != "\n":
            chars[i] = " "


def _blank_fences(text: str, chars: List[str]) -> None:
    fence, pos = None, 0
    for line in text.split("\n"):
        x = _FENCE.match(line)
        opened = fence is not None
        if x and (fence is None or (x.group(1)[0] == fence[0] and len(x.group(1)) >= len(fence))):
            fence = None if opened else x.group(1)
            _blank(chars, pos, pos + len(line))
        elif opened:
            _blank(chars, pos, pos + len(line))
        pos += len(line) + 1


def clean(text: str, latex: bool) -> str:
    """text with what never holds a claim replaced by spaces (same length, same lines)."""
    chars = list(text)
    if latex:
        for rx in _TEX_BLANK:
            for x in rx.finditer("".join(chars)):
                _blank(chars, x.start(), x.end())
        joined = "".join(chars).replace("\\%", " %")
    else:
        _blank_fences(text, chars)
        for rx in _MD_BLANK:
            for x in rx.finditer("".join(chars)):
                _blank(chars, x.start(), x.end())
        joined = "".join(chars)
    chars = list(joined)
    for x in _URL.finditer(joined):
        _blank(chars, x.start(), x.end())
    return "".join(chars)


def claims_in(text: str, latex: bool = False, rows: Optional[re.Pattern[str]] = None) -> List[Claim]:
    """Every claim in a document's text, in document order (table rows: those `rows` matches)."""
    doc = Doc(clean(text, latex), rows)
    found = latex_claims(doc, text) if latex else markdown_claims(doc)
    return sorted(found, key=lambda c: (c.line, c.col))


def read_claims(path: Path, rows: Optional[re.Pattern[str]] = None) -> List[Claim]:
    """Every claim in the document at path (LaTeX by suffix, else Markdown)."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return claims_in(text, Path(path).suffix.lower() in LATEX_SUFFIXES, rows)
