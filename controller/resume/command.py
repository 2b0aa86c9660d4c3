"""What `rgt resume` runs on the new box: decided on the laptop, never taken from the old box.

The old box wrote the run's run.json and sent its hello (the store's run metadata). A box is
someone else's machine and may rewrite both; the command resume starts runs on the NEW box with
that box's secrets in its environment. So what runs (the command, where, with which Python) is

1. what the person gives: `rgt resume RUN --on HOST --cwd DIR -- python train.py ...`;
2. else the laptop's own record of the launch (`store.record_launch`, written by `rgt launch`
   and by `rgt resume` for the run it starts);
3. else nothing: a run launched before rgt kept that record, or one rgt did not launch, is
   refused, with a hint that shows how to give the command.

What the box says the command was is shown, as a difference, when it is not the one that runs;
it is never run. The box's run.json still gives what starts no code: its watch settings (carried
as `rgt-onbox launch` flags, plain values only), the names of the env vars and secrets the old
run had (notes), its durable dir, and its project name (by the run-id grammar).
"""
from __future__ import annotations

import dataclasses
import json
import posixpath
import re
import shlex
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from controller import trust as boxtrust
from controller.box.handle import Box
from controller.box.ssh import SshError
from controller.errors import StoreError
from controller.paths import LOCAL

REDACTED = "***"  # what the box's launcher writes in run.json where a secret-looking value was
MAX_RUN_JSON_BYTES = 1 << 20
MAX_FLAG_VALUE_CHARS = 1000
# The old run's watch settings (run.json "watch") that the new run keeps, as `rgt-onbox launch` flags.
CARRIED = (("scalars", "--watch-scalar"), ("log_regex", "--log-regex"), ("stall_floor_s", "--stall-floor"),
           ("stall_grace_s", "--stall-grace"), ("expected_steps", "--expected-steps"),
           ("expected_seconds", "--expected-seconds"), ("stale_after_s", "--stale-after"),
           ("durable_policy", "--durable-policy"))
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class ResumeError(Exception):
    """The resume cannot go on; `hint` is what a person can do."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclasses.dataclass
class What:
    """What runs on the new box, and where it came from."""

    command: List[str]
    source: str                       # "given" (after -- on rgt resume's line) or "launch" (the laptop's)
    cwd: str                          # where it runs on HOST (`cd` there first); see in_root
    in_root: bool = False             # cwd is relative to the runs root on HOST (a --code launch)
    code_dir: Optional[str] = None    # a --code launch: where --code goes, relative to that root
    python: Optional[str] = None      # the --python the launch named, passed again with its command
    project: Optional[str] = None     # the launch's project, when the laptop knows it
    box_command: Optional[List[str]] = None  # what the box says the command was, when it differs
    notes: List[str] = dataclasses.field(default_factory=list)


# ---- what the box says (shown, never run) ---------------------------------------------------------


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def inside(root: Path, *parts: str) -> Optional[Path]:
    """ROOT/PARTS when it stays under ROOT (boxtrust.contained: a symlink out is refused), else None."""
    try:
        return boxtrust.contained(root, *parts)
    except boxtrust.Untrusted:
        return None


def run_doc(store: Any, info: Mapping[str, Any], dirs: Sequence[Path]) -> Dict[str, Any]:
    """The old run's run.json as the box wrote it: from a pull, else the store's metadata (its
    hello), else the old box itself; {} when none. Claims: nothing in it is run."""
    for where in dirs:
        path = inside(where, "run.json")
        doc = read_json(path) if path is not None else None
        if doc is not None and doc.get("id") in (None, info["run"]):
            return doc
    meta = info.get("meta") or {}
    if isinstance(meta, dict) and meta.get("command"):
        return meta
    if not info.get("target") or not info.get("run_dir"):
        return {}
    try:
        shell = Box.of(store, str(info["target"])).shell
        path_there = shlex.quote(str(info["run_dir"]) + "/run.json")
        done = shell.run(f"head -c {MAX_RUN_JSON_BYTES} -- {path_there}", check=False, timeout_s=30)
        doc = json.loads(done.stdout) if done.returncode == 0 else None
    except (SshError, StoreError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _argv(value: Any) -> Optional[List[str]]:
    if isinstance(value, list) and value and all(isinstance(a, str) for a in value):
        return list(value)
    return None


def _same_arg(box: str, mine: str) -> bool:
    """The box's (maybe redacted: *** for a secret-looking part) word stands for MINE."""
    if REDACTED not in box:
        return box == mine
    pattern = ".+?".join(re.escape(piece) for piece in box.split(REDACTED))
    return re.fullmatch(pattern, mine, re.DOTALL) is not None


def same_command(box: Sequence[str], mine: Sequence[str]) -> bool:
    """The box's command is MINE, as the box's launcher shows it (secret-looking values redacted)."""
    return len(box) == len(mine) and all(_same_arg(b, m) for b, m in zip(box, mine))


MAX_SHOWN_CHARS = 2000


def shown(argv: Sequence[str]) -> str:
    """A command as one line for a message, cut at MAX_SHOWN_CHARS (render.printable it before a
    terminal sees it: a box's words may hold anything)."""
    line = shlex.join(argv)
    return line if len(line) <= MAX_SHOWN_CHARS else line[:MAX_SHOWN_CHARS] + "... (cut)"


# ---- what runs --------------------------------------------------------------------------------------


def laptop_record(info: Mapping[str, Any]) -> Dict[str, Any]:
    """The laptop's record of the launch (store.record_launch), {} when there is none."""
    launch = info.get("launch")
    return dict(launch) if isinstance(launch, dict) else {}


def _text(value: Any) -> Optional[str]:
    return value if isinstance(value, str) and value else None


