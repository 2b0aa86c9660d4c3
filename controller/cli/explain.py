"""`rgt explain`: what a problem means, why it happens and what to do, from the symptom catalog.

A thin command over controller.insight.explain: parse the words, answer, render. Four ways in:

    rgt explain gpu.xid code=79      an event kind, optionally with event data (`xid 79` for short)
    rgt explain nan-fp16-overflow    an entry id (or a fact id: profile:vastai/teardown)
    rgt explain "loss goes nan with fp16"   free text, ranked by BM25 with the matched words shown
    rgt explain --platform autodl    every fact of one platform profile

Free text that names a platform ("on vast.ai", "恒源云"), or --platform NAME, ranks that profile's
facts (what stops the meter, what each action deletes, the storage tiers, the danger clocks) beside
the entries, each with the month its facts were verified. Every answer ends with the next command.

Exit 0 with at least one entry, 1 when nothing matches (with a hint), 2 on usage errors.
"""
from __future__ import annotations

import textwrap
from typing import List, Optional, Sequence

import click

from controller.cli.base import JSON_OPTION, CliError, RgtCommand, emit_json
from controller.insight import explain
from controller.insight.catalog import default_catalog
from controller.insight.platforms import Fact
from controller.render import printable

WIDTH = 100
INDENT = " " * 9


def _wrapped(label: str, text: str) -> List[str]:
    lines = textwrap.wrap(text, WIDTH - len(INDENT)) or [""]
    return [f"   {label:<6}{lines[0]}"] + [INDENT + line for line in lines[1:]]


def _why(answer: explain.Answer, hit: explain.Hit) -> str:
    if answer.query.mode in ("id", "platform"):
        why = "exact id" if answer.query.mode == "id" else "every fact of the platform"
    elif answer.query.mode == "kind":
        why = "matched " + ", ".join(hit.matched)
    else:
        why = f"score {hit.score:.2f}: " + ", ".join(hit.matched)
    if isinstance(hit.entry, Fact):
        stamp = f", verified {hit.entry.verified}" if hit.entry.verified else ", undated"
        return f"from profile {hit.entry.profile}{stamp}; {why}"
    return why


def _lines(label: str, items: Sequence[str]) -> List[str]:
    out: List[str] = []
    for i, line in enumerate(items):
        wrapped = textwrap.wrap(line, WIDTH - len(INDENT) - 2) or [""]
        out.append(f"   {label if i == 0 else '':<6}- {wrapped[0]}")
        out += [INDENT + "  " + more for more in wrapped[1:]]
    return out


def render(answer: explain.Answer) -> str:
    """Per entry: rank, id and title; why it matched; cause (a fact's facts); the fix lines; related
    ids and the next command. Then the answer's hint, if any."""
    out: List[str] = []
    for rank, hit in enumerate(answer.hits, 1):
        e = hit.entry
        out.append(f"{rank}. {e.id}  {e.title}")
        out.append(f"   ({_why(answer, hit)})")
        if isinstance(e, Fact):
            out += _lines("facts", e.signals)
        else:
            out += _wrapped("cause", e.cause)
        out += _lines("fix", e.fix)
        if e.see:
            out.append(f"   {'see':<6}{', '.join(e.see)}")
        if hit.next_command:
            out.append(f"   {'next':<6}{hit.next_command}")
        out.append("")
    if answer.hint:
        out += _wrapped("hint", answer.hint)
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
@click.option("--platform", metavar="NAME", help="Rank this platform profile's facts (rgt profile list) "
              "beside the entries, whether the question names it or not.")
@JSON_OPTION
def explain_command(words: Sequence[str], top: int, list_all: bool, platform: Optional[str],
                    as_json: bool) -> None:
    """Explain a problem: its cause and fix, from the symptom catalog.

    Give an event kind (with FIELD=VALUE data to pick the special case), an entry id, or
    describe the problem in your own words, in English or Chinese. A question that names a
    platform (or --platform NAME) also ranks that profile's facts. --json prints {"query", "mode",
    "platforms", "next", "hint", "entries": [{"id", "type" (entry or profile), "title", "score",
    "matched", "cause", "fix", "kinds", "symptoms", "signals", "see", "source", "verified",
    "next"}]}.

    \b
    Examples:
      rgt explain "loss turns nan after switching to fp16"
      rgt explain job.exited oom_killed=true
      rgt explain xid 79
      rgt explain nan-fp16-overflow --json
      rgt explain "on vast.ai what stops billing without losing checkpoints"
      rgt explain --platform autodl "关机以后还扣费吗"
    """
    if list_all:
        if words:
            raise click.UsageError("give --list or a query, not both")
        _listing(as_json)
        return
    try:
        query = explain.parse_query(words, platform=platform)
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
