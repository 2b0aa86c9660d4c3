"""Run a command the way every ssh, rsync and shell call of rgt runs: in its own process group,
with a deadline, dying with rgt, and with its output bounded.

Every byte a command prints may come from a box, and a box may print without end: stdout is read
up to MAX_OUTPUT_BYTES and stderr (a temporary file, not a pipe) up to MAX_STDERR_BYTES before the
command's group is ended with OutputTooLarge; only the last _STDERR_KEEP_BYTES of stderr are read.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import tempfile
import time
from typing import Any, List, Optional, Sequence

from controller import pidlock

# What a box may print for one command before rgt ends it: far above any answer rgt reads (a pull
# manifest of 100,000 files is ~20 MB), far below what would hurt the laptop.
MAX_OUTPUT_BYTES = 256 * 1024 * 1024
MAX_STDERR_BYTES = 64 * 1024 * 1024
_STDERR_KEEP_BYTES = 1024 * 1024


def execute(argv: Sequence[str], *, input: Optional[bytes] = None, timeout_s: float,
             capture_stdout: bool = True) -> subprocess.CompletedProcess[bytes]:
    """Run argv in its own process group with a deadline; raise TimeoutExpired after
    ending that group (which we started). It dies with this process (pidlock.dies_with_us):
    a copy or session that outlived a killed rgt would go on alone. stderr goes to a temporary file, not a
    pipe, so a background child that inherits it (ssh -f, a ProxyCommand) cannot
    keep us waiting for EOF."""
    with tempfile.TemporaryFile() as err:
        with subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE if capture_stdout else subprocess.DEVNULL,
            stderr=err, start_new_session=True, preexec_fn=pidlock.dies_with_us(),
        ) as proc:
            try:
                out = _bounded_output(proc, input, err, time.monotonic() + timeout_s)
            except (subprocess.TimeoutExpired, OutputTooLarge):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        # Only the tail is ever shown; a box that floods stderr costs a bounded read.
        size = os.fstat(err.fileno()).st_size
        err.seek(max(0, size - _STDERR_KEEP_BYTES))
        return subprocess.CompletedProcess(list(argv), proc.returncode, out, err.read())


class OutputTooLarge(Exception):
    """A command printed more than MAX_OUTPUT_BYTES (stdout) or MAX_STDERR_BYTES: it was ended."""


def _bounded_output(proc: subprocess.Popen[bytes], input: Optional[bytes], err: Any,
                    deadline: float) -> bytes:
    """communicate(), with caps: every answer comes from a box, which may print without end."""
    if proc.stdin is not None:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write(input or b"")
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
    chunks: List[bytes] = []
    total = 0
    stream = proc.stdout
    while stream is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, 0)
        ready, _, _ = select.select([stream], [], [], min(left, 0.5))
        if os.fstat(err.fileno()).st_size > MAX_STDERR_BYTES:
            raise OutputTooLarge(f"a command printed over {MAX_STDERR_BYTES} bytes of errors; it was ended")
        if not ready:
            continue
        chunk = os.read(stream.fileno(), 1 << 16)
        if not chunk:
            break
        total += len(chunk)
        if total > MAX_OUTPUT_BYTES:
            raise OutputTooLarge(f"a command printed over {MAX_OUTPUT_BYTES} bytes; it was ended "
                                 "(no answer rgt reads is that long)")
        chunks.append(chunk)
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise subprocess.TimeoutExpired(proc.args, 0) from None
    return b"".join(chunks)
