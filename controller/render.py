"""Events for people (one short table line each) and for programs (one JSON object per line);
table() lays out the columns of text the commands print.

Event contents come from a remote box, and so do its answers, paths and error output: every
string from a box that reaches a terminal goes through printable() (or printable_lines() for a
block of lines, json_safe() for JSON text), so that it cannot move the cursor, clear the screen,
retitle the window, write the clipboard (OSC 52) or make a line read as something else.
"""
from __future__ import annotations

import json
import math
import re
import sys
import time
from typing import TYPE_CHECKING, Any, Iterable, List, Mapping, Optional, Sequence

if TYPE_CHECKING:   # the protocol is imported by the one function that encodes: most commands never do
    import protocol

SUMMARY_WIDTH = 72
_ELLIPSIS = "..."
_KIND_WIDTH = 20
_SEQ_WIDTH = 7
# What printable() escapes. Every one of these is non-printable for str.isprintable() (a test
# checks), which is what lets ordinary text skip the regular expression.
#   \x00-\x1f \x7f \x80-\x9f  C0 (ESC, CR, BEL, ...), DEL and C1 (\x9b is a one-byte CSI)
#   \xad                      soft hyphen: invisible, "ru\xadn" reads as "run"
#   U+061C U+200E U+200F U+202A-U+202E U+2066-U+2069   bidi marks, embeddings, overrides, isolates
#   U+2028 U+2029             line and paragraph separators (a new line to some readers)
#   U+180E U+200B U+2060-U+2064 U+FEFF   invisible spaces and joiners (not ZWNJ/ZWJ U+200C/U+200D:
#                             emoji sequences and Indic and Persian text need them)
#   U+206A-U+206F U+FFF9-U+FFFB U+1BCA0-U+1BCA3 U+1D173-U+1D17A   other invisible format characters
#   U+E0000-U+E007F           tag characters: invisible ASCII that text readers (and models) still read
#   U+D800-U+DFFF             lone surrogates (from undecodable bytes): they cannot even be encoded
_UNSAFE_CLASS = ("\x00-\x1f\x7f-\x9f\xad\u061c\u180e\u200b\u200e\u200f\u2028-\u202e"
                 "\u2060-\u206f\ufeff\ufff9-\ufffb\ud800-\udfff"
                 "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e007f")
_UNSAFE = re.compile(f"[{_UNSAFE_CLASS}]")
_BARE = re.compile(r"[^\s=\"']+")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{{{code:04x}}}"


def printable(text: str) -> str:
    """text with every character that could control a terminal or spoof what it shows escaped:
    C0, DEL and C1 as \\xNN (ESC as \\x1b, a newline as \\x0a), bidi controls, line separators
    and invisible format characters as \\u{XXXX} (the set is _UNSAFE_CLASS). Other text, CJK and
    emoji included, is unchanged; the result holds nothing printable() would escape again."""
    if text.isprintable():  # fast path: none of the escaped characters is printable
        return text
    return _UNSAFE.sub(_escape, text)


def printable_lines(text: str) -> str:
    """A block of lines (a box's multi-line answer or stderr) kept as lines: split on \\n (a
    \\r\\n counts as one), each line escaped by printable()."""
    return "\n".join(printable(line[:-1] if line.endswith("\r") else line) for line in text.split("\n"))


def _json_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xd800 + (code >> 10):04x}\\u{0xdc00 + (code & 0x3ff):04x}"


def json_safe(text: str) -> str:
    """JSON text (json.dumps with ensure_ascii=False) with what printable() escapes written as JSON
    \\uXXXX escapes instead: the same data once parsed, and safe on a terminal. Outside strings
    JSON text is ASCII, so each such character is inside a string, never inside an escape."""
    if text.isascii() and "\x7f" not in text:  # json.dumps escapes C0 but not DEL
        return text
    return _UNSAFE.sub(_json_escape, text)


def local_time(ts: float) -> str:
    """HH:MM:SS in local time; ??:??:?? for a timestamp the platform cannot show."""
    try:
        return time.strftime("%H:%M:%S", time.localtime(ts))
    except (OverflowError, OSError, ValueError):
        return "??:??:??"


