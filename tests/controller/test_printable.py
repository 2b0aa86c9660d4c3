"""render.printable and its kin: nothing a box sends can control the terminal rgt prints on.

The unsafe set is written out here on its own (not read from controller/render.py), so a
character dropped from render's class fails these tests.
"""
from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import zipfile
from pathlib import Path
from typing import List, Optional, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import protocol
from controller.cli import base as clibase
from controller.install import onbox as install
from controller.output import error_tail
from controller.render import json_line, json_safe, printable, printable_lines, table_row
from controller.store.db import Store
from controller.teardown import deadman
from protocol import PACKAGE_VERSION

RANGES = [(0x00, 0x1F), (0x7F, 0x9F), (0xAD, 0xAD), (0x061C, 0x061C), (0x180E, 0x180E),
          (0x200B, 0x200B), (0x200E, 0x200F), (0x2028, 0x202E), (0x2060, 0x206F), (0xFEFF, 0xFEFF),
          (0xFFF9, 0xFFFB), (0xD800, 0xDFFF), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A),
          (0xE0000, 0xE007F)]
UNSAFE = frozenset(chr(c) for lo, hi in RANGES for c in range(lo, hi + 1))
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True)


def clean(text: str) -> bool:
    return not any(c in UNSAFE for c in text)


# ---- each class ---------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, shown", [
    ("\x1b]52;c;cm0gLXJmIH4K\x07", "\\x1b]52;c;cm0gLXJmIH4K\\x07"),          # OSC 52: write the clipboard
    ("\x1b[2J\x1b[H", "\\x1b[2J\\x1b[H"),                                     # CSI 2J: clear the screen
    ("\x1b]0;title\x1b\\", "\\x1b]0;title\\x1b\\"),                           # OSC 0 ended by ST
    ("a\rgate OPEN", "a\\x0dgate OPEN"),                                     # CR: overwrite the line
    ("one\ntwo\tthree\x00\x08", "one\\x0atwo\\x09three\\x00\\x08"),           # C0
    ("\x7f", "\\x7f"),                                                       # DEL
    ("\x9b2J \x9d0;t\x9c \x85", "\\x9b2J \\x9d0;t\\x9c \\x85"),                # C1: CSI, OSC, ST, NEL
    ("run\u202egnp.exe", "run\\u{202e}gnp.exe"),                             # RLO
    ("\u202a\u202b\u202c\u202d\u200e\u200f\u061c", "\\u{202a}\\u{202b}\\u{202c}\\u{202d}\\u{200e}"
                                                  "\\u{200f}\\u{061c}"),
    ("\u2066x\u2067y\u2068z\u2069", "\\u{2066}x\\u{2067}y\\u{2068}z\\u{2069}"),  # isolates
    ("a\u2028b\u2029c", "a\\u{2028}b\\u{2029}c"),                            # line/paragraph separators
    ("\ufeffrun\u200b-a\u2060", "\\u{feff}run\\u{200b}-a\\u{2060}"),          # invisible
    ("ru\xadn", "ru\\xadn"),                                                 # soft hyphen
    ("tag\U000e0041\U000e007f", "tag\\u{e0041}\\u{e007f}"),                  # tag characters
    ("bad\udcff", "bad\\u{dcff}"),                                           # a lone surrogate
])
def test_each_unsafe_class_is_escaped(raw: str, shown: str) -> None:
    assert printable(raw) == shown
    assert clean(printable(raw))


def test_ordinary_text_cjk_and_emoji_are_unchanged() -> None:
    for text in ["loss=0.25 step=100 /data/ckpt-100.pt", "关机 显存 不足", "训练 🚀 done ✅",
                 "family 👨\u200d👩\u200d👧 and ❤\ufe0f", "کتاب\u200cها", "Ünïcödé ß ©", ""]:
        assert printable(text) == text


def test_every_escaped_character_is_unprintable_so_the_fast_path_is_sound() -> None:
    assert all(not c.isprintable() for c in UNSAFE)
    # and render escapes exactly UNSAFE: nothing else is touched, all of it is
    assert {c for c in map(chr, range(0x110000)) if printable(c) != c} == UNSAFE


@SETTINGS
@given(st.text(max_size=200))
def test_printable_never_leaves_an_unsafe_character_and_is_idempotent(text: str) -> None:
    once = printable(text)
    assert clean(once)
    assert printable(once) == once


@SETTINGS
@given(st.text(alphabet=st.characters(blacklist_characters=sorted(UNSAFE)), max_size=200))
def test_safe_text_is_left_alone(text: str) -> None:
    assert printable(text) == text


@SETTINGS
@given(st.text(max_size=200))
def test_printable_lines_keeps_the_lines_and_escapes_each(text: str) -> None:
    shown = printable_lines(text)
    lines = shown.split("\n")
    assert len(lines) == len(text.split("\n")) and all(clean(line) for line in lines)


def test_printable_lines_takes_crlf_as_one_line_break() -> None:
    assert printable_lines("a\r\nb\x1b[2J\r\n\rc\n") == "a\nb\\x1b[2J\n\\x0dc\n"


@SETTINGS
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=30),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                               max_size=4),
                    max_leaves=12))
def test_json_safe_keeps_the_data_and_is_terminal_safe(value: object) -> None:
    text = json.dumps(value, ensure_ascii=False)
    safe = json_safe(text)
    assert clean(safe) and json.loads(safe) == value


def test_json_safe_escapes_del_in_ascii_text() -> None:
    """json.dumps leaves DEL (0x7f) as it is, and DEL is ASCII: the ASCII shortcut must not skip it."""
    safe = json_safe(json.dumps({"\x7f": "a\x7fb"}, ensure_ascii=False))
    assert "\x7f" not in safe and json.loads(safe) == {"\x7f": "a\x7fb"}


