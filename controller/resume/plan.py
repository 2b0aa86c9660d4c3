"""`rgt resume RUN --on HOST`: go on with a run on another box, from its newest hashed checkpoint.

    plan = make_plan(store, run, host, Options())   # reads the store and pulls, asks HOST two questions
    answer = execute(store, plan)                    # push, launch, record the lineage

1. What to run (controller/resume/command.py): the command given after `--`, else the one the
   laptop recorded at launch, never the one the old box's run.json or hello names (that one is
   shown when it differs); with no laptop record and none given, the resume is refused. The old
   run's run.json (from its newest pull, else the store's metadata, else the old box) gives only
   the watch settings carried, the env and secret names, its durable dir and its project name.
   `rgt resume` shows this and asks before it pushes anything (cli_resume.py).
2. Which checkpoint: every checkpoint custody hashed for the run (its ckpt.saved events, and the
   rgt/manifest.jsonl of each pull), newest first; the first usable one wins, and it is usable
   - on a durable path (its ckpt.durable event) under the durable dir of HOST's profile or of the old
     run, when HOST sees a file of that size there: nothing is pushed, the launcher verifies it;
   - or as a local copy: a file in a pulled dir (or --checkpoint FILE) that hashes to the recorded
     SHA-256 now (so no PULL_VERIFIED.json is needed). A copy with other bytes is skipped (and named
     in the plan's notes). A directory unit (HF `checkpoint-N/`: kind "dir" in its ckpt.saved event
     or custody record) is found in a pull at its run-relative path, its event's `pull_path`, or a
     `unit` of the pull's PULL_MANIFEST.json with its name, and is usable when its unit digest
     (`unit_digest`: the files listed as custody lists them, temporary names left out) is the
     recorded one; a durable one when HOST sees a directory there.
   A checkpoint whose weights the newest `rgt verify` found NaN/Inf in (its verify.done record) is
   never picked, unless allow_nonfinite (`--allow-nonfinite`); the plan's notes name it.
3. Push (rsync over HOST's ssh master, controller/box/ssh.py): the checkpoint (a directory unit whole,
   temporary names left out) into the new run's checkpoint dir
   <root>/<project>/active/<new-run>/checkpoints/, and with --code DIR that
   directory's contents into the command's cwd there (.git, __pycache__ and pulled runs left out).
4. Launch that command in that cwd through `rgt-onbox launch --resume-from PATH
   --resume-sha256 HEX --resume-step N --resumes OLD` (HEX: a directory's unit digest): the launcher
   hashes the file (each file of the directory) again, refuses a mismatch, records it in the new
   run's custody and sets RGT_RESUME_FROM. The box's answer is checked (boxtrust.launch_answer:
   the run id asked for, a run dir named after it). The new run is stored with `resumed_from` = OLD,
   so `rgt status` shows one history, and with the laptop's launch record of what it ran.
"""
from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import shlex
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import profiles
from protocol.ids import new_run_id
from protocol.pull import FILENAME as PULL_MANIFEST
from protocol.pull import is_temporary
from rgtlib.hashing import unit_digest

from controller import trust as boxtrust
from controller.box.handle import Box, BoxError
from controller.box.ssh import LocalShell, Ssh, SshError
from controller.output import error_tail, last_json_object
from controller.paths import LOCAL
from controller.pull.stage import sha256_of
from controller.resume.command import (
    ResumeError,
    What,
    box_notes,
    carried_args,
    decide,
    inside,
    read_json,
    run_doc,
    watch,
)
from controller.runs.status import all_events, nonfinite_checkpoints
from controller.store.db import Store

LAUNCH_TIMEOUT_S = 1800  # the launcher hashes (and may copy) the checkpoint before it answers
CODE_EXCLUDES = (".git", "__pycache__")
Shell = Union[Ssh, LocalShell]
DIR = "dir"  # a custody record's kind for a directory unit (onbox.custody.manifest.DIR)
# What a directory unit's push leaves out: the temporary names custody never counts (is_temporary).
TEMP_EXCLUDES = (".*", "*.tmp", "*.partial", "*.tmp.*", "tmp-*", "tmp_*")


