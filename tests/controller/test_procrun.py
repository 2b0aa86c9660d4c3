"""Every command rgt runs has bounded output: a box that prints without end is ended, not buffered."""
from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from controller import procrun
from controller.box import ssh

FLOOD = [sys.executable, "-c", "import sys\nwhile True: sys.stdout.write('x' * 65536)"]
ERR_FLOOD = [sys.executable, "-c", "import sys\nwhile True: sys.stderr.write('e' * 65536)"]


def test_an_answer_comes_back_whole_with_its_exit_code_and_stderr() -> None:
    done = procrun.execute([sys.executable, "-c", "import sys; print('a' * 100000); "
                            "sys.stderr.write('oops'); sys.exit(3)"], timeout_s=30)
    assert done.stdout == b"a" * 100000 + b"\n" and done.stderr == b"oops" and done.returncode == 3


def test_input_reaches_the_command() -> None:
    done = procrun.execute([sys.executable, "-c", "import sys; print(sys.stdin.read()[::-1])"],
                           input=b"secret", timeout_s=30)
    assert done.stdout == b"terces\n"


def test_a_stdout_flood_is_ended_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procrun, "MAX_OUTPUT_BYTES", 1 << 20)
    with pytest.raises(procrun.OutputTooLarge, match="bytes; it was ended"):
        procrun.execute(FLOOD, timeout_s=60)


def test_a_stderr_flood_is_ended_and_only_its_tail_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procrun, "MAX_STDERR_BYTES", 1 << 20)
    with pytest.raises(procrun.OutputTooLarge, match="of errors"):
        procrun.execute(ERR_FLOOD, timeout_s=60)
    monkeypatch.setattr(procrun, "_STDERR_KEEP_BYTES", 10)
    done = procrun.execute([sys.executable, "-c", "import sys; sys.stderr.write('z' * 5000 + 'END')"],
                           timeout_s=30)
    assert done.stderr == b"zzzzzzzEND"


def test_the_deadline_still_holds() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        procrun.execute([sys.executable, "-c", "import signal; signal.pause()"], timeout_s=0.5)


def test_through_a_shell_the_flood_is_an_ssh_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procrun, "MAX_OUTPUT_BYTES", 1 << 20)
    with pytest.raises(ssh.SshError, match="it was ended"):
        ssh.LocalShell().run(shlex.join([sys.executable, "-c",
                                         "import sys\nwhile True: sys.stdout.write('x' * 65536)"]),
                             timeout_s=60)