def _value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    if isinstance(value, int):
        try:
            return str(value)
        except ValueError:  # over Python's digit limit: stored by an older rgt, before the 64-bit cap
            return f"(an integer of {value.bit_length()} bits)"
    if isinstance(value, str):
        return value if _BARE.fullmatch(value) else json.dumps(value, ensure_ascii=False)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def huge_int_text(value: Any) -> str:
    """An integer past 64 bits by its size (Python prints none over 4300 digits), else ''."""
    return f"(an integer of {value.bit_length():,} bits)" if type(value) is int and abs(value) >> 64 else ""


def text_of(value: Any) -> str:
    """str(value) that never raises: a huge integer by its size, anything unprintable by its type."""
    try:
        return huge_int_text(value) or str(value)
    except Exception:  # box data: a list of huge integers, a broken __str__
        return f"({type(value).__name__})"


def number(value: Any) -> str:
    """1,204 / 0.5123 / NaN / Inf: a value as a person reads it."""
    if isinstance(value, str) and value.lower() in ("nan", "inf", "+inf", "-inf"):
        value = float(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "NaN" if math.isnan(value) else ("Inf" if value > 0 else "-Inf")
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return huge_int_text(value) or f"{value:,}"
    return text_of(value)


def seconds(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or huge_int_text(value):
        return f"{huge_int_text(value)} s" if huge_int_text(value) else "?"
    return f"{value:,.0f} s" if value >= 10 else f"{value:.3g} s"


def size(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or huge_int_text(value):
        return f"{huge_int_text(value)} B" if huge_int_text(value) else "?"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def _cut(text: str, width: int) -> str:
    """text, or its first characters and "..." when it is longer than width."""
    return text if len(text) <= width else text[: max(width - len(_ELLIPSIS), 0)] + _ELLIPSIS


def summarize(data: Mapping[str, Any], width: int = SUMMARY_WIDTH) -> str:
    """key=value pairs in the event's order, cut to width characters."""
    return _cut(printable(" ".join(f"{k}={_value(v)}" for k, v in data.items())), width)


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "",
          max_widths: Sequence[Optional[int]] = ()) -> str:
    """Columns of text for people: the header line, then one line per row. Each column is as
    wide as its widest cell, two spaces apart; the last column is not padded, each line starts
    with indent and ends without spaces. Every cell is escaped by printable() before the
    columns are measured, so they line up even round escapes; max_widths[i] (None or missing:
    no limit) cuts longer cells of column i to that many characters, "..." at the end (headers
    are never cut). Every row has as many cells as headers. The lines are joined by newlines,
    with none at the end."""
    def cells(row: Sequence[str]) -> List[str]:
        out = []
        for i, cell in enumerate(row):
            limit = max_widths[i] if i < len(max_widths) else None
            out.append(printable(cell) if limit is None else _cut(printable(cell), limit))
        return out

    grid = [[printable(h) for h in headers], *(cells(r) for r in rows)]
    widths = [max(len(r[i]) for r in grid) for i in range(len(headers) - 1)]
    return "\n".join((indent + "  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]])).rstrip()
                     for r in grid)


def table_header() -> str:
    return f"{'SEQ':>{_SEQ_WIDTH}}  {'TIME':<8}  {'SEV':<8}  {'KIND':<{_KIND_WIDTH}}  DATA"


def table_row(event: protocol.Event, width: int = SUMMARY_WIDTH) -> str:
    """`SEQ  TIME  SEV  KIND  key=value ...` for one event."""
    kind = printable(event.kind)
    line = (f"{event.seq:>{_SEQ_WIDTH}}  {local_time(event.ts)}  {printable(event.sev):<8}  "
            f"{kind:<{_KIND_WIDTH}}  {summarize(event.data, width)}")
    return line.rstrip()


def json_line(event: protocol.Event) -> str:
    """event.to_dict() as one line of JSON (non-finite floats as "nan"/"inf", as on the wire),
    C1, bidi and invisible characters as \\u escapes (json_safe)."""
    import protocol
    return json_safe(protocol.encode_json(event.to_dict(), max_bytes=sys.maxsize).decode("utf-8"))
