"""What to watch in a run, from run.json's "watch" section (written by the launcher).

Keeping these settings in run.json, not only on a command line, means a
sidecar restarted by its supervisor (or started by hand later) watches the run
exactly as the launch asked.

    "watch": {"metrics": "metrics.jsonl", "log": "train.log", "log_regex": null,
              "scalars": ["loss"], "stall_floor_s": 300, "stall_k": 2, "stall_grace_s": 900,
              "expected_steps": null, "expected_seconds": null,
              "ckpt_dir": "checkpoints", "durable_dir": null, "durable_policy": "all",
              "stale_after_s": null}

Relative paths are relative to the run dir.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from onbox.custody import manifest
from onbox.custody.monitor import CustodyConfig
from onbox.errors import ConfigError
from onbox.monitors.training import TrainingConfig

KNOWN = {"metrics", "log", "log_regex", "scalars", "stall_floor_s", "stall_k", "stall_grace_s",
         "expected_steps", "expected_seconds", "ckpt_dir", "durable_dir", "durable_policy",
         "stale_after_s"}


def load_watch(run_dir: Path, overrides: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """run.json's watch section with `overrides` on top; unknown keys are refused."""
    try:
        meta = json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, ValueError):
        meta = {}
    watch = dict(meta.get("watch") or {}) if isinstance(meta, dict) else {}
    watch.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = set(watch) - KNOWN
    if unknown:
        raise ConfigError(f"unknown watch settings: {', '.join(sorted(unknown))} "
                          f"(known: {', '.join(sorted(KNOWN))})")
    return watch


def _path(run_dir: Path, value: Any) -> Optional[Path]:
    if value in (None, ""):
        return None
    p = Path(str(value))
    return p if p.is_absolute() else Path(run_dir) / p


def resume_step(run_dir: Path) -> Optional[int]:
    """The step of the checkpoint this attempt started from (run.json "resume", written by the
    launcher for `--resume-from`; else the custody record of run.json "resume_from"), or None."""
    try:
        meta = json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return None
    resume = meta.get("resume") if isinstance(meta, dict) else None
    step = resume.get("step") if isinstance(resume, dict) else None
    if step is None and isinstance(meta, dict) and isinstance(meta.get("resume_from"), str):
        step = _recorded_step(Path(run_dir), Path(meta["resume_from"]))
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def _recorded_step(run_dir: Path, path: Path) -> Optional[int]:
    """The step custody recorded for the checkpoint at `path` (a relaunch in place resumes from it)."""
    for record in reversed(manifest.read(run_dir)):
        if record.location(run_dir) == path:
            return record.step
    return None


def job_cwd(run_dir: Path) -> Optional[Path]:
    """The job's working directory from run.json ("cwd"), when it names an existing directory."""
    try:
        doc = json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return None
    cwd = doc.get("cwd") if isinstance(doc, dict) else None
    if not isinstance(cwd, str) or not cwd.startswith("/") or "\x00" in cwd:
        return None
    return Path(cwd) if Path(cwd).is_dir() else None


def training_config(run_dir: Path, watch: Mapping[str, Any], job_pid: Optional[int]) -> TrainingConfig:
    cfg = TrainingConfig(run_dir=Path(run_dir), metrics_path=_path(run_dir, watch.get("metrics")),
                         log_path=_path(run_dir, watch.get("log")), log_regex=watch.get("log_regex"),
                         stall=job_pid is not None,
                         job_key=str(job_pid) if job_pid is not None else None,
                         resume_step=resume_step(run_dir), job_cwd=job_cwd(run_dir))
    if watch.get("scalars"):
        cfg.watch = tuple(str(s) for s in watch["scalars"])
    for key in ("stall_floor_s", "stall_k", "stall_grace_s", "expected_seconds"):
        if watch.get(key) is not None:
            setattr(cfg, key, float(watch[key]))
    if watch.get("expected_steps") is not None:
        cfg.expected_steps = int(watch["expected_steps"])
    return cfg


def custody_config(run_dir: Path, watch: Mapping[str, Any], job_pid: Optional[int] = None) -> CustodyConfig:
    """Custody of the run's checkpoint dir plus where the job writes: its cwd (run.json "cwd") and
    the files its processes (`job_pid`: the wrapper or the job, and their descendants) hold open."""
    cfg = CustodyConfig(run_dir=Path(run_dir), ckpt_dir=_path(run_dir, watch.get("ckpt_dir")),
                        durable_dir=_path(run_dir, watch.get("durable_dir")), job_cwd=job_cwd(run_dir),
                        job_pid=job_pid)
    if watch.get("durable_policy"):
        if watch["durable_policy"] not in ("all", "last"):
            raise ConfigError("durable_policy must be 'all' or 'last'")
        cfg.durable_policy = str(watch["durable_policy"])
    if watch.get("stale_after_s") is not None:
        cfg.stale_after_s = float(watch["stale_after_s"])
    return cfg
