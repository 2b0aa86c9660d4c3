"""SKILL.md is the contract an agent gets besides `--help`: every command and flag it names must exist.

Every `rgt ...` / `rgt-onbox ...` command line in SKILL.md's code (fenced blocks and inline spans) is
resolved through the real click groups (placeholders such as HOST for a group's own argument, `rgt
queue FILE` as `rgt queue start`), and each `--flag` on it must be listed in that command's real
`--help` (run with click's CliRunner). A flag named on its own (`--durable-dir`) must be in the
`--help` of some command; `--onbox-arg=--flag` names a flag of `rgt-onbox launch`. The checker is
tested on a page that names a missing command and a missing flag, so it cannot pass vacuously.
"""
from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path
from typing import Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

import click
from click.testing import CliRunner

from controller.cli.main import main as rgt_main
from onbox.cli.main import main as onbox_main
from tests.helpers import citations

ROOT = Path(__file__).resolve().parents[1]
SKILL = ROOT / "SKILL.md"
PROGRAMS: Dict[str, click.Command] = {"rgt": rgt_main, "rgt-onbox": onbox_main}
ONBOX_LAUNCH = ("rgt-onbox", "launch")

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SPAN = re.compile(r"`([^`]+)`")
_SEGMENT = re.compile(r"\s(?:;|&&|\|\|?)\s")
_COMMENT = re.compile(r"\s+#(?:\s.*)?$")
_FLAG = re.compile(r"^--?[A-Za-z][\w-]*$")
_HELP_OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


# ---- the page -------------------------------------------------------------------------------------


def code_texts(markdown: str) -> Tuple[List[str], List[str]]:
    """(lines of fenced blocks, inline code spans outside them)."""
    lines = [line for block in _FENCE.findall(markdown) for line in block.splitlines()]
    rest = _FENCE.sub("", markdown)
    spans = [" ".join(span.split()) for span in _SPAN.findall(rest)]
    return lines, spans


def _words(text: str) -> List[str]:
    try:
        return shlex.split(text)
    except ValueError:  # an unbalanced quote in prose-like code
        return text.split()


def commands_in(text: str) -> Iterator[List[str]]:
    """Each `rgt`/`rgt-onbox` command of a code line or span, as words (comments cut off)."""
    for segment in _SEGMENT.split(_COMMENT.sub("", text)):
        words = [w for w in _words(segment.strip().rstrip("&").strip()) if w]
        if words and words[0] in PROGRAMS:
            yield words


def _pieces(word: str) -> List[str]:
    """`[--ref`, `RUN|--all`: the words inside brackets and alternatives."""
    return [p for p in re.split(r"[|\[\]]", word) if p]


# ---- the real --help ------------------------------------------------------------------------------


@functools.cache
def help_of(invocation: Tuple[str, ...]) -> Tuple[FrozenSet[str], FrozenSet[str]]:
    """(options, subcommands) listed by `PROG ARGS... --help`."""
    result = CliRunner().invoke(PROGRAMS[invocation[0]], [*invocation[1:], "--help"], prog_name=invocation[0])
    assert result.exit_code == 0, f"`{' '.join(invocation)} --help` failed: {result.output}"
    options, commands, section = set(), set(), ""
    for line in result.output.splitlines():
        if line and not line.startswith(" "):
            section = line.strip().rstrip(":").lower()
            continue
        if not line.startswith("  ") or line.startswith("   "):
            continue  # a continuation line of a help text
        head = re.split(r"\s{2,}", line.strip())[0]
        if section == "options":
            options.update(_HELP_OPTION.findall(head))
        elif section == "commands":
            commands.add(head.split()[0])
    return frozenset(options), frozenset(commands)


def _arguments(command: click.Command) -> int:
    return sum(1 for p in command.params if isinstance(p, click.Argument))


