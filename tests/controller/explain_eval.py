"""The explain eval set: tests/controller/explain_cases/*.jsonl, read and scored.

Each line is {"q": a question as people ask it, "want": [ids that must all be in the top 3]}; an id
is a catalog entry or a platform fact (profile:NAME/TOPIC). Used by test_explain_eval.py (which
fails below MIN_TOP3) and bench/explain_rank.py (top-1, top-3 and the time per question).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import List, Sequence, Tuple

from controller.insight import explain

CASES = Path(__file__).resolve().parent / "explain_cases"
MIN_TOP3 = 0.95


@dataclasses.dataclass(frozen=True)
class Case:
    where: str              # file:line
    q: str
    want: Tuple[str, ...]

    @property
    def chinese(self) -> bool:
        return any("\u4e00" <= c <= "\u9fff" for c in self.q)

    @property
    def platform(self) -> bool:
        return any(w.startswith("profile:") for w in self.want)


def load_cases(folder: Path = CASES) -> List[Case]:
    out: List[Case] = []
    for path in sorted(folder.glob("*.jsonl")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            doc = json.loads(line)
            out.append(Case(f"{path.name}:{n}", str(doc["q"]), tuple(doc["want"])))
    return out


@dataclasses.dataclass(frozen=True)
class Result:
    case: Case
    got: Tuple[str, ...]    # the top 3 ids

    @property
    def top1(self) -> bool:
        return bool(self.got) and self.got[0] in self.case.want

    @property
    def top3(self) -> bool:
        return all(w in self.got for w in self.case.want)


def run(cases: Sequence[Case]) -> List[Result]:
    return [Result(c, tuple(h.entry.id for h in explain.answer(explain.parse_query([c.q]), 3).hits))
            for c in cases]
