"""The close-out of a run: after the job exits, finish before judging, then one `run.closed`.

`job.exited` goes out at once (raw: code, signal, OOM kill; `closing: true` says a close-out
follows); the training sources were read to their end just before it (TrainingMonitor.on_job_exit).
Then, on the thread "rgt-closeout":

1. custody: look for places and units one last time, commit every unit the job wrote once it is
   quiet (the job is gone: no settle time to wait for), hash unpaced, and wait until nothing is
   settling, queued, hashing or copying. While it waits, `run.closing` every PROGRESS_S says what
   is pending (paths, bytes, bytes hashed), the bytes left and an ETA from the rate seen so far;
2. the final pull manifest (rgt/PULL_MANIFEST.json), built as a pull would ask for it;
3. the verdict again (a checkpoint judged suspect during the close-out fails the run), and one
   `run.closed`: job.exited's data with the final verdict, the manifest's sha256 and counts, the
   units still pending (named "incomplete", with why), close_s and exit_seq. At warn only when the
   close turns the verdict (a clean exit, a failed close): a failure the exit told is not told twice.

Bounded: past `budget_s` the close goes on to step 2 with what is recorded and names the rest as
incomplete ("still hashing"); custody keeps hashing them after run.closed (their ckpt.saved
follow), so nothing is lost; the marker names them until custody is done.

Exactly once per attempt: rgt/run.closed (written after run.closed is journaled) marks it done. A
sidecar restarted after the exit was reported and before that marker (a SIGKILL mid close-out)
looks in its journal for a run.closed after the job.exited (journaled, marker not yet written), and
otherwise closes again: never a lost close, never a doubled one.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from protocol import Event, ProtocolError
from protocol.codec import decode_event

from onbox.custody.monitor import CustodyMonitor
from onbox.custody.pullmanifest import MANIFEST_REL, ManifestError, build_manifest, save_manifest
from onbox.fsutil import write_json_atomic
from onbox.sidecar.journal import Journal

log = logging.getLogger(__name__)

BUDGET_S = 120.0        # the longest the close-out holds run.closed
FIRST_REPORT_S = 1.0    # no run.closing for a close-out that is done sooner
PROGRESS_S = 5.0        # then one run.closing this often
MARKER = "run.closed"   # in rgt/: {"exit_seq", "seq"} once run.closed is journaled

Emit = Callable[..., Any]
Verdict = Callable[[Dict[str, Any]], Tuple[bool, List[str]]]


def closed_marker(rgt_dir: Path) -> Optional[Dict[str, Any]]:
    try:
        doc = json.loads((rgt_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def journaled_close(journal: Journal) -> Tuple[Optional[Event], Optional[Event]]:
    """The newest attempt's job.exited in the journal and a run.closed after it, or None for each."""
    exited: Optional[Event] = None
    closed: Optional[Event] = None
    seq = 0
    while True:
        frames, more = journal.read_since(seq, 1000, 8 << 20)
        for frame in frames:
            try:
                ev = decode_event(frame)
            except ProtocolError:
                continue
            seq = max(seq, ev.seq)
            if ev.kind == "job.started":
                exited = closed = None
            elif ev.kind == "job.exited":
                exited, closed = ev, None
            elif ev.kind == "run.closed" and exited is not None:
                closed = ev
        if not more or not frames:
            return exited, closed