@functools.cache
def every_invocation() -> Tuple[Tuple[str, ...], ...]:
    """Every command of both programs, as the words that reach its --help (group arguments as names)."""
    found: List[Tuple[str, ...]] = []

    def walk(command: click.Command, words: Tuple[str, ...], parent: Optional[click.Context]) -> None:
        found.append(words)
        if isinstance(command, click.Group):
            ctx = click.Context(command, info_name=words[-1], parent=parent)
            extra = tuple(p.name.upper() for p in command.params if isinstance(p, click.Argument) and p.name)
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    walk(sub, (*words, *extra, name), ctx)

    for program, command in PROGRAMS.items():
        walk(command, (program,), None)
    return tuple(found)


@functools.cache
def all_options() -> FrozenSet[str]:
    return frozenset(o for words in every_invocation() for o in help_of(words)[0])


# ---- the check ------------------------------------------------------------------------------------


def _flag_problems(flag: str, value: Optional[str], options: FrozenSet[str], where: str,
                   seen: List[str]) -> List[str]:
    seen.append(flag)
    out = [] if flag in options else [f"{where}: {flag} is not in its --help"]
    if flag == "--onbox-arg" and value and value.startswith("-"):
        inner = value.split("=", 1)[0]
        seen.append(inner)
        if inner not in help_of(ONBOX_LAUNCH)[0]:
            out.append(f"{where}: {inner} (through --onbox-arg) is not in `rgt-onbox launch --help`")
    return out


def check_command(words: Sequence[str], seen: Optional[List[str]] = None) -> List[str]:
    """What is wrong with one command line: an unknown (sub)command, or a flag its --help lacks."""
    where = "`" + " ".join(words) + "`"
    command: click.Command = PROGRAMS[words[0]]
    invocation: List[str] = [words[0]]
    ctx = click.Context(command, info_name=words[0])
    rest = list(words[1:])
    problems: List[str] = []
    flags: List[Tuple[str, Optional[str], Tuple[str, ...]]] = []
    while isinstance(command, click.Group):
        skip = _arguments(command)
        while rest and rest[0].startswith("-") and rest[0] != "--":
            flag, _, value = rest.pop(0).partition("=")
            flags.append((flag, value or None, tuple(invocation)))
        if len(rest) <= skip:
            break
        invocation += rest[:skip]
        rest = rest[skip:]
        name = rest[0]
        if name.isupper():  # `rgt COMMAND --help`: any command; its flags must be some command's
            flags, invocation = [(f, v, ()) for f, v, _ in flags], []
            break
        try:
            resolved, sub, args = command.resolve_command(ctx, rest)
        except click.UsageError:
            return [f"{where}: `{' '.join(invocation)} {name}` is not a command"]
        assert resolved is not None and sub is not None
        if resolved not in help_of(tuple(invocation))[1]:
            problems.append(f"{where}: {resolved} is not listed in `{' '.join(invocation)} --help`")
        rest = list(args)
        invocation.append(resolved)
        ctx = click.Context(sub, info_name=resolved, parent=ctx)
        command = sub
    for word in rest:
        if word == "--":
            break  # the user's own command follows
        for piece in _pieces(word):
            flag, _, value = piece.partition("=")
            if _FLAG.match(flag):
                flags.append((flag, value or None, tuple(invocation)))
    for name, given, at in flags:
        problems += _flag_problems(name, given, help_of(at)[0] if at else all_options(), where,
                                   [] if seen is None else seen)
    return problems


def check_markdown(markdown: str) -> Tuple[List[str], List[List[str]], List[str]]:
    """(problems, commands found, every flag checked) for a page."""
    lines, spans = code_texts(markdown)
    commands = [words for text in lines + spans for words in commands_in(text)]
    seen: List[str] = []
    problems = [p for words in commands for p in check_command(words, seen)]
    for span in spans:
        words = _words(span)
        flag, _, value = words[0].partition("=") if words else ("", "", "")
        if not flag.startswith("--") or not _FLAG.match(flag):
            continue  # not a flag, or `--` itself
        problems += _flag_problems(flag, value or None, all_options(), f"`{span}`", seen)
    return problems, commands, seen


# ---- tests ----------------------------------------------------------------------------------------


