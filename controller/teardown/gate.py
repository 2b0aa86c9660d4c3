"""`rgt teardown RUN`: what each provider action costs, and the gate before the destructive ones.

    p = plan(store, run)                  # Plan: the gate and one ActionPlan per profile action
    result = execute(store, p, "release", typed_run_id, instance_id=None)

Nothing is destroyed before a verified pull: the gate is OPEN only when every rule holds; the first that
fails names the reason:

0. the job has ended (controller.runs.life): a job that still runs may write a checkpoint a second after
   the pull, so the plan says to stop it first (`rgt stop RUN`)                 (job_running)
1. a pulled dir is known: `--from DIR`, else the dir of the run's newest pull.done or verify.done
   event                                                                        (not_verified)
2. DIR/rgt/PULL_VERIFIED.json reads as rgt.pull_verified version 1 of this run  (not_verified)
3. its "ok" is true                                                             (verify_failed)
4. it is bound to DIR/rgt/PULL_MANIFEST.json: that manifest passes protocol.pull.check_manifest, names
   this run, and its sha256 is the report's manifest_sha256                    (not_bound)
5. the box answers `rgt-onbox manifest RUN_DIR --gate --json` now: no answer, or an answer that is
   not a gate view, keeps the gate CLOSED, never open                          (box_unreachable)
6. every checkpoint the box records (path and sha256, the ones gone from the box included) is in
   the report's files with the same sha256 and identity "ok": else missing_checkpoint (recorded,
   gone from the box, not pulled), new_checkpoint (written after the pull) or changed_checkpoint
   A checkpoint the job rotated away (the view's "removed" with by "job", and gone from the box) is
   gone on purpose: not required, named in the gate's "rotated_away". Removed by anything else it
   is required like any other (removed_checkpoint when the pull lacks it).
7. the box records at least one checkpoint that was not rotated away           (no_checkpoint)
8. the box holds no checkpoint-like file outside custody ("unrecorded": in the checkpoint dir or
   outside every watched place) and no temporary one                           (unrecorded_checkpoint,
                                                                               partial_checkpoint)
9. the pulled copy of each of those checkpoints is still in DIR, a regular file, and still the
   bytes that were verified: its stat is the one `rgt verify` pinned when it hashed it (size,
   mtime_ns, inode, device: the report's "stat"), else (any change, or no pin) it is hashed again
   and must match the verified sha256                                           (local_copy_changed)

An action runs with the gate closed only when it is reversible and deletes nothing (`deletes` empty or
"nothing": AutoDL's 关机 keeps the disks), because stopping the meter must stay possible while a pull
is impossible; a destructive action never runs with the gate closed. Either way the run id must be
typed. A profile command runs without a shell, its words filled from {instance_id} {host} {run_id},
with only PATH, HOME and the profile's credentials_env variables in its environment. Nothing here
deletes a file, local or remote.

The actions are the run's own profile's (the one it was launched with: `rgt launch --profile`,
kept in its launch record), else its host's.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shlex
import stat
import subprocess
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import profiles
from protocol import ProtocolError
from protocol.pull import check_manifest

from controller.box.handle import Box
from controller.box.ssh import SshError
from controller.pull.stage import MANIFEST_REL, VERIFIED_REL
from controller.runs import life
from controller.store.db import Store
from controller.verify.identity import hash_file, pin_of

STALE_MONTHS = profiles.STALE_MONTHS
COMMAND_TIMEOUT_S = 600
GATE_TIMEOUT_S = 600
_OUTPUT_TAIL = 4000
ViewFn = Callable[[], Dict[str, Any]]


class TeardownError(Exception):
    """Refused or impossible; `hint` is the next step for a person. Nothing was run."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclasses.dataclass
class Gate:
    open: bool
    code: str                     # "open" or the rule that failed (see the module doc)
    reason: str
    problems: List[str] = dataclasses.field(default_factory=list)  # every failure of rules 6-8
    pulled_dir: Optional[str] = None
    manifest_sha256: Optional[str] = None
    checkpoints: int = 0          # checkpoints the box records
    rotated_away: List[str] = dataclasses.field(default_factory=list)  # by the job: gone on purpose