class Closer:
    """One close-out (see the module doc); `start` runs it on its own thread."""

    def __init__(self, run_dir: Path, host: str, custody: CustodyMonitor, emit: Emit, verdict: Verdict,
                 stop: threading.Event, on_closed: Callable[[], None], *, budget_s: float = BUDGET_S,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.run_dir = run_dir
        self.rgt_dir = run_dir / "rgt"
        self.host = host
        self.custody = custody
        self.emit = emit
        self.verdict = verdict
        self.stop = stop
        self.on_closed = on_closed
        self.budget_s = budget_s
        self._mono = monotonic
        self._thread: Optional[threading.Thread] = None
        self.state: Dict[str, Any] = {"state": "open"}

    def start(self, exit_event: Event) -> None:
        if self._thread is not None:
            return
        self.state = {"state": "closing", "exit_seq": exit_event.seq}
        self._thread = threading.Thread(target=self._run, args=(exit_event,), name="rgt-closeout",
                                        daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self, exit_event: Event) -> None:
        try:
            self.close(exit_event)
        except Exception as e:  # a thread boundary: a close that raised is told, never silent
            log.exception("the close-out failed")
            self.emit("sidecar.degraded", {"part": "closeout", "error": f"{type(e).__name__}: {e}"[:500]})

    def close(self, exit_event: Event) -> None:
        t0 = self._mono()
        self.custody.begin_close()
        pending = self._wait_custody(t0)
        if pending is None:
            return  # the sidecar is stopping: a restarted one closes again
        data = dict(exit_event.data)
        data.pop("closing", None)
        data.update(self._manifest())
        ok, reasons = self.verdict(data)
        if data.get("manifest") is None:
            why = data["manifest_error"]
            ok, reasons = False, [*reasons, f"the final pull manifest could not be built: {why}"]
        incomplete = [{"path": p["path"], "reason": f"still {p['state']} at close ({p['bytes']} bytes, "
                       f"{p['hashed_bytes']} hashed): custody goes on; a pull waits for it"}
                      for p in pending]
        data.update(final_ok=ok, final_reasons=reasons, incomplete=incomplete,
                    close_s=round(self._mono() - t0, 3), exit_seq=exit_event.seq)
        # Material only when the close turns the verdict: a failure the exit already told woke then.
        turned = not ok and exit_event.data.get("final_ok") is not False
        ev = self.emit("run.closed", data, "warn" if turned else "info")
        seq = getattr(ev, "seq", None)
        marker = {"exit_seq": exit_event.seq, "seq": seq, "incomplete": incomplete}
        write_json_atomic(self.rgt_dir / MARKER, marker)
        self.state = {"state": "closed", "exit_seq": exit_event.seq, "seq": seq,
                      "incomplete": len(incomplete)}
        self.on_closed()
        if incomplete:
            self._finish_late(marker, t0)

    def _finish_late(self, marker: Dict[str, Any], t0: float) -> None:
        """After a close past its budget: once custody has hashed the rest (their ckpt.saved tell),
        the marker says the manifest a pull now asks for is final."""
        while not self.stop.is_set():
            if self.custody.wait_idle(PROGRESS_S):
                write_json_atomic(self.rgt_dir / MARKER, {**marker, "incomplete": [],
                                                         "late_s": round(self._mono() - t0, 3)})
                self.state = {**self.state, "incomplete": 0}
                return

    def _wait_custody(self, t0: float) -> Optional[List[Dict[str, Any]]]:
        """[] once custody is idle, what is left once the budget is spent, None when stopping."""
        wait = FIRST_REPORT_S
        last: Optional[Tuple[float, int]] = None
        while True:
            elapsed = self._mono() - t0
            if self.custody.wait_idle(max(0.0, min(wait, self.budget_s - elapsed))):
                return []
            if self.stop.is_set():
                return None
            pending = self.custody.open_units()
            elapsed = self._mono() - t0
            if elapsed >= self.budget_s:
                return pending
            left = sum(max(0, p["bytes"] - p["hashed_bytes"]) for p in pending)
            now = self._mono()
            eta = None
            if last is not None and last[1] > left and now > last[0]:
                eta = round(left / ((last[1] - left) / (now - last[0])), 1)
            last = (now, left)
            report = {"phase": "custody", "pending": pending[:20], "pending_units": len(pending),
                      "pending_bytes": left, "eta_s": eta, "elapsed_s": round(elapsed, 1)}
            write_json_atomic(self.rgt_dir / "closing.json", report)   # what a reader of the box sees
            self.emit("run.closing", report)
            self.state = {**self.state, "pending_bytes": left, "pending_units": len(pending)}
            wait = PROGRESS_S

    def _manifest(self) -> Dict[str, Any]:
        try:
            doc = build_manifest(self.run_dir, host=self.host, judge_missing=self.custody.judge_missing)
            save_manifest(self.run_dir, doc)
        except (ManifestError, OSError) as e:
            return {"manifest": None, "manifest_error": str(e)[:500]}
        files = doc.get("files") or []
        units = {f.get("unit") for f in files if f.get("kind") == "checkpoint"}
        return {"manifest": {"sha256": doc["sha256"], "files": len(files), "checkpoints": len(units),
                             "total_bytes": doc.get("total_bytes"), "path": MANIFEST_REL}}


__all__ = ["BUDGET_S", "MARKER", "Closer", "closed_marker", "journaled_close"]
