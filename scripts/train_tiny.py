"""A tiny CPU training job for the demo and the end-to-end tests.

It learns y = 3x - 1 with a small MLP, appends one JSON line per log step to
$RGT_METRICS (or ./metrics.jsonl) and saves checkpoints atomically (tmp, fsync,
rename) into $RGT_CKPT_DIR (or ./checkpoints). Flags make it misbehave on
purpose: --nan-at, --crash-at, --hang-at (SIGSTOPs itself), --non-atomic-save,
--ignore-resume. It resumes from $RGT_RESUME_FROM when set; --device cuda runs
it on a GPU.

It is cheap to start and to idle (the tests start it over a hundred times on two cores): plain
SGD written out, since constructing a torch.optim optimizer imports torch._dynamo (1.5 s of CPU
per start here), and one CPU thread unless OMP_NUM_THREADS says otherwise (between paced steps
idle OpenMP threads spin: a fifth of a core per job).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

LR = 0.05


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--step-seconds", type=float, default=0.02, help="pace each step (sleep)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nan-at", type=int, default=-1)
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--hang-at", type=int, default=-1)
    ap.add_argument("--non-atomic-save", action="store_true")
    ap.add_argument("--ignore-resume", action="store_true")
    ap.add_argument("--device", default="cpu", help="torch device (cuda on a GPU box)")
    ap.add_argument("--stop-file", type=Path, default=None,
                    help="finish cleanly (exit 0) once this file exists: tests decide how long a run lasts")
    return ap.parse_args()


def save(state: dict, path: Path, atomic: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not atomic:
        torch.save(state, path)
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> int:
    args = parse()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    metrics = Path(os.environ.get("RGT_METRICS", "metrics.jsonl"))
    ckpt_dir = Path(os.environ.get("RGT_CKPT_DIR", "checkpoints"))
    model = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = model.to(args.device)
    start = 0
    resume = os.environ.get("RGT_RESUME_FROM")
    if resume and not args.ignore_resume:
        state = torch.load(resume, weights_only=True, map_location=args.device)
        model.load_state_dict(state["model"])
        start = int(state["step"])
        print(f"resumed from {resume} at step {start}", flush=True)
    x = torch.linspace(-1, 1, 256, device=args.device).unsqueeze(1)
    began = time.perf_counter()
    y = 3 * x - 1
    for step in range(start + 1, args.steps + 1):
        if step == args.crash_at:
            print(f"crashing at step {step}", flush=True)
            return 3
        if step == args.hang_at:
            print(f"hanging at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step >= args.nan_at > 0:
            loss = loss * float("nan")
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        if step % args.log_every == 0:
            value = loss.item()
            line = {"step": step, "epoch": step / args.steps, "loss": value if value == value else "nan",
                    "time": time.time()}
            with open(metrics, "a") as f:
                f.write(json.dumps(line) + "\n")
            print(f"step={step} loss={value:.6f}", flush=True)
        if step % args.ckpt_every == 0:
            state = {"model": model.state_dict(), "opt": {"lr": LR}, "step": step}
            save(state, ckpt_dir / f"step{step:06d}.pt", atomic=not args.non_atomic_save)
        if args.step_seconds:
            time.sleep(args.step_seconds)
        if args.stop_file is not None and step % args.log_every == 0 and args.stop_file.exists():
            print(f"stop file seen at step {step}", flush=True)
            break
    print(f"train_seconds={time.perf_counter() - began:.4f}", flush=True)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
