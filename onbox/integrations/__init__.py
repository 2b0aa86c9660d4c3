"""Two-line integrations for the frameworks people train with.

    from onbox.integrations.hf import RgtCallback            # transformers.Trainer
    trainer = Trainer(..., callbacks=[RgtCallback()])
    trainer.train(resume_from_checkpoint=resume_from())       # from onbox.integrations import resume_from

    from onbox.integrations.lightning import RgtCallback     # lightning (or pytorch_lightning)
    trainer = L.Trainer(..., callbacks=[RgtCallback()])
    trainer.fit(model, ckpt_path=resume_from())

The callbacks write every logging step to $RGT_METRICS (step, epoch, loss, grad_norm, learning
rate, eval metrics), hint every checkpoint's path once its save is complete and every checkpoint
the framework's rotation deleted (<run>/rgt/hints.jsonl, `onbox.hints`), hint the framework's
output directories, and make each process dump its Python stacks on SIGUSR2 for the sidecar's
hang report. Outside an rgt launch (no RGT_RUN_DIR, no RGT_METRICS) they do nothing; a failing
hook logs once and training goes on.

Importing this package imports no framework (nor torch): the callback classes are built on first
access of `RgtCallback`, from the framework the job already uses.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

HF_STATE = "trainer_state.json"


def resume_from() -> Optional[str]:
    """What to resume from: $RGT_RESUME_FROM (the checkpoint directory for Hugging Face, the
    .ckpt file for Lightning), or None when the launcher set nothing (a fresh run).

    A path naming a file inside a Hugging Face checkpoint directory (`checkpoint-150/
    trainer_state.json`, as older launchers set it) gives that directory. A path that does not
    exist is returned as it is, so the framework fails loudly instead of silently starting from zero.
    """
    value = os.environ.get("RGT_RESUME_FROM")
    if not value:
        return None
    path = Path(value)
    if not path.is_dir() and path.suffix != ".ckpt" and (path.parent / HF_STATE).is_file():
        return str(path.parent)
    return value


__all__ = ["resume_from"]