def _code_project(code_dir: str) -> str:
    """The project of a --code launch from where its code went (<root>/<project>/code)."""
    parent, name = posixpath.split(posixpath.normpath(code_dir))
    project = posixpath.basename(parent)
    if name != "code" or not boxtrust.is_run_id(project):
        raise ResumeError(f"the laptop's record of the launch names code dir {code_dir[:200]!r}, not "
                          "<root>/<project>/code", hint="name the working directory with --cwd DIR")
    return project


def _launch_cwd(launch: Mapping[str, Any], run: str) -> What:
    """Where the launch ran the command, as the laptop knows it (What with command filled later)."""
    cwd, code = _text(launch.get("cwd")), _text(launch.get("code"))
    project = _text(launch.get("project"))
    if cwd and (cwd.startswith("/") or cwd == "~" or cwd.startswith("~/")):
        return What([], "launch", cwd, project=project)
    if code:
        # `rgt launch --code DIR` synced DIR to <root>/<project>/code on the old box (the record's
        # "code") and ran the command there (--cwd: from there); on HOST that is <its root>/<project>/code.
        project = project or _code_project(code)
        base = f"{project}/code"
        return What([], "launch", f"{base}/{cwd}" if cwd else base, in_root=True, code_dir=base,
                     project=project)
    if launch.get("host") == LOCAL:
        # On this machine the launcher started where the laptop's shell was; that is not recorded.
        raise ResumeError(f"the laptop's record of {run} names no working directory (it was launched here, "
                          "from a directory rgt did not keep)", hint="name it with --cwd DIR")
    # Over ssh the launcher starts in the login directory: the box's home.
    return What([], "launch", f"~/{cwd}" if cwd else "~", project=project)


def decide(info: Mapping[str, Any], doc: Mapping[str, Any], host: str, given: Sequence[str] = (),
           cwd: Optional[str] = None) -> What:
    """What runs on HOST for run INFO: GIVEN (with --cwd CWD), else the laptop's launch record;
    the box's DOC only shows up as a difference. ResumeError when the laptop knows no command."""
    run = str(info["run"])
    launch = laptop_record(info)
    recorded = _argv(launch.get("command"))
    box = _argv(doc.get("command"))
    hint = f"give it after --: rgt resume {run} --on {host} --cwd DIR -- python train.py ..."
    if given:
        what = What(list(given), "given", cwd or "")
        if not cwd:
            if not recorded:
                where = f" (the box says {str(doc['cwd'])[:300]})" if isinstance(doc.get("cwd"), str) else ""
                raise ResumeError(f"no working directory is known on the laptop for {run}{where}",
                                  hint="name it with --cwd DIR")
            what = dataclasses.replace(_launch_cwd(launch, run), command=list(given), source="given")
        if recorded and list(given) != recorded:
            what.notes.append(f"at launch the command was {shown(recorded)}; rgt runs the one you gave")
    elif recorded:
        what = dataclasses.replace(_launch_cwd(launch, run), command=recorded) if not cwd else \
            What(recorded, "launch", cwd, project=_text(launch.get("project")))
    else:
        said = f"; the box says it was {shown(box)}, which rgt does not run" if box else ""
        raise ResumeError(f"the laptop has no record of the command {run} was launched with (a run "
                          f"launched before rgt kept one, or one rgt did not launch){said}", hint=hint)
    if isinstance(launch.get("python"), str) and launch["python"] and what.source == "launch":
        what.python = str(launch["python"])
    if box and not same_command(box, what.command):
        whose = "the one recorded at launch" if what.source == "launch" else "the one you gave"
        what.box_command = box
        what.notes.insert(0, f"the box says the command was {shown(box)}; rgt will run {whose}")
    return what


# ---- what the box's run.json may still give (no code) -----------------------------------------------


def watch(doc: Mapping[str, Any]) -> Dict[str, Any]:
    found = doc.get("watch")
    return found if isinstance(found, dict) else {}


def _plain(value: Any) -> bool:
    """A flag value a box may hand on: a bounded number or line of text (no flags smuggled in)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    return isinstance(value, str) and 0 < len(value) <= MAX_FLAG_VALUE_CHARS and not _CONTROL.search(value)


def carried_args(doc: Mapping[str, Any], given: Sequence[str]) -> List[str]:
    """The old run's watch settings as launch flags, except those the user passes himself; a value
    that is not a plain number or line of text is left out."""
    settings = watch(doc)
    out: List[str] = []
    for key, flag in CARRIED:
        value = settings.get(key)
        if value is None or any(a == flag or a.startswith(flag + "=") for a in given):
            continue
        for item in value if isinstance(value, list) else [value]:
            if _plain(item):
                out.append(f"{flag}={item}")
    return out


def _names(value: Any) -> List[str]:
    items = value if isinstance(value, list) else []
    return [str(v)[:128] for v in items if isinstance(v, str)][:50]


def box_notes(doc: Mapping[str, Any], host: str) -> List[str]:
    """What the old run had that the new one needs again (names only: values are never recorded)."""
    notes = []
    if _names(doc.get("env_set")):
        notes.append(f"the old run set {', '.join(_names(doc['env_set']))} with --env; values are never "
                     "recorded: pass them again with --onbox-arg=--env=NAME")
    if _names(doc.get("secrets")):
        notes.append(f"the old run had the box secrets {', '.join(_names(doc['secrets']))}; push them to "
                     f"{host} first if they are not there (rgt secret push {host} NAME)")
    return notes


__all__ = ["CARRIED", "REDACTED", "ResumeError", "What", "box_notes", "carried_args", "decide", "inside",
           "laptop_record", "read_json", "run_doc", "same_command", "shown", "watch"]
