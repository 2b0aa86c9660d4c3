"""The recomputed-metric proof: run the user's eval command on a pulled checkpoint and compare the
number it prints with the number the run reported for that checkpoint's step.

- Which checkpoint: the newest (highest step among the manifest's checkpoint-kind files), or every
  step with `every=True`. Several checkpoint files at one step (model.safetensors + optimizer.pt)
  are one checkpoint: {ckpt} is then their common parent directory.
- Only checkpoints whose files all passed identity and safe load are evaluated: an eval script
  may load with plain torch.load, so it never sees a file we have not proved safe. It is not run
  on the pulled directory but on a view of it (`build_view`): a fresh directory beside the run
  (else in the temp dir) holding, at their run-relative paths, hard links to (copies of, where a
  link fails) exactly the files under {ckpt} and its checkpoint unit that passed (`members`; the
  caller decides which passed: safe-loaded, or hashed metadata of no loadable format). Every file
  kept out is named with its reason in the result's "withheld"; the view is removed afterwards.
- The command is never run through a shell: the template is split with shlex, then every
  `{ckpt}` inside an argument is replaced by the checkpoint's absolute path, so the path is one
  argument whatever characters it holds. A template without {ckpt} is a usage error.
- The eval's value: the LAST line of its stdout that is a JSON object, key `metric`.
- The run's value: <run>/metrics.jsonl, the last line with that exact step that has the metric.
  A value logged at another step is never compared (other weights gave it): for the newest
  checkpoint that fails as "nothing to compare"; with every=True an older checkpoint whose step
  the run did not log is listed as not compared (`compared` false) and evaluated by nobody.
- Equal when |a - b| <= max(tolerance x max(|a|, |b|), ABS_TOLERANCE).
"""
from __future__ import annotations

import dataclasses
import math
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from controller.jsonl import objects
from controller.output import last_json_object
from controller.verify.identity import pin_of

DEFAULT_METRIC = "loss"
DEFAULT_TOLERANCE = 1e-4  # relative: same weights, same data, other hardware or kernels
ABS_TOLERANCE = 1e-6  # for values near zero
DEFAULT_EVAL_TIMEOUT_S = 3600.0
METRICS_FILE = "metrics.jsonl"
CKPT = "{ckpt}"


class EvalCommandError(ValueError):
    """The eval-cmd template cannot be used (usage error)."""


def build_argv(template: str, ckpt: Path) -> List[str]:
    """The eval argv for one checkpoint; EvalCommandError for an unusable template."""
    try:
        argv = shlex.split(template)
    except ValueError as e:
        raise EvalCommandError(f"--eval-cmd does not parse: {e}") from e
    if not argv:
        raise EvalCommandError("--eval-cmd is empty")
    if not any(CKPT in a for a in argv):
        raise EvalCommandError("--eval-cmd must contain {ckpt}, where the checkpoint path goes")
    return [a.replace(CKPT, str(ckpt)) for a in argv]


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def reported_values(path: Path, metric: str) -> Dict[int, float]:
    """{step: the last value of `metric` logged at that step} from a metrics.jsonl."""
    out: Dict[int, float] = {}
    for _, row in objects(path):
        step, value = row.get("step"), _number(row.get(metric))
        if type(step) is int and value is not None:
            out[step] = value
    return out


def reported_for(values: Dict[int, float], step: int) -> Optional[Tuple[int, float]]:
    """(step, value) at exactly `step`; None when the run did not log the metric there."""
    return (step, values[step]) if step in values else None


def logged_near(values: Dict[int, float], step: int) -> str:
    """Where the run did log the metric around `step`, in words ("" when nowhere)."""
    before = [s for s in values if s < step]
    after = [s for s in values if s > step]
    near = ([max(before)] if before else []) + ([min(after)] if after else [])
    return f" (it logged it at step {' and '.join(map(str, near))})" if near else ""


def not_compared(target: Target, metric: str, values: Dict[int, float]) -> MetricResult:
    """An older checkpoint of --eval-all whose step the run never logged the metric at."""
    return MetricResult(target.step, target.ckpt, True, f"not compared: the run reported no {metric!r} at "
                        f"step {target.step}{logged_near(values, target.step)}", compared=False)


def close_enough(a: float, b: float, tolerance: float) -> bool:
    return math.isclose(a, b, rel_tol=tolerance, abs_tol=ABS_TOLERANCE)


@dataclasses.dataclass(frozen=True)
class Target:
    """One checkpoint to evaluate: its step, the path given as {ckpt}, the manifest files in it."""

    step: int
    ckpt: str  # relative to the run dir
    files: Tuple[str, ...]


def targets(checkpoints: Sequence[Tuple[str, Optional[int]]], every: bool) -> List[Target]:
    """The checkpoints to evaluate, from (path, step) of the manifest's checkpoint files."""
    by_step: Dict[int, List[str]] = {}
    for path, step in checkpoints:
        if step is not None:
            by_step.setdefault(step, []).append(path)
    steps = sorted(by_step) if every else sorted(by_step)[-1:]
    out = []
    for step in steps:
        files = sorted(by_step[step])
        ckpt = files[0] if len(files) == 1 else os.path.commonpath(files)
        out.append(Target(step, ckpt or ".", tuple(files)))
    return out


