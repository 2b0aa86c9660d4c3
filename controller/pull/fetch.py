"""`rgt pull RUN`: bring a run's files home, resumably, and never call half a pull complete.

    result = pull(store, run, dest=None, bwlimit=None, on_progress=None)

1. ask    the box for a fresh manifest (`rgt-onbox manifest RUN_DIR --json`) and read it back:
          the exact list of files, each with its size and SHA-256 (protocol.pull);
2. stage  into <dest>.partial/ next to the final dir, never under the final name. What staging holds
          already stays only where it can help: a file of the listed size must hash to the listed
          SHA-256, a shorter one is a prefix that rsync appends to; anything else is removed from
          staging (ours: it carries the marker file). Files of an earlier pull in <dest> that hash
          to the listed SHA-256 are hard-linked in, so a rerun sends nothing twice;
3. fetch  the manifest and every listed file with ONE rsync over the host's ssh master (when one runs):
          `--files-from` the exact list (`--from0`), `--copy-links`, `--partial --append-verify`.
          Appending writes in place, so every byte received survives even a SIGKILL, and rsync
          checks each appended file as a whole (a file whose start differs is sent again);
4. check  every size against the manifest, and the manifest against the bytes read in step 1;
5. swap   staging into place (os.replace): <dest> is exactly this pull, never a mix of two. An
          earlier pull there is removed once each of its files is hard-linked into the new one
          (its PULL_MANIFEST/PULL_VERIFIED are superseded), else kept as <dest>.prev-<time>.

Measured with rsync 3.5 (hence no --link-dest and no --partial-dir): with --append-verify, rsync skips
a file whose --link-dest copy has the listed size but other content, and leaves it out of staging
altogether; and a --partial-dir temp file is lost when rsync is SIGKILLed.

No rsync on the box is an error with a hint, never a fallback to scp (which cannot resume).
Sizes are proved here; `rgt verify` proves content (SHA-256, safe load) and writes PULL_VERIFIED.json.

The box chooses nothing on the laptop: the run id is checked by the run-id grammar before it names
./runs/<run-id>, the manifest must be the run's own (its run id, read from the run's own directory),
and every path built from it stays under staging (controller.trust.contained; pullstage.inside).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from protocol import ProtocolError
from protocol.pull import check_manifest

from controller import pidlock
from controller import trust as boxtrust
from controller.box.handle import Box
from controller.box.ssh import LocalShell, Ssh, SshError, classify
from controller.output import error_tail, last_json_object
from controller.pull.stage import (
    MANIFEST_REL,
    STAGING_SUFFIX,
    Entry,
    PullError,
    check_entries,
    check_staging,
    earlier_pull,
    prepare,
    staging_dir,
    swap_in,
)
from controller.render import printable
from controller.store.db import Store

RSYNC_IO_TIMEOUT_S = 120
MANIFEST_TIMEOUT_S = 3600  # the box may hash checkpoints custody has not hashed yet
CLOSE_WAIT_S = 300.0       # how long a pull waits for a box that is still closing the run
_CLOSE_STEP_S = 5.0        # one box-side wait (rgt-onbox manifest --wait-closed): progress this often
CLOSING_EXIT = 75          # rgt-onbox manifest: the run is still closing, nothing written
CLOSE_STATES = ("closed", "incomplete", "closing", "running", "unclosed")
_BWLIMIT = re.compile(r"^[0-9]+(\.[0-9]+)?[KkMmGg]?$")
_PROGRESS = re.compile(rb"^\s*([\d,]+)\s+\d+%\s")
_STATS = {b"Literal data:": "literal_bytes", b"Matched data:": "matched_bytes",
          b"Total bytes received:": "received_bytes",
          b"Number of regular files transferred:": "files_transferred"}
_PROGRESS_EVERY_S = 0.5
_ATTEMPTS = 3
log = logging.getLogger(__name__)
Shell = Union[Ssh, LocalShell]


@dataclasses.dataclass(frozen=True)
class Progress:
    pulled_bytes: int
    total_bytes: int
    rate_bps: float
    eta_s: Optional[float]

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PullResult:
    run: str
    dest: str
    files: int                 # files the manifest lists (the manifest itself not counted)
    bytes: int                 # their total size
    manifest_sha256: str
    resumed_bytes: int         # bytes that were in staging (or linked from an earlier pull) before rsync
    rsync: Dict[str, int]      # rsync's own --stats: literal/matched/received bytes, files transferred
    elapsed_s: float
    previous: Optional[str] = None  # an earlier pull kept aside because it held files this one does not
    rotated_away: List[str] = dataclasses.field(default_factory=list)  # the manifest's removed, by "job"
    removed_other: List[str] = dataclasses.field(default_factory=list)  # removed by anything else
    # the box's close state when the manifest was made (close_of): final only once the run is closed
    close: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def final(self) -> bool:
        return bool(self.close.get("final"))

    def to_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["transferred_bytes"] = self.rsync.get("literal_bytes", 0)
        out["final"] = self.final
        return out


# ---- the box ----------------------------------------------------------------------------------


def need_rsync(shell: Shell, host: str, run: str) -> None:
    """rsync here (3.1+, for --info=progress2) and on the box, or PullError with the fix."""
    local = shutil.which(getattr(shell, "rsync_bin", "rsync"))
    if local is None:
        raise PullError("rsync is not installed on this machine",
                        hint="install it (apt-get install rsync, dnf install rsync, brew install rsync)")
    version = subprocess.run([local, "--version"], capture_output=True, timeout=30, check=False).stdout
    found = re.search(rb"version\s+v?(\d+)\.(\d+)", version)
    if found is None or (int(found.group(1)), int(found.group(2))) < (3, 1):
        raise PullError(f"{local} is too old for a resumable pull (rgt needs rsync 3.1 or newer)",
                        hint="install a current rsync (macOS: brew install rsync) and put it first on PATH")
    if isinstance(shell, LocalShell):
        return
    done = shell.run("command -v rsync", check=False, timeout_s=60)
    if done.returncode != 0:
        raise PullError(
            f"rsync is not installed on {host}: `command -v rsync` found nothing there",
            hint=f"install it on {host} (Debian/Ubuntu images: `apt-get install -y rsync`), then run "
                 f"`rgt pull {run}` again; rgt does not fall back to scp, which cannot resume a pull")


def box_manifest(shell: Shell, onbox: str, run_dir: str, run: str,
                 on_closing: Optional[Callable[[Dict[str, Any]], None]] = None,
                 close_wait_s: float = CLOSE_WAIT_S) -> Tuple[Dict[str, Any], bytes, str, Dict[str, Any]]:
    """(manifest doc, its exact bytes, the run dir as the box resolved it, the run's close state),
    freshly written there. While the box is still closing the run (its job exited; the last
    checkpoints are being committed), wait up to close_wait_s, telling on_closing what is pending
    every few seconds; still closing then: PullError naming what is pending."""
    deadline = time.monotonic() + close_wait_s
    while True:
        step = max(0.1, min(_CLOSE_STEP_S, deadline - time.monotonic()))   # 0 would not wait at all
        done = shell.run(f"{onbox} manifest {shlex.quote(run_dir)} --json --wait-closed {step:.1f}",
                         check=False, timeout_s=MANIFEST_TIMEOUT_S)
        answer = last_json_object(done.stdout)
        if done.returncode != CLOSING_EXIT or answer is None:
            break
        close = close_of(answer)
        if time.monotonic() >= deadline:
            raise PullError(f"{run} is still closing after {close_wait_s:.0f} s: {pending_text(close)}",
                            hint="the box is committing the run's last checkpoints; nothing was copied. "
                                 "Run `rgt pull` again later (`rgt status` shows the close-out)")
        if on_closing is not None:
            on_closing(close)
    if done.returncode != 0 or answer is None or not isinstance(answer.get("sha256"), str):
        raise PullError(f"the box could not list {run} for a pull (rgt-onbox manifest, exit "
                        f"{done.returncode}): {error_tail(done.stderr)}", hint="nothing was copied")
    where = _manifest_dir(answer.get("run_dir"), run_dir, run)
    raw = shell.run(f"cat -- {shlex.quote(where + '/' + MANIFEST_REL)}", timeout_s=300).stdout
    try:
        doc = json.loads(raw)
        check_manifest(doc)
    except (ValueError, ProtocolError) as e:
        raise PullError(f"refused the box's {MANIFEST_REL} for {run}: {e}", hint="nothing was copied") from e
    if doc["sha256"] != answer["sha256"]:
        raise PullError(f"{MANIFEST_REL} of {run} changed while it was read",
                        hint="another `rgt pull` of this run may be running; try again when it is done")
    return doc, raw, where, close_of(answer)


def close_of(answer: Dict[str, Any]) -> Dict[str, Any]:
    """The box's close state of a run (onbox.runs.close_state), checked: a known state, counts as
    numbers, at most 20 paths of at most 300 printable characters. An answer without one (an
    older box) is "unknown", never final."""
    raw = answer.get("close")
    raw = raw if isinstance(raw, dict) else {}
    state = raw.get("state") if raw.get("state") in CLOSE_STATES else "unknown"

    def paths(key: str) -> List[str]:
        items = raw.get(key)
        listed = items if isinstance(items, list) else []
        out = [i.get("path") if isinstance(i, dict) else i for i in listed]
        return [printable(p)[:300] for p in out if isinstance(p, str)][:20]

    def number(key: str) -> Optional[float]:
        value = raw.get(key)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e18
        return value if ok else None

    return {"state": state, "final": state == "closed" and raw.get("final") is True,
            "pending": paths("pending"), "incomplete": paths("incomplete"),
            "pending_bytes": number("pending_bytes"), "eta_s": number("eta_s")}


def pending_text(close: Dict[str, Any]) -> str:
    """One line: what the box is still committing."""
    names = close["pending"] or close["incomplete"]
    left = close["pending_bytes"]
    eta = close["eta_s"]
    text = f"{len(names)} checkpoint unit(s) pending" + (f" ({', '.join(names[:3])})" if names else "")
    if left is not None:
        text += f", {left / 1e6:.1f} MB left"
    if eta is not None:
        text += f", eta {eta:.0f} s"
    return text


def _manifest_dir(answered: Any, run_dir: str, run: str) -> str:
    """Where the box says it wrote the manifest: the run's own directory (as the box resolved it:
    an absolute path named after the run), or PullError; absent, the stored run dir."""
    if answered is None or answered == "":
        return run_dir
    try:
        where = boxtrust.box_path(answered, "manifest directory")
    except boxtrust.Untrusted as e:
        raise PullError(f"refused the box's manifest answer for {run}: {e}",
                        hint="nothing was copied") from None
    named = {run, run_dir.rstrip("/").rsplit("/", 1)[-1]}
    if where.rstrip("/").rsplit("/", 1)[-1] not in named:
        raise PullError(f"refused the box's manifest answer for {run}: it was written in {where[:200]!r}, "
                        f"not in the run's own directory {run_dir[:200]!r}", hint="nothing was copied")
    return where


# ---- rsync ------------------------------------------------------------------------------------


class _Meter:
    """rsync's --info=progress2 lines as Progress, at most every _PROGRESS_EVERY_S."""

    def __init__(self, total: int, resumed: int, complete: int, on_progress: Callable[[Progress], None],
                 clock: Callable[[], float]) -> None:
        self.total, self.resumed, self.complete = total, resumed, complete
        self.on_progress, self.clock = on_progress, clock
        self.began = self.last = clock()
        self.pulled = resumed

    def line(self, raw: bytes) -> None:
        found = _PROGRESS.match(raw)
        if found is None:
            return
        # progress2 counts the files rsync works on (with any prefix they had), not skipped ones
        done = int(found.group(1).replace(b",", b""))
        self.pulled = max(self.resumed, min(self.total, self.complete + done))
        if self.clock() - self.last >= _PROGRESS_EVERY_S:
            self.emit()

    def emit(self, final: bool = False) -> None:
        now = self.last = self.clock()
        spent = now - self.began  # a rate over less than a second says little, until the end
        rate = (self.pulled - self.resumed) / spent if spent >= 1.0 or (final and spent > 0) else 0.0
        eta = (self.total - self.pulled) / rate if rate > 0 else None
        self.on_progress(Progress(self.pulled, self.total, round(rate, 1),
                                  None if eta is None else round(eta, 1)))


