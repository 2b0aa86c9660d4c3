"""Which wheels a box needs: requirements, markers, versions and tags, without an index.

    resolve(root_wheel, wheelhouses, env, tags) -> Resolution(wheels, missing)

Reads Requires-Dist from a wheel's METADATA, keeps the requirements whose environment marker holds
on the *box* (its marker environment comes from the box itself, so `tomli; python_version < "3.11"`
is judged for the box's Python, not this one), and picks for each the newest wheel in the local
wheelhouses that satisfies its version specifier and whose tags the box accepts; then the same for
what those wheels require. Pure functions over files; nothing here touches the network.

PEP 440 versions and specifiers, PEP 508 requirements and markers and PEP 425 tags are the
`packaging` library's; its errors become WheelError here, naming the wheel and what is wrong.
Pre-releases are chosen only when the specifier names one or nothing else fits, as pip does.
"""
from __future__ import annotations

import dataclasses
import functools
import zipfile
from email.parser import HeaderParser
from pathlib import Path
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple, Union

from packaging.markers import InvalidMarker, Marker, UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement
from packaging.requirements import Requirement as _Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.tags import Tag, parse_tag
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

# The PEP 508 marker variables a box's marker environment names (the probe reports them all).
MARKER_NAMES = ("implementation_name", "implementation_version", "os_name", "platform_machine",
                "platform_release", "platform_system", "platform_version", "python_full_version",
                "platform_python_implementation", "python_version", "sys_platform")

class WheelError(ValueError):
    """A wheel, requirement or marker that cannot be read."""


def normalize(name: str) -> str:
    """A project name as indexes compare them (PEP 503): `Foo_Bar.baz` -> `foo-bar-baz`."""
    return canonicalize_name(name)


