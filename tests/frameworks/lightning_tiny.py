"""A stock Lightning job: a tiny LightningModule, ModelCheckpoint, synthetic data, CPU.

No rgt code: Trainer defaults (default_root_dir is the cwd, the default logger, the default
progress bar) plus a ModelCheckpoint that keeps the best two by train loss, as users set it.
--logger csv|tensorboard|default picks the logger. Test-only switches: --nan-at STEP poisons the
weights from that step on; --crash-at STEP raises; --hang-at STEP blocks forever; --ignore-resume
starts from zero; --integration adds the two-line rgt callback (onbox.integrations.lightning).
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

# Never set. The job waits on it for its pace and, when told to hang, for good.
NEVER = threading.Event()


def stamp(path: str) -> None:
    """--fault-stamp: the wall time the first fault was injected (for bench/frameworks.py)."""
    if path and not os.path.exists(path):
        with open(path, "w") as f:
            f.write(repr(time.time()))


class Tiny(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        step = self.global_step
        if self.args.nan_at >= 0 and step >= self.args.nan_at:
            stamp(self.args.fault_stamp)
            with torch.no_grad():
                for p in self.parameters():
                    p.fill_(float("nan"))
        if self.args.crash_at >= 0 and step >= self.args.crash_at:
            stamp(self.args.fault_stamp)
            raise RuntimeError(f"injected crash at step {step}")
        if self.args.hang_at >= 0 and step >= self.args.hang_at:
            stamp(self.args.fault_stamp)
            NEVER.wait()   # hangs here for good, as a deadlocked job does
        if self.args.step_seconds:
            NEVER.wait(self.args.step_seconds)   # the step's compute time
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--logger", choices=("default", "csv", "tensorboard"), default="csv")
    ap.add_argument("--step-seconds", type=float, default=0.0)
    ap.add_argument("--nan-at", type=int, default=-1)
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--hang-at", type=int, default=-1)
    ap.add_argument("--ignore-resume", action="store_true")
    ap.add_argument("--flush-every", type=int, default=0,
                    help="the logger writes its file every N steps (csv) or at once (tensorboard)")
    ap.add_argument("--integration", action="store_true")
    ap.add_argument("--fault-stamp", default="", help="write the fault's wall time to this file (bench)")
    args = ap.parse_args()

    L.seed_everything(0)
    x = torch.randn(512, 8)
    y = x.sum(dim=1, keepdim=True) * 0.5
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)
    logger: object = True
    flush: dict = {}
    if args.logger == "csv":
        flush = {"flush_logs_every_n_steps": args.flush_every} if args.flush_every else {}
        logger = L.pytorch.loggers.CSVLogger(".", name="lightning_logs", **flush)
    elif args.logger == "tensorboard":
        flush = {"max_queue": 1, "flush_secs": 1} if args.flush_every else {}
        logger = L.pytorch.loggers.TensorBoardLogger(".", name="lightning_logs", **flush)
    ckpt = ModelCheckpoint(monitor="train_loss", save_top_k=2, every_n_train_steps=args.save_every)
    callbacks: list = [ckpt]
    if args.integration:
        from onbox.integrations.lightning import RgtCallback
        callbacks.append(RgtCallback())
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=logger,
                        log_every_n_steps=args.log_every, callbacks=callbacks,
                        enable_model_summary=False)
    resume = None if args.ignore_resume else (os.environ.get("RGT_RESUME_FROM") or None)
    if args.integration and not args.ignore_resume:
        from onbox.integrations import resume_from
        resume = resume_from()
    trainer.fit(Tiny(args), data, ckpt_path=resume)


if __name__ == "__main__":
    main()