def rsync_argv(shell: Shell, run_dir: str, staging: Path, list_file: Path,
               bwlimit: Optional[str]) -> List[str]:
    argv = [getattr(shell, "rsync_bin", "rsync"), f"--files-from={list_file}", "--from0", "--copy-links",
            "--times", "--partial", "--append-verify", "--protect-args", "--no-inc-recursive",
            "--info=progress2", "--stats", f"--timeout={RSYNC_IO_TIMEOUT_S}"]
    if bwlimit:
        argv.append(f"--bwlimit={bwlimit}")
    source = run_dir.rstrip("/") + "/"
    if isinstance(shell, Ssh):
        argv += ["-e", shell.rsync_shell()]
        source = f"{shell.alias}:{source}"
    return [*argv, "--", source, f"{staging}/"]


def _read_lines(fd: int, on_line: Callable[[bytes], None]) -> None:
    """Every \\r- or \\n-ended piece of what the pipe carries, until EOF."""
    buf = b""
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        parts = re.split(rb"[\r\n]", buf + chunk)
        buf = parts.pop()
        for part in parts:
            on_line(part)
    if buf:
        on_line(buf)


def run_rsync(argv: List[str], meter: _Meter) -> Tuple[int, Dict[str, int], bytes]:
    """(exit code, --stats numbers, stderr). rsync stays in our process group, so Ctrl-C (and a
    kill of the group) reaches it; on any exception here it is ended and waited for."""
    stats: Dict[str, int] = {}

    def on_line(raw: bytes) -> None:
        for prefix, name in _STATS.items():
            if raw.startswith(prefix):
                stats[name] = int(raw[len(prefix):].split()[0].replace(b",", b""))
                return
        meter.line(raw)

    with tempfile.TemporaryFile() as err:
        # rsync ends with us: a SIGKILLed `rgt pull` leaves no transfer running (what it received stays).
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                preexec_fn=pidlock.dies_with_us())
        try:
            assert proc.stdout is not None
            _read_lines(proc.stdout.fileno(), on_line)
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # rsync keeps what it has (it writes in place)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        err.seek(0)
        return code, stats, err.read()


