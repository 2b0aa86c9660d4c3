"""The Lightning callback: two lines in a training script.

    from onbox.integrations.lightning import RgtCallback
    trainer = L.Trainer(..., callbacks=[RgtCallback()])
    trainer.fit(model, ckpt_path=resume_from())            # from onbox.integrations import resume_from

`RgtCallback` is a `lightning.pytorch.Callback` (or a `pytorch_lightning.Callback` when that is the
package the job uses), built on first access of the name: importing this module imports neither
Lightning nor torch. On global rank 0 it writes, at each step Lightning logs (`log_every_n_steps`),
one line of $RGT_METRICS: `step` = `trainer.global_step`, a fractional `epoch`, what the module
logged for that step (`self.log`), `loss` from `training_step`'s output, `grad_norm` (rank 0's
local L2 norm of the gradients, taken just before the optimizer step; none under DeepSpeed, which
keeps its own) and `lr` (the first optimizer's first group); and one line of validation metrics
after each validation run.

Checkpoints: Lightning's `on_save_checkpoint` hook runs before the file is written, so the callback
observes `trainer.save_checkpoint` (what ModelCheckpoint and user code call) and
`trainer.strategy.remove_checkpoint` (ModelCheckpoint's `save_top_k` rotation) instead: from
`on_fit_start` to `teardown` both are wrapped on this trainer instance, and a `checkpoint` hint
goes out when the save (and its barrier) has returned, a `removed` hint when the file is gone. Each
ModelCheckpoint's `dirpath` is hinted as an `output_dir` at fit start. Under an asynchronous
CheckpointIO a file not yet on disk when the save returns is hinted at a later hook, once it exists.

Every process registers a faulthandler stack dump on SIGUSR2 (<run>/rgt/stacks/<pid>.txt) at fit
start. Outside an rgt launch it does nothing.
"""
from __future__ import annotations

import importlib
import math
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

from onbox.integrations._common import (
    guarded,
    hint,
    lazy_class,
    log_metrics,
    register_stacks,
    warn_resume_ignored,
)

FRAMEWORK = "lightning"
PACKAGES = ("lightning.pytorch", "pytorch_lightning")
RESUME_HOW = "trainer.fit(model, ckpt_path=onbox.integrations.resume_from())"
_MISSING = object()


def _should_log(trainer: Any) -> bool:
    """Whether Lightning sends this step's metrics to its loggers (the same test it makes)."""
    try:
        if trainer.fit_loop._should_accumulate():
            return False
        return bool(trainer._logger_connector.should_update_logs)
    except AttributeError:  # another Lightning: its public settings
        every = int(getattr(trainer, "log_every_n_steps", 50) or 0)
        return every > 0 and (int(trainer.global_step) + 1) % every == 0


def _grad_norm(module: Any) -> Optional[float]:
    """The L2 norm of this process's gradients (one device sync), None without gradients."""
    norms = [p.grad.detach().float().norm(2) for p in module.parameters()
             if p.grad is not None and not getattr(p.grad, "is_sparse", False)]
    if not norms:
        return None
    device = norms[0].device
    total = sum(n.to(device) ** 2 for n in norms)
    return math.sqrt(float(total))


def _local(path: str) -> bool:
    return "://" not in path


