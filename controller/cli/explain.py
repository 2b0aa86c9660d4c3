"""`rgt explain`: what a problem means, why it happens and what to do, from the symptom catalog.

A thin command over controller.insight.explain: parse the words, answer, render. Three ways in:

    rgt explain gpu.xid code=79      an event kind, optionally with event data (`xid 79` for short)
    rgt explain nan-fp16-overflow    an entry id
    rgt explain "loss goes nan with fp16"   free text, ranked by BM25 with the matched words shown

Exit 0 with at least one entry, 1 when nothing matches (with a hint), 2 on usage errors.
"""
from __future__ import annotations

import textwrap
from typing import List, Sequence

import click

from controller.cli.base import JSON_OPTION, CliError, RgtCommand, emit_json
from controller.insight import explain
from controller.insight.catalog import default_catalog
from controller.render import printable

WIDTH = 100
INDENT = " " * 9


def _wrapped(label: str, text: str) -> List[str]:
    lines = textwrap.wrap(text, WIDTH - len(INDENT)) or [""]
    return [f"   {label:<6}{lines[0]}"] + [INDENT + line for line in lines[1:]]


def _why(answer: explain.Answer, hit: explain.Hit) -> str:
    if answer.query.mode == "id":
        return "exact id"
    if answer.query.mode == "kind":
        return "matched " + ", ".join(hit.matched)
    return f"score {hit.score:.2f}: " + ", ".join(hit.matched)


def render(answer: explain.Answer) -> str:
    """Per entry: rank, id and title; why it matched; cause; the fix lines; related ids."""
    out: List[str] = []
    for rank, hit in enumerate(answer.hits, 1):
        e = hit.entry
        out.append(f"{rank}. {e.id}  {e.title}")
        out.append(f"   ({_why(answer, hit)})")
        out += _wrapped("cause", e.cause)
        for i, line in enumerate(e.fix):
            wrapped = textwrap.wrap(line, WIDTH - len(INDENT) - 2) or [""]
            out.append(f"   {'fix' if i == 0 else '':<6}- {wrapped[0]}")
            out += [INDENT + "  " + more for more in wrapped[1:]]
        if e.see:
            out.append(f"   {'see':<6}{', '.join(e.see)}")
        out.append("")
    return "\n".join(printable(line) for line in out).rstrip()


def _listing(as_json: bool) -> None:
    entries = default_catalog().entries
    if as_json:
        emit_json({"entries": [{"id": e.id, "title": e.title, "kinds": list(e.kinds)} for e in entries]})
        return
    width = max(len(e.id) for e in entries)
    click.echo("\n".join(f"{e.id:<{width}}  {e.title}" for e in entries))


@click.command("explain", cls=RgtCommand)
@click.argument("words", nargs=-1, metavar="KIND [FIELD=VALUE]... | ENTRY_ID | TEXT...")
@click.option("--top", default=3, show_default=True, type=click.IntRange(1, 50), metavar="N",
              help="How many entries to show.")
@click.option("--list", "list_all", is_flag=True, help="List every entry id and title.")
@JSON_OPTION
def explain_command(words: Sequence[str], top: int, list_all: bool, as_json: bool) -> None:
    """Explain a problem: its cause and fix, from the symptom catalog.

    Give an event kind (with FIELD=VALUE data to pick the special case), an entry id, or
    describe the problem in your own words. --json prints {"query", "mode", "entries": [{"id",
    "title", "score", "matched", "cause", "fix", "kinds", "symptoms", "signals", "see"}]}.

    \b
    Examples:
      rgt explain "loss turns nan after switching to fp16"
      rgt explain job.exited oom_killed=true
      rgt explain xid 79
      rgt explain nan-fp16-overflow --json
    """
    if list_all:
        if words:
            raise click.UsageError("give --list or a query, not both")
        _listing(as_json)
        return
    try:
        query = explain.parse_query(words)
    except explain.QueryError as e:
        raise click.UsageError(str(e)) from e
    answer = explain.answer(query, top)
    if as_json:
        emit_json(answer.to_dict())
    if not answer.hits:
        raise CliError(f"nothing in the catalog matches {query.text!r}",
                       "use other words, an event kind (rgt explain gpu.xid) or see rgt explain --list")
    if not as_json:
        click.echo(render(answer))


__all__ = ["explain_command", "render"]