@dataclasses.dataclass
class Checkpoint:
    """One checkpoint custody hashed: its path in the run dir, bytes, step, and a durable copy's path."""

    rel: str
    sha256: str
    size: int
    step: Optional[int]
    ts: float
    durable: Optional[str] = None
    kind: str = "file"                     # "dir": a directory unit; sha256 is its unit digest
    pull_path: Optional[str] = None        # where a unit recorded outside the run dir lies in a pull

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Options:
    checkpoint: Optional[str] = None      # a local file, a path in the run dir, a name or a durable path
    run_id: Optional[str] = None          # the new run's id (default: UTC time + random)
    root: Optional[str] = None            # where runs live on HOST (default: the host's, else the box's)
    cwd: Optional[str] = None             # where the command runs on HOST (default: the old run's cwd)
    code: Optional[Path] = None           # a local directory pushed to that cwd first
    onbox_args: Sequence[str] = ()        # more `rgt-onbox launch` arguments
    allow_nonfinite: bool = False         # may pick a checkpoint verify found NaN/Inf weights in
    command: Sequence[str] = ()           # the command to run (default: the laptop's launch record)


@dataclasses.dataclass
class Plan:
    run: str                              # the run resumed
    host: str
    run_id: str                           # the new run
    project: str
    root: str                             # absolute, on HOST
    cwd: str
    command: List[str]
    checkpoint: Checkpoint
    source: str                           # "local" (pushed) or "durable" (HOST sees it; nothing pushed)
    local_path: Optional[str]             # the local copy that is pushed
    resume_from: str                      # the checkpoint's path on HOST (--resume-from)
    push_bytes: int                       # the checkpoint's bytes when pushed (the code's not counted)
    code: Optional[str] = None
    onbox_args: List[str] = dataclasses.field(default_factory=list)
    notes: List[str] = dataclasses.field(default_factory=list)
    command_source: str = "launch"        # "launch" (the laptop's record) or "given" (after --)
    python: Optional[str] = None          # --python for the launcher (the one the launch named)
    box_command: Optional[List[str]] = None  # what the old box says the command was, when not this one
    code_to: Optional[str] = None         # where --code goes on HOST (default: the cwd)

    @property
    def run_dir(self) -> str:
        return f"{self.root}/{self.project}/active/{self.run_id}"

    def to_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(run_dir=self.run_dir, command_line=shlex.join(self.command))
        return out




# ---- what the run was -----------------------------------------------------------------------------


def pulled_dirs(store: Store, run_id: str) -> List[Path]:
    """The run's pulled dirs that still exist here, newest pull (or verify) first."""
    out: List[Path] = []
    for ev in reversed(store.local_events(run_id)):
        where = ev.data.get("dest") or ev.data.get("run_dir")
        if ev.kind in ("pull.done", "verify.done") and isinstance(where, str) and where:
            path = Path(where)
            if path not in out and path.is_dir():
                out.append(path)
    return out


# ---- which checkpoint -----------------------------------------------------------------------------


def _manifest_records(where: Path) -> Iterator[Dict[str, Any]]:
    """The custody records in a pulled dir's rgt/manifest.jsonl (torn or foreign lines skipped)."""
    path = inside(where, "rgt", "manifest.jsonl")
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path is not None else []
    except OSError:
        return
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("v") == 1:
            yield obj


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def custody(store: Store, run_id: str, dirs: Sequence[Path]) -> List[Checkpoint]:
    """Every checkpoint custody hashed for the run (events and pulled manifests), newest first."""
    found: Dict[Tuple[str, str], Checkpoint] = {}

    def add(d: Mapping[str, Any], ts: Any) -> None:
        rel, sha, size = d.get("path"), d.get("sha256"), _int(d.get("size"))
        if isinstance(rel, str) and rel and isinstance(sha, str) and len(sha) == 64 and size is not None \
                and (rel, sha) not in found:
            pull_path = d.get("pull_path")
            found[(rel, sha)] = Checkpoint(rel, sha, size, _int(d.get("step")), float(ts or 0.0),
                                           kind=DIR if d.get("kind") == DIR else "file",
                                           pull_path=pull_path if isinstance(pull_path, str) else None)

    for ev in all_events(store, run_id, "ckpt.saved"):
        add(ev.data, ev.ts)
    for where in dirs:
        for record in _manifest_records(where):
            add(record, record.get("ts"))
    for ev in all_events(store, run_id, "ckpt.durable"):
        ck = found.get((str(ev.data.get("path")), str(ev.data.get("sha256"))))
        if ck is not None and isinstance(ev.data.get("durable_path"), str):
            ck.durable = str(ev.data["durable_path"])
    return sorted(found.values(), key=lambda c: (c.ts, -1 if c.step is None else c.step), reverse=True)


