"""What the sidecar watches besides checkpoints: the health monitor of one run (`health`: GPUs,
the job, memory, disk), the training-signal monitor (`training`), the GPU probe set-up (`probes`),
Xid meaning (`xid`), a stalled job's stacks (`stacks`), the job's processes that left its group
(`strays`), and `rgt-onbox health`, the pre-flight check before paying for GPU hours
(`preflight`). See docs/ARCHITECTURE.md §3.
"""
