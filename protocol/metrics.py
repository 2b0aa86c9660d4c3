"""What a scalar metric is: one rule for the box (the sources, the detectors) and the laptop (status,
`--ref`, plot, compare).

A metric is a number (never a bool) under a metric name. Two strengths of name check:

- structured input (metrics.jsonl, a CSV logger's columns, TensorBoard tags) was written as metrics
  on purpose, so any well-formed name is one, except the names that never are;
- text (train.log) holds anything a program prints, so a name read from it must also be a known
  metric name (``loss``, ``lr``, ``grad_norm``, ``accuracy``, ``ppl``, ``eval_*``, ``train_*``, ...)
  or one the job declared (its `watch` list, the named groups of its log regex): a torchrun warning's
  ``torch/distributed/run.py:874``, a tqdm ``Loading checkpoint shards: 2`` or Lightning's
  ``TPU available: False, using: 0 TPU cores`` are text, not metrics.

Never a metric, whatever the input or a declaration says: wall-clock and duration fields (``time``,
``timestamp``, ``ts``, ``epoch_time``, ``wall_time``, ``train_runtime``, ``elapsed``, ...: two runs'
clocks are not a result to compare), file names (a ``.py``-like suffix, a ``:<digits>`` line-number
tail, a leading ``/``), banner words (``using``, ``shards``, ``v_num``), the counters themselves
(``step``, ``epoch``: where the run is, not what it measured), and anything that is not name-shaped.

Standard library only; runs on Python 3.9 (the box's sidecar imports it).
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional

MAX_NAME = 64

# Where the run is, not what it measured.
COUNTERS = frozenset({"step", "global_step", "iteration", "iter", "epoch", "steps", "epochs"})
# Words of a name that make it a clock or a duration.
TIME_WORDS = frozenset({
    "time", "times", "timestamp", "ts", "datetime", "date", "wall", "walltime", "wallclock", "clock",
    "runtime", "uptime", "elapsed", "duration", "seconds", "secs", "now", "unixtime", "created",
})
# Words programs print before a number that are not metrics (banners, tqdm descriptions).
BANNER_WORDS = frozenset({
    "using", "used", "available", "shards", "shard", "files", "v_num", "version", "pid", "port", "rank",
    "local_rank", "world_size", "line", "lineno", "cores", "gpus", "devices", "nodes", "workers",
    "num_workers", "seed", "batch_size", "warning", "error", "info", "debug", "code", "exit", "signal",
})
# File suffixes: a name ending in one is a file (or a file:line), not a metric.
FILE_SUFFIXES = frozenset({
    "py", "pyc", "pyx", "c", "cc", "cpp", "cxx", "h", "hpp", "cu", "cuh", "rs", "go", "js", "ts", "java",
    "json", "jsonl", "yaml", "yml", "toml", "ini", "cfg", "txt", "log", "csv", "sh", "so", "pt", "pth",
    "ckpt", "bin", "safetensors", "pkl", "npy", "npz", "md", "html", "png", "jpg",
})
# Known metric names (whole name, or its last "/" segment), for text.
KNOWN = frozenset({
    "loss", "lr", "learning_rate", "grad_norm", "gradient_norm", "grad_norm_total", "global_grad_norm",
    "acc", "accuracy", "top1", "top5", "top1_acc", "top5_acc", "ppl", "perplexity", "f1", "precision",
    "recall", "auc", "auroc", "map", "iou", "miou", "dice", "bleu", "rouge", "rouge1", "rouge2", "rougel",
    "wer", "cer", "mse", "mae", "rmse", "nll", "kl", "entropy", "reward", "score", "error_rate",
    "momentum", "weight_decay", "scale", "loss_scale", "throughput", "tokens_per_s", "tokens_per_sec",
    "samples_per_s", "samples_per_second", "steps_per_second", "mfu", "tflops",
})
# A name starting with one of these (eval_loss, val/acc, train_ppl) is known.
KNOWN_PREFIXES = ("eval", "val", "valid", "validation", "test", "train", "training", "dev")

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_./\-@]*$")
_WORDS = re.compile(r"[_\-./@]+")
_LINE_TAIL = re.compile(r":\d+\]?$")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def _words(name: str) -> List[str]:
    """A name's words: split on _ - . / @ and at camelCase humps, lower-cased."""
    return [w for w in _WORDS.split(_CAMEL.sub("_", name).lower()) if w]


def looks_like_file(name: str) -> bool:
    """``run.py``, ``torch/distributed/run.py:874``, ``/abs/path``, ``loss_utils.py:88``."""
    if name.startswith(("/", "./", "~")) or "//" in name or _LINE_TAIL.search(name):
        return True
    for part in name.split("/"):
        stem, dot, suffix = part.rpartition(".")
        if dot and stem and suffix.lower() in FILE_SUFFIXES:
            return True
    return False


def is_time_name(name: str) -> bool:
    """A clock or a duration: time, timestamp, ts, epoch_time, wall_time, train_runtime, elapsed_s."""
    return any(w in TIME_WORDS for w in _words(name))


def is_known_name(name: str) -> bool:
    """A metric name people use: loss-like, lr, grad_norm, accuracy, ppl, eval_*/train_*/val_*, ..."""
    low = name.lower()
    base = low.rsplit("/", 1)[-1]
    words = _words(low)
    if base in KNOWN or low in KNOWN or "loss" in low:
        return True
    if words and (words[0] in KNOWN_PREFIXES or words[0] in ("lr", "grad", "gradient")):
        return True
    return any(w in ("acc", "accuracy", "ppl", "perplexity", "f1", "reward", "norm") for w in words)


def is_metric_name(name: Any, declared: Iterable[str] = (), strict: bool = False) -> bool:
    """Whether `name` can be a scalar metric's name (see the module doc). `strict`: the name comes from
    text, so it must also be known or in `declared` (compared case-insensitively)."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not _NAME.match(name):
        return False
    low = name.lower()
    if low in COUNTERS or low.rsplit("/", 1)[-1] in COUNTERS or looks_like_file(name) or is_time_name(name):
        return False
    if low in BANNER_WORDS and low not in {d.lower() for d in declared}:
        return False
    if not strict:
        return True
    return is_known_name(name) or low in {d.lower() for d in declared}


def is_loss_name(name: Any) -> bool:
    """A metric name with "loss" in it (loss, train/loss, eval_loss, lossG), never a file or a time."""
    return isinstance(name, str) and "loss" in name.lower() and is_metric_name(name)


def value_of(value: Any, finite: bool = True) -> Optional[float]:
    """A metric value: an int or float (never a bool); non-finite ones only when not `finite`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        number = math.inf if value > 0 else -math.inf
    if finite and not math.isfinite(number):
        return None
    return number


def scalars(mapping: Mapping[Any, Any], declared: Iterable[str] = (), strict: bool = False,
            finite: bool = True) -> Dict[str, float]:
    """The metrics of one record: metric-named keys with number values (finite ones unless `finite`
    is False: the box keeps a NaN loss, which is what its detector looks for)."""
    wanted = list(declared)
    out: Dict[str, float] = {}
    for key, value in mapping.items():
        number = value_of(value, finite)
        if number is not None and is_metric_name(key, wanted, strict):
            out[str(key)] = number
    return out


__all__ = ["BANNER_WORDS", "COUNTERS", "KNOWN", "TIME_WORDS", "is_known_name", "is_loss_name",
           "is_metric_name", "is_time_name", "looks_like_file", "scalars", "value_of"]