def without_nonfinite(store: Store, run_id: str, candidates: List[Checkpoint],
                      allow: bool) -> Tuple[List[Checkpoint], List[str]]:
    """(the candidates that may be picked, notes): a checkpoint verify found non-finite (its file,
    or a file of its unit) is left out unless `allow`."""
    bad = nonfinite_checkpoints(store.local_events(run_id))
    names = {str(b["path"]) for b in bad} | {str(b["unit"]).rstrip("/") for b in bad if b.get("unit")}

    def hit(c: Checkpoint) -> bool:  # verify names a unit outside the run dir by its pull path
        return any(rel in names or any(rel.startswith(n + "/") for n in names)
                   for rel in (c.rel, c.pull_path) if rel)

    out = [c for c in candidates if allow or not hit(c)]
    skipped = [c.rel for c in candidates if hit(c)]
    notes = [f"{'allowed' if allow else 'skipped'} {rel}: `rgt verify` found NaN/Inf in its weights"
             + ("" if allow else " (pass --allow-nonfinite to resume from it anyway)") for rel in skipped]
    if candidates and not out:
        raise ResumeError(f"every checkpoint of {run_id} custody hashed has NaN/Inf weights (rgt verify): "
                          "resuming from one would go on training NaN",
                          hint="--allow-nonfinite picks one anyway")
    return out, notes


def _inside_rel(rel: str) -> bool:
    parts = rel.split("/")
    return not rel.startswith("/") and ".." not in parts and "" not in parts


def unit_files(unit: Path) -> List[Tuple[str, Path]]:
    """(POSIX path under `unit`, path) of every regular file a directory unit holds, as custody lists
    one (onbox.custody.units.signature): no symlink followed, temporary names left out."""
    out: List[Tuple[str, Path]] = []
    for base, dirs, files in os.walk(unit):
        dirs[:] = [d for d in dirs if not is_temporary(d)]
        for name in files:
            path = Path(base, name)
            if not is_temporary(name) and path.is_file() and not path.is_symlink():
                out.append((path.relative_to(unit).as_posix(), path))
    return sorted(out)


def _pulled_units(where: Path, name: str) -> List[str]:
    """The directory units named `name` in a pull's PULL_MANIFEST.json (units outside the run dir
    lie under rgt/external/ there)."""
    path = inside(where, "rgt", PULL_MANIFEST)
    doc = (read_json(path) if path is not None else None) or {}
    listed = doc.get("files")
    files: List[Any] = listed if isinstance(listed, list) else []
    units = {str(e.get("unit")) for e in files if isinstance(e, dict) and isinstance(e.get("unit"), str)
             and e.get("unit") != e.get("path")}
    return sorted(u for u in units if posixpath.basename(u) == name and _inside_rel(u))


class Finder:
    """Finds usable copies of checkpoints: local files that hash right, durable ones HOST sees."""

    def __init__(self, dirs: Sequence[Path], durable_roots: Sequence[str],
                 visible: Callable[[str, int], bool], hash_file: Callable[[Path], str] = sha256_of) -> None:
        self.dirs = list(dirs)
        self.roots = [r.rstrip("/") for r in durable_roots if r and r.startswith("/")]
        self.visible = visible
        self._hash_file = hash_file
        self._hashes: Dict[Path, str] = {}
        self.notes: List[str] = []

    def hash(self, path: Path) -> str:
        if path not in self._hashes:
            self._hashes[path] = self._hash_file(path)
        return self._hashes[path]

    def unit_digest(self, unit: Path) -> str:
        """The unit digest of a local directory, its files hashed now (once each)."""
        return unit_digest((rel, path.stat().st_size, self.hash(path)) for rel, path in unit_files(unit))

    def local_dir(self, ck: Checkpoint) -> Optional[Path]:
        """A pulled copy of the directory unit `ck` whose files have its unit digest now."""
        for where in self.dirs:
            rels = [r for r in (ck.rel, ck.pull_path) if r and _inside_rel(r)]
            for rel in dict.fromkeys(rels + _pulled_units(where, posixpath.basename(ck.rel.rstrip("/")))):
                path = inside(where, rel)  # a pull is the box's tree: no symlink out of it
                if path is None or not path.is_dir():
                    continue
                if self.unit_digest(path) == ck.sha256:
                    return path
                self.notes.append(f"skipped {path}: its files are not the {ck.sha256[:12]} custody hashed")
        return None

    def local(self, ck: Checkpoint) -> Optional[Path]:
        """A pulled copy of `ck` whose bytes hash to its SHA-256 now (a directory: its unit digest)."""
        if ck.kind == DIR:
            return self.local_dir(ck)
        if not _inside_rel(ck.rel):
            return None
        for where in self.dirs:
            path = inside(where, ck.rel)
            if path is None:
                continue
            try:
                size = path.stat().st_size if path.is_file() else -1
            except OSError:
                continue
            if size == ck.size and self.hash(path) == ck.sha256:
                return path
            if size >= 0:
                self.notes.append(f"skipped {path}: its bytes are not the {ck.sha256[:12]} custody hashed")
        return None

    def durable(self, ck: Checkpoint) -> bool:
        """`ck` has a durable copy under a named durable dir, and HOST sees a file of its size there
        (a directory unit: a directory; the launcher checks its unit digest)."""
        path = posixpath.normpath(ck.durable) if ck.durable else ""
        return bool(path) and any(path.startswith(root + "/") for root in self.roots) \
            and self.visible(path, -1 if ck.kind == DIR else ck.size)


