"""Platform facts for `rgt explain`: each profile's billing, storage, clocks and access as documents.

A question that names a platform ("on vast.ai", "恒源云", "my RunPod pod") makes that profile's facts
eligible beside the catalog's entries (controller.insight.explain ranks both with one BM25F). Each
profile gives up to four documents, built from its data and nothing else:

- `profile:NAME/teardown`: what really stops the meter, and what each action stops, deletes and
  still bills, with the order that loses nothing (pull, verify, plan, then the action);
- `profile:NAME/storage`: each storage tier, whether it survives a stop and a release;
- `profile:NAME/clocks`: the danger clocks and the notes a person must hear before renting;
- `profile:NAME/access`: ssh, interruptions (spot) and the network scripts, where the profile has them.

Every document carries the oldest `verified` month of the facts it shows and their sources, so an
answer can say "from profile vastai, verified 2026-06". Platforms are found by the profile's
`aliases` (what people call it, English and Chinese) and its name where that is distinctive.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

from controller.insight.words import is_cjk

if TYPE_CHECKING:   # profiles are read only to build the facts (controller.insight.index_cache keeps them)
    import profiles

# Profile names too common as plain words to count as naming the platform on their own.
PLAIN_NAMES = frozenset({"local", "lambda", "generic-ssh", "colab-kaggle"})
# Words that ask about money, teardown or storage: without a platform named, the answer says how
# to get the platform's facts.
PLATFORM_WORDS = frozenset("""
bill billing billed bills meter metered charge charged charges charging pay paying paid cost costs
money invoice teardown destroy destroyed release released terminate terminated delete deleted
shutdown poweroff instance instances pod pods volume volumes
计费 扣费 收费 费用 释放 关机 销毁 删除 实例 数据盘 余额 欠费 停止计费
""".split())
_NOT_WORD = re.compile(r"[^a-z0-9]+")


@dataclasses.dataclass(frozen=True)
class Fact:
    """One document of platform facts; shaped like a catalog Entry where the index reads it."""

    id: str
    title: str
    symptoms: Tuple[str, ...]
    signals: Tuple[str, ...]     # the facts themselves, one line each
    cause: str                   # the one line that matters most
    fix: Tuple[str, ...]
    profile: str
    verified: str                # the oldest stamp among the facts shown ("" when none is dated)
    source: Tuple[str, ...]
    command: str
    kinds: Tuple[str, ...] = ()
    see: Tuple[str, ...] = ()


def normalized(text: str) -> str:
    """Lowercase words (and CJK runs) joined by single spaces, with a space at each end."""
    low = text.lower()
    if low.isascii():
        flat = _NOT_WORD.sub(" ", low)
    else:
        flat = "".join(c if ("a" <= c <= "z" or "0" <= c <= "9" or is_cjk(c)) else " " for c in low)
    return " " + " ".join(flat.split()) + " "


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def _oldest(months: Sequence[Optional[str]]) -> str:
    dated = sorted(m for m in months if m)
    return dated[0] if dated else ""


def _sources(items: Sequence[str]) -> Tuple[str, ...]:
    return tuple(dict.fromkeys(s for s in items if s))


def _label(p: profiles.Profile) -> str:
    return p.aliases[0] if p.aliases else p.name


def _teardown(p: profiles.Profile) -> Optional[Fact]:
    if not p.actions and not p.surface.meter_stop:
        return None
    lines = [f"{a.name}: stops the meter: {_yes(a.stops_meter)}; deletes: {a.deletes}; still bills: "
             f"{a.still_bills or 'nothing said'}; reversible: {_yes(a.reversible)}"
             for a in p.actions.values()]
    meter = p.actions.get(p.meter_stop_action or "")
    last = (f"Only then {meter.name} (it deletes {meter.deletes}); `rgt teardown RUN --action "
            f"{meter.name}` runs it behind the gate, after an explicit yes." if meter else
            "Only then stop the machine the way the platform offers; rgt teardown keeps the gate.")
    label = _label(p)
    return Fact(
        id=f"profile:{p.name}/teardown",
        title=f"{label}: what stops billing, and tearing down without losing checkpoints",
        symptoms=(f"which action on {label} actually stops billing",
                  "does a stopped instance still bill me, and what does destroy or release delete",
                  "how do I tear down the box without losing my checkpoints",
                  "stop paying for the GPU once training is done",
                  "关机以后还扣费吗，释放实例会删除数据吗，怎么停止计费"),
        signals=tuple(lines), cause=p.surface.meter_stop or f"The meter stops with {p.meter_stop_action}.",
        fix=("Pull the run and prove the copy first: rgt pull RUN, then rgt verify RUN.",
             "See what the teardown would do and whether the gate is open: rgt teardown RUN --plan.", last),
        profile=p.name, verified=_oldest([a.verified for a in p.actions.values()]),
        source=_sources([a.source for a in p.actions.values()]), command="rgt teardown RUN --plan")


def _storage(p: profiles.Profile) -> Optional[Fact]:
    if not p.storage:
        return None
    lines = [f"{t.name} ({t.path or 'mounted where you choose'}): survives a stop: {_yes(t.survives_stop)}; "
             f"survives a release: {_yes(t.survives_release)}"
             + (f"; bills while stopped: {t.bills_while_stopped}" if t.bills_while_stopped else "")
             + (f"; cap: {t.cap}" if t.cap else "") + (f". {t.note}" if t.note else "")
             for t in p.storage.values()]
    durable = [t for t in p.storage.values() if t.survives_release]
    keep = (f"Keep checkpoints that must outlive the instance on {', '.join(t.name for t in durable)}"
            + (f" ({p.scripts.durable_dir})" if p.scripts.durable_dir else "") + "."
            if durable else "No tier outlives the instance: pull and verify before any release.")
    label = _label(p)
    return Fact(
        id=f"profile:{p.name}/storage",
        title=f"{label}: storage tiers, what survives a stop and a release",
        symptoms=(f"where should I keep checkpoints on {label} so they survive",
                  "is the data disk kept after I stop or shut down the instance",
                  "which folder is deleted when the instance is released or destroyed",
                  "disk filled up, can I grow the volume, what does the storage cost while stopped",
                  "数据盘 系统盘 关机后保留吗 释放后删除 checkpoint 存哪里"),
        signals=tuple(lines), cause=keep,
        fix=(keep, "rgt profile show " + p.name + " prints every tier and what bills while stopped.",
             "Before a release or destroy: rgt pull RUN, rgt verify RUN, then rgt teardown RUN --plan."),
        profile=p.name, verified=_oldest([t.verified for t in p.storage.values()]),
        source=_sources([t.source for t in p.storage.values()]), command=f"rgt profile show {p.name}")


def _clocks(p: profiles.Profile) -> Optional[Fact]:
    s = p.surface
    if not (s.danger_clocks or s.notes):
        return None
    label = _label(p)
    return Fact(
        id=f"profile:{p.name}/clocks",
        title=f"{label}: danger clocks, what costs money or data when nobody acts",
        symptoms=(f"what should I know before renting on {label} the first time",
                  "I forgot the instance running, what happens to the money and the data",
                  "is the stopped instance deleted after some days, or at a zero balance",
                  "首次使用 注意事项 忘记关机 欠费 多少天后释放 数据会被删除"),
        signals=tuple(s.danger_clocks) + tuple(s.notes),
        cause=s.danger_clocks[0] if s.danger_clocks else s.notes[0],
        fix=("Arm the dead-man so a forgotten box stops itself safely: rgt deadman HOST arm.",
             f"Read every clock once: rgt profile show {p.name}.",
             "Pull and verify what you need before any clock runs out: rgt pull RUN, rgt verify RUN."),
        profile=p.name, verified=_oldest([st.verified for st in p.stamps]), source=(f"profile {p.name}",),
        command=f"rgt profile show {p.name}")


def _access(p: profiles.Profile) -> Optional[Fact]:
    lines: List[str] = []
    ssh, spot, sc = p.ssh, p.spot, p.scripts
    if ssh.user:
        lines.append(f"ssh user: {ssh.user}")
    if ssh.port_changes_on_restart is not None:
        lines.append(f"the ssh port changes on restart: {_yes(ssh.port_changes_on_restart)}")
    if ssh.rsync_works is not None:
        lines.append(f"rsync works: {_yes(ssh.rsync_works)}")
    lines += list(ssh.notes)
    if spot.available is not None:
        notice = f"; notice: {spot.signal}" if spot.signal else ""
        grace = f", {spot.grace_s:g} s of grace" if spot.grace_s is not None else ""
        lines.append(f"interruptible (spot) capacity: {_yes(spot.available)}{notice}{grace}")
    lines += list(spot.notes)
    if sc.proxy_hook:
        lines.append(f"network accelerator sourced before the job: {sc.proxy_hook}")
    lines += [f"mirror: {k}={v}" for k, v in sorted(sc.env.items())]
    if not lines:
        return None
    label = _label(p)
    return Fact(
        id=f"profile:{p.name}/access",
        title=f"{label}: reaching the box over ssh, the network, and interruptions",
        symptoms=(f"ssh into the {label} box keeps failing or the port changed",
                  "downloads from huggingface or pip are slow or blocked on the box",
                  "my spot or interruptible instance was preempted, how much notice is there",
                  "ssh 连不上 端口变了 下载慢 镜像 学术加速 抢占"),
        signals=tuple(lines), cause=lines[0],
        fix=(f"rgt profile show {p.name} prints the ssh, spot and script facts.",
             f"rgt hosts add NAME --ssh ALIAS --profile {p.name} applies the profile's scripts to "
             "every launch."),
        profile=p.name, verified=_oldest([ssh.verified, spot.verified]),
        source=_sources([ssh.source, spot.source]), command=f"rgt profile show {p.name}")


def facts_of(p: profiles.Profile) -> List[Fact]:
    return [f for f in (_teardown(p), _storage(p), _clocks(p), _access(p)) if f is not None]


@dataclasses.dataclass(frozen=True)
class Platforms:
    """Every loadable profile's facts, and the phrases that name each platform."""

    facts: Tuple[Fact, ...]
    names: Mapping[str, Tuple[str, ...]]   # profile -> its normalized naming phrases

    def named_in(self, text: str) -> List[Tuple[str, str]]:
        """(profile, phrase) for each platform `text` names, in profile order."""
        norm = normalized(text)
        found: List[Tuple[str, str]] = []
        for name, phrases in self.names.items():
            for phrase in phrases:
                inside = phrase.strip() in norm if any(map(is_cjk, phrase)) else phrase in norm
                if inside:
                    found.append((name, phrase.strip()))
                    break
        return found

    def known(self) -> List[str]:
        return sorted(self.names)


