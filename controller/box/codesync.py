"""`rgt launch HOST --code DIR`: which files of a working tree go to the box, and putting them there.

    scan = scan_tree(DIR)                 # the files that go, the entries left out, the bytes
    scan.check_size(limit_bytes)          # CodeError naming the biggest entries when over the limit
    where = code_dir_on_box(shell, root, project)     # <root>/<project>/code, made, absolute
    sync(shell, scan, where)              # rsync over the host's ssh master (a copy for `local`)

What is left out, in this order (the last rule that matches an entry decides, as in git):
1. built in: .git, .hg, .svn, __pycache__/, *.pyc/*.pyo, .venv/, venv/, .tox/, .nox/, .mypy_cache/,
   .pytest_cache/, .ruff_cache/, .ipynb_checkpoints/, node_modules/, *.egg-info/, .DS_Store, and any
   directory holding a pyvenv.cfg (a virtualenv under whatever name);
2. DIR/.gitignore, then DIR/.rgtignore (same syntax; `!pattern` there brings an entry back);
3. the .gitignore of each subdirectory, for the entries under it.
The syntax is git's: `#` comments, `!` negation, a trailing `/` for directories only, a pattern with
a slash anchored at its file's directory, `*`, `?`, `[...]` and `**`. An entry inside a left-out
directory never comes back (git's rule). Symlinks are copied as links. Nothing on the box is
deleted: a file removed here stays there, and what the job writes under the code directory
(a Trainer's default output_dir) is never touched by a later sync.

The rules are judged here, once; rsync is then handed the exact entries to leave out, anchored at
DIR, so the box gets what scan_tree() listed (a file created meanwhile goes too unless a rule
would have left it out by name).
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from rgtlib.units import human_bytes

from controller.box.ssh import Shell

DEFAULT_LIMIT_BYTES = 200 << 20
BUILTIN_IGNORES = (".git", ".hg/", ".svn/", "__pycache__/", "*.py[cod]", ".venv/", "venv/", ".tox/", ".nox/",
                   ".mypy_cache/", ".pytest_cache/", ".ruff_cache/", ".ipynb_checkpoints/", "node_modules/",
                   "*.egg-info/", ".DS_Store")
IGNORE_FILES = (".gitignore", ".rgtignore")
_SAFE_PROJECT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CodeError(Exception):
    """The code cannot be synced as asked; `hint` is the next step for a person."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclasses.dataclass(frozen=True)
class Rule:
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool
    base: str              # the directory (relative to DIR, "" for DIR) whose ignore file holds it

    def matches(self, rel: str, is_dir: bool) -> bool:
        if self.dir_only and not is_dir:
            return False
        if self.base:
            if not rel.startswith(self.base + "/"):
                return False
            rel = rel[len(self.base) + 1:]
        return self.regex.match(rel) is not None


def _segment(part: str) -> str:
    """One path segment of a pattern as a regex (no slash inside)."""
    out, i = [], 0
    while i < len(part):
        c = part[i]
        if c == "\\" and i + 1 < len(part):
            out.append(re.escape(part[i + 1]))
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = part.find("]", i + 2 if part[i + 1:i + 2] in ("!", "^") else i + 1)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = part[i + 1:end]
                body = "^" + body[1:] if body[:1] in ("!", "^") else body
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def parse_rule(line: str, base: str = "") -> Optional[Rule]:
    """One line of a .gitignore as a Rule; None for blanks and comments."""
    text = line.rstrip("\n").rstrip("\r")
    while text.endswith(" ") and not text.endswith("\\ "):
        text = text[:-1]
    if not text or text.startswith("#"):
        return None
    negate = text.startswith("!")
    if negate or text.startswith("\\!") or text.startswith("\\#"):
        text = text[1:]
    dir_only = text.endswith("/")
    text = text.rstrip("/")
    if not text:
        return None
    anchored = "/" in text
    parts = text.lstrip("/").split("/")
    rx = "" if anchored else "(?:[^/]+/)*"
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            rx += ".*" if last else "(?:[^/]+/)*"
        else:
            rx += _segment(part) + ("" if last else "/")
    return Rule(re.compile(rx + r"\Z"), negate, dir_only, base)


def read_rules(path: Path, base: str = "") -> List[Rule]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [r for r in (parse_rule(line, base) for line in text.splitlines()) if r is not None]


def ignored(rules: Sequence[Rule], rel: str, is_dir: bool) -> bool:
    """What the last matching rule says (git's order); False when none matches."""
    for rule in reversed(rules):
        if rule.matches(rel, is_dir):
            return not rule.negate
    return False


