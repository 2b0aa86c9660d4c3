"""The one registry of event kinds and control operations.

A kind's default severity is what the sidecar uses when a detector does not
say otherwise. Telemetry kinds never wake anyone. A reader meets kinds it does
not know (a newer sidecar): it keeps them, treats them by their sev, and never
refuses them.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional


@dataclasses.dataclass(frozen=True)
class KindSpec:
    name: str
    default_sev: str
    telemetry: bool
    summary: str


_KINDS: Dict[str, KindSpec] = {}


def _k(name: str, default_sev: str, summary: str, telemetry: bool = False) -> None:
    _KINDS[name] = KindSpec(name, default_sev, telemetry, summary)


# Telemetry: streamed and stored, never material.
_k("heartbeat", "info", "the sidecar is alive; carries its own counters", telemetry=True)
_k("gpu.sample", "info", "per-GPU min/mean/max over the sample interval", telemetry=True)
_k("train.progress", "info", "latest step/epoch/scalars, rate-limited", telemetry=True)
_k("disk.sample", "info", "bytes and inodes of watched filesystems", telemetry=True)
_k("synthetic.tick", "info", "load generated for tests and benchmarks", telemetry=True)

# Sidecar life.
_k("sidecar.started", "info", "a sidecar process started serving this run")
_k("sidecar.capability", "info", "what this sidecar can see: GPU section on or off and why, kernel log")
_k("sidecar.stopping", "info", "the sidecar is shutting down cleanly")
_k("sidecar.degraded", "warn", "a source or the journal is failing; the sidecar goes on")
_k("sidecar.recovered", "info", "a degraded part works again")

# Job.
_k("job.started", "info", "the training job started")
_k("job.exited", "warn", "the training job exited (code, signal, oom_killed)")
_k("job.stalled", "warn", "no progress past the stall budget (verdict: hung, idle)")
_k("job.progressing", "info", "progress resumed after a stall")
_k("job.preempted", "warn", "the job was told to stop by someone else than rgt (a spot reclaim); grace_s")
_k("run.closing", "info", "the job exited and the sidecar is closing the run: what is still settling or "
   "hashing, bytes left, eta_s", telemetry=True)
_k("run.closed", "info", "the run's end on the box: every source read to its end, every checkpoint "
   "committed or named incomplete; the final verdict and the final pull manifest (sha256, counts)")
_k("job.rank_failed", "critical", "one node's job exited while the other nodes of the run wait on it")

# Training signals.
_k("train.nonfinite", "critical", "a loss or watched scalar is NaN or Inf")
_k("train.restarted_from_zero", "warn", "a resumed run started far below its last step")
_k("train.metric_zero", "warn", "a metric stayed exactly 0 while the loss fell")
_k("train.slow", "warn", "progress with a starved GPU (data-bound)")
_k("train.loss_spike", "warn", "the loss jumped beyond k sigma of its recent window")
_k("train.short_run", "warn", "the run finished far sooner than its expected duration")
_k("train.bad_metrics", "warn", "lines of metrics.jsonl or train.log that could not be read (counted)")

# GPU and box health.
_k("gpu.xid", "warn", "an Xid from the driver (code, pci, pid, class, advice)")
_k("gpu.throttle", "warn", "a clock-slowdown reason held past its window")
_k("gpu.throttle_cleared", "info", "the slowdown reasons cleared")
_k("gpu.ecc", "critical", "uncorrected ECC counts rose")
_k("gpu.lost", "critical", "the GPU fell off the bus or stopped answering")
_k("gpu.foreign_memory", "warn", "GPU memory held by processes that are not the job")
_k("gpu.foreign_memory_cleared", "info", "no foreign process holds GPU memory any more")
_k("disk.low", "warn", "a watched filesystem is nearly full (bytes or inodes)")
_k("disk.ok", "info", "a watched filesystem has room again")
_k("mem.pressure", "warn", "the job's memory is near its limit")
_k("mem.ok", "info", "the job's memory use is back under the clear level")

# Checkpoints.
_k("ckpt.saved", "info", "a checkpoint was committed and hashed (path, size, sha256, step)")
_k("ckpt.suspect", "warn", "a checkpoint looks partial, empty, unloadable or abandoned")
_k("ckpt.stale", "warn", "no good checkpoint for longer than the policy age")
_k("ckpt.durable", "info", "a checkpoint was copied to storage that outlives the box")
_k("ckpt.sync_failed", "critical", "a durable copy failed or did not hash back")
_k("ckpt.removed", "info", "a recorded checkpoint was deleted (by: job rotation, or something else: warn)")
_k("ckpt.location", "info", "custody found a place the job writes checkpoints and watches it from now on")

# Dead-man.
_k("deadman.armed", "info", "the box-level lease is armed (ttl_s, idle_s, max_hours)")
_k("deadman.renewed", "info", "the lease was renewed (by launch, controller or cli)")
_k("deadman.expiring", "warn", "the lease or the hard budget ends soon (minutes_left 30, then 5)")
_k("deadman.held", "info", "the lease expired but a run is progressing: nothing is done")
_k("deadman.authorized", "info", "a person pre-authorized a further action for this box")
_k("deadman.disarmed", "info", "the lease was disarmed: the dead-man will do nothing")
_k("deadman.firing", "critical", "the dead-man is about to run its action (journaled before it runs)")
_k("deadman.fired", "critical", "the dead-man acted (action, outcome, exit_code)")

# Controller side (recorded by the controller, never sent by a sidecar).
_k("link.lost", "warn", "the transport is down; says nothing about the job")
_k("link.restored", "info", "the transport is back")
_k("sidecar.silent", "warn", "the link is up but no heartbeat arrived")
_k("journal.gap", "warn", "events the sidecar could not keep (disk full) are missing")


def spec(kind: str) -> Optional[KindSpec]:
    """The registered spec, or None for a kind this version does not know."""
    return _KINDS.get(kind)


def default_sev(kind: str) -> str:
    found = _KINDS.get(kind)
    return found.default_sev if found else "info"


def is_telemetry(kind: str) -> bool:
    found = _KINDS.get(kind)
    return bool(found and found.telemetry)


def all_kinds() -> Dict[str, KindSpec]:
    return dict(_KINDS)


# Control operations a ROUTER understands. Later versions add ops; a server
# answers an op it does not know with an "unknown_op" error reply.
CONTROL_OPS = ("hello", "since", "manifest", "renew")

# The dead-man lease as a renew reply states it: armed and counting, already fired, disarmed,
# no lease file on the box, or a lease file that could not be read (treated as armed).
DEADMAN_STATES = ("armed", "fired", "disarmed", "absent", "unreadable")

# Error codes in error replies.
# "refused": understood, but the sidecar will not do it (a manifest that could not be complete).
ERROR_CODES = ("bad_request", "unknown_op", "version", "too_large", "refused", "internal")