def _closed(code: str, reason: str, pulled_dir: Optional[Path] = None, **kw: Any) -> Gate:
    return Gate(False, code, reason, pulled_dir=None if pulled_dir is None else str(pulled_dir), **kw)


# ---- the gate -----------------------------------------------------------------------------------


def pulled_dir_of(store: Store, run_id: str) -> Optional[Path]:
    """The dir of the run's newest pull.done or verify.done event, if any."""
    for ev in reversed(store.local_events(run_id)):
        if ev.kind in ("pull.done", "verify.done"):
            where = ev.data.get("dest") or ev.data.get("run_dir")
            if isinstance(where, str) and where:
                return Path(where)
    return None


def _verified_files(run_id: str, where: Path) -> Tuple[Optional[Gate], Dict[str, Dict[str, Any]], str]:
    """Rules 2-4: (a closed gate, or None and the verified files by path, and the manifest sha256)."""
    try:
        report = json.loads((where / VERIFIED_REL).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return _closed("not_verified", f"not verified: {where} has no {VERIFIED_REL} "
                       f"(run `rgt verify {where}`)", where), {}, ""
    except (OSError, ValueError) as e:
        return _closed("not_verified", f"not verified: {where / VERIFIED_REL} is unreadable: {e}",
                       where), {}, ""
    if not isinstance(report, dict) or report.get("schema") != "rgt.pull_verified" \
            or report.get("version") != 1 or report.get("run_id") != run_id:
        return _closed("not_verified", f"not verified: {where / VERIFIED_REL} is not a "
                       f"rgt.pull_verified v1 report of {run_id}", where), {}, ""
    if report.get("ok") is not True:
        first = _first_failure(report)
        said = f" ({first})" if first else ""
        return _closed("verify_failed", f"verify failed: {where / VERIFIED_REL} says ok={report.get('ok')!r}"
                       f"{said} (fix what `rgt verify {where}` reports, then run it again)", where), {}, ""
    try:
        manifest = json.loads((where / MANIFEST_REL).read_text(encoding="utf-8"))
        check_manifest(manifest)
    except (OSError, ValueError, ProtocolError) as e:
        return _closed("not_bound", f"not bound: {where / MANIFEST_REL} is not a usable manifest: {e}",
                       where), {}, ""
    if manifest["sha256"] != report.get("manifest_sha256") or manifest["run_id"] != run_id:
        return _closed("not_bound", f"not bound: {VERIFIED_REL} verified manifest "
                       f"{str(report.get('manifest_sha256'))[:12]}, but {where / MANIFEST_REL} is "
                       f"{manifest['sha256'][:12]} (run `rgt verify {where}` again)", where), {}, ""
    files = {str(f["path"]): f for f in report.get("files", []) if isinstance(f, dict)
             and isinstance(f.get("path"), str) and isinstance(f.get("sha256"), str)
             and f.get("identity", "ok") == "ok"}
    return None, files, str(manifest["sha256"])


_NOT_FAILED = ("ok", "skipped", "identity only", "not loadable")


def _first_failure(report: Dict[str, Any]) -> Optional[str]:
    """The first failure a failing report names, cut short: a suspect the box's custody recorded,
    a file's failed proof, else a failed proof's reason."""
    for item in report.get("suspect") or []:
        if isinstance(item, dict) and isinstance(item.get("path"), str):
            return f"{item['path'][:200]}: the box's custody recorded it as suspect"
    for f in report.get("files") or []:
        if not isinstance(f, dict) or not isinstance(f.get("path"), str):
            continue
        for proof in ("identity", "load", "metric"):
            value = f.get(proof)
            if isinstance(value, str) and not value.startswith(_NOT_FAILED):
                return f"{f['path'][:200]}: {proof}: {value[:200]}"
    proofs = report.get("proofs")
    for name, proof in (proofs.items() if isinstance(proofs, dict) else ()):
        if isinstance(proof, dict) and proof.get("status") == "failed" \
                and isinstance(proof.get("reason"), str):
            return f"{name}: {proof['reason'][:200]}"
    return None


def _is_view(view: Any) -> bool:
    return isinstance(view, dict) and isinstance(view.get("checkpoints"), dict) and all(
        isinstance(view.get(k), list) for k in ("unrecorded", "missing", "partials")) and all(
        isinstance(v, dict) and isinstance(v.get("sha256"), str) for v in view["checkpoints"].values())


def _removed(view: Dict[str, Any]) -> List[Dict[str, Any]]:
    items = view.get("removed")
    return [r for r in items if isinstance(r, dict) and isinstance(r.get("path"), str)] \
        if isinstance(items, list) else []


def _rotated(path: str, ck: Dict[str, Any], by_job: List[Dict[str, Any]]) -> bool:
    """Whether the recorded checkpoint `path` is one the job removed (its file, or its unit)."""
    unit = ck.get("unit") if isinstance(ck.get("unit"), str) else None
    for r in by_job:
        rp = str(r["path"]).rstrip("/")
        if rp == path and r.get("sha256") in (None, ck.get("sha256")):
            return True
        if path.startswith(rp + "/") or (unit is not None and rp == unit.rstrip("/")):
            return True
    return False


def _name(r: Dict[str, Any]) -> str:
    unit = r.get("unit")
    if isinstance(unit, str) and unit:
        return unit
    parts = str(r["path"]).split("/")
    for i, part in enumerate(parts[:-1]):
        if part.startswith(("checkpoint-", "global_step")):
            return "/".join(parts[:i + 1])
    return str(r["path"])


def rotated_names(view: Dict[str, Any]) -> List[str]:
    """The checkpoints the job rotated away, as people name them (checkpoint-20, not its files)."""
    return list(dict.fromkeys(_name(r) for r in _removed(view) if r.get("by") == "job"))


def local_copy_problem(where: Path, path: str, verified: Dict[str, Any]) -> Optional[str]:
    """Why the pulled copy of `path` is no longer what was verified; None when it still is. The
    stat pinned at hashing time saves the hash; any difference from it means hashing again."""
    full = where / path
    try:
        st = os.lstat(full)
    except OSError:
        return "it is gone"
    if not stat.S_ISREG(st.st_mode) or os.path.realpath(full) != os.path.join(os.path.realpath(where), path):
        return "it is no longer a regular file inside the pulled dir"
    if st.st_size != verified.get("size"):
        return f"its size is {st.st_size} bytes, {verified.get('size')} were verified"
    pin = verified.get("stat")
    if isinstance(pin, dict) and pin == pin_of(st):
        return None
    try:
        _, sha = hash_file(full)
    except OSError as e:
        return f"it cannot be read again ({e.strerror or e})"
    if sha != verified.get("sha256"):
        return (f"its bytes changed since they were verified (sha256 now {sha[:12]}, verified "
                f"{str(verified.get('sha256'))[:12]})")
    return None


def _coverage(view: Dict[str, Any], files: Dict[str, Dict[str, Any]], where: Path) -> List[Tuple[str, str]]:
    """Rules 6-9: (code, reason) for every checkpoint the pull does not cover."""
    found: List[Tuple[str, str]] = []
    gone = set(view["missing"])
    removed = _removed(view)
    by_job = [r for r in removed if r.get("by") == "job"]
    kept = 0
    for path, ck in sorted(view["checkpoints"].items()):
        mine = files.get(path)
        present = path not in gone
        if mine is None and not present and _rotated(path, ck, by_job):
            continue  # rotated away by the job: gone on purpose
        kept += 1
        if mine is None:
            found.append(("missing_checkpoint", f"checkpoint {path} is recorded but gone from the box, "
                          "and not in the pull") if path in gone else
                         ("new_checkpoint", f"new checkpoint {path} (not in the verified pull)"))
        elif mine["sha256"] != ck["sha256"]:
            found.append(("changed_checkpoint", f"changed checkpoint {path} (its sha256 on the box is "
                          f"{ck['sha256'][:12]}, the pull verified {mine['sha256'][:12]})"))
        else:
            problem = local_copy_problem(where, path, {"size": ck.get("size"), **mine})
            if problem is not None:
                found.append(("local_copy_changed", f"the pulled copy of {path} in {where} changed since it "
                              f"was verified: {problem} (pull and verify it again)"))
    for r in removed:
        held = files.get(str(r["path"]), {}).get("sha256")
        if r.get("by") != "job" and not (isinstance(r.get("sha256"), str) and held == r["sha256"]):
            why = r.get("reason") or "no reason given"
            found.append(("removed_checkpoint", f"checkpoint {r['path']} was removed from the box by "
                          f"something other than the job's rotation ({why}), and the pull does not hold it: "
                          "suspect"))
    for item in view["unrecorded"]:
        path = item.get("path") if isinstance(item, dict) else item
        why = item.get("reason", "outside every watched place") if isinstance(item, dict) else "no record"
        nbytes = item.get("size") if isinstance(item, dict) else None
        shown = f", {nbytes} bytes" if isinstance(nbytes, int) else ""
        found.append(("unrecorded_checkpoint", f"unrecorded checkpoint file {path} on the box "
                      f"({why}{shown}): custody never hashed it, so no pull can prove it"))
    found += [("partial_checkpoint", f"partial checkpoint file {p} on the box (a save in progress "
               "or abandoned)") for p in view["partials"]]
    if kept == 0:  # last: a file named above says more than "none recorded"
        found.append(("no_checkpoint", "no recorded checkpoint: custody recorded none for this run, so "
                      "nothing proves its checkpoints were pulled (they may sit where custody did not "
                      "watch; see the box's ckpt.location events)"))
    return found


def judge(run_id: str, where: Optional[Path], view_fn: ViewFn, job: Optional[life.Life] = None) -> Gate:
    """The gate for `run_id` given its pulled dir and a way to ask the box (view_fn raises
    TeardownError when the box does not answer), and the run's life (None: not judged here)."""
    if job is not None and not job.ended:
        return _closed("job_running", f"the job has not ended ({job.reason}): stop the job first: "
                       f"`rgt stop {shlex.quote(run_id)}`, then pull and verify what it saved last",
                       where)
    if where is None:
        return _closed("not_verified", f"not verified: no pull of {run_id} is recorded (run `rgt pull "
                       f"{run_id}` and `rgt verify DIR`, or name the dir with --from)")
    gate, files, manifest_sha = _verified_files(run_id, where)
    if gate is not None:
        return gate
    try:
        view = view_fn()
    except TeardownError as e:
        return _closed("box_unreachable", f"box unreachable: {e.message}", where,
                       manifest_sha256=manifest_sha)
    if not _is_view(view):
        return _closed("box_unreachable", "box unreachable: its answer is not a gate view", where,
                       manifest_sha256=manifest_sha)
    found = _coverage(view, files, where)
    rotated = rotated_names(view)
    count = len(view["checkpoints"])
    if found:
        return _closed(found[0][0], found[0][1], where, problems=[r for _, r in found],
                       manifest_sha256=manifest_sha, checkpoints=count, rotated_away=rotated)
    also = f"; rotated away by the job: {', '.join(rotated)}" if rotated else ""
    return Gate(True, "open", f"{VERIFIED_REL} in {where} covers all {count} checkpoint(s) on the box{also}",
                pulled_dir=str(where), manifest_sha256=manifest_sha, checkpoints=count, rotated_away=rotated)


def box_view(store: Store, host: str, run_dir: str) -> Dict[str, Any]:
    """The box's current checkpoint set (`rgt-onbox manifest RUN_DIR --gate --json`)."""
    try:
        done, view = Box.of(store, host).run_onbox(["manifest", run_dir, "--gate", "--json"], GATE_TIMEOUT_S)
    except SshError as e:
        raise TeardownError(e.message, e.hint) from e
    if done.returncode != 0 or view is None:
        err = [ln.strip() for ln in done.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
        raise TeardownError(f"{host} could not show its checkpoints (exit {done.returncode}"
                            f"{': ' + err[-1][:300] if err else ''})")
    return view


# ---- the plan -------------------------------------------------------------------------------------


@dataclasses.dataclass
class ActionPlan:
    name: str
    stops_meter: bool
    deletes: str
    still_bills: str
    reversible: bool
    verified: str
    age_months: int
    warning: Optional[str]        # the stamp is older than STALE_MONTHS
    source: str
    command: Optional[str]
    credentials_env: List[str]
    console: List[str]
    meter_stop: bool              # the profile's meter_stop_action
    allowed: bool                 # may run now (after the typed run id)
    why: str


@dataclasses.dataclass
class Plan:
    run: str
    host: str
    profile: str
    gate: Gate
    actions: List[ActionPlan]
    meter_stop: Optional[str]     # the profile's [surface] line
    danger_clocks: List[str]
    today: str

    def action(self, name: str) -> ActionPlan:
        for a in self.actions:
            if a.name == name:
                return a
        have = ", ".join(a.name for a in self.actions) or "none"
        raise TeardownError(f"profile {self.profile} has no action {name!r} (it has: {have})",
                            hint=f"see `rgt teardown {self.run} --plan`")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def deletes_nothing(action: profiles.Action) -> bool:
    return action.deletes.strip().rstrip(".").lower() in ("", "nothing", "none")


def may_run(action: profiles.Action, gate: Gate) -> Tuple[bool, str]:
    """Whether `action` may run now, and why (see the module doc)."""
    if gate.open:
        return True, "the gate is open"
    if action.reversible and deletes_nothing(action):
        return True, "reversible and deletes nothing: allowed with the gate closed"
    return False, f"refused while the gate is closed: {gate.reason}"


def age_months(verified: str, today: datetime.date) -> int:
    return profiles.months_between(verified, profiles.this_month(today))


def _action_plan(a: profiles.Action, profile: profiles.Profile, gate: Gate,
                 today: datetime.date) -> ActionPlan:
    age = age_months(a.verified, today)
    warning = (f"WARNING: these facts were verified {a.verified}, {age} months ago: check the provider's "
               "current page before an irreversible step") if age > STALE_MONTHS else None
    allowed, why = may_run(a, gate)
    return ActionPlan(name=a.name, stops_meter=a.stops_meter, deletes=a.deletes, still_bills=a.still_bills,
                      reversible=a.reversible, verified=a.verified, age_months=age, warning=warning,
                      source=a.source, command=a.command, credentials_env=list(a.credentials_env),
                      console=list(a.console), meter_stop=a.name == profile.meter_stop_action,
                      allowed=allowed, why=why)


def _run_info(store: Store, run: str) -> Tuple[str, str, str]:
    info = store.run(run)
    run_id, host, run_dir = str(info["run"]), str(info["target"] or ""), str(info["run_dir"] or "")
    if not host or not run_dir:
        raise TeardownError(f"run {run_id} was not launched through rgt: no host or run directory known")
    return run_id, host, run_dir


def profile_name(store: Store, run_id: str, host: str) -> str:
    """The run's own profile (its launch record's), else its host's; "" when neither has one."""
    launch = store.run(run_id).get("launch")
    name = launch.get("profile") if isinstance(launch, dict) else None
    if isinstance(name, str) and name:
        return name
    return Box.of(store, host).profile


def load_profile(store: Store, host: str, name: Optional[str] = None) -> profiles.Profile:
    """Profile `name` (the run's: profile_name), else the host's."""
    name = name or Box.of(store, host).profile
    if not name:
        raise TeardownError(f"host {host} has no profile, so rgt knows no teardown action for it",
                            hint=f"rgt hosts add {host} --ssh ALIAS --profile NAME --replace")
    try:
        return profiles.load(name, profiles.directory())
    except profiles.ProfileError as e:
        raise TeardownError(str(e)) from e


def plan(store: Store, run: str, *, from_dir: Optional[Path] = None, today: Optional[datetime.date] = None,
         view_fn: Optional[ViewFn] = None, record: bool = True) -> Plan:
    """Every action of the run's profile (else its host's) with its facts, and the gate as it stands
    now (closed while the job runs)."""
    run_id, host, run_dir = _run_info(store, run)
    profile = load_profile(store, host, profile_name(store, run_id, host))
    where = Path(os.path.abspath(from_dir)) if from_dir is not None else pulled_dir_of(store, run_id)
    gate = judge(run_id, where, view_fn or (lambda: box_view(store, host, run_dir)),
                 job=life.of_run(store, run_id))
    day = today or datetime.date.today()
    result = Plan(run=run_id, host=host, profile=profile.name, gate=gate,
                  actions=[_action_plan(a, profile, gate, day) for a in profile.actions.values()],
                  meter_stop=profile.surface.meter_stop, danger_clocks=list(profile.surface.danger_clocks),
                  today=day.isoformat())
    if record:
        store.add_local_event(run_id, "teardown.planned", "info", {
            "gate": "open" if gate.open else "closed", "code": gate.code, "reason": gate.reason,
            "actions": [a.name for a in result.actions]})
    return result


# ---- running an action ----------------------------------------------------------------------------


@dataclasses.dataclass
class ActionResult:
    run: str
    action: str
    mode: str                     # "command" or "console"
    ok: Optional[bool]            # None for console steps: rgt cannot see whether they were done
    exit_code: Optional[int]
    argv: List[str]
    output: str
    console: List[str]
    gate: Gate

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def build_argv(template: str, values: Mapping[str, Optional[str]]) -> List[str]:
    """The template's words (split like a shell line, never run by one) with placeholders filled;
    a value can never become more than part of one word."""
    for field in profiles.command_fields(template):
        if not values.get(field):
            hint = "pass --instance-id ID" if field == "instance_id" else None
            raise TeardownError(f"the command needs {{{field}}}, and none is known", hint=hint)
    return profiles.fill_command(template, {k: v or "" for k, v in values.items()})


def command_env(action: profiles.Action, environ: Mapping[str, str]) -> Dict[str, str]:
    """PATH, HOME and the action's credential variables: nothing else of ours reaches the command."""
    env = {k: environ[k] for k in ("PATH", "HOME") if k in environ}
    for name in action.credentials_env:
        if not environ.get(name):
            raise TeardownError(f"{name} is not set: the {action.name} command takes its credential "
                                "from it, and nothing was run", hint=f"export {name}=... and run it again")
        env[name] = environ[name]
    return env


def confirm(run_id: str, typed: Optional[str]) -> None:
    if typed is None or typed.strip() != run_id:
        raise TeardownError(f"the typed run id does not match {run_id}: nothing was run",
                            hint="type the full run id exactly (or pass --yes RUN_ID)")


def _run_command(argv: List[str], env: Dict[str, str]) -> Tuple[Optional[int], str]:
    try:
        done = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=COMMAND_TIMEOUT_S, check=False)
    except FileNotFoundError:
        return 127, f"{argv[0]}: no such program"
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        return None, out.decode("utf-8", "replace")[-_OUTPUT_TAIL:] + f"\n(ended after {COMMAND_TIMEOUT_S}s)"
    return done.returncode, (done.stdout + done.stderr).decode("utf-8", "replace")[-_OUTPUT_TAIL:]


def execute(store: Store, p: Plan, name: str, typed: Optional[str], *, instance_id: Optional[str] = None,
            environ: Optional[Mapping[str, str]] = None) -> ActionResult:
    """Run action `name` of plan `p` (or hand back its console steps) once the gate allows it and
    `typed` is the run id; recorded as teardown.ran. TeardownError before anything runs."""
    ap = p.action(name)
    if not ap.allowed:
        raise TeardownError(f"{name}: {ap.why}", hint=f"see `rgt teardown {p.run} --plan`")
    confirm(p.run, typed)
    action = load_profile(store, p.host, p.profile).actions[name]
    argv: List[str] = []
    code: Optional[int] = None
    output = ""
    if action.command is not None:
        argv = build_argv(action.command, {"instance_id": instance_id, "host": p.host, "run_id": p.run})
        env = command_env(action, os.environ if environ is None else environ)
        code, output = _run_command(argv, env)
    result = ActionResult(run=p.run, action=name, mode="command" if argv else "console",
                          ok=(code == 0) if argv else None, exit_code=code, argv=argv, output=output,
                          console=list(action.console), gate=p.gate)
    store.add_local_event(p.run, "teardown.ran", "info" if result.ok is not False else "warn", {
        "action": name, "mode": result.mode, "ok": result.ok, "exit_code": code,
        "gate": "open" if p.gate.open else "closed"})
    return result


__all__ = ["ActionPlan", "ActionResult", "Gate", "Plan", "TeardownError", "age_months", "box_view",
           "build_argv", "command_env", "confirm", "deletes_nothing", "execute", "judge", "may_run", "plan",
           "profile_name", "pulled_dir_of"]