def _given(want: str, candidates: List[Checkpoint], finder: Finder,
           run: str) -> Tuple[List[Checkpoint], Optional[Path]]:
    """--checkpoint: a local file that hashes to a recorded checkpoint, or a recorded one by name."""
    path = Path(want).expanduser()
    if path.is_file() or path.is_dir():
        sha = finder.hash(path) if path.is_file() else finder.unit_digest(path)
        same = [c for c in candidates if c.sha256 == sha]
        if not same:
            raise ResumeError(f"{path} is no checkpoint custody hashed for {run} (SHA-256 {sha[:12]}... "
                              "is in none of its records)", hint="leave out --checkpoint and rgt picks one")
        return same[:1], path
    chosen = [c for c in candidates if want in (c.rel, posixpath.basename(c.rel), c.durable)]
    if not chosen:
        names = ", ".join(c.rel for c in candidates[:5])
        raise ResumeError(f"--checkpoint {want}: no such checkpoint of {run}", hint=f"hashed ones: {names}")
    return chosen, None


def choose(candidates: List[Checkpoint], finder: Finder, run: str,
           want: Optional[str] = None) -> Tuple[Checkpoint, str, Optional[Path]]:
    """(the checkpoint, "durable" or "local", the local copy) to resume from: the newest usable one."""
    if not candidates:
        raise ResumeError(f"{run} has no checkpoint custody hashed: there is nothing to resume from",
                          hint="start it afresh with rgt launch")
    given: Optional[Path] = None
    if want:
        candidates, given = _given(want, candidates, finder, run)
    for ck in candidates:
        if given is not None:
            return ck, "local", given
        if finder.durable(ck):
            return ck, "durable", None
        local = finder.local(ck)
        if local is not None:
            return ck, "local", local
    raise ResumeError(f"none of the {len(candidates)} checkpoints of {run} custody hashed is here (a pulled "
                      "copy with the recorded bytes) or on a durable path the new box sees",
                      hint=f"rgt pull {run} first, then rgt resume again")


# ---- the plan -------------------------------------------------------------------------------------


def _expand(path: str) -> str:
    """`path` for the box's shell: quoted, a leading ~ being the home there."""
    if path == "~" or path.startswith("~/"):
        return '"$HOME"' + (("/" + shlex.quote(path[2:])) if path[2:] else "")
    return shlex.quote(path)


def remote_facts(shell: Shell, root: Optional[str], cwd: str, in_root: bool = False) -> Tuple[str, bool]:
    """(the runs root on the box as an absolute path, whether `cwd` exists there; with `in_root`
    the cwd is relative to that root)."""
    value = _expand(root) if root else '"${RGT_ROOT:-$HOME/rgt-runs}"'
    where = f'"$r"/{shlex.quote(cwd)}' if in_root else _expand(cwd)
    script = (f'r={value}; case "$r" in /*) ;; *) r="$HOME/$r" ;; esac; printf "%s\\n" "$r"; '
              f"if [ -d {where} ]; then echo cwd=yes; else echo cwd=no; fi")
    lines = shell.run(script, timeout_s=60).stdout.decode("utf-8", "replace").splitlines()
    if len(lines) < 2 or not lines[-2].startswith("/"):
        raise ResumeError(f"{shell.alias}: could not work out where runs live there (got {lines[-2:]!r})")
    return posixpath.normpath(lines[-2]), lines[-1] == "cwd=yes"


