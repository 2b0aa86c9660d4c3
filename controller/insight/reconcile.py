"""`rgt reconcile`: do the numbers a write-up claims match the run's evidence?

    report = reconcile(Path("README.md"), [Path("runs/r1")], tolerance=0.0)
    report.drifted, report.unbacked, report.matched, report.missing

controller.insight.claims_doc finds the claims (line, column, metric, the number as shown; the readers
of numbers and prose are in controller.insight.claims_text); this module loads the evidence and
compares. It reports and never edits. Unlike the script it replaces (a hand-written EVIDENCE.json
of claims, relative tolerance), the evidence is the run's own files and the tolerance is the
precision each number is shown with.

Evidence (each value keeps its file and its key, line or step)
- metrics.jsonl (any *.jsonl): one JSON object per line. For every key that names a metric
  (below), its FINAL value (the last line that has it) is evidence. A claim that names a step or
  epoch (`accuracy at step 5000`, a `Step` column) is compared with the value logged at that step
  instead; a claim that says `best` is also compared with the best value (max, or min for
  lower-is-better metrics). No other step counts: a run passes through every value on its way.
- an eval JSON (any other *.json): nested objects flatten to dotted keys (`eval.top1`); a list of
  {"metric"|"name"|"key": ..., "value"|"score": ...} objects gives one key per entry; other lists
  of objects flatten by index, and lists of bare numbers (per-class values) are skipped.
- PULL_VERIFIED.json (`rgt verify`'s report, by name or by its "schema"): the metric it recomputed
  from the pulled checkpoint (proofs.metric.evaluated[].recomputed, under proofs.metric.metric).
- a directory: its metrics.jsonl, its top-level *.json files except run.json and configs
  (names with config, args, hparams, tokenizer, vocab, trainer_state), and rgt/PULL_VERIFIED.json.
  A file in a directory that does not parse is skipped with a note; one named on its own fails.

Which evidence a claim is compared with
- A key names a metric when one of its tokens (split at `.`, `/`, `_`, `-`, camelCase) is one of
  the metric's key tokens, optionally followed by digits (`map50`). Keys with a counting token
  (step, epoch, num, count, time, lr, std, ...) are not metrics (`grad_acc_steps` is not accuracy).
- The key's other tokens are qualifiers (`val`, `test`, `set5`). When a claim's context names
  qualifiers that evidence keys carry (of any metric), it is compared with the values whose keys
  share the most of them, or, when none shares one, with the values whose keys carry no qualifier:
  `val accuracy 91.3` is compared with val_acc, not test_acc; `Set5 SSIM` not with ssim_set14
  (unbacked, if that is all there is); `val loss` with a plain `loss`. A context naming no
  qualifier is compared with every value of its metric.
- The claim matches when one kept value lies within its shown precision: |value - shown| <=
  half a unit of the last shown digit + --tolerance (absolute, in the document's units). So
  91.3 matches 91.27 and 91.34, not 91.36. Only when no value fits as is, and the metric is a
  ratio (accuracy, F1, mAP, ...) or the claim shows `%`, a value x100 (0.913 for 91.3%) or /100
  is tried; a match found so says `x100` or `/100`.

Outcome
- matched: a value fits. drifted: values were compared and none fits (the closest is reported).
  unbacked: nothing to compare with (no value for the metric, none its qualifiers allow, or none
  at the step it names). missing: an evidence value no claim was compared with (a list only).
- Drift fails (exit 1). Unbacked claims, and a document with no claims, are warnings unless
  --strict. Evidence without a single metric value is an error: nothing could be checked.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Sequence, Set, Tuple

from controller.insight.claims_doc import read_claims
from controller.insight.claims_text import METRIC_BY_NAME, METRICS, Claim, Metric, words
from controller.jsonl import objects

VERIFIED_NAME = "PULL_VERIFIED.json"
VERIFIED_SCHEMA = "rgt.pull_verified"
_NOT_A_METRIC = frozenset({
    "step", "steps", "epoch", "epochs", "iter", "iters", "iteration", "iterations", "num", "count", "n",
    "time", "runtime", "per", "second", "seconds", "sec", "lr", "samples", "tokens", "std", "stderr",
    "var", "grad", "delta", "diff", "threshold", "thresh", "weight", "patience", "warmup"})
_GENERIC = frozenset({"metrics", "metric", "final", "value", "score", "result", "results", "mean", "avg",
                      "b"})
_SKIP_JSON = re.compile(r"config|args|hparams|tokenizer|vocab|trainer_state", re.I)
_EPS = 1e-9


class ReconcileError(Exception):
    """The evidence or the document cannot be read (a person can fix it)."""

    def __init__(self, message: str, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.hint = hint


# ---- evidence ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Value:
    """One evidence number, with where it came from."""

    metric: str  # METRICS name
    key: str  # as written in its file (dotted for nested JSON)
    value: float
    source: str  # the file, as given
    where: str  # "final, line 40, step 900" | "recomputed, step 900" | "" (a JSON key)
    qualifiers: FrozenSet[str] = frozenset()

    @property
    def ident(self) -> Tuple[str, str]:
        return self.source, self.key

    def to_dict(self) -> Dict[str, Any]:
        return {"metric": self.metric, "key": self.key, "value": self.value, "source": self.source,
                "where": self.where}


@dataclasses.dataclass
class Series:
    """Every logged value of one metrics.jsonl key: (line, step, epoch, value) in file order."""

    metric: Metric
    key: str
    source: str
    qualifiers: FrozenSet[str]
    rows: List[Tuple[int, Optional[float], Optional[float], float]] = dataclasses.field(default_factory=list)

    def _value(self, row: Tuple[int, Optional[float], Optional[float], float], label: str) -> Value:
        line, step, _, value = row
        parts = [label, f"line {line}", f"step {step:g}" if step is not None else ""]
        return Value(self.metric.name, self.key, value, self.source, ", ".join(p for p in parts if p),
                     self.qualifiers)

    def final(self) -> Value:
        return self._value(self.rows[-1], "final")

    def best(self) -> Value:
        pick = min if self.metric.lower_is_better else max
        return self._value(pick(self.rows, key=lambda r: r[3]), "best")

    def at(self, kind: str, n: float) -> Optional[Value]:
        rows = [r for r in self.rows if (r[1] if kind == "step" else r[2]) == n]
        return self._value(rows[-1], "" if kind == "step" else f"epoch {n:g}") if rows else None


def key_metric(key: str) -> Optional[Tuple[Metric, FrozenSet[str]]]:
    """(metric, qualifiers) an evidence key names, or None (see the module docstring)."""
    tokens = [t for t in re.split(r"[^a-z0-9]+", re.sub(r"([a-z])([A-Z][a-z])", r"\1_\2", key).lower()) if t]
    if not tokens or any(t in _NOT_A_METRIC for t in tokens):
        return None
    for metric in METRICS:
        for i, t in enumerate(tokens):
            alias = next((a for a in metric.keys if t == a or (t.startswith(a) and t[len(a):].isdigit())),
                         None)
            if alias is not None:
                rest = [*tokens[:i], t[len(alias):], *tokens[i + 1:]]
                return metric, words(" ".join(rest), parts=False) - _GENERIC
    return None


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    f = float(value)
    return f if f == f and abs(f) != float("inf") else None


def flatten(obj: Any, prefix: str = "") -> Iterator[Tuple[str, float]]:
    """(dotted key, number) for every number in a JSON value (lists: see the module docstring)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            if not isinstance(item, dict):
                continue
            name = next((item[k] for k in ("metric", "name", "key") if isinstance(item.get(k), str)), None)
            value = next((item[k] for k in ("value", "score") if k in item), None)
            if name is not None and _number(value) is not None:
                yield f"{prefix}.{name}" if prefix else name, float(value)  # type: ignore[arg-type]
            else:
                yield from flatten(item, f"{prefix}.{i}" if prefix else str(i))
    else:
        n = _number(obj)
        if n is not None and prefix:
            yield prefix, n