def _rsync_failed(shell: Shell, code: int, stderr: bytes, staging: Path, run: str) -> PullError:
    again = f"the bytes received so far stay in {staging}; run `rgt pull {run}` again to go on from there"
    if isinstance(shell, Ssh):
        link = classify(shell.alias, stderr, code)
        if link is not None:
            return PullError(f"rsync lost the box: {link.message}",
                             hint=f"{link.hint}; {again}" if link.hint else again)
    what = "was interrupted" if code == 20 else f"failed (exit {code})"
    return PullError(f"rsync {what}: {error_tail(stderr)}", hint=again)


def _entries(doc: Dict[str, Any], manifest_raw: bytes) -> Dict[str, Entry]:
    entries = {str(f["path"]): Entry(str(f["path"]), int(f["size"]), str(f["sha256"])) for f in doc["files"]}
    entries[MANIFEST_REL] = Entry(MANIFEST_REL, len(manifest_raw), hashlib.sha256(manifest_raw).hexdigest())
    return entries


def _fetch(shell: Shell, where: str, staging: Path, entries: Dict[str, Entry], earlier: Optional[Path],
           bwlimit: Optional[str], on_progress: Callable[[Progress], None], clock: Callable[[], float]
           ) -> Tuple[int, Dict[str, int], int, bytes]:
    """Steps 2 and 3: (resumed bytes, rsync stats, rsync exit code, its stderr)."""
    resumed = prepare(staging, entries, earlier)
    complete = sum(e.size for rel, e in entries.items()
                   if os.path.lexists(staging / rel) and os.lstat(staging / rel).st_size == e.size)
    meter = _Meter(sum(e.size for e in entries.values()), resumed, complete, on_progress, clock)
    with tempfile.NamedTemporaryFile(prefix="rgt-pull-", suffix=".list") as listing:
        listing.write(b"".join(rel.encode("utf-8") + b"\0" for rel in sorted(entries)))
        listing.flush()
        code, stats, stderr = run_rsync(rsync_argv(shell, where, staging, Path(listing.name), bwlimit), meter)
    if code == 0:
        meter.pulled = meter.total
    meter.emit(final=True)
    return resumed, stats, code, stderr