def durable_roots(box: Box, doc: Dict[str, Any]) -> List[str]:
    """The durable dirs a checkpoint copy may sit in: the box's profile's, and the old run's own."""
    roots: List[str] = []
    name = box.profile
    if name and box.name != LOCAL:
        try:
            found = profiles.load(name, profiles.directory()).scripts.durable_dir
        except profiles.ProfileError:
            found = None
        roots += [found] if found else []
    roots += [v for v in (doc.get("durable_dir"), watch(doc).get("durable_dir")) if isinstance(v, str) and v]
    return roots


def _visible(shell: Shell) -> Callable[[str, int], bool]:
    def visible(path: str, size: int) -> bool:
        """HOST sees a file of `size` bytes at `path` (size -1: a directory)."""
        if size < 0:
            return shell.run(f"test -d {shlex.quote(path)}", check=False, timeout_s=60).returncode == 0
        done = shell.run(f"stat -c %s -- {shlex.quote(path)}", check=False, timeout_s=60)
        return done.returncode == 0 and done.stdout.strip() == str(size).encode()
    return visible


def _new_id(store: Store, wanted: Optional[str]) -> str:
    try:
        run_id = boxtrust.run_id(wanted or new_run_id(), "--run-id")
    except boxtrust.Untrusted as e:
        raise ResumeError(str(e), hint="leave out --run-id, or name one by that grammar") from None
    if run_id in {str(r["run"]) for r in store.runs()}:
        raise ResumeError(f"run {run_id} exists already", hint="leave out --run-id, or name a new one")
    return run_id


def _project(what: What, doc: Mapping[str, Any]) -> str:
    """The new run's project: the launch's, else the old run's name for it (a claim, but only a
    name: it must pass the run-id grammar), else "default"."""
    for value in (what.project, doc.get("project")):
        if boxtrust.is_run_id(value):
            return str(value)
    return "default"


def make_plan(store: Store, run: str, host: str, opts: Options, shell: Optional[Shell] = None) -> Plan:
    """Everything `rgt resume` will do, decided; nothing is pushed or started (see the module doc)."""
    info = store.run(run)
    run_id = str(info["run"])
    box = Box.of(store, host, shell)
    record = box.record
    dirs = pulled_dirs(store, run_id)
    doc = run_doc(store, info, dirs)
    what = decide(info, doc, host, opts.command, opts.cwd)
    project = _project(what, doc)
    new_id = _new_id(store, opts.run_id)
    candidates, finite_notes = without_nonfinite(store, run_id, custody(store, run_id, dirs),
                                                 opts.allow_nonfinite)
    shell = box.shell
    root, cwd_there = remote_facts(shell, opts.root or str(record.get("root") or "") or None, what.cwd,
                                   what.in_root)
    cwd = f"{root}/{what.cwd}" if what.in_root else what.cwd
    if not cwd_there and opts.code is None:
        code = " (the tree rgt launch --code synced)" if what.code_dir else ""
        raise ResumeError(f"the command's directory {cwd} does not exist on {host}",
                          hint=f"push the code there with --code DIR{code}, or run elsewhere with --cwd DIR")
    finder = Finder(dirs, durable_roots(box, doc), _visible(shell))
    ck, source, local = choose(candidates, finder, run_id, opts.checkpoint)
    run_dir = f"{root}/{project}/active/{new_id}"
    there = ck.durable if source == "durable" and ck.durable else \
        f"{run_dir}/checkpoints/{posixpath.basename(ck.rel)}"
    return Plan(run=run_id, host=host, run_id=new_id, project=project, root=root, cwd=cwd,
                command=what.command, checkpoint=ck, source=source, local_path=str(local) if local else None,
                resume_from=there, push_bytes=ck.size if source == "local" else 0,
                code=str(Path(opts.code).resolve()) if opts.code else None,
                onbox_args=carried_args(doc, opts.onbox_args) + list(opts.onbox_args),
                notes=what.notes + finite_notes + finder.notes + box_notes(doc, host),
                command_source=what.source, python=what.python, box_command=what.box_command,
                code_to=f"{root}/{what.code_dir}" if what.code_dir and opts.code else None)


# ---- doing it -------------------------------------------------------------------------------------


def code_excludes(store: Store, code: Path) -> List[str]:
    """What a --code push leaves out: .git, __pycache__, and every pulled run under `code`."""
    out = list(CODE_EXCLUDES)
    base = code.resolve()
    for r in store.runs():
        for where in pulled_dirs(store, str(r["run"])):
            for path in (where, where.with_name(where.name + ".partial")):
                if base in path.resolve().parents:
                    out.append("/" + path.resolve().relative_to(base).as_posix())
    return out


