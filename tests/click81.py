"""A pytest plugin (`-p tests.click81`, loaded by `make py39`) that gives click 8.1's CliRunner the
result streams of click 8.2, which the controller's tests are written against.

click 8.2 needs Python 3.10, so a 3.9 laptop runs rgt on click 8.1. The commands behave the same;
only the test runner differs: 8.1 mixes stderr into stdout unless told `mix_stderr=False` and then
`result.stderr` raises, while 8.2 always keeps stderr apart and `result.output` holds both. Here a
runner keeps stderr apart by default and `output` is stdout followed by stderr (8.2 interleaves
them as written; the tests only look for text in it). With click 8.2 or newer this does nothing.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from click import testing


def _patch() -> None:
    if "mix_stderr" not in inspect.signature(testing.CliRunner.__init__).parameters:
        return  # click 8.2+
    original = testing.CliRunner.__init__

    @functools.wraps(original)
    def init(self: testing.CliRunner, *args: Any, mix_stderr: bool = False, **kwargs: Any) -> None:
        original(self, *args, mix_stderr=mix_stderr, **kwargs)

    def output(self: testing.Result) -> str:
        return self.stdout + (self.stderr if self.stderr_bytes is not None else "")

    testing.CliRunner.__init__ = init  # type: ignore[method-assign]
    testing.Result.output = property(output)  # type: ignore[assignment,method-assign]


_patch()