def _pull_once(box: Box, run_id: str, run_dir: str, target: Path, bwlimit: Optional[str],
               on_progress: Callable[[Progress], None], clock: Callable[[], float],
               on_closing: Optional[Callable[[Dict[str, Any]], None]] = None,
               close_wait_s: float = CLOSE_WAIT_S,
               ) -> Tuple[Dict[str, Any], int, Dict[str, int], Optional[Path], Dict[str, Any]]:
    """One attempt: (manifest doc, resumed bytes, rsync stats, where an earlier pull was kept, the
    run's close state)."""
    shell, host = box.shell, box.name
    need_rsync(shell, host, run_id)
    doc, raw, where, close = box_manifest(shell, box.onbox, run_dir, run_id, on_closing, close_wait_s)
    if doc["run_id"] != run_id:
        raise PullError(f"refused the box's manifest: it says {run_dir} holds run {doc['run_id'][:80]!r}, "
                        f"not {run_id}", hint="nothing was copied")
    earlier = earlier_pull(target, run_id)
    entries = _entries(doc, raw)
    staging = target.with_name(target.name + STAGING_SUFFIX)
    check_entries(staging, entries)  # before staging is made: a refused manifest writes nothing
    with staging_dir(staging, run_id):
        resumed, stats, code, stderr = _fetch(shell, where, staging, entries, earlier, bwlimit, on_progress,
                                              clock)
        if code != 0:
            raise _rsync_failed(shell, code, stderr, staging, run_id)
        check_staging(staging, entries, raw)
        return doc, resumed, stats, swap_in(staging, target, clock), close