def _phrases(p: profiles.Profile) -> Tuple[str, ...]:
    words = list(p.aliases) + ([] if p.name in PLAIN_NAMES else [p.name])
    return tuple(dict.fromkeys(normalized(w) for w in words if normalized(w).strip()))


def build(loaded: Mapping[str, Any]) -> Platforms:
    """Platforms from profiles.load_all()'s result; a profile that does not load is left out."""
    import profiles
    good = {n: p for n, p in loaded.items() if isinstance(p, profiles.Profile)}
    facts = tuple(f for p in good.values() for f in facts_of(p))
    return Platforms(facts=facts, names={n: _phrases(p) for n, p in good.items()})


@functools.lru_cache(maxsize=1)
def default_platforms() -> Platforms:
    """The profiles of profiles.directory() ($RGT_PROFILES_DIR, else the packaged ones), once."""
    import profiles
    return build(profiles.load_all(profiles.directory()))


def asks_about_platforms(words: Sequence[str]) -> bool:
    return any(w in PLATFORM_WORDS for w in words)


def fact_dict(f: Fact) -> Dict[str, Any]:
    return {"profile": f.profile, "verified": f.verified, "facts": list(f.signals)}


__all__ = ["Fact", "PLATFORM_WORDS", "Platforms", "asks_about_platforms", "build", "default_platforms",
           "fact_dict", "facts_of", "normalized"]
