"""How old the profiles' facts are: every `verified = "YYYY-MM"` stamp with its age in months.

A stamp is stale when its age is more than `months` (6 by default): a 2026-06 stamp is still fine
in 2026-12 and stale from 2027-01 (whole calendar months are counted). A passing check only
says the facts were looked at recently; it never says they are still true. Imports nothing of ours.
"""
from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import List, Optional, Union

from profiles.loader import load, names
from profiles.model import Profile, Stamp
from profiles.schema import MONTH

STALE_MONTHS = 6


@dataclasses.dataclass(frozen=True)
class Aged:
    """One stamp of one profile file, with its age on the day asked about."""

    profile: str
    path: Path
    line: int
    key: str
    verified: str
    age_months: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def is_month(value: str) -> bool:
    """True for a real "YYYY-MM" month."""
    return bool(MONTH.match(value))


def this_month(today: Optional[datetime.date] = None) -> str:
    day = today or datetime.date.today()
    return f"{day.year:04d}-{day.month:02d}"


def months_between(earlier: str, later: str) -> int:
    """Whole months from `earlier` to `later` ("YYYY-MM" each); negative when `earlier` is later."""
    for value in (earlier, later):
        if not is_month(value):
            raise ValueError(f"{value!r} is not a \"YYYY-MM\" month")
    (y1, m1), (y2, m2) = ((int(v[:4]), int(v[5:])) for v in (earlier, later))
    return (y2 * 12 + m2) - (y1 * 12 + m1)


def stamps(profile_or_path: Union[Profile, Path, str]) -> List[Stamp]:
    """The stamps of a loaded profile, or of the profile file at a path (loaded and checked first)."""
    if isinstance(profile_or_path, Profile):
        return list(profile_or_path.stamps)
    path = Path(profile_or_path)
    return list(load(path.stem, path.parent).stamps)


def ages(today: Optional[str] = None, where: Optional[Path] = None) -> List[Aged]:
    """Every stamp of every profile in `where` (the packaged ones by default), aged to `today`
    ("YYYY-MM", this month by default). A profile that does not load raises ProfileError."""
    now = today or this_month()
    out: List[Aged] = []
    for name in names(where):
        profile = load(name, where)
        out += [Aged(profile=name, path=profile.path, line=s.line, key=s.key, verified=s.verified,
                     age_months=months_between(s.verified, now)) for s in profile.stamps]
    return out


def stale(today: Optional[str] = None, months: int = STALE_MONTHS,
          where: Optional[Path] = None) -> List[Aged]:
    """The stamps older than `months` on `today`, oldest first."""
    if months < 0:
        raise ValueError(f"months must be 0 or more, not {months}")
    old = [a for a in ages(today, where) if a.age_months > months]
    return sorted(old, key=lambda a: (-a.age_months, a.profile, a.line))
