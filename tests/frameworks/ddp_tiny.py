"""A stock torchrun DDP job on gloo (CPU): each rank trains a tiny model, rank 0 logs and saves.

No rgt code. Run it as `torchrun --nproc-per-node 2 ddp_tiny.py`. Test-only switches:
--crash-rank R --crash-at STEP makes one rank raise; --hang-rank R --hang-at STEP makes one rank
stop calling the collective (the others then block in all_reduce).
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import torch
import torch.distributed as dist

# Never set. The job waits on it for its pace and, when told to hang, for good.
NEVER = threading.Event()


def stamp(path: str) -> None:
    """--fault-stamp: the wall time the first fault was injected (for bench/frameworks.py)."""
    if path and not os.path.exists(path):
        with open(path, "w") as f:
            f.write(repr(time.time()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--step-seconds", type=float, default=0.02)
    ap.add_argument("--crash-rank", type=int, default=-1)
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--hang-rank", type=int, default=-1)
    ap.add_argument("--hang-at", type=int, default=-1)
    ap.add_argument("--fault-stamp", default="", help="write the fault's wall time to this file (bench)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt_dir = os.environ.get("RGT_CKPT_DIR", "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)
    for step in range(1, args.steps + 1):
        if rank == args.crash_rank and step == args.crash_at:
            stamp(args.fault_stamp)
            raise RuntimeError(f"injected crash on rank {rank} at step {step}")
        if rank == args.hang_rank and step == args.hang_at:
            stamp(args.fault_stamp)
            NEVER.wait()   # hangs here for good, as a deadlocked job does
        x = torch.randn(16, 8)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss={loss.item():.4f}", flush=True)
        if rank == 0 and step % args.save_every == 0:
            path = os.path.join(ckpt_dir, f"step{step:06d}.pt")
            torch.save({"model": model.module.state_dict(), "step": step}, path + ".tmp")
            os.replace(path + ".tmp", path)
        NEVER.wait(args.step_seconds)   # the step's compute time
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