@dataclasses.dataclass
class Evidence:
    """Every evidence value, the metrics.jsonl series, the files read and notes about skipped ones."""

    values: List[Value] = dataclasses.field(default_factory=list)
    series: List[Series] = dataclasses.field(default_factory=list)
    files: List[str] = dataclasses.field(default_factory=list)
    notes: List[str] = dataclasses.field(default_factory=list)

    def metrics(self) -> FrozenSet[str]:
        return frozenset([v.metric for v in self.values] + [s.metric.name for s in self.series])

    def all_values(self) -> List[Value]:
        """The static values and each series' final value (what `missing` is listed from)."""
        return [*self.values, *(s.final() for s in self.series)]

    def candidates(self, claim: Claim) -> List[Value]:
        """The values a claim is compared with, narrowed by its context."""
        pool = [v for v in self.values if v.metric == claim.metric]
        for s in self.series:
            if s.metric.name != claim.metric:
                continue
            at = s.at(*claim.step) if claim.step else s.final()
            pool.extend([at] if at is not None else [])
            pool.extend([s.best()] if claim.best else [])
        known = frozenset().union(*(v.qualifiers for v in self.values), *(s.qualifiers for s in self.series))
        named = claim.context & known
        if not named:
            return pool
        scores = [len(v.qualifiers & named) for v in pool]
        top = max(scores, default=0)
        return [v for v, score in zip(pool, scores) if score == top and (top or not v.qualifiers)]

    def add_json(self, path: Path, obj: Any) -> None:
        for key, value in flatten(obj):
            named = key_metric(key)
            if named is not None:
                self.values.append(Value(named[0].name, key, value, str(path), "", named[1]))

    def add_verified(self, path: Path, obj: Dict[str, Any]) -> None:
        proof = (obj.get("proofs") or {}).get("metric") or {}
        key = proof.get("metric")
        named = key_metric(key) if isinstance(key, str) else None
        for row in proof.get("evaluated") or []:
            value = _number(row.get("recomputed")) if isinstance(row, dict) else None
            if named is not None and value is not None:
                where = f"recomputed, step {row.get('step')}"
                self.values.append(Value(named[0].name, str(key), value, str(path), where, named[1]))

    def add_jsonl(self, path: Path) -> None:
        by_key: Dict[str, Series] = {}
        for line_no, row in objects(path):  # a torn last line, a stray print: skipped
            step, epoch = _number(row.get("step")), _number(row.get("epoch"))
            for key, value in flatten(row):
                named = key_metric(key)
                if named is None:
                    continue
                if key not in by_key:
                    by_key[key] = Series(named[0], key, str(path), named[1])
                by_key[key].rows.append((line_no, step, epoch, value))
        self.series.extend(by_key.values())


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ReconcileError(f"{path}: not readable as JSON: {e}") from e


