"""The recomputed-metric proof: run the user's eval command on a pulled checkpoint and compare the
number it prints with the number the run reported for that checkpoint's step.

- Which checkpoint: the newest (highest step among the manifest's checkpoint-kind files), or every
  step with `every=True`. Several checkpoint files at one step (model.safetensors + optimizer.pt)
  are one checkpoint: {ckpt} is then their common parent directory.
- Only checkpoints whose files all passed identity and safe load are evaluated: an eval script
  may load with plain torch.load, so it never sees a file we have not proved safe.
- The command is never run through a shell: the template is split with shlex, then every
  `{ckpt}` inside an argument is replaced by the checkpoint's absolute path, so the path is one
  argument whatever characters it holds. A template without {ckpt} is a usage error.
- The eval's value: the LAST line of its stdout that is a JSON object, key `metric`.
- The run's value: <run>/metrics.jsonl, the last line with that exact step that has the metric,
  else the nearest earlier step that has it; none at all fails as "nothing to compare".
- Equal when |a - b| <= max(tolerance x max(|a|, |b|), ABS_TOLERANCE).
"""
from __future__ import annotations

import dataclasses
import math
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from controller.jsonl import objects
from controller.output import last_json_object

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
    """(step, value) at `step`, else at the nearest earlier step; None when there is none."""
    if step in values:
        return step, values[step]
    earlier = [s for s in values if s < step]
    return (max(earlier), values[max(earlier)]) if earlier else None


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

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _tail(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no output"


def evaluate(run_dir: Path, target: Target, template: str, metric: str, tolerance: float,
             reported: Optional[Dict[int, float]], timeout_s: float) -> MetricResult:
    """Run the eval on one target and compare; never raises for a failing eval."""
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
        res.reason = (f"nothing to compare: the run reported no {metric!r} at or before step "
                      f"{target.step} ({where})")
        return res
    res.reported_step, res.reported = found
    res.ok = close_enough(value, found[1], tolerance)
    if not res.ok:
        res.reason = (f"{metric} recomputed {value!r}, run reported {found[1]!r} at step {found[0]} "
                      f"(tolerance rel {tolerance:g})")
    return res
