"""A stock Hugging Face Trainer job: a tiny GPT-2 built from a config, synthetic data, CPU.

No rgt code: it runs with the Trainer's defaults (output_dir relative to the cwd, the default
`logging_nan_inf_filter=True`, the default progress bar) plus what a user sets every day
(max_steps, logging_steps, save_steps, save_total_limit). Test-only switches make it misbehave:
--nan-at STEP poisons the weights from that step on; --crash-at STEP raises; --hang-at STEP blocks
forever (waits on an event never set); --ignore-resume starts from zero even when a checkpoint exists.
--integration adds the two-line rgt callback (onbox.integrations.hf).
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        ids = self.data[i]
        return {"input_ids": ids, "labels": ids.clone()}


# Never set. The job waits on it for its pace and, when told to hang, for good.
NEVER = threading.Event()


def stamp(path: str) -> None:
    """--fault-stamp: the wall time the first fault was injected (for bench/frameworks.py)."""
    if path and not os.path.exists(path):
        with open(path, "w") as f:
            f.write(repr(time.time()))


class Faults(TrainerCallback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_step_end(self, args, state, control, model=None, **kw):
        step = state.global_step
        if self.args.nan_at >= 0 and step >= self.args.nan_at:
            stamp(self.args.fault_stamp)
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
        if self.args.crash_at >= 0 and step >= self.args.crash_at:
            stamp(self.args.fault_stamp)
            raise RuntimeError(f"injected crash at step {step}")
        if self.args.hang_at >= 0 and step >= self.args.hang_at:
            stamp(self.args.fault_stamp)
            NEVER.wait()   # hangs here for good, as a deadlocked job does
        if self.args.step_seconds:
            NEVER.wait(self.args.step_seconds)   # the step's compute time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--save-total-limit", type=int, default=2)
    ap.add_argument("--output-dir", default="out")
    ap.add_argument("--step-seconds", type=float, default=0.0)
    ap.add_argument("--nan-at", type=int, default=-1)
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--hang-at", type=int, default=-1)
    ap.add_argument("--ignore-resume", action="store_true")
    ap.add_argument("--integration", action="store_true")
    ap.add_argument("--fault-stamp", default="", help="write the fault's wall time to this file (bench)")
    args = ap.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4,
        logging_steps=args.log_every, save_steps=args.save_every, save_total_limit=args.save_total_limit,
        report_to="none", use_cpu=True, dataloader_num_workers=0, seed=0)
    callbacks = [Faults(args)]
    if args.integration:
        from onbox.integrations.hf import RgtCallback
        callbacks.append(RgtCallback())
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(256, 16, 64), callbacks=callbacks)
    resume = None if args.ignore_resume else (os.environ.get("RGT_RESUME_FROM") or None)
    if args.integration and not args.ignore_resume:
        from onbox.integrations import resume_from
        resume = resume_from()
    trainer.train(resume_from_checkpoint=resume)


if __name__ == "__main__":
    main()