def _add_file(ev: Evidence, path: Path) -> None:
    if path.suffix == ".jsonl":
        try:
            ev.add_jsonl(path)
        except OSError as e:
            raise ReconcileError(f"{path}: {e.strerror or e}") from e
    else:
        obj = _read_json(path)
        if path.name == VERIFIED_NAME or (isinstance(obj, dict) and obj.get("schema") == VERIFIED_SCHEMA):
            ev.add_verified(path, obj)
        else:
            ev.add_json(path, obj)
    ev.files.append(str(path))


def _dir_files(root: Path) -> List[Path]:
    out = [root / "metrics.jsonl"] if (root / "metrics.jsonl").is_file() else []
    out.extend(p for p in sorted(root.glob("*.json"))
               if p.is_file() and p.name != "run.json" and not _SKIP_JSON.search(p.name))
    verified = root / "rgt" / VERIFIED_NAME
    return out + ([verified] if verified.is_file() else [])


def load_evidence(paths: Sequence[Path]) -> Evidence:
    """The evidence in files and run directories; ReconcileError when a named file cannot be read."""
    ev = Evidence()
    for path in paths:
        path = Path(path)
        if not path.is_dir():
            _add_file(ev, path)
            continue
        found = _dir_files(path)
        if not found:
            ev.notes.append(f"{path}: no metrics.jsonl, *.json or rgt/{VERIFIED_NAME} in it")
        for f in found:
            try:
                _add_file(ev, f)
            except ReconcileError as e:
                ev.notes.append(f"skipped {e}")
    return ev


