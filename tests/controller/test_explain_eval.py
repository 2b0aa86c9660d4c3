"""The eval set of `rgt explain`: realistic questions (long, with context, some in Chinese, some about
platforms) and the entries that must rank in their top 3. `make test` fails below 95 %."""
from __future__ import annotations

import re
import shlex
from typing import Optional

import click

from controller.cli.main import main as cli
from controller.insight import explain
from controller.insight.catalog import default_catalog
from tests.controller.explain_eval import MIN_TOP3, load_cases, run


def test_the_eval_set_is_big_and_varied_and_names_only_what_exists() -> None:
    cases = load_cases()
    assert len(cases) >= 80
    assert sum(c.chinese for c in cases) >= 15 and sum(c.platform for c in cases) >= 15
    assert sum(len(c.q) >= 80 for c in cases) >= len(cases) // 2   # most come with context
    for c in cases:
        for want in c.want:
            found = explain.answer(explain.parse_query([want]), 1).hits
            assert found and found[0].entry.id == want, f"{c.where}: {want} is no entry or fact"


def test_at_least_95_percent_of_the_questions_have_their_entries_in_the_top_3() -> None:
    results = run(load_cases())
    misses = [r for r in results if not r.top3]
    report = "\n".join(f"{r.case.where}: want {list(r.case.want)}, got {list(r.got)}: {r.case.q[:100]}"
                       for r in misses)
    assert len(results) - len(misses) >= MIN_TOP3 * len(results), report


def test_the_catalog_carries_the_skills_knowledge_with_sources() -> None:
    entries = default_catalog().entries
    assert len(entries) >= 200
    assert [e.id for e in entries if not e.source] == []
    assert sum(any("\u4e00" <= ch <= "\u9fff" for s in e.symptoms for ch in s) for e in entries) >= 30
    cited = {m for e in entries for s in e.source for m in re.findall(r"gotchas_universal (U\d+)", s)}
    assert cited == {f"U{n}" for n in range(1, 45)}   # every one of the skill's 44 gotchas has a home


def _resolves(line: str) -> Optional[str]:
    """None when `line` is `rgt SUB ... [--option ...]` with SUB and every option real, else why not."""
    tokens = shlex.split(line)
    if tokens[:1] != ["rgt"]:
        return "does not start with rgt"
    cmd: click.Command = cli
    ctx = click.Context(cli)
    for token in tokens[1:]:
        if token == "--":
            break
        if isinstance(cmd, click.Group) and not token.startswith("-"):
            sub = cmd.get_command(ctx, token)
            if sub is not None:
                cmd = sub
                continue
            if not any(isinstance(p, click.Argument) for p in cmd.params):
                return f"{token!r} is no subcommand of {cmd.name}"
        if token.startswith("--"):
            name = token.split("=", 1)[0]
            if not any(name in p.opts or name in p.secondary_opts for p in cmd.params):
                return f"{cmd.name} has no option {name}"
    if isinstance(cmd, click.Group) and cmd is cli:
        return "names no subcommand"
    return None


def test_every_next_command_is_a_real_rgt_command_with_real_options() -> None:
    index = explain.default_index()
    lines = {e.id: e.command for e in index.catalog.entries if e.command}
    lines.update({f.id: f.command for f in index.facts})
    lines.update({f"field {k}": v for k, v in explain.NEXT_BY_FIELD.items()})
    wrong = {i: (c, why) for i, c in lines.items() if (why := _resolves(c))}
    assert wrong == {}
    assert _resolves("rgt verify RUN --no-such-flag") and _resolves("rgt frobnicate") and _resolves("ls")
