"""Reading claims out of cleaned text: metric names, numbers, prose, and what a claim is.

controller/insight/claims_doc.py cleans a document and reads its tables; this module holds the pieces
both it and the prose reader use: METRICS, `numbers`, `mentions`, `Claim`, `Doc`, `prose_claims`.

Metric names come from METRICS: how documents write each (`acc`, `Top-1`, `mAP@0.5`, `F1`,
`BLEU-4`, `ppl`...) and the tokens evidence keys use for it. A name counts only as a whole word,
and `mAP` only so spelled (`map` is an English word).

Numbers: a decimal (`91.3`, `.5`, `1,234.5`, `1e-4`, `-0.2`, optional `%` or ` dB`) not glued to a
word: nothing alphanumeric right before it, nor `-_.@` or an en dash after one (`Set5`, `v2`,
`ResNet-50`, `CIFAR-10`, `25-40` hold none), and no letter or digit right after it (`50k`, `2x`).
Never a claim: a `+` number (a delta); one right after by/than/from/over/under/above/below/step/
epoch/iter/x or a reference sign (`#`, `[`, section, pilcrow); one right before a counting word
(`90 epochs`, `1.2 points`, `8 GPUs`). The last written digit is the precision: `91.3` stands
for [91.25, 91.35].

Prose (lines outside tables with metric headers): a number belongs to the metric name before it
on its line (at most WINDOW characters back, no sentence end and no other name in between:
`top-1 accuracy on ImageNet is 76.1`), or to the name right after it with at most one word in
between (`91.3% test accuracy`, `32.1 dB PSNR`); when both could take it, the one with fewer
words between wins, the name before on a tie. A name takes one number (`accuracy 91.3 and 92.1`:
91.3). Names joined by `/`, `,`, `and`, `&` share as many numbers joined the same way (`PSNR/SSIM
of 32.1/0.89`, `precision and recall are 0.81 and 0.77`); unequal counts claim nothing.

Context: each claim keeps the words of its clause (prose: from the previous claim's clause to
the next `,` `;` `and` or sentence end after its number) or of its header and row label (table);
controller.insight.reconcile picks among evidence keys with them (`val` vs `test`, `Set5` vs `Set14`).
`step N`/`epoch N`/`iter N` (`5k` = 5000) there, or a `Step`/`Epoch` column, names the step the
claim is about; `best` there asks for the best value.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from decimal import Decimal, InvalidOperation
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

WINDOW = 48  # characters from the end of a metric name to the start of its number


# ---- metric names -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Metric:
    """One metric: how documents write it, how evidence keys spell it, how it compares."""

    name: str
    prose: str  # regex of the written forms
    keys: Tuple[str, ...]  # evidence key tokens, lower case (a token may add digits: map50)
    ratio: bool = False  # written as a percent or as a fraction, so x100 may be needed
    lower_is_better: bool = False
    case_sensitive: bool = False


_ACC = r"(?:[ -]acc(?:uracy)?\.?)?"
# Specific before general: a key with several metric tokens takes the first one listed here.
METRICS: Tuple[Metric, ...] = (
    Metric("top5", rf"top-?5{_ACC}|acc(?:uracy)?@5", ("top5",), ratio=True),
    Metric("accuracy", rf"top-?1{_ACC}|acc(?:uracy)?@1|accuracy|acc\.?", ("accuracy", "acc", "top1"),
           ratio=True),
    Metric("map", r"mAP(?:@?(?:\d*\.)?\d+(?:[:-](?:\d*\.)?\d+)?)?", ("map",), ratio=True,
           case_sensitive=True),
    Metric("miou", r"miou", ("miou",), ratio=True),
    Metric("iou", r"iou", ("iou",), ratio=True),
    Metric("f1", r"f1(?:[- ]score)?|f-score|f-measure", ("f1",), ratio=True),
    Metric("precision", r"precision", ("precision",), ratio=True),
    Metric("recall", r"recall", ("recall",), ratio=True),
    Metric("auc", r"(?:roc[- ])?auc|auroc", ("auc", "auroc"), ratio=True),
    Metric("dice", r"dice", ("dice",), ratio=True),
    Metric("bleu", r"bleu(?:-?4)?", ("bleu",), ratio=True),
    Metric("rouge", r"rouge(?:-?(?:1|2|lsum|l))?", ("rouge", "rougel", "rougelsum"), ratio=True),
    Metric("wer", r"wer", ("wer",), ratio=True, lower_is_better=True),
    Metric("cer", r"cer", ("cer",), ratio=True, lower_is_better=True),
    Metric("psnr", r"psnr", ("psnr",)),
    Metric("ssim", r"ssim", ("ssim",)),
    Metric("lpips", r"lpips", ("lpips",), lower_is_better=True),
    Metric("fid", r"fid", ("fid",), lower_is_better=True),
    Metric("perplexity", r"perplexity|ppl", ("perplexity", "ppl"), lower_is_better=True),
    Metric("loss", r"loss", ("loss",), lower_is_better=True),
    Metric("rmse", r"rmse", ("rmse",), lower_is_better=True),
    Metric("mse", r"mse", ("mse",), lower_is_better=True),
    Metric("mae", r"mae", ("mae",), lower_is_better=True),
)
METRIC_BY_NAME: Dict[str, Metric] = {m.name: m for m in METRICS}

_NAME_RES = tuple(
    (m, re.compile(rf"(?<![A-Za-z0-9])(?:{m.prose})(?![A-Za-z0-9])", 0 if m.case_sensitive else re.I))
    for m in METRICS)


@dataclasses.dataclass(frozen=True)
class Mention:
    metric: Metric
    start: int
    end: int
    text: str


def mentions(text: str) -> List[Mention]:
    """Metric names in text, left to right; of overlapping ones the longest."""
    found = [Mention(m, x.start(), x.end(), x.group()) for m, rx in _NAME_RES for x in rx.finditer(text)]
    found.sort(key=lambda x: (x.start, x.start - x.end))
    out: List[Mention] = []
    for x in found:
        if not out or x.start >= out[-1].end:
            out.append(x)
    return out


# ---- numbers ------------------------------------------------------------------------------

_NUMBER = re.compile(
    r"(?P<sign>[-+\u2212])?(?P<num>(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)"
    r"(?P<exp>[eE][-+]?[0-9]+)?(?P<pct> ?%| ?dB)?")
_GLUE = "-_.@\u2013"  # and the en dash of ranges (25\u201340)
_SKIP_BEFORE = re.compile(r"(?:\b(?:by|than|from|over|under|above|below|steps?|epochs?|iters?|iterations?)"
                          r"|[#\[\u00a7\u00b6]|\\times\$?|(?<![A-Za-z])[x\u00d7])\s*[:=]?\s*$", re.I)
_SKIP_AFTER = re.compile(r"\s*(?:steps?|epochs?|iters?|iterations?|points?|pp|ep|gpus?|hours?|"
                         r"minutes?|seconds?|samples|images|tokens|layers|params|parameters)\b", re.I)


@dataclasses.dataclass(frozen=True)
class Number:
    start: int
    end: int
    shown: str  # as written, with sign and % (commas kept)
    value: float  # a percent stays as written: 91.3% is 91.3
    half: float  # half a unit of the last shown digit
    percent: bool


def _glued(text: str, start: int, end: int) -> bool:
    before = text[start - 1] if start > 0 else " "
    if before.isalnum() or (before in _GLUE and start > 1 and text[start - 2].isalnum()):
        return True
    after = text[end] if end < len(text) else " "
    return after.isalnum() or (after == "." and text[end + 1:end + 2].isdigit())


def _number(x: re.Match[str]) -> Optional[Number]:
    digits = x.group("num").replace(",", "") + (x.group("exp") or "")
    try:
        dec = Decimal(digits)
    except InvalidOperation:
        return None
    exponent = dec.as_tuple().exponent
    if not isinstance(exponent, int):
        return None
    sign = -1.0 if x.group("sign") in ("-", "\u2212") else 1.0
    suffix = (x.group("pct") or "").strip()
    return Number(x.start(), x.end(), x.group().replace(" %", "%"), sign * float(dec),
                  0.5 * 10.0 ** exponent, suffix == "%")


def numbers(text: str) -> List[Number]:
    """The numbers in text that may be claims (see the module docstring for what is skipped)."""
    out = []
    for x in _NUMBER.finditer(text):
        if _glued(text, x.start(), x.end()) or x.group("sign") == "+":
            continue
        if _SKIP_BEFORE.search(text, max(0, x.start() - 16), x.start()) or _SKIP_AFTER.match(text, x.end()):
            continue
        n = _number(x)
        if n is not None:
            out.append(n)
    return out


# ---- context: words, steps, "best" ----------------------------------------------------------

_WORD = re.compile(r"[a-z0-9]+")
_PART = re.compile(r"[a-z]+|[0-9]+")
_SYNONYMS = {"validation": "val", "valid": "val", "testing": "test", "training": "train",
             "evaluation": "eval"}
_STEP = re.compile(r"\b(step|iter(?:ation)?|epoch)s?\s*[:=#]?\s*([0-9][0-9,]*(?:\.[0-9]+)?)(k?)\b", re.I)
_BEST = re.compile(r"\bbest\b", re.I)


def words(text: str, parts: bool = True) -> FrozenSet[str]:
    """Lower-case words (`Set5` gives set5, and with parts also set and 5), synonyms folded (val)."""
    found = _WORD.findall(text.lower())
    if parts:
        found += [p for w in found for p in _PART.findall(w)]
    return frozenset(_SYNONYMS.get(w, w) for w in found)


def without_numbers(text: str, nums: Sequence[Number]) -> str:
    chars = list(text)
    for n in nums:
        chars[n.start:n.end] = " " * (n.end - n.start)
    return "".join(chars)


def step_named(text: str, near: int) -> Optional[Tuple[str, float]]:
    """("step"|"epoch", N) named in text, the one nearest to offset `near`; None without one."""
    best: Optional[Tuple[int, Tuple[str, float]]] = None
    for x in _STEP.finditer(text):
        kind = "epoch" if x.group(1).lower() == "epoch" else "step"
        value = float(x.group(2).replace(",", "")) * (1000 if x.group(3) else 1)
        distance = abs(x.start() - near)
        if best is None or distance < best[0]:
            best = (distance, (kind, value))
    return best[1] if best else None


# ---- claims --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Claim:
    line: int  # 1-based
    col: int  # 1-based, of the number's first character
    metric: str  # METRICS name
    name: str  # the metric as written ("Top-1", "Acc. (%)")
    shown: str  # the number as written
    value: float
    half: float
    percent: bool  # written with %, or under a header with %
    kind: str  # "prose" | "table"
    context: FrozenSet[str] = frozenset()
    step: Optional[Tuple[str, float]] = None
    best: bool = False

    def to_dict(self) -> Dict[str, object]:
        return {"line": self.line, "col": self.col, "metric": self.metric, "name": self.name,
                "shown": self.shown, "value": self.value, "plus_minus": self.half, "percent": self.percent,
                "kind": self.kind, "step": list(self.step) if self.step else None, "best": self.best}


class Doc:
    """The cleaned text with a map from offsets to (line, col)."""

    def __init__(self, text: str, rows: Optional[re.Pattern[str]] = None) -> None:
        self.text = text
        self.rows = rows  # only table rows whose label this matches hold claims
        self.starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
        self.lines = text.split("\n")

    def where(self, offset: int) -> Tuple[int, int]:
        i = bisect.bisect_right(self.starts, offset) - 1
        return i + 1, offset - self.starts[i] + 1

    def claim(self, base: int, n: Number, metric: Metric, name: str, kind: str, context: str,
              step: Optional[Tuple[str, float]], percent: bool = False) -> Claim:
        line, col = self.where(base + n.start)
        return Claim(line, col, metric.name, name, n.shown, n.value, n.half, n.percent or percent, kind,
                     words(context), step, bool(_BEST.search(context)))


_LIST_SEP = re.compile(r"\s*(?:/|,\s*(?:and\s+)?|and\s+|&|\\&)\s*", re.I)
_SENTENCE_END = re.compile(r"[.;!?](?:\s|$)")
_CLAUSE_END = re.compile(r"[,;.!?](?:\s|$)|\s(?:and|but|while|whereas)\s", re.I)
_PREFIX_GAP = re.compile(r"\s+(?:(?!(?:and|or|but|while|with|of|on|in|at|for|to|is|was|are|were|vs)\b)"
                         r"[A-Za-z][\w-]*\s+)?|\s*", re.I)


def _chains(found: List[Mention], text: str) -> List[List[Mention]]:
    """Mentions joined by / , and & form one chain (a list of names sharing a list of numbers)."""
    out: List[List[Mention]] = []
    for m in found:
        if out and _LIST_SEP.fullmatch(text[out[-1][-1].end:m.start]):
            out[-1].append(m)
        else:
            out.append([m])
    return out


def _gap_words(gap: str) -> int:
    return len(re.findall(r"(?<![\\A-Za-z])[A-Za-z]+", gap))


def _after_chain(chains: List[List[Mention]], n: Number, text: str) -> Optional[int]:
    """The chain right before n that may take it (index), or None."""
    before = [i for i, c in enumerate(chains) if c[-1].end <= n.start]
    if not before:
        return None
    i = before[-1]
    gap = text[chains[i][-1].end:n.start]
    return i if len(gap) <= WINDOW and not _SENTENCE_END.search(gap) else None


def _prefix_chain(chains: List[List[Mention]], n: Number, text: str) -> Optional[int]:
    """The one-name chain right after n that may take it (`91.3% accuracy`), or None."""
    after = [i for i, c in enumerate(chains) if c[0].start >= n.end]
    if not after or len(chains[after[0]]) != 1:
        return None
    i = after[0]
    gap = text[n.end:chains[i][0].start]
    return i if len(gap) <= 16 and _PREFIX_GAP.fullmatch(gap) else None


def _number_list(nums: List[Number], first: int, k: int, text: str) -> Optional[List[int]]:
    """Indexes of k numbers from nums[first] joined by list separators; None when there are fewer."""
    got = [first]
    while len(got) < k:
        nxt = got[-1] + 1
        if nxt >= len(nums) or not _LIST_SEP.fullmatch(text[nums[got[-1]].end:nums[nxt].start]):
            return None
        got.append(nxt)
    return got


def _assign(text: str, chains: List[List[Mention]], nums: List[Number]) -> List[Tuple[Mention, Number]]:
    """Pair names with numbers by the prose rules of the module docstring."""
    taken, used, pairs = set(), set(), []
    for j, n in enumerate(nums):
        if j in used:
            continue
        a, p = _after_chain(chains, n, text), _prefix_chain(chains, n, text)
        a = None if a in taken else a
        p = None if p in taken else p
        if a is not None and p is not None:
            after_words = _gap_words(text[chains[a][-1].end:n.start])
            prefix_words = _gap_words(text[n.end:chains[p][0].start])
            a, p = (a, None) if after_words <= prefix_words else (None, p)
        if p is not None:
            taken.add(p)
            pairs.append((chains[p][0], n))
        elif a is not None:
            taken.add(a)
            listed = _number_list(nums, j, len(chains[a]), text)
            if listed is not None:
                used.update(listed)
                pairs.extend(zip(chains[a], (nums[i] for i in listed)))
    return pairs


def prose_claims(doc: Doc, base: int, text: str) -> List[Claim]:
    """The claims in one stretch of prose (a line, or a table row read as prose)."""
    found = mentions(text)
    if not found:
        return []
    nums = numbers(text)
    pairs = sorted(_assign(text, _chains(found, text), nums), key=lambda p: p[1].start)
    plain = without_numbers(text, nums)
    out, since = [], 0
    for i, (m, n) in enumerate(pairs):
        start, end = min(since, m.start, n.start), max(n.end, m.end)
        upto = min(pairs[i + 1][0].start, pairs[i + 1][1].start) if i + 1 < len(pairs) else len(text)
        cut = _CLAUSE_END.search(text, end, max(upto, end))
        stop = cut.start() if cut else max(upto, end)
        step = step_named(text[start:stop], n.start - start)
        out.append(doc.claim(base, n, m.metric, m.text, "prose", plain[start:stop], step))
        since = stop
    return out
