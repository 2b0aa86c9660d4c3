"""`rgt compare`: what differs between two runs, and their metrics at the same step.

    compare(a, b, metric=None, step=None) -> report (a dict; what `rgt compare --json` prints)

The runs' facts come from controller/insight/runfacts.py: run.json (command, git, environment names,
profile), rgt/fingerprint.json (config files, seed and determinism settings, packages, GPU; written
by onbox/launch/fingerprint.py at launch) and rgt/preflight.json. Every difference found is a row
(section, name, A's value, B's value) and names the *variable* it belongs to: one thing a person
changed. A flag (`--lr`), a config key (`--config:optim.lr`), the commit, uncommitted changes,
one package, the Python version, the profile, the GPU type or driver, an environment variable the
launch set, the launcher's other environment as a whole, and the seed, which gathers every
seed-named flag, config key and variable. A row may name no variable: shown, not counted (a config
text that differs only in comments or masked values; our own monitor's package).

Metrics: for each scalar both metrics.jsonl files hold, the values at one step both logged: the
last step both reached (or `--step`), never A at one step against B at another. When the runs'
last steps differ the row says so (`note`); a metric with no step logged by both is refused (its
step is null, with a warning). B - A and (B - A) / |A| follow.

Seed spread: runs whose every difference from A (or B) is the seed are its seed group: the other
runs in the store for stored runs, the sibling directories of a directory. A group with at least
MIN_SEEDS seeds that reached the compared step gives min, max and stdev of each metric there;
|B - A| is inside the spread when it is at most max - min. Fewer seeds estimate no spread (two
values give one difference, no spread): the row then carries `spread_note` ("not enough seeds to
estimate spread") and nothing is called inside or outside. When A and B differ only by the seed,
the one group is A's without B (B's own value must not widen the spread it is measured against);
otherwise A's group and B's group are measured and the wider counts.

Warnings: more than one variable ("cannot attribute the difference to one change"), only the seed,
nothing recorded differs, a run without a fingerprint, both runs dirty at the same commit, torn or
missing metrics lines.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from controller.insight.runfacts import RunFacts, config_keys

SEED = "seed"
MIN_SEEDS = 3      # seeds a group needs at one step before it estimates a seed-to-seed spread
NOT_ENOUGH = "not enough seeds to estimate spread"
MONITOR_PACKAGE = "remote-gpu-trainer"
# Variables set by the launcher itself; they differ between runs by design.
LAUNCHER_ENV = frozenset({"PYTHONUNBUFFERED"})
DETERMINISM_ENV = frozenset({
    "PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "CUDA_LAUNCH_BLOCKING", "TF_DETERMINISTIC_OPS",
    "TF_CUDNN_DETERMINISTIC", "NVIDIA_TF32_OVERRIDE", "PL_SEED_WORKERS", "TORCH_DETERMINISTIC",
})
# Python's own flags that take no value (so `python -u train.py` keeps train.py a positional).
_PY_FLAGS = frozenset({"-u", "-O", "-OO", "-B", "-s", "-S", "-E", "-I", "-q", "-b", "-bb", "-d", "-P", "-v"})
_ASSIGN = re.compile(r"^[+~]{0,2}(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)=(?P<value>.*)$", re.DOTALL)


@dataclasses.dataclass
class Difference:
    section: str              # command | config | seed | git | env | packages | python | profile | gpu
    name: str
    a: Any
    b: Any
    variable: Optional[str]   # the thing a person changed; None: shown, not counted

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def name_kind(name: str) -> Optional[str]:
    """"seed" (--seed, trainer.seed, PYTHONHASHSEED), "determinism" (--deterministic,
    CUBLAS_WORKSPACE_CONFIG), else None. The same rules as onbox/launch/fingerprint.py."""
    words = [w for w in re.split(r"[-_.+~]+", name.strip("-+~").lower()) if w]
    if not words:
        return None
    if words[-1] == SEED or "".join(words).endswith(SEED):
        return SEED
    if any(w.startswith("determinis") for w in words) or name.upper() in DETERMINISM_ENV:
        return "determinism"
    return None


def _variable(name: str, kind: Optional[str]) -> str:
    return SEED if kind == SEED else name


# ---- the command --------------------------------------------------------------------------------


def _is_option(arg: str) -> bool:
    return arg.startswith("-") and arg not in ("-", "--") and not re.match(r"^-[0-9.]", arg)


def command_items(argv: Sequence[str], run_id: str = "") -> Dict[str, Any]:
    """A command as `key -> value`: `program`; options by name (`--lr 0.1`, `--lr=0.1`, a bare
    flag is True); `KEY=VALUE` by KEY; other arguments as #0, #1... The run's own id inside an
    argument reads `<run>` (an output directory named after the run is no difference)."""
    own = re.compile(rf"(?<![A-Za-z0-9]){re.escape(run_id)}(?![A-Za-z0-9])") if run_id else None
    tokens = [own.sub("<run>", t) if own else t for t in map(str, argv)]
    items: Dict[str, List[Any]] = collections.OrderedDict()
    python = bool(tokens) and re.match(r"^python[0-9.]*$", Path(tokens[0]).name) is not None
    if tokens:
        items["program"] = [tokens[0]]
    bare, i = 0, 1
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if tok == "--":
            rest = tokens[i:]
            for n, arg in enumerate(rest):
                items.setdefault(f"#{bare + n}", []).append(arg)
            break
        if _is_option(tok):
            name, eq, value = tok.partition("=")
            nxt = tokens[i] if i < len(tokens) else None
            if eq:
                items.setdefault(name, []).append(value)
            elif (nxt is None or _is_option(nxt) or _ASSIGN.match(nxt) or (python and bare == 0
                                                                         and name in _PY_FLAGS)):
                items.setdefault(name, []).append(True)
            else:
                items.setdefault(name, []).append(nxt)
                i += 1
            continue
        m = _ASSIGN.match(tok)
        if m is not None and not tok.startswith(("/", ".")):
            items.setdefault(m.group("name"), []).append(m.group("value"))
        else:
            items.setdefault(f"#{bare}", []).append(tok)
            bare += 1
    return {k: v[0] if len(v) == 1 else v for k, v in items.items()}


def _configs(f: RunFacts) -> List[Dict[str, Any]]:
    fp = f.fingerprint or {}
    return [c for c in fp.get("configs") or [] if isinstance(c, dict)]


def _command_diffs(a: RunFacts, b: RunFacts) -> List[Difference]:
    ia = command_items(a.run.get("command") or [], a.run_id)
    ib = command_items(b.run.get("command") or [], b.run_id)
    paths_a = {c.get("arg") for c in _configs(a)}
    paths_b = {c.get("arg") for c in _configs(b)}
    out: List[Difference] = []
    for key in [*ia, *(k for k in ib if k not in ia)]:
        va, vb = ia.get(key), ib.get(key)
        if va == vb:
            continue
        if isinstance(va, str) and isinstance(vb, str) and va in paths_a and vb in paths_b:
            continue  # another config file in the same place: compared by content below
        kind = None if key == "program" or key.startswith("#") else name_kind(key)
        out.append(Difference(SEED if kind else "command", key, va, vb, _variable(key, kind)))
    return out


# ---- config files -------------------------------------------------------------------------------


def _config_label(entry: Dict[str, Any]) -> str:
    slot = str(entry.get("slot") or "")
    return slot if slot and not slot.startswith("#") else Path(str(entry.get("arg") or slot)).name


def _config_pair(x: Dict[str, Any], y: Dict[str, Any]) -> List[Difference]:
    label = _config_label(x)
    keys_a, keys_b = config_keys(x), config_keys(y)
    if keys_a is None or keys_b is None:
        return [Difference("config", f"{label} (sha256)", str(x.get("sha256"))[:12],
                           str(y.get("sha256"))[:12], f"config {label}")]
    out = []
    for key in [*keys_a, *(k for k in keys_b if k not in keys_a)]:
        va, vb = keys_a.get(key, "<absent>"), keys_b.get(key, "<absent>")
        if va != vb:
            kind = name_kind(key.rsplit(".", 1)[-1])
            out.append(Difference(SEED if kind else "config", f"{label}:{key}", va, vb,
                                  _variable(f"{label}:{key}", kind)))
    if not out:  # same keys and values: comments, order, or masked values differ
        out.append(Difference("config", f"{label} (text only)", str(x.get("sha256"))[:12],
                              str(y.get("sha256"))[:12], None))
    return out


def _config_diffs(a: RunFacts, b: RunFacts, notes: List[str]) -> List[Difference]:
    by_a = {str(c.get("slot")): c for c in _configs(a)}
    by_b = {str(c.get("slot")): c for c in _configs(b)}
    out: List[Difference] = []
    for slot, x in by_a.items():
        y = by_b.get(slot)
        if y is None:
            continue  # a config only one run names: the command rows show it
        if x.get("skipped") or y.get("skipped"):
            notes.append(f"config {_config_label(x)} not compared: {x.get('skipped') or y.get('skipped')}")
        elif x.get("sha256") != y.get("sha256"):
            out += _config_pair(x, y)
    return out


# ---- the rest of the fingerprint ----------------------------------------------------------------


def _git_diffs(a: RunFacts, b: RunFacts, warnings: List[str]) -> List[Difference]:
    sha_a, sha_b = a.run.get("git_sha"), b.run.get("git_sha")
    dirty_a, dirty_b = a.run.get("git_dirty"), b.run.get("git_dirty")
    if sha_a != sha_b:
        return [Difference("git", "commit", sha_a, sha_b, "commit")]
    if dirty_a != dirty_b:
        return [Difference("git", "uncommitted changes", dirty_a, dirty_b, "uncommitted changes")]
    if dirty_a and dirty_b:
        warnings.append("both runs had uncommitted changes at the same commit: their code may differ "
                        "in ways nothing here records")
    return []


def _env_names(f: RunFacts) -> Set[str]:
    return {str(n) for n in f.run.get("env_names") or []
            if not str(n).startswith("RGT_") and str(n) not in LAUNCHER_ENV}


def _env_diffs(a: RunFacts, b: RunFacts) -> List[Difference]:
    names_a, names_b = _env_names(a), _env_names(b)
    chosen = {str(n) for f in (a, b) for key in ("env_set", "secrets") for n in f.run.get(key) or []}
    out: List[Difference] = []
    for name in sorted(names_a ^ names_b):
        kind = name_kind(name)
        section = SEED if kind else "env"
        variable = _variable(f"env {name}", kind) if kind or name in chosen else "environment"
        out.append(Difference(section, name, name in names_a, name in names_b, variable))
    seeds_a = ((a.fingerprint or {}).get("seed") or {}).get("env") or {}
    seeds_b = ((b.fingerprint or {}).get("seed") or {}).get("env") or {}
    for name in sorted(set(seeds_a) & set(seeds_b)):
        if seeds_a[name] != seeds_b[name]:
            out.append(Difference(SEED, name, seeds_a[name], seeds_b[name],
                                  _variable(f"env {name}", name_kind(name))))
    return out


def _package_diffs(a: RunFacts, b: RunFacts, notes: List[str]) -> List[Difference]:
    pa = (a.fingerprint or {}).get("packages") or {}
    pb = (b.fingerprint or {}).get("packages") or {}
    for f, p in ((a, pa), (b, pb)):
        if f.fingerprint is not None and p.get("error"):
            notes.append(f"packages of {f.run_id} not recorded: {p['error']}")
    if not pa.get("distributions") or not pb.get("distributions"):
        return []
    out: List[Difference] = []
    if pa.get("python") != pb.get("python"):
        out.append(Difference("python", "python", pa.get("python"), pb.get("python"), "python"))
    da, db = pa["distributions"], pb["distributions"]
    for name in sorted(set(da) | set(db)):
        if da.get(name) != db.get(name):
            counted = None if name == MONITOR_PACKAGE else f"package {name}"
            out.append(Difference("packages", name, da.get(name), db.get(name), counted))
    return out


def gpu_facts(f: RunFacts) -> Optional[Dict[str, Any]]:
    """The fingerprint's GPU record, else the pre-flight report's, else None."""
    gpu = (f.fingerprint or {}).get("gpu")
    if isinstance(gpu, dict):
        return gpu
    report = (f.preflight or {}).get("gpu")
    if isinstance(report, dict):
        return {"available": report.get("available"), "driver_version": report.get("driver_version"),
                "devices": report.get("devices"), "names": report.get("names") or []}
    return None


def _gpu_type(gpu: Dict[str, Any]) -> str:
    names = [str(n) for n in gpu.get("names") or []]
    if names:
        return ", ".join(f"{n}x {name}" for name, n in sorted(collections.Counter(names).items()))
    if not gpu.get("available"):
        return "no GPU"
    return f"{gpu.get('devices')} GPU(s), model not recorded"


def _platform_diffs(a: RunFacts, b: RunFacts, notes: List[str]) -> List[Difference]:
    out: List[Difference] = []
    if a.run.get("profile") != b.run.get("profile"):
        out.append(Difference("profile", "profile", a.run.get("profile"), b.run.get("profile"), "profile"))
    ga, gb = gpu_facts(a), gpu_facts(b)
    if ga is None or gb is None:
        missing = [f.run_id for f, g in ((a, ga), (b, gb)) if g is None]
        if len(missing) == 1:
            notes.append(f"GPU type of {missing[0]} unknown (no pre-flight report): not compared")
        return out
    if _gpu_type(ga) != _gpu_type(gb):
        out.append(Difference("gpu", "gpu type", _gpu_type(ga), _gpu_type(gb), "gpu type"))
    if ga.get("driver_version") != gb.get("driver_version"):
        out.append(Difference("gpu", "driver", ga.get("driver_version"), gb.get("driver_version"),
                              "gpu driver"))
    return out


def differences(a: RunFacts, b: RunFacts) -> Tuple[List[Difference], List[str], List[str]]:
    """(differences, warnings, notes) between two runs' recorded facts."""
    warnings: List[str] = []
    notes: List[str] = []
    diffs = _command_diffs(a, b) + _config_diffs(a, b, notes) + _git_diffs(a, b, warnings)
    diffs += _env_diffs(a, b) + _package_diffs(a, b, notes) + _platform_diffs(a, b, notes)
    return diffs, warnings, notes