def pull(store: Store, run: str, dest: Optional[Path] = None, *, bwlimit: Optional[str] = None,
         on_progress: Optional[Callable[[Progress], None]] = None, shell: Optional[Shell] = None,
         clock: Callable[[], float] = time.time,
         on_closing: Optional[Callable[[Dict[str, Any]], None]] = None,
         close_wait_s: float = CLOSE_WAIT_S) -> PullResult:
    """Pull RUN into `dest` (default ./runs/<run-id>) as the module doc says. Raises PullError
    (and StoreError for an unknown run); an interrupted pull leaves staging for the rerun.

    The pull rides the host's ssh master when one runs and starts none itself (a master started
    here would outlive a killed pull, and stopping it would cut the watchers' forwards). A run's
    watcher stops that master when the run is over, even under a pull: when the master we rode is
    gone after a failure, the pull goes on without it, resuming (at most _ATTEMPTS tries).
    """
    began = time.monotonic()
    if bwlimit is not None and not _BWLIMIT.match(bwlimit):
        raise PullError(f"--bwlimit {bwlimit!r} is not a rate like 500k, 20m or 1.5g (bytes per second)")
    info = store.run(run)
    run_id, host, run_dir = str(info["run"]), str(info["target"] or ""), str(info["run_dir"] or "")
    if not host or not run_dir:
        raise PullError(f"run {run_id} was not launched through rgt: no host or run directory known")
    target = destination(run_id, run_dir, dest)
    box = Box.of(store, host, shell)
    shell = box.shell
    for attempt in range(1, _ATTEMPTS + 1):
        riding = isinstance(shell, Ssh) and shell.master_pid() is not None
        try:
            doc, resumed, stats, previous, close = _pull_once(box, run_id, run_dir, target, bwlimit,
                                                              on_progress or (lambda p: None), clock,
                                                              on_closing, close_wait_s)
            break
        except (PullError, SshError) as e:
            if attempt < _ATTEMPTS and riding and isinstance(shell, Ssh) and shell.master_pid() is None:
                log.info("the ssh master of %s went away during the pull (%s); going on without it", host, e)
                continue
            if isinstance(e, SshError):
                raise PullError(e.message, e.hint) from e
            raise
    result = PullResult(run=run_id, dest=str(target), files=len(doc["files"]), bytes=int(doc["total_bytes"]),
                        manifest_sha256=str(doc["sha256"]), resumed_bytes=resumed, rsync=stats,
                        elapsed_s=round(time.monotonic() - began, 3),
                        previous=None if previous is None else str(previous), close=close)
    result.rotated_away, result.removed_other = removed_of(doc)
    store.add_local_event(run_id, "pull.done", "info", {
        "dest": result.dest, "manifest_sha256": result.manifest_sha256, "files": result.files,
        "bytes": result.bytes, "host": host, "transferred_bytes": stats.get("literal_bytes", 0),
        "rotated_away": result.rotated_away, "removed_other": result.removed_other,
        "final": result.final, "close_state": close["state"]})
    return result


