"""The Hugging Face Trainer callback: two lines in a training script.

    from onbox.integrations.hf import RgtCallback
    trainer = Trainer(..., callbacks=[RgtCallback()])
    trainer.train(resume_from_checkpoint=resume_from())   # from onbox.integrations import resume_from

`RgtCallback` is a `transformers.TrainerCallback`, built on first access of the name (importing
this module imports neither transformers nor torch). On the main process it writes each `on_log`
(training steps every `logging_steps`, evaluation metrics, the closing summary) as one line of
$RGT_METRICS with `step` = the global step; hints `output_dir` at train begin; hints each
`checkpoint-N` directory in `on_save`, which the Trainer calls after `_save_checkpoint` has written
every file of it (trainer_state.json last) and rotated old ones out (`save_total_limit`); and hints
every checkpoint directory that rotation removed. Every process registers a faulthandler stack dump
on SIGUSR2 (<run>/rgt/stacks/<pid>.txt). Outside an rgt launch it does nothing.
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Dict, Optional, Set

from onbox.integrations._common import (
    guarded,
    hint,
    lazy_class,
    log_metrics,
    register_stacks,
    warn_resume_ignored,
)

FRAMEWORK = "hf"
PREFIX = "checkpoint-"
RESUME_HOW = "trainer.train(resume_from_checkpoint=onbox.integrations.resume_from())"


def _checkpoint_dirs(output_dir: str) -> Set[str]:
    """The checkpoint-N directories under output_dir now (absolute paths)."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return set()
    return {os.path.abspath(os.path.join(output_dir, n)) for n in names
            if n.startswith(PREFIX) and n[len(PREFIX):].isdigit()}


class RgtHooks:
    """The hooks of `RgtCallback`, mixed into `transformers.TrainerCallback` on first access."""

    def __init__(self) -> None:
        self._known: Set[str] = set()  # checkpoint dirs seen (before training or hinted since)
        self._first_step = True

    @guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        register_stacks(FRAMEWORK)
        if state.is_world_process_zero and args.output_dir:
            hint("output_dir", str(args.output_dir), framework=FRAMEWORK)
            self._known |= _checkpoint_dirs(str(args.output_dir))

    @guarded
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._first_step:
            self._first_step = False
            if state.is_world_process_zero and state.global_step <= 1:
                warn_resume_ignored(FRAMEWORK, RESUME_HOW)

    @guarded
    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None,
               **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        epoch = logs.get("epoch", state.epoch)
        log_metrics(int(state.global_step), None if epoch is None else float(epoch), logs)

    @guarded
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not args.output_dir:
            return
        step = int(state.global_step)
        path = os.path.abspath(os.path.join(str(args.output_dir), f"{PREFIX}{step}"))
        if os.path.isdir(path):
            hint("checkpoint", path, step=step, framework=FRAMEWORK)
            self._known.add(path)
        for gone in sorted(p for p in self._known if not os.path.exists(p)):
            hint("removed", gone, framework=FRAMEWORK)
            self._known.discard(gone)


_CLASS: Optional[type] = None


def callback_class() -> type:
    """`RgtCallback`: a subclass of `transformers.TrainerCallback` (imports transformers)."""
    global _CLASS
    if _CLASS is None:
        base = importlib.import_module("transformers").TrainerCallback
        _CLASS = type("RgtCallback", (RgtHooks, base), {
            "__module__": __name__, "__qualname__": "RgtCallback", "__doc__": __doc__})
    return _CLASS


__getattr__ = lazy_class(globals(), __name__, callback_class)


__all__ = ["RgtHooks", "callback_class"]  # and RgtCallback, built by __getattr__