def test_event_lines_escape_box_text_in_both_forms() -> None:
    event = protocol.Event(run="r1", host="box", seq=1, ts=0.0, kind="log\x9b2J", sev="info",
                           data={"line": "ok\u202egnp.exe \x1b]52;c;eA==\x07 关机"})
    row = table_row(event)
    assert clean(row) and "log\\x9b2J" in row and "\\u{202e}" in row and "\\u001b]52;c;" in row
    line = json_line(event)
    assert clean(line) and "\\u009b" in line and "\\u202e" in line and "关机" in line
    assert json.loads(line) == event.to_dict()


# ---- where box text meets the terminal ----------------------------------------------------------


HOSTILE = {"lease": {"armed": True, "ttl_s": 7200, "renewed_by": "ctl\x1b[2J\x1b[H",
                     "max_hours": "12\x1b]52;c;cm0gLXJmIH4K\x07", "fired": None,
                     "authorized": "not a dict"},
           "seconds_left": float("nan"), "daemon": {"pid": "1\x9b31m", "alive": True},
           "decision": {"verdict": "armed", "reason": "ok\r\x1b[32mgate OPEN\x1b[0m"},
           "would": {"action": "stop\u2028FAKE LINE", "reason": "\u202etxt.exe", "refused": None}}


def test_deadman_render_escapes_a_hostile_answer() -> None:
    text = deadman.render("gpu1", HOSTILE)
    lines = text.split("\n")
    assert all(clean(line) for line in lines)
    assert len(lines) == 6  # armed, expires, budget, daemon, now, when it fires: nothing injected
    assert "renewed by ctl\\x1b[2J\\x1b[H" in lines[1] and "expires in   - " in lines[1]
    assert "\\x1b]52;c;cm0gLXJmIH4K\\x07" in lines[2] and "pid 1\\x9b31m" in lines[3]
    assert lines[4] == "  now          armed: ok\\x0d\\x1b[32mgate OPEN\\x1b[0m"
    assert "stop\\u{2028}FAKE LINE: \\u{202e}txt.exe" in lines[5]


def test_error_tails_of_box_stderr_are_escaped() -> None:
    tail = error_tail(b"fine\nno\x1b]0;pwned\x07 \xc2\x9b2J\r\n\xe2\x80\xae done\n")
    assert clean(tail) and tail == "fine / no\\x1b]0;pwned\\x07 \\x9b2J / \\u{202e} done"


def test_cli_errors_hints_and_log_lines_are_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    clibase._report("box said \x1b[2J", "try \x9b0m")
    handler = clibase._EchoHandler(debug=False)
    hostile = ("\x1b]52;c;eA==\x07",)
    handler.emit(logging.LogRecord("x", logging.WARNING, __file__, 1, "box %s", hostile, None))
    err = capsys.readouterr().err
    assert clean(err.replace("\n", ""))
    assert err.splitlines() == ["error: box said \\x1b[2J", "hint: try \\x9b0m",
                                "warning: box \\x1b]52;c;eA==\\x07"]


class ProbeShell:
    """A box whose probe answer names a hostile interpreter and venv; records every command."""

    alias = "fake"

    def __init__(self, answers: List[bytes]) -> None:
        self.answers = list(answers)
        self.commands: List[str] = []

    def run(self, command: str, *, input: Optional[bytes] = None, timeout_s: float = 60,
            check: bool = True) -> subprocess.CompletedProcess[bytes]:
        self.commands.append(command)
        return subprocess.CompletedProcess(command, 0, self.answers.pop(0), b"")

    def put(self, files: Sequence[Path], remote_dir: str, timeout_s: float = 600) -> None:
        raise AssertionError("an install of the same version copies nothing")


def test_install_progress_lines_from_a_hostile_box_are_escaped(tmp_path: Path) -> None:
    wheel = tmp_path / f"remote_gpu_trainer-{PACKAGE_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"remote_gpu_trainer-{PACKAGE_VERSION}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: remote-gpu-trainer\nVersion: {PACKAGE_VERSION}\n")
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    markers = {"python_version": "3.11", "sys_platform": "linux", "platform_machine": "x86_64"}
    probe = {"version": [3, 11, 7], "executable": "/py\x1b]52;c;cm0gLXJmIH4K\x07", "venv": "/v\x1b[2J",
             "wheels_dir": "/w\u202e", "home": "/h", "markers": markers, "tags": ["py3-none-any"],
             "venv_python": True, "record": {"version": PACKAGE_VERSION, "sha256": sha}, "wheels": {}}
    shell = ProbeShell([json.dumps(probe).encode() + b"\n",
                        f"rgt-onbox, version {PACKAGE_VERSION}\n".encode()])
    lines: List[str] = []
    with Store.open(tmp_path / "rgt.db") as store:
        result = install.install(store, "local", install.InstallOptions(wheel=wheel, python="python3"),
                                 progress=lines.append, shell=shell)  # type: ignore[arg-type]
    assert result.already and len(shell.commands) == 2
    assert lines and all(clean(line) for line in lines)
    assert any("(/py\\x1b]52;c;cm0gLXJmIH4K\\x07)" in line for line in lines)
    assert any("already in /v\\x1b[2J" in line for line in lines)


def test_a_json_answer_holding_a_raw_line_separator_is_still_read() -> None:
    from controller.output import last_json_object

    doc = {"reason": "a\u2028b\x85c"}
    assert last_json_object(b"noise\n" + json.dumps(doc, ensure_ascii=False).encode() + b"\n") == doc
