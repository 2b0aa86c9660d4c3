"""What the sidecar watches besides checkpoints: the health monitor of one run (`health`: GPUs,
the job, memory, disk), the training-signal monitor (`training`), the GPU probe set-up (`probes`),
a stalled job's stacks (`stacks`), and `rgt-onbox health`, the pre-flight check before paying
for GPU hours (`preflight`). See docs/ARCHITECTURE.md §3.
"""