def test_every_command_and_flag_skill_md_names_exists() -> None:
    problems, commands, flags = check_markdown(SKILL.read_text(encoding="utf-8"))
    assert not problems, "SKILL.md names what --help does not have:\n" + "\n".join(problems)
    named = {" ".join(w[:2]) for w in commands}
    assert len(commands) >= 30 and len(named) >= 15, named  # the page was read, not skipped
    assert {"--durable-dir", "--expected-steps", "--code-limit", "--plan", "--action", "--all"} <= set(flags)


def test_the_checker_catches_a_missing_command_and_a_missing_flag() -> None:
    page = "\n".join([
        "Run `rgt watch RUN --timeout 6h --no-such-flag` or `rgt frobnicate RUN`.",
        "```", "rgt deadman HOST bogus", "rgt queue cells.txt --hosts a,b --nope", "```",
        "Pass `--never-existed`, or `--onbox-arg=--not-an-onbox-flag=1`.",
        "`rgt launch gpu1 --code . -- python train.py --lr 3e-4` is fine (after -- is the job's).",
    ])
    problems, _, _ = check_markdown(page)
    text = "\n".join(problems)
    wrongs = ("--no-such-flag", "frobnicate", "bogus", "--nope", "--never-existed", "--not-an-onbox-flag")
    for wrong in wrongs:
        assert wrong in text, (wrong, problems)
    flagged = {p.split("`: ", 1)[1].split()[0] for p in problems}
    assert not flagged & {"--lr", "--code", "--hosts", "--timeout"}, problems
    assert len(problems) == 6, problems


def test_group_arguments_and_the_queue_shorthand_resolve() -> None:
    assert check_command(["rgt", "deadman", "gpu1", "status", "--json"]) == []
    assert check_command(["rgt", "queue", "cells.txt", "--hosts", "a,b", "--max-attempts", "2"]) == []
    assert check_command(["rgt-onbox", "launch", "--expected-steps", "9", "--", "python", "x.py"]) == []
    assert check_command(["rgt", "launch", "h", "--onbox-arg=--durable-dir=/d", "--", "python"]) == []
    assert check_command(["rgt", "launch", "h", "--onbox-arg=--durable-dirx=/d"]) != []


def test_skill_md_states_the_contract_an_agent_needs() -> None:
    """The parts an agent had to guess at are on the page (what each is is checked against --help above)."""
    text = SKILL.read_text(encoding="utf-8")
    for needed in ("$RGT_CKPT_DIR", "$RGT_RESUME_FROM", "$RGT_METRICS", "metrics.jsonl", "os.replace",
                   "onbox.integrations.hf", "onbox.integrations.lightning", "143", "stopped by request",
                   "preemption", "--expected-steps", "--durable-dir", "rgt pull RUN", "rgt verify RUN",
                   "rgt teardown RUN --plan", "rgt teardown RUN --action", "does\nNOT check", "--code DIR",
                   ".rgtignore", '"stopped_by"', "rgt watch --all", "`time`"):
        assert needed in text, needed
    table = dict(re.findall(r"^\| (\d+) \| ([^|]+)\|", text, re.MULTILINE))
    assert set(table) == {"0", "1", "2", "3", "4", "5", "10", "130"}, table
    assert "timeout" in table["3"] and "link" in table["4"] and "usage" in table["2"]
    assert "store" in table["5"] and "stopped by request" in table["0"]
    assert not citations(text), citations(text)


def test_rgt_watch_help_documents_the_exit_codes_skill_md_lists() -> None:
    """One contract in two places: `rgt watch --help` and SKILL.md's table list the same exit codes."""
    text = SKILL.read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| (\d+) \|", text, re.MULTILINE))
    result = CliRunner().invoke(rgt_main, ["watch", "--help"], prog_name="rgt")
    helped = set(re.findall(r"^\s+(\d{1,3})\s{2,}\S", result.output, re.MULTILINE))
    assert listed == helped, f"SKILL.md: {sorted(listed)}, rgt watch --help: {sorted(helped)}"
