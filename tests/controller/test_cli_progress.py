"""controller.cli.progress.ProgressMeter: redrawn in place on a terminal (a real pty here), plain
lines or nothing elsewhere, always on stderr, always escaped."""
from __future__ import annotations

import os
import pty
import subprocess
import sys
import textwrap

import pytest

from controller.cli.progress import ProgressMeter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def on_a_terminal(script: str) -> bytes:
    """What `script` (given `meter`, a ProgressMeter) writes: stderr on a pty, stdout on a pipe."""
    code = "from controller.cli.progress import ProgressMeter\n" + textwrap.dedent(script)
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=slave)
    finally:
        os.close(slave)
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out == b""
    return b"".join(chunks).replace(b"\r\n", b"\n")  # the pty's own newline translation


def test_on_a_terminal_the_line_is_redrawn_over_the_longer_one_and_wiped_at_the_end() -> None:
    shown = on_a_terminal("""
        meter = ProgressMeter()
        meter.show("hash 10/100", plain="never off a terminal")
        meter.show("hash 11/100")
        meter.show("load 1/2")
        meter.end()
        meter.end()
    """)
    assert shown == b"\rhash 10/100\rhash 11/100\rload 1/2   \r        \r"


def test_keep_ends_the_line_with_a_newline_instead() -> None:
    shown = on_a_terminal("""
        meter = ProgressMeter(keep=True)
        meter.show("1.0 MB / 2.0 MB")
        meter.end()
        meter.end()
    """)
    assert shown == b"\r1.0 MB / 2.0 MB\n"


def test_a_line_ends_the_redrawn_one_first_and_text_is_escaped() -> None:
    shown = on_a_terminal("""
        meter = ProgressMeter()
        meter.line("copy: \\x1b]52;c;eA==\\x07")
        meter.show("step \\x1b[2J")
        meter.line("done")
    """)
    assert shown == b"copy: \\x1b]52;c;eA==\\x07\n\rstep \\x1b[2J\r            \rdone\n"


def test_off_a_terminal_show_writes_its_plain_form_or_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    meter = ProgressMeter(keep=True)
    assert not meter.tty
    meter.show("hash 1/2")
    meter.show("1 MB / 2 MB", plain='{"pulled_bytes": 1}')
    meter.line("install: \x9b0m")
    meter.end()
    out, err = capsys.readouterr()
    assert out == "" and err == '{"pulled_bytes": 1}\ninstall: \\x9b0m\n'
