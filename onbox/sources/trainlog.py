"""Tail <run>/train.log (the job's stdout and stderr) into `Record`s.

Lines end at "\\n" or "\\r" (a tqdm bar rewrites itself with "\\r"); ANSI colour codes are dropped.
Each line is tried, in this order:

1. the user's regex (`LogParser(regex=...)`), when given: on a match its named groups are the
   record (groups named step/global_step/iter/iteration and epoch are the counters, the others
   scalars) and nothing else is tried; a group that is not a number makes the line bad;
2. a dict as the Hugging Face Trainer prints it, ``{'loss': 0.12, 'learning_rate': 5e-05, 'epoch':
   0.5}``: read with `ast.literal_eval` (never eval) after bare ``nan``/``inf`` became strings and
   ``np.float32(0.5)``-style wrappers their argument; JSON objects are read with `json` as a fallback.
   A dict that reads as neither but names loss/epoch/learning_rate is a bad line; other
   unreadable braces are just text;
3. a tqdm bar, `` 33%|███▎      | 20/60 [00:01<00:02, 14.89it/s]``. A bar with no description (the
   Trainer's training bar) gives the step and its total (``20/60``), with three guards: ``0/N``
   (a bar just drawn, before a resumed run jumps to its step) gives nothing; the first such bar
   fixes the total, and bars with another total (the Trainer's evaluation bar) are ignored; once
   a bar reached its total, a later bar counting from the start again is a loop's own counter
   (``for batch in tqdm(loader)`` each epoch), and bars give no step any more in this job attempt
   (`new_attempt()` lifts both). A bar described ``Epoch N:`` (Lightning's TQDM bar) gives the epoch
   and the ``key=value`` pairs of its postfix; other described bars (``Writing model shards``) nothing;
4. ``key=value`` and ``key: value`` pairs with a numeric value (``loss=0.5``, ``lr: 5e-05``,
   ``loss=nan``), and the counters ``Epoch 3/10`` and ``step 120``. Keys are lower-cased. Rich's
   bar (Lightning's default; in a non-TTY printed once, at the end) is read this way:
   ``Epoch 0/-2 ━━ 60/60 ... v_num: 0.000`` and ``train_loss: nan`` on the next line.

A log is text, not metrics: outside the user's regex, a name read from a line (a dict's keys, a
bar's postfix, a pair) is a scalar only when `protocol.metrics` knows it as a metric name (loss, lr,
grad_norm, accuracy, eval_*, ...) or the job declared it (`declared`: its watch list). So a
torchrun warning's ``torch/distributed/run.py:874``, tqdm's ``Loading checkpoint shards: 2``,
Lightning's ``using: 0 TPU cores`` and ``v_num``, ``loss_utils.py:88`` or a printed config dict
give nothing; ``time``/``timestamp`` fields never do, not even through the regex.

The tail itself is `onbox.sources.metrics.FileTail`.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from protocol.metrics import is_metric_name

from onbox.errors import ConfigError
from onbox.sources.metrics import (
    MAX_NAME,
    MAX_SCALARS,
    Record,
    TailSource,
    record_from_mapping,
    to_epoch,
    to_number,
    to_step,
)

MAX_DICT_CHARS = 16_384   # a longer {...} line is not literal_eval'ed
MAX_DICT_DEPTH = 8        # nor one with more opening brackets than this

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_BARE_NONFINITE = re.compile(r"(?<![\w'\".])([-+]?(?:nan|inf|infinity))(?![\w'\"])", re.IGNORECASE)
_WRAPPER = re.compile(
    r"\b(?:np\.|numpy\.|torch\.)?(?:float\d*|int\d*|uint\d*|tensor)\(\s*([^(),]*?)\s*(?:,[^()]*)?\)")
_METRIC_DICT = re.compile(r"['\"](?:\w*loss\w*|epoch|learning_rate)['\"]\s*:", re.IGNORECASE)
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?![\d.])"
_WORD = r"[-+]?(?:nan|inf(?:inity)?)\b"
_PAIR = re.compile(r"(?<![\w./:-])([A-Za-z_][\w./-]{0,63})\s*[=:]\s*(" + _NUMBER + "|" + _WORD + ")",
                   re.IGNORECASE)
_COUNTER = re.compile(r"(?<![\w/])(epoch|step|iteration|iter)\s+(\d+)(?:\s*/\s*\d+)?(?![\w.])", re.IGNORECASE)
_STEP_NAMES = ("step", "global_step", "iteration", "iter")
_BAR = re.compile(r"(?P<desc>[^|]*?)\s*\d{1,3}%\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+)"
                  r"\s*(?:\[(?P<post>[^\]]*)\]?)?")
_BAR_EPOCH = re.compile(r"^Epoch\s+(\d+)\s*:?$", re.IGNORECASE)


def _literal(body: str) -> Optional[Any]:
    """A Python literal or JSON value from `body`, or None when it is neither (never evaluates code)."""
    if len(body) > MAX_DICT_CHARS or body.count("{") + body.count("[") > MAX_DICT_DEPTH:
        return None
    text = _BARE_NONFINITE.sub(r"'\1'", _WRAPPER.sub(r"\1", body))
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


class LogParser:
    """One train.log line -> (record or None, bad); see the module doc."""

    def __init__(self, regex: Optional[str] = None, declared: Sequence[str] = ()) -> None:
        self.regex: Optional[re.Pattern[str]] = None
        self.declared = tuple(d.lower() for d in declared)
        self.bar_total: Optional[int] = None   # the training bar's total (see the module doc)
        self.bar_done = False                  # a bar reached its total in this job attempt
        self.bar_last: Optional[int] = None
        if regex:
            try:
                self.regex = re.compile(regex)
            except re.error as e:
                raise ConfigError(f"log regex {regex!r} does not compile: {e}") from e
            if not self.regex.groupindex:
                raise ConfigError(f"log regex {regex!r} has no named groups (?P<name>...)")
            self.declared += tuple(name.lower() for name in self.regex.groupindex)

    def parse(self, text: str) -> Tuple[Optional[Record], bool]:
        text = _ANSI.sub("", text).strip()
        if not text:
            return None, False
        if self.regex is not None:
            match = self.regex.search(text)
            if match is not None:
                return self._from_groups(match.groupdict())
        start = text.find("{")
        if start >= 0 and text.endswith("}") and ":" in text[start:]:
            body = text[start:]
            obj = _literal(body)
            if isinstance(obj, dict):
                return record_from_mapping(obj, "log", strict=True, declared=self.declared), False
            if _METRIC_DICT.search(body):
                return None, True
        bar = _BAR.search(text)
        if bar is not None:
            return self._from_bar(bar), False
        return self._from_pairs(text), False

    def new_attempt(self) -> None:
        """A new job attempt: its bar may have another total and counts from the start."""
        self.bar_total, self.bar_done, self.bar_last = None, False, None

    def _from_bar(self, bar: re.Match[str]) -> Optional[Record]:
        desc = bar.group("desc").strip()
        n, total = int(bar.group("n")), int(bar.group("total"))
        pairs = self._from_pairs(bar.group("post") or "")
        scalars = dict(pairs.scalars) if pairs is not None else {}
        if desc:
            epoch = _BAR_EPOCH.match(desc)
            if epoch is None:
                return None
            return Record("log", None, float(epoch.group(1)), scalars)
        step: Optional[int] = n
        if n == 0 or total == 0 or (self.bar_total is not None and total != self.bar_total):
            step = None
        elif self.bar_last is not None and n < self.bar_last and self.bar_done:
            self.bar_total, step = -1, None   # a loop's own counter: no steps from bars in this attempt
        else:
            self.bar_total, self.bar_last = total, n
            self.bar_done = self.bar_done or n >= total
        if step is None and not scalars:
            return None
        return Record("log", step, None, scalars, total=total if step is not None else None)

    def _from_groups(self, groups: Dict[str, Optional[str]]) -> Tuple[Optional[Record], bool]:
        step: Optional[int] = None
        epoch: Optional[float] = None
        scalars: Dict[str, float] = {}
        for name, value in groups.items():
            if value is None:
                continue
            number = to_number(value)
            if number is None:
                return None, True
            low = name.lower()
            if low in _STEP_NAMES:
                step = to_step(number)
            elif low == "epoch":
                epoch = to_epoch(number)
            elif len(scalars) < MAX_SCALARS and is_metric_name(low[:MAX_NAME], self.declared, strict=True):
                scalars[low[:MAX_NAME]] = number
        if step is None and epoch is None and not scalars:
            return None, False
        return Record("log", step, epoch, scalars), False

    def _from_pairs(self, text: str) -> Optional[Record]:
        step: Optional[int] = None
        epoch: Optional[float] = None
        scalars: Dict[str, float] = {}
        for match in _COUNTER.finditer(text):
            name, value = match.group(1).lower(), match.group(2)
            if name == "epoch":
                epoch = to_epoch(value)
            else:
                step = to_step(value)
        for match in _PAIR.finditer(text):
            name, number = match.group(1).lower(), to_number(match.group(2))
            if number is None:
                continue
            if name in _STEP_NAMES:
                step = to_step(number)
            elif name == "epoch":
                epoch = to_epoch(number)
            elif len(scalars) < MAX_SCALARS and is_metric_name(name[:MAX_NAME], self.declared, strict=True):
                scalars[name[:MAX_NAME]] = number
        if step is None and epoch is None and not scalars:
            return None
        return Record("log", step, epoch, scalars)


class LogSource(TailSource):
    """train.log -> `Record`s. Bad lines are only dict lines that could not be read."""

    name = "log"
    count_overlong = False

    def __init__(self, path: Path, regex: Optional[str] = None, declared: Sequence[str] = (),
                 **tail: Any) -> None:
        tail.setdefault("newlines", b"\r\n")
        super().__init__(path, **tail)
        self.parser = LogParser(regex, declared)

    def parse(self, line: bytes) -> Tuple[Optional[Record], bool]:
        record, bad = self.parser.parse(line.decode("utf-8", "replace"))
        if record is None:
            return None, bad
        return Record(self.name, record.step, record.epoch, record.scalars, record.total), bad


__all__ = ["LogParser", "LogSource"]