@dataclasses.dataclass
class Scan:
    root: Path
    files: List[Tuple[str, int]] = dataclasses.field(default_factory=list)     # (rel, bytes) that go
    left_out: List[Tuple[str, bool]] = dataclasses.field(default_factory=list)  # (rel, is_dir) pruned

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)

    def biggest(self, n: int = 5) -> List[Tuple[str, int]]:
        """The top-level entries that weigh most (a directory: everything under it that goes)."""
        sizes: Dict[str, int] = {}
        for rel, size in self.files:
            top = rel.split("/", 1)
            key = top[0] + ("/" if len(top) > 1 else "")
            sizes[key] = sizes.get(key, 0) + size
        return sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:n]

    def rsync_excludes(self) -> List[str]:
        """The left-out entries as rsync patterns anchored at DIR (wildcard characters made literal)."""
        return ["/" + _literal(rel) + ("/" if is_dir else "") for rel, is_dir in self.left_out]

    def check_size(self, limit_bytes: Optional[int]) -> None:
        if limit_bytes is None or self.total_bytes <= limit_bytes:
            return
        top = ", ".join(f"{name} {human_bytes(size)}" for name, size in self.biggest())
        size = human_bytes(self.total_bytes)
        raise CodeError(f"the code in {self.root} is {size} in {len(self.files)} files, "
                        f"over the {human_bytes(limit_bytes)} limit; biggest: {top}",
                        hint=f"leave data and outputs out with {self.root}/.rgtignore (gitignore syntax), "
                             "or pass --yes (or --code-limit SIZE) to copy it anyway")


def _literal(rel: str) -> str:
    """`rel` as a pattern that matches only itself, in both rsync's wildmatch and fnmatch."""
    return "".join(f"[{c}]" if c in "*?[" else "?" if c == "\\" else c for c in rel)


def _is_venv(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "pyvenv.cfg"))


def scan_tree(root: Path) -> Scan:
    """Walk DIR under the rules of the module doc: what goes and what is left out."""
    top = Path(root).expanduser().resolve()
    if not top.is_dir():
        raise CodeError(f"--code {root}: not a directory here")
    rules = [r for r in (parse_rule(line) for line in BUILTIN_IGNORES) if r is not None]
    for name in IGNORE_FILES:
        rules += read_rules(top / name)
    scan = Scan(top)
    _walk(top, "", rules, scan)
    return scan


def _walk(directory: Path, rel_dir: str, rules: List[Rule], scan: Scan) -> None:
    if rel_dir and (directory / ".gitignore").is_file():
        rules = rules + read_rules(directory / ".gitignore", rel_dir)
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as e:
        raise CodeError(f"cannot read {directory}: {e.strerror}") from e
    for entry in entries:
        rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
        is_dir = entry.is_dir(follow_symlinks=False)
        if ignored(rules, rel, is_dir) or (is_dir and _is_venv(entry.path)):
            scan.left_out.append((rel, is_dir))
        elif is_dir:
            _walk(Path(entry.path), rel, rules, scan)
        else:
            scan.files.append((rel, entry.stat(follow_symlinks=False).st_size))


def project_for(code: Path) -> str:
    """The default project of a --code launch: DIR's name, made safe."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(code).expanduser().resolve().name).strip("-._")[:64]
    return name if name and _SAFE_PROJECT.match(name) else "default"


def code_dir_on_box(shell: Shell, root: Optional[str], project: str) -> str:
    """<root>/<project>/code on the box (root: as given, else $RGT_ROOT, else ~/rgt-runs, the same
    default rgt-onbox uses), made and returned as an absolute path there."""
    if not _SAFE_PROJECT.match(project):
        raise CodeError(f"project {project!r} must be 1-128 of A-Z a-z 0-9 . _ - (starting alphanumeric)")
    if root:
        base = "~/" + shlex.quote(root[2:]) if root.startswith("~/") else shlex.quote(root)
    else:
        base = '"${RGT_ROOT:-$HOME/rgt-runs}"'
    script = f'd={base}/{project}/code && mkdir -p -- "$d" && cd -- "$d" && pwd'
    done = shell.run(script, check=False, timeout_s=60)
    lines = done.stdout.decode("utf-8", "replace").strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith("/"):
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise CodeError(f"cannot make the code directory on {shell.alias}: {tail[0][:300]}")
    return lines[-1]


def sync(shell: Shell, scan: Scan, remote_dir: str, timeout_s: float = 3600) -> str:
    """Copy what `scan` lists into `remote_dir` (rsync over the ssh master; nothing there deleted)."""
    return shell.push(scan.root, remote_dir, excludes=scan.rsync_excludes(), timeout_s=timeout_s)


__all__ = ["BUILTIN_IGNORES", "DEFAULT_LIMIT_BYTES", "CodeError", "Rule", "Scan", "code_dir_on_box",
           "ignored", "parse_rule", "project_for", "read_rules", "scan_tree", "sync"]
