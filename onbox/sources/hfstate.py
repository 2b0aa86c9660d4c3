"""Read Hugging Face ``trainer_state.json`` files (one in each ``checkpoint-N/``) into `Record`s.

Each checkpoint's file holds the whole ``log_history`` so far (``{"loss", "grad_norm",
"learning_rate", "epoch", "step"}`` entries, eval entries with ``eval_*``), ``global_step``,
``epoch`` and ``max_steps``. The files of one run overlap, so `HfStateSource` keeps one high-water
step for all of them: a file read gives the entries after that step, then a record with
``global_step`` (and ``max_steps`` as its total). A file whose ``global_step`` is under the
high-water step was written by a job that started again from a lower step (a restart, or a
relaunch that ignored its checkpoint): its whole history is new and is given in order, so the
restart detector sees the step fall.

A file is read again only when its (inode, mtime, size) changed; one that does not parse (being
written) is tried again at the next poll and counted bad only when it stays unreadable while
unchanged. Files are read in ``global_step`` order (from the ``checkpoint-N`` name), at most
`MAX_FILE` bytes each. JSON's NaN/Infinity (the Trainer writes them) become non-finite floats.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from onbox.sources.metrics import Record, SourceRead, record_from_mapping, to_epoch, to_step

MAX_FILE = 32 << 20
_CKPT_NUMBER = re.compile(r"checkpoint-(\d+)$")

Sig = Tuple[int, int, int]


def _order(path: Path) -> Tuple[int, str]:
    match = _CKPT_NUMBER.search(path.parent.name)
    return (int(match.group(1)) if match else -1, str(path))


class HfStateSource:
    """Every trainer_state.json of a run, as one source; see the module doc."""

    name = "hfstate"

    def __init__(self) -> None:
        self.high: Optional[int] = None
        self.seen: Dict[str, Sig] = {}
        self.failed: Dict[str, Sig] = {}
        self.bad = 0
        self.bad_path: Optional[str] = None

    def state(self) -> Dict[str, Any]:
        return {"high": self.high, "seen": {p: list(s) for p, s in self.seen.items()}}

    def restore(self, saved: Mapping[str, Any]) -> None:
        high = saved.get("high")
        self.high = high if isinstance(high, int) and not isinstance(high, bool) else None
        seen = saved.get("seen")
        if isinstance(seen, dict):
            for path, sig in seen.items():
                if isinstance(sig, list) and len(sig) == 3 and all(isinstance(v, int) for v in sig):
                    self.seen[str(path)] = (sig[0], sig[1], sig[2])

    @staticmethod
    def signature(path: Path) -> Optional[Sig]:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def changed(self, paths: Iterable[Path]) -> List[Path]:
        """The files new or changed since they were last read, in global_step order."""
        present = {str(p) for p in paths}
        for gone in [p for p in self.seen if p not in present]:
            del self.seen[gone]
        out = []
        for path in sorted(paths, key=_order):
            sig = self.signature(path)
            if sig is not None and self.seen.get(str(path)) != sig:
                out.append(path)
        return out

    def mark_seen(self, paths: Iterable[Path]) -> None:
        """Count these files as read without reading them (old files found at start)."""
        for path in paths:
            sig = self.signature(path)
            if sig is not None:
                self.seen[str(path)] = sig
                step = _order(path)[0]
                if step >= 0:
                    self.high = max(self.high or 0, step)

    def read(self, paths: Iterable[Path]) -> SourceRead:
        out = SourceRead()
        for path in self.changed(paths):
            sig = self.signature(path)
            doc = self._load(path)
            if sig is None:
                continue
            if doc is None:
                if self.failed.get(str(path)) == sig:
                    self.bad, self.bad_path = self.bad + 1, str(path)
                    out.bad += 1
                    self.seen[str(path)] = sig
                self.failed[str(path)] = sig
                continue
            self.failed.pop(str(path), None)
            self.seen[str(path)] = sig
            out.new_bytes += sig[2]
            out.mtime = max(out.mtime or 0.0, sig[1] / 1e9)
            out.records += self._records(doc)
        return out

    @staticmethod
    def _load(path: Path) -> Optional[Dict[str, Any]]:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_FILE + 1)
            if len(raw) > MAX_FILE:
                return None
            doc = json.loads(raw)
        except (OSError, ValueError, RecursionError):
            return None
        return doc if isinstance(doc, dict) else None

    def _records(self, doc: Mapping[str, Any]) -> List[Record]:
        history = doc.get("log_history")
        entries = [e for e in history if isinstance(e, dict)] if isinstance(history, list) else []
        global_step = to_step(doc.get("global_step"))
        if global_step is None:
            steps = [s for s in (to_step(e.get("step")) for e in entries) if s is not None]
            global_step = max(steps) if steps else None
        if global_step is None:
            return []
        after = -1 if self.high is None or global_step < self.high else self.high
        out: List[Record] = []
        for entry in entries:
            record = record_from_mapping(entry, self.name)
            if record is not None and record.step is not None and after < record.step <= global_step:
                out.append(record)
        total = to_step(doc.get("max_steps")) or None
        out.append(Record(self.name, global_step, to_epoch(doc.get("epoch")), {}, total=total))
        self.high = global_step
        return out


__all__ = ["HfStateSource"]