def launch_line(plan: Plan, onbox: str, record: Dict[str, Any]) -> str:
    """The shell line that starts the resumed run on the box (every word quoted)."""
    args = ["launch", "--json", "--run-id", plan.run_id, "--project", plan.project, "--root", plan.root]
    profile = str(record.get("profile") or "") if plan.host != LOCAL else ""
    if profile:
        args += ["--profile", profile]
    if plan.host == LOCAL and not any(a.startswith("--deadman") for a in plan.onbox_args):
        args += ["--deadman", "off"]  # nothing bills on this machine
    args += ["--resume-from", plan.resume_from, "--resume-sha256", plan.checkpoint.sha256]
    if plan.checkpoint.step is not None:
        args += ["--resume-step", str(plan.checkpoint.step)]
    if plan.python and not any(a == "--python" or a.startswith("--python=") for a in plan.onbox_args):
        args += ["--python", plan.python]
    args += ["--resumes", plan.run, *plan.onbox_args]
    return f"cd -- {_expand(plan.cwd)} && {onbox} {shlex.join(args)} -- {shlex.join(plan.command)}"


def launch_record(plan: Plan, record: Mapping[str, Any]) -> Dict[str, Any]:
    """The laptop's record of what this resume started (store.record_launch): what a later resume of
    the new run runs again. Its cwd is the one it ran in (absolute, so it is taken as it is); its code
    is where --code went on HOST, as `rgt launch` records it."""
    profile = str(record.get("profile") or "") if plan.host != LOCAL else ""
    return {"command": list(plan.command), "cwd": plan.cwd, "python": plan.python,
            "code": (plan.code_to or plan.cwd) if plan.code else None,
            "profile": profile or None, "onbox_args": list(plan.onbox_args), "host": plan.host,
            "project": plan.project}


def execute(store: Store, plan: Plan, shell: Optional[Shell] = None) -> Dict[str, Any]:
    """Push, launch, record; the launcher's JSON answer with host, resumed_from and checkpoint added."""
    box = Box.of(store, plan.host, shell)
    record = box.record
    shell = box.shell
    onbox = box.onbox
    try:
        if isinstance(shell, Ssh):
            shell.start_master()  # it ends itself once idle (ssh.MASTER_IDLE_S)
        box.check_version()
        if plan.code:
            code = Path(plan.code)
            shell.push(code, plan.code_to or plan.cwd, excludes=code_excludes(store, code))
        if plan.source == "local" and plan.local_path:
            unit = plan.checkpoint.kind == DIR
            shell.push(Path(plan.local_path), plan.resume_from, excludes=TEMP_EXCLUDES if unit else ())
        out = shell.run(launch_line(plan, onbox, record), check=False, timeout_s=LAUNCH_TIMEOUT_S)
    except BoxError as e:
        raise ResumeError(e.message, e.hint) from e
    except SshError as e:
        raise ResumeError(e.message, e.hint) from e
    answer = last_json_object(out.stdout)
    if out.returncode != 0 or answer is None or "run_id" not in answer:
        raise ResumeError(f"{plan.host} refused the resumed launch (exit {out.returncode}): "
                          f"{error_tail(out.stderr)}", hint=f"nothing runs there; see `rgt resume {plan.run} "
                          f"--on {plan.host} --dry-run` for the plan")
    try:
        answer = boxtrust.launch_answer(answer, plan.run_id)
    except boxtrust.Untrusted as e:
        raise ResumeError(f"{plan.host}'s answer to the resumed launch is refused: {e}",
                          hint=f"the job may be running there untracked: look with `rgt-onbox ps` on "
                               f"{plan.host} and stop it with `rgt-onbox stop {plan.run_id}`") from None
    new = str(answer["run_id"])
    store.upsert_run(new, host="", target=plan.host, run_dir=str(answer["run_dir"]))
    store.set_lineage(new, resumed_from=plan.run)
    store.record_launch(new, launch_record(plan, record))
    return {**answer, "host": plan.host, "resumed_from": plan.run, "checkpoint": plan.checkpoint.to_dict(),
            "source": plan.source, "pushed_bytes": plan.push_bytes}


__all__ = ["Checkpoint", "Finder", "Options", "Plan", "ResumeError", "carried_args",
           "choose", "custody", "execute", "launch_line", "launch_record", "make_plan", "new_run_id",
           "pulled_dirs", "remote_facts", "run_doc"]