@dataclasses.dataclass
class MetricResult:
    step: int
    ckpt: str
    ok: bool
    reason: Optional[str] = None
    recomputed: Optional[float] = None
    reported: Optional[float] = None
    reported_step: Optional[int] = None
    compared: bool = True      # False: not evaluated, no value was logged at this step
    given: List[str] = dataclasses.field(default_factory=list)  # what the eval's view held
    withheld: List[Dict[str, str]] = dataclasses.field(default_factory=list)  # {"path", "reason"}
    view: Optional[str] = None  # "hard links" | "copies" | "hard links and copies"

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def members(target: Target, units: Mapping[str, Optional[str]]) -> List[str]:
    """The manifest files an eval of `target` could reach: those under its {ckpt} and under the
    checkpoint units of its files (an HF eval handed model.safetensors opens its directory)."""
    tops = {target.ckpt} | {u for u in (units.get(p) for p in target.files) if u}
    if "." in tops:
        return sorted(units)
    return sorted(p for p in units if any(p == t or p.startswith(t.rstrip("/") + "/") for t in tops))


@dataclasses.dataclass
class View:
    root: Path
    given: List[str]
    withheld: List[Dict[str, str]]
    how: str


def _place(src: Path, dst: Path) -> str:
    """Hard-link src at dst, else copy it; how it was placed."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst, follow_symlinks=False)
        return "hard links"
    except OSError:
        shutil.copyfile(src, dst, follow_symlinks=False)
        return "copies"


def _pin(path: Path) -> Optional[Dict[str, int]]:
    try:
        return pin_of(os.lstat(path))
    except OSError:
        return None


def build_view(run_dir: Path, paths: Sequence[str], refused: Mapping[str, str],
               pins: Mapping[str, Optional[Dict[str, int]]]) -> View:
    """A fresh directory with every path of `paths` not in `refused` (path -> why) placed at its
    run-relative path, each only while it is still the file that was hashed (`pins`)."""
    try:
        root = Path(tempfile.mkdtemp(prefix=".rgt-eval-", dir=Path(run_dir).parent))
    except OSError:
        root = Path(tempfile.mkdtemp(prefix="rgt-eval-"))
    view = View(root, [], [{"path": p, "reason": refused[p]} for p in paths if p in refused], "")
    hows = set()
    try:
        for rel in (p for p in paths if p not in refused):
            src, dst = Path(run_dir, *rel.split("/")), Path(root, *rel.split("/"))
            pin = pins.get(rel)
            why = None
            if pin is None or _pin(src) != pin:
                why = "changed since it was hashed (or never pinned)"
            else:
                try:
                    hows.add(_place(src, dst))
                except OSError as e:
                    why = f"could not be linked or copied: {e.strerror or e}"
                if why is None and _pin(src) != pin:
                    dst.unlink()
                    why = "changed while it was being copied"
            if why is None:
                view.given.append(rel)
            else:
                view.withheld.append({"path": rel, "reason": why})
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    view.how = " and ".join(sorted(hows)) or "nothing"
    return view


def _tail(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no output"


def evaluate_in_view(run_dir: Path, target: Target, template: str, metric: str, tolerance: float,
                     reported: Optional[Dict[int, float]], timeout_s: float, paths: Sequence[str],
                     refused: Mapping[str, str], pins: Mapping[str, Optional[Dict[str, int]]]
                     ) -> MetricResult:
    """Build the view of `paths` (see build_view), evaluate the target in it, remove it."""
    try:
        view = build_view(run_dir, paths, refused, pins)
    except OSError as e:
        return MetricResult(target.step, target.ckpt, False, f"not evaluated: no view for the eval: {e}")
    try:
        lost = [w for w in view.withheld if w["path"] in target.files]
        if lost:
            res = MetricResult(target.step, target.ckpt, False,
                               f"not evaluated: {lost[0]['path']} {lost[0]['reason']}")
        else:
            res = evaluate(view.root, target, template, metric, tolerance, reported, timeout_s)
    finally:
        shutil.rmtree(view.root, ignore_errors=True)
    res.given, res.withheld, res.view = view.given, view.withheld, view.how
    return res


def evaluate(run_dir: Path, target: Target, template: str, metric: str, tolerance: float,
             reported: Optional[Dict[int, float]], timeout_s: float) -> MetricResult:
    """Run the eval on one target under `run_dir` (the view) and compare; never raises for a
    failing eval."""
    res = MetricResult(step=target.step, ckpt=target.ckpt, ok=False)
    argv = build_argv(template, Path(run_dir).resolve() / target.ckpt)
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        res.reason = f"eval timed out after {timeout_s:g}s"
        return res
    except OSError as e:
        res.reason = f"eval could not start: {e.strerror or e}"
        return res
    if proc.returncode != 0:
        res.reason = f"eval exited {proc.returncode}: {_tail(proc.stderr)}"
        return res
    obj = last_json_object(proc.stdout)
    value = _number(obj.get(metric)) if obj is not None else None
    if value is None:
        res.reason = f"eval printed no JSON line with a number for {metric!r}"
        return res
    res.recomputed = value
    found = reported_for(reported, target.step) if reported is not None else None
    if found is None:
        where = METRICS_FILE if reported is not None else f"no {METRICS_FILE}"
        near = logged_near(reported, target.step) if reported is not None else ""
        res.reason = (f"nothing to compare: the run reported no {metric!r} at step {target.step}{near} "
                      f"({where}); a recomputed metric is compared at its checkpoint's own step only")
        return res
    res.reported_step, res.reported = found
    res.ok = close_enough(value, found[1], tolerance)
    if not res.ok:
        res.reason = (f"{metric} recomputed {value!r}, run reported {found[1]!r} at step {found[0]} "
                      f"(tolerance rel {tolerance:g})")
    return res