def destination(run_id: str, run_dir: str, dest: Optional[Path]) -> Path:
    """Where the pull goes: DEST as given, else ./runs/<run-id>, the run id checked first (a box
    chose it once: an id like ../../x or /abs must not name a laptop path); PullError otherwise."""
    try:
        boxtrust.run_id(run_id)
        boxtrust.box_path(run_dir)
        if dest is not None:
            return Path(os.path.abspath(dest))
        return boxtrust.contained(Path(os.path.abspath("runs")), run_id)
    except boxtrust.Untrusted as e:
        raise PullError(f"refused to pull {run_id[:80]!r}: {e}",
                        hint="its id or directory came from a box before rgt checked them; "
                             "nothing was copied") from None


def removed_of(doc: Dict[str, Any]) -> Tuple[List[str], List[str]]:
    """(what the job rotated away, what something else removed) from a manifest's optional
    "removed" list, named as people name checkpoints (checkpoint-20, not each of its files)."""
    items = doc.get("removed")
    rotated: List[str] = []
    other: List[str] = []
    for r in items if isinstance(items, list) else []:
        if not isinstance(r, dict) or not isinstance(r.get("path"), str):
            continue
        unit = r.get("unit") if isinstance(r.get("unit"), str) else None
        parts = str(r["path"]).split("/")
        saves = ("checkpoint-", "global_step")
        cut = next((i for i, p in enumerate(parts[:-1]) if p.startswith(saves)), None)
        name = unit or ("/".join(parts[:cut + 1]) if cut is not None else str(r["path"]))
        (rotated if r.get("by") == "job" else other).append(name[:300])
    return list(dict.fromkeys(rotated)), list(dict.fromkeys(other))


__all__ = ["Progress", "PullError", "PullResult", "box_manifest", "destination", "need_rsync", "pull",
           "removed_of", "rsync_argv", "run_rsync"]