def parse_version(text: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion as e:
        raise WheelError(f"not a version: {text!r}") from e


def python_admits(requires_python: str, python: Union[str, Version]) -> bool:
    """Whether a Requires-Python specifier admits the Python version `python` (pre-releases too)."""
    try:
        spec = SpecifierSet(requires_python)
    except InvalidSpecifier as e:
        raise WheelError(f"not a Requires-Python specifier: {requires_python!r}") from e
    return spec.contains(python if isinstance(python, Version) else parse_version(python), prereleases=True)


# ---- markers and requirements -----------------------------------------------------------------


def marker_holds(marker: Union[str, Marker, None], env: Mapping[str, str],
                 extras: Sequence[str] = ()) -> bool:
    """Whether `marker` holds in `env` (the box's marker environment) for any of `extras`.

    `env` must name every PEP 508 variable: packaging would fill a missing one from *this* machine."""
    if not marker:
        return True
    try:
        parsed = marker if isinstance(marker, Marker) else Marker(marker)
    except InvalidMarker as e:
        raise WheelError(f"cannot read the marker {marker!r}: {e}") from e
    lacking = [n for n in MARKER_NAMES if n not in env]
    if lacking:
        raise WheelError(f"the box's marker environment lacks {', '.join(lacking)} (for {str(parsed)!r})")
    try:
        return any(parsed.evaluate({**env, "extra": extra}) for extra in (extras or [""]))
    except (UndefinedComparison, UndefinedEnvironmentName, InvalidVersion) as e:
        raise WheelError(f"cannot judge the marker {str(parsed)!r} on the box: {e}") from e


@dataclasses.dataclass(frozen=True)
class Requirement:
    name: str                       # normalized
    specifier: SpecifierSet
    extras: Tuple[str, ...] = ()    # normalized, sorted
    marker: Optional[Marker] = None
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> Requirement:
        try:
            req = _Requirement(text)
        except InvalidRequirement as e:
            raise WheelError(f"not a requirement: {text!r} ({e})") from e
        if req.url:
            raise WheelError(f"{text!r} names a URL; a box without an index cannot use it")
        return cls(name=normalize(req.name), specifier=req.specifier,
                   extras=tuple(sorted(normalize(e) for e in req.extras)), marker=req.marker,
                   text=text.strip())

    def __str__(self) -> str:
        """name[extras]specifier, without the marker (already judged for the box): what pip is asked for."""
        extras = f"[{','.join(self.extras)}]" if self.extras else ""
        return f"{self.name}{extras}{self.specifier}"


# ---- wheels -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Wheel:
    path: Path
    name: str                       # normalized
    version: Version
    tags: FrozenSet[Tag]

    @classmethod
    def from_path(cls, path: Path) -> Wheel:
        try:
            name, version, _, tags = parse_wheel_filename(path.name)
        except (InvalidWheelFilename, InvalidVersion) as e:
            raise WheelError(f"{path.name} is not a wheel file name ({e})") from e
        return cls(path=path, name=str(name), version=version, tags=frozenset(tags))

    def metadata(self) -> Tuple[str, str, List[str], Optional[str]]:
        """(name, version, Requires-Dist lines, Requires-Python) from the wheel's METADATA."""
        return _metadata(self.path)


def _metadata(path: Path) -> Tuple[str, str, List[str], Optional[str]]:
    try:
        st = path.stat()
    except OSError as e:
        raise WheelError(f"{path}: not a readable wheel ({e})") from e
    name, version, requires, python = _read_metadata(path, st.st_mtime_ns, st.st_size)
    return name, version, list(requires), python


@functools.lru_cache(maxsize=512)
def _read_metadata(path: Path, mtime_ns: int, size: int) -> Tuple[str, str, Tuple[str, ...], Optional[str]]:
    """METADATA of the wheel at path as it is now (mtime and size key the cache)."""
    try:
        with zipfile.ZipFile(path) as z:
            found = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(found) != 1:
                raise WheelError(f"{path.name}: expected one .dist-info/METADATA, found {found}")
            text = z.read(found[0]).decode("utf-8", "replace")
    except (OSError, zipfile.BadZipFile) as e:
        raise WheelError(f"{path}: not a readable wheel ({e})") from e
    msg = HeaderParser().parsestr(text)
    return (str(msg.get("Name", "")), str(msg.get("Version", "")),
            tuple(str(r) for r in msg.get_all("Requires-Dist") or []), msg.get("Requires-Python"))


def requirements(wheel: Wheel, env: Mapping[str, str], extras: Sequence[str] = ()) -> List[Requirement]:
    """The wheel's Requires-Dist that hold on the box (markers judged in `env`, with `extras`)."""
    out = []
    for line in wheel.metadata()[2]:
        try:
            req = Requirement.parse(line)
            holds = marker_holds(req.marker, env, extras)
        except WheelError as e:
            raise WheelError(f"{wheel.path.name}: bad Requires-Dist {line!r}: {e}") from e
        if holds:
            out.append(req)
    return out


@dataclasses.dataclass
class Resolution:
    wheels: List[Wheel]                                   # the root first, then what it needs
    missing: List[Tuple[Requirement, str]]                # (requirement, needed by) with no wheel here
    optional_missing: List[Tuple[Requirement, str]] = dataclasses.field(default_factory=list)


def scan(wheelhouses: Sequence[Path]) -> Dict[str, List[Wheel]]:
    """Every wheel in the given directories, by normalized project name (unreadable names skipped)."""
    found: Dict[str, List[Wheel]] = {}
    for where in wheelhouses:
        for path in sorted(Path(where).glob("*.whl")):
            try:
                wheel = Wheel.from_path(path)
            except WheelError:
                continue
            found.setdefault(wheel.name, []).append(wheel)
    return found


def runs_on(wheel: Wheel, python: Optional[Version]) -> bool:
    """Whether the wheel's Requires-Python admits `python` (None: not known, so yes)."""
    if python is None:
        return True
    needs = wheel.metadata()[3]
    try:
        return not needs or python_admits(needs, python)
    except WheelError as e:
        raise WheelError(f"{wheel.path.name}: bad Requires-Python: {e}") from e


def _box_tags(tags: Sequence[str]) -> Dict[Tag, int]:
    """The box's tags (most preferred first, compressed sets allowed) -> rank."""
    rank: Dict[Tag, int] = {}
    for i, text in enumerate(tags):
        for tag in parse_tag(text):
            rank.setdefault(tag, i)
    return rank


def best(candidates: Sequence[Wheel], req: Requirement, tags: Sequence[str],
         python: Optional[Version] = None) -> Optional[Wheel]:
    """The newest candidate the box accepts: its tags, the specifier, and Requires-Python for
    `python` (ties: the box's most preferred tag)."""
    rank = _box_tags(tags)
    fits = [w for w in candidates if w.tags & rank.keys() and runs_on(w, python)]
    allowed = set(req.specifier.filter(w.version for w in fits))  # pre-releases as pip chooses them
    pool = [w for w in fits if w.version in allowed]
    if not pool:
        return None
    return max(pool, key=lambda w: (w.version, -min(rank[t] for t in w.tags & rank.keys())))


def resolve(root: Path, wheelhouses: Sequence[Path], env: Mapping[str, str],
            tags: Sequence[str], optional: Sequence[Requirement] = ()) -> Resolution:
    """The root wheel and every wheel it needs on the box, from the local wheelhouses; `optional`
    requirements (py-spy) are added when a wheel fits, else listed in `optional_missing`."""
    available = scan(wheelhouses)
    python = parse_version(env["python_full_version"]) if env.get("python_full_version") else None
    top = Wheel.from_path(root)
    chosen: Dict[str, Wheel] = {top.name: top}
    res = Resolution(wheels=[], missing=[])
    queue: List[Tuple[Requirement, str, bool]] = [(r, top.name, False) for r in requirements(top, env)]
    queue += [(r, "the sidecar (optional)", True) for r in optional]
    while queue:
        req, needed_by, opt = queue.pop(0)
        have = chosen.get(req.name)
        if have is not None:
            if not req.specifier.contains(have.version, prereleases=True):
                (res.optional_missing if opt else res.missing).append(
                    (req, f"{needed_by} (conflicts with {have.name} {have.version})"))
            continue
        wheel = best(available.get(req.name, []), req, tags, python)
        if wheel is None:
            (res.optional_missing if opt else res.missing).append((req, needed_by))
            continue
        chosen[req.name] = wheel
        queue += [(r, wheel.name, opt) for r in requirements(wheel, env, req.extras)]
    res.wheels = list(chosen.values())
    return res


__all__ = ["Requirement", "Resolution", "Version", "Wheel", "WheelError", "best", "marker_holds",
           "normalize", "parse_version", "python_admits", "requirements", "resolve", "runs_on", "scan"]