# ---- comparing -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Finding:
    claim: Claim
    status: str  # "matched" | "drifted" | "unbacked"
    evidence: Optional[Value] = None  # the value that fits, or the closest one
    scale: float = 1.0  # what the evidence was multiplied by to compare
    compared: int = 0  # how many evidence values the claim was compared with

    @property
    def scaled(self) -> Optional[str]:
        return None if self.scale == 1.0 else ("x100" if self.scale > 1 else "/100")

    def to_dict(self) -> Dict[str, Any]:
        return {**self.claim.to_dict(), "status": self.status, "scaled": self.scaled,
                "compared": self.compared, "evidence": self.evidence.to_dict() if self.evidence else None}


def _scales(claim: Claim) -> Tuple[float, ...]:
    metric = METRIC_BY_NAME[claim.metric]
    return (1.0, 100.0, 0.01) if claim.percent or metric.ratio else (1.0,)


def compare(claim: Claim, candidates: Sequence[Value], tolerance: float) -> Finding:
    """One claim against its candidate values (rules in the module docstring)."""
    if not candidates:
        return Finding(claim, "unbacked")
    slack = claim.half + tolerance + _EPS * max(1.0, abs(claim.value))
    closest: Optional[Tuple[float, Value, float]] = None
    for scale in _scales(claim):
        for v in candidates:
            off = abs(claim.value - v.value * scale)
            if off <= slack:
                return Finding(claim, "matched", v, scale, len(candidates))
            if closest is None or off < closest[0]:
                closest = (off, v, scale)
    assert closest is not None
    return Finding(claim, "drifted", closest[1], closest[2], len(candidates))


@dataclasses.dataclass
class Report:
    doc: str
    findings: List[Finding]
    missing: List[Value]
    evidence_files: List[str]
    notes: List[str]
    tolerance: float

    def having(self, status: str) -> List[Finding]:
        return [f for f in self.findings if f.status == status]

    @property
    def drifted(self) -> List[Finding]:
        return self.having("drifted")

    @property
    def unbacked(self) -> List[Finding]:
        return self.having("unbacked")

    @property
    def matched(self) -> List[Finding]:
        return self.having("matched")

    def ok(self, strict: bool = False) -> bool:
        """No drift; with strict, also no unbacked claim and at least one claim."""
        return not self.drifted and (not strict or (not self.unbacked and bool(self.findings)))

    def to_dict(self, strict: bool = False) -> Dict[str, Any]:
        counts = {s: len(self.having(s)) for s in ("matched", "drifted", "unbacked")}
        return {"doc": self.doc, "ok": self.ok(strict), "strict": strict, "tolerance": self.tolerance,
                "counts": {**counts, "claims": len(self.findings), "missing": len(self.missing)},
                "drifted": [f.to_dict() for f in self.drifted],
                "unbacked": [f.to_dict() for f in self.unbacked],
                "matched": [f.to_dict() for f in self.matched],
                "missing": [v.to_dict() for v in self.missing],
                "evidence": self.evidence_files, "notes": self.notes}


def reconcile(doc: Path, evidence_paths: Sequence[Path], tolerance: float = 0.0,
              rows: Optional[re.Pattern[str]] = None) -> Report:
    """Compare every claim in doc with the evidence; ReconcileError when nothing can be checked."""
    ev = load_evidence(evidence_paths)
    if not ev.metrics():
        where = ", ".join(str(p) for p in evidence_paths)
        raise ReconcileError(f"no metric values in the evidence ({where})",
                             "give a run directory, its metrics.jsonl, an eval JSON or PULL_VERIFIED.json")
    try:
        claims = read_claims(doc, rows)
    except OSError as e:
        raise ReconcileError(f"{doc}: {e.strerror or e}") from e
    findings: List[Finding] = []
    compared: Set[Tuple[str, str]] = set()
    for claim in claims:
        pool = ev.candidates(claim)
        compared.update(v.ident for v in pool)
        findings.append(compare(claim, pool, tolerance))
    missing = [v for v in ev.all_values() if v.ident not in compared]
    return Report(str(doc), findings, missing, ev.files, ev.notes, tolerance)


__all__ = ["Evidence", "Finding", "ReconcileError", "Report", "Series", "Value", "compare", "flatten",
           "key_metric", "load_evidence", "reconcile"]