class RgtHooks:
    """The hooks of `RgtCallback`, mixed into Lightning's `Callback` on first access."""

    def __init__(self) -> None:
        self._grad_norm: Optional[float] = None
        self._pending: List[str] = []  # saved, not yet on disk (asynchronous CheckpointIO)
        self._wrapped: List[Tuple[Any, str, Any, Any]] = []  # (object, method, before, ours)

    # ---- fit --------------------------------------------------------------------------------------

    @guarded
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        register_stacks(FRAMEWORK)
        self._observe(trainer)
        if trainer.is_global_zero:
            for cb in getattr(trainer, "checkpoint_callbacks", []):
                dirpath = getattr(cb, "dirpath", None)
                if dirpath and _local(str(dirpath)):
                    hint("output_dir", str(dirpath), framework=FRAMEWORK)

    @guarded
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero and not getattr(trainer, "ckpt_path", None) and trainer.global_step == 0:
            warn_resume_ignored(FRAMEWORK, RESUME_HOW)

    @guarded
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._flush(trainer)
        self._unobserve()

    # ---- metrics ----------------------------------------------------------------------------------

    @guarded
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._grad_norm = None
        if trainer.is_global_zero and _should_log(trainer):
            self._grad_norm = _grad_norm(pl_module)

    @guarded
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._flush(trainer)
        if not trainer.is_global_zero or not _should_log(trainer):
            return
        values = self._step_metrics(trainer)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None and "loss" not in values:
            values["loss"] = loss
        if self._grad_norm is not None:
            values["grad_norm"] = self._grad_norm
        self._grad_norm = None
        try:
            values["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
        except (AttributeError, IndexError, KeyError, TypeError):
            pass
        log_metrics(int(trainer.global_step), self._epoch(trainer, batch_idx), values)

    @guarded
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        log_metrics(int(trainer.global_step), float(trainer.current_epoch), dict(trainer.callback_metrics))

    @staticmethod
    def _step_metrics(trainer: Any) -> Dict[str, Any]:
        """What Lightning is about to send its loggers for this step, else its callback metrics."""
        try:
            return dict(trainer._logger_connector.metrics["log"])
        except (AttributeError, KeyError, TypeError, AssertionError):
            return {k: v for k, v in dict(trainer.callback_metrics).items()
                    if not k.startswith(("val", "test"))}

    @staticmethod
    def _epoch(trainer: Any, batch_idx: int) -> float:
        epoch = float(trainer.current_epoch)
        batches = getattr(trainer, "num_training_batches", None)
        if isinstance(batches, (int, float)) and math.isfinite(batches) and batches > 0:
            epoch += min(1.0, (batch_idx + 1) / batches)
        return epoch

    # ---- checkpoints ------------------------------------------------------------------------------

    def _observe(self, trainer: Any) -> None:
        """Shadow trainer.save_checkpoint and strategy.remove_checkpoint on these instances."""
        if self._wrapped:
            return
        save = trainer.save_checkpoint
        strategy = trainer.strategy
        remove = strategy.remove_checkpoint

        def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> None:
            save(filepath, *args, **kwargs)
            self._saved(trainer, filepath)

        def remove_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> None:
            remove(filepath, *args, **kwargs)
            self._removed(trainer, filepath)

        for obj, name, ours in ((trainer, "save_checkpoint", save_checkpoint),
                                (strategy, "remove_checkpoint", remove_checkpoint)):
            self._wrapped.append((obj, name, vars(obj).get(name, _MISSING), ours))
            setattr(obj, name, ours)

    def _unobserve(self) -> None:
        """Put back what was there before `_observe` (unless someone shadowed it again since)."""
        for obj, name, before, ours in self._wrapped:
            if vars(obj).get(name) is ours:
                if before is _MISSING:
                    delattr(obj, name)  # the class's own method shows through again
                else:
                    setattr(obj, name, before)
        self._wrapped = []

    @guarded
    def _saved(self, trainer: Any, filepath: Any) -> None:
        path = os.fspath(filepath)
        if trainer.is_global_zero and _local(path):
            self._pending.append(os.path.abspath(path))
            self._flush(trainer)

    @guarded
    def _removed(self, trainer: Any, filepath: Any) -> None:
        path = os.fspath(filepath)
        if trainer.is_global_zero and _local(path) and not os.path.exists(path):
            self._pending = [p for p in self._pending if p != os.path.abspath(path)]
            hint("removed", path, step=None, framework=FRAMEWORK)

    def _flush(self, trainer: Any) -> None:
        """Hint each pending save that is on disk now."""
        still: List[str] = []
        for path in self._pending:
            if os.path.exists(path):
                hint("checkpoint", path, step=int(trainer.global_step), framework=FRAMEWORK)
            else:
                still.append(path)
        self._pending = still


_CLASSES: Dict[str, type] = {}


def _package() -> str:
    """The Lightning the job uses: one already imported, else the first importable."""
    for name in PACKAGES:
        if name in sys.modules:
            return name
    for name in PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        return name
    raise ImportError("onbox.integrations.lightning needs `lightning` or `pytorch_lightning`")


def callback_class(package: Optional[str] = None) -> type:
    """`RgtCallback` for `package` ("lightning.pytorch" or "pytorch_lightning"; default: the one
    the job imported). Imports that package."""
    name = package or _package()
    if name not in PACKAGES:
        raise ValueError(f"package must be one of {PACKAGES}, not {name!r}")
    if name not in _CLASSES:
        base = importlib.import_module(name).Callback
        _CLASSES[name] = type("RgtCallback", (RgtHooks, base), {
            "__module__": __name__, "__qualname__": "RgtCallback", "__doc__": __doc__})
    return _CLASSES[name]


__getattr__ = lazy_class(globals(), __name__, callback_class)


__all__ = ["RgtHooks", "callback_class"]  # and RgtCallback, built by __getattr__