def variables(diffs: Sequence[Difference]) -> List[str]:
    return list(dict.fromkeys(d.variable for d in diffs if d.variable is not None))


# ---- metrics and the seed spread ----------------------------------------------------------------


def _number(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


def _value(x: float) -> Any:
    """A metric value for JSON: the number, or "nan" / "inf" / "-inf" (JSON has no such numbers)."""
    return x if math.isfinite(x) else str(x)


def metric_rows(a: RunFacts, b: RunFacts, metric: Optional[str], step: Optional[int],
                warnings: List[str]) -> List[Dict[str, Any]]:
    ma, mb = a.metrics(), b.metrics()
    for f, m in ((a, ma), (b, mb)):
        if m.missing:
            warnings.append(f"{f.run_id} has no metrics.jsonl")
        elif m.skipped:
            warnings.append(f"{f.run_id}: {m.skipped} of {m.lines} metrics lines skipped (torn or not JSON)")
        if m.truncated:
            warnings.append(f"{f.run_id}: metrics.jsonl is large; only its last part was read")
    names = sorted(set(ma.rows) & set(mb.rows))
    if metric is not None:
        if metric not in names:
            warnings.append(f"metric {metric!r} is not in both runs' metrics (both have: "
                            f"{', '.join(names) or 'none'})")
        names = [n for n in names if n == metric]
    rows: List[Dict[str, Any]] = []
    for name in names:
        common = set(ma.rows[name]) & set(mb.rows[name])
        at = (step if step in common else None) if step is not None else max(common, default=None)
        row: Dict[str, Any] = {"metric": name, "step": at, "a": None, "b": None, "diff": None, "rel": None}
        last_a, last_b = max(ma.rows[name]), max(mb.rows[name])
        if step is None and at is None:
            warnings.append(f"{name}: no step logged by both runs (A logged steps {min(ma.rows[name])}-"
                            f"{last_a}, B {min(mb.rows[name])}-{last_b}): not compared")
        elif step is None and last_a != last_b:
            row["note"] = (f"compared at step {at}, the last step both logged (A logged to step {last_a}, "
                           f"B to step {last_b})")
        if at is not None:
            va, vb = ma.rows[name][at], mb.rows[name][at]
            diff = _number(vb - va) if math.isfinite(va) and math.isfinite(vb) else None
            row.update(a=_value(va), b=_value(vb), diff=diff,
                       rel=diff / abs(va) if diff is not None and va != 0 else None)
        rows.append(row)
    if step is not None and rows and all(r["step"] is None for r in rows):
        warnings.append(f"no metric is at step {step} in both runs")
    return rows


def seed_value(f: RunFacts) -> str:
    """Every seed setting of a run as one comparable text ("[]" when none is recorded)."""
    found = [(k, v) for k, v in command_items(f.run.get("command") or [], f.run_id).items()
             if not k.startswith("#") and name_kind(k) == SEED]
    env = ((f.fingerprint or {}).get("seed") or {}).get("env") or {}
    found += [(k, v) for k, v in env.items() if name_kind(k) == SEED]
    for entry in _configs(f):
        keys = config_keys(entry) or {}
        found += [(f"{_config_label(entry)}:{k}", v) for k, v in keys.items()
                  if name_kind(k.rsplit(".", 1)[-1]) == SEED]
    return json.dumps(sorted(found, key=lambda kv: kv[0]), default=str)


def _seed_only(a: RunFacts, b: RunFacts) -> bool:
    return all(v == SEED for v in variables(differences(a, b)[0]))


def seed_groups(a: RunFacts, b: RunFacts, only_seed: bool) -> List[Tuple[str, List[RunFacts]]]:
    """A's and B's seed groups; only A's, without B, when A and B differ only by the seed."""
    seen = {a.where, b.where}
    found: List[RunFacts] = [*a.siblings(seen), *b.siblings(seen)]
    if only_seed:
        return [("A", [a, *(s for s in found if _seed_only(a, s))])]
    return [("A", [a, *(s for s in found if _seed_only(a, s))]),
            ("B", [b, *(s for s in found if _seed_only(b, s))])]


def _seeds(group: Sequence[RunFacts], metric: str, step: int) -> Tuple[int, List[float]]:
    """(distinct seeds, finite values) of a group's runs at one step."""
    values = [(seed_value(f), f.metrics().rows[metric][step]) for f in group
              if step in f.metrics().rows.get(metric, {})]
    numbers = [v for _, v in values if math.isfinite(v)]
    return len({s for s, v in values if math.isfinite(v)}), numbers


def _spread(group: Sequence[RunFacts], metric: str, step: int) -> Optional[Dict[str, Any]]:
    """min, max and stdev of a group with at least MIN_SEEDS seeds at `step`; else None."""
    seeds, numbers = _seeds(group, metric, step)
    if seeds < MIN_SEEDS or len(numbers) < MIN_SEEDS:
        return None
    return {"runs": len(numbers), "seeds": seeds, "min": min(numbers), "max": max(numbers),
            "stdev": statistics.stdev(numbers)}


def add_spread(rows: List[Dict[str, Any]], groups: List[Tuple[str, List[RunFacts]]]) -> None:
    for row in rows:
        if row["step"] is None:
            continue
        found = []
        for of, members in groups:
            spread = _spread(members, row["metric"], row["step"])
            if spread is not None:
                found.append({"of": of, **spread})
        if found:
            width = max(g["max"] - g["min"] for g in found)
            inside = None if row["diff"] is None else abs(row["diff"]) <= width
            row["spread"] = {"groups": found, "range": width, "inside": inside}
        else:
            most = max(_seeds(m, row["metric"], row["step"])[0] for _, m in groups)
            row["spread_note"] = (f"{NOT_ENOUGH}: {most} seed{'s' if most != 1 else ''} at step "
                                  f"{row['step']} per side, {MIN_SEEDS} needed")


# ---- the report ---------------------------------------------------------------------------------


def _who(f: RunFacts) -> Dict[str, Any]:
    return {"label": f.label, "run_id": f.run_id, "where": f.where,
            "fingerprint": f.fingerprint is not None, "git_sha": f.run.get("git_sha")}


def _verdict(names: List[str], rows: List[Dict[str, Any]], warnings: List[str]) -> None:
    if len(names) > 1:
        warnings.insert(0, f"{len(names)} variables changed ({', '.join(names)}): cannot attribute "
                           "the difference to one change")
    elif names == [SEED]:
        said = []
        for r in rows:
            if r.get("spread") and r["spread"]["inside"] is not None:
                said.append(f"{r['metric']} {'inside' if r['spread']['inside'] else 'OUTSIDE'} the "
                            "seed-to-seed spread")
            elif r.get("spread_note"):
                said.append(f"{r['metric']}: {r['spread_note']}")
        warnings.insert(0, "only the seed differs: " + ("; ".join(said) or "no seed group to measure the "
                                                                          "seed-to-seed spread against"))
    elif not names:
        warnings.insert(0, "nothing recorded differs: a metric difference is nondeterminism "
                           "(or something rgt does not record)")


def compare(a: RunFacts, b: RunFacts, metric: Optional[str] = None,
            step: Optional[int] = None) -> Dict[str, Any]:
    """The report (see the module doc): a, b, differences, variables, metrics, warnings, notes."""
    diffs, warnings, notes = differences(a, b)
    for f in (a, b):
        if f.fingerprint is None:
            warnings.append(f"{f.run_id} has no rgt/fingerprint.json: config files, seed variables, "
                            "packages and GPU were not compared")
    names = variables(diffs)
    rows = metric_rows(a, b, metric, step, warnings)
    if rows and any(r["step"] is not None for r in rows):
        add_spread(rows, seed_groups(a, b, all(n == SEED for n in names)))
    _verdict(names, rows, warnings)
    return {"a": _who(a), "b": _who(b), "differences": [d.to_dict() for d in diffs],
            "variables": names, "attributable": len(names) == 1, "seed_only": names == [SEED],
            "metrics": rows, "warnings": warnings, "notes": notes}


def iter_rows(report: Dict[str, Any]) -> Iterator[Tuple[str, str, str, str]]:
    """The differences as (section, name, A, B) text, for the human table."""
    for d in report["differences"]:
        yield d["section"], d["name"], _text(d["a"]), _text(d["b"])


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)
