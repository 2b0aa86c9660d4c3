"""Which wheels a box needs: requirements, markers, versions and tags, without an index.

    resolve(root_wheel, wheelhouses, env, tags) -> Resolution(wheels, missing)

Reads Requires-Dist from a wheel's METADATA, keeps the requirements whose environment marker holds
on the *box* (its marker environment comes from the box itself, so `tomli; python_version < "3.11"`
is judged for the box's Python, not this one), and picks for each the newest wheel in the local
wheelhouses that satisfies its version specifier and whose tags the box accepts; then the same for
what those wheels require. Pure functions over files; nothing here touches the network.

The subset of PEP 440/508/425 implemented is what wheels on PyPI use: versions with epochs,
pre/post/dev parts and local labels; specifiers ==, !=, <, <=, >, >=, ~=, === and `==X.*`;
markers with and/or/parentheses, comparisons and `in`/`not in`; extras. Pre-releases are chosen
only when the specifier names one or nothing else fits, as pip does.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import zipfile
from email.parser import HeaderParser
from pathlib import Path
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

_VERSION = re.compile(
    r"^v?(?:(?P<epoch>\d+)!)?(?P<release>\d+(?:\.\d+)*)"
    r"(?:[-_.]?(?P<pre_l>a|b|rc|c|alpha|beta|pre|preview)[-_.]?(?P<pre_n>\d+)?)?"
    r"(?:-(?P<post_n1>\d+)|[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>\d+)?)?"
    r"(?:[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>\d+)?)?"
    r"(?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?$", re.IGNORECASE)
_PRE_ORDER = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}
_INF = 1 << 62
_REQ = re.compile(r"^\s*(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*"
                  r"(?:\[(?P<extras>[^\]]*)\])?\s*(?P<rest>[^;]*?)\s*(?:;\s*(?P<marker>.*?))?\s*$")
_SPEC = re.compile(r"^\s*(===|==|!=|<=|>=|~=|<|>)\s*([^\s,]+)\s*$")
_TOKEN = re.compile(r"""\s*(?:(?P<str>'[^']*'|"[^"]*")|(?P<op>===|==|!=|<=|>=|~=|<|>|\(|\))"""
                    r"|(?P<word>[A-Za-z_][A-Za-z0-9_.]*))")

VersionKey = Tuple[int, Tuple[int, ...], Tuple[int, int], int, int]


class WheelError(ValueError):
    """A wheel, requirement or marker that cannot be read."""


def normalize(name: str) -> str:
    """A project name as indexes compare them (PEP 503): `Foo_Bar.baz` -> `foo-bar-baz`."""
    return re.sub(r"[-_.]+", "-", name).lower()


# ---- versions and specifiers ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, order=False)
class Version:
    text: str
    key: VersionKey
    release: Tuple[int, ...]
    is_prerelease: bool

    @classmethod
    def parse(cls, text: str) -> Version:
        m = _VERSION.match(text.strip())
        if not m:
            raise WheelError(f"not a version: {text!r}")
        release = tuple(int(p) for p in m.group("release").split("."))
        trimmed = release
        while len(trimmed) > 1 and trimmed[-1] == 0:
            trimmed = trimmed[:-1]
        post_n = m.group("post_n1") or m.group("post_n2")
        has_post = m.group("post_n1") is not None or m.group("post_l") is not None
        has_dev = m.group("dev_l") is not None
        if m.group("pre_l"):
            pre = (_PRE_ORDER[m.group("pre_l").lower()], int(m.group("pre_n") or 0))
        elif has_dev and not has_post:
            pre = (-1, 0)  # 1.0.dev1 sorts before 1.0a1
        else:
            pre = (_INF, 0)
        post = int(post_n or 0) if has_post else -1
        dev = int(m.group("dev_n") or 0) if has_dev else _INF
        key = (int(m.group("epoch") or 0), trimmed, pre, post, dev)
        return cls(text=text.strip(), key=key, release=release,
                   is_prerelease=bool(m.group("pre_l")) or has_dev)

    def __lt__(self, other: Version) -> bool:
        return self.key < other.key


def _matches_one(version: Version, op: str, wanted: str) -> bool:
    if op == "===":
        return version.text == wanted
    if wanted.endswith(".*") and op in ("==", "!="):
        prefix = Version.parse(wanted[:-2]).release
        padded = version.release + (0,) * max(0, len(prefix) - len(version.release))
        return (padded[:len(prefix)] == prefix) == (op == "==")
    other = Version.parse(wanted)
    if op == "~=":
        if len(other.release) < 2:
            raise WheelError(f"~={wanted} needs at least two release parts")
        return version.key >= other.key and _matches_one(
            version, "==", ".".join(str(p) for p in other.release[:-1]) + ".*")
    base = Version.parse(version.text.split("+", 1)[0]) if "+" not in wanted else version
    if op == "==":
        return base.key == other.key
    if op == "!=":
        return base.key != other.key
    if op == "<=":
        return base.key <= other.key
    if op == ">=":
        return base.key >= other.key
    if op == "<":  # `<2.0` does not admit 2.0rc1
        return base.key < other.key and not (
            base.is_prerelease and not other.is_prerelease and base.key[1] == other.key[1])
    if op == ">":  # `>2.0` does not admit 2.0.post1
        return base.key > other.key and not (base.key[3] >= 0 > other.key[3]
                                             and base.key[1] == other.key[1])
    raise WheelError(f"unknown version operator {op!r}")


@dataclasses.dataclass(frozen=True)
class Specifier:
    clauses: Tuple[Tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> Specifier:
        text = text.strip()
        if text.startswith("(") and text.endswith(")"):
            text = text[1:-1]
        clauses = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = _SPEC.match(part)
            if not m:
                raise WheelError(f"not a version specifier: {part!r}")
            clauses.append((m.group(1), m.group(2)))
        return cls(tuple(clauses))

    def allows_prereleases(self) -> bool:
        return any(Version.parse(v.rstrip(".*")).is_prerelease for op, v in self.clauses
                   if op not in ("!=", "===") and _VERSION.match(v.rstrip(".*")))

    def contains(self, version: Version) -> bool:
        return all(_matches_one(version, op, v) for op, v in self.clauses)

    def __str__(self) -> str:
        return ",".join(op + v for op, v in self.clauses)


# ---- markers ----------------------------------------------------------------------------------


def _tokens(text: str) -> List[Tuple[str, str]]:
    out: List[Tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            raise WheelError(f"cannot read the marker {text!r} at {text[pos:pos + 20]!r}")
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


class _MarkerParser:
    """marker := and ('or' and)*; and := atom ('and' atom)*; atom := '(' marker ')' | value op value."""

    def __init__(self, text: str, env: Mapping[str, str]) -> None:
        self.text = text
        self.tokens = _tokens(text)
        self.pos = 0
        self.env = env

    def _peek(self) -> Tuple[str, str]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else ("end", "")

    def _take(self) -> Tuple[str, str]:
        token = self._peek()
        self.pos += 1
        return token

    def parse(self) -> bool:
        result = self._or()
        if self._peek()[0] != "end":
            raise WheelError(f"unexpected {self._peek()[1]!r} in the marker {self.text!r}")
        return result

    def _or(self) -> bool:
        result = self._and()
        while self._peek() == ("word", "or"):
            self._take()
            result = self._and() or result
        return result

    def _and(self) -> bool:
        result = self._atom()
        while self._peek() == ("word", "and"):
            self._take()
            result = self._atom() and result
        return result

    def _value(self) -> Tuple[str, Optional[str]]:
        kind, text = self._take()
        if kind == "str":
            return text[1:-1], None
        if kind == "word" and text not in ("and", "or", "in", "not"):
            name = text.replace(".", "_")  # os.name, sys.platform: the old spellings
            if name not in self.env:
                raise WheelError(f"unknown marker variable {text!r} in {self.text!r}")
            return self.env[name], name
        raise WheelError(f"expected a value, got {text!r} in the marker {self.text!r}")

    def _op(self) -> str:
        kind, text = self._take()
        if kind == "op" and text not in ("(", ")"):
            return text
        if (kind, text) == ("word", "in"):
            return "in"
        if (kind, text) == ("word", "not") and self._take() == ("word", "in"):
            return "not in"
        raise WheelError(f"expected a comparison, got {text!r} in the marker {self.text!r}")

    def _atom(self) -> bool:
        if self._peek() == ("op", "("):
            self._take()
            result = self._or()
            if self._take() != ("op", ")"):
                raise WheelError(f"unbalanced parentheses in the marker {self.text!r}")
            return result
        left, lname = self._value()
        op = self._op()
        right, rname = self._value()
        return _compare(left, op, right, lname or rname)


def _compare(left: str, op: str, right: str, variable: Optional[str]) -> bool:
    if variable == "extra":
        left, right = normalize(left), normalize(right)
    if op == "in":
        return left in right
    if op == "not in":
        return left not in right
    if _VERSION.match(left) and _VERSION.match(right.rstrip(".*")) and (op != "~=" or "." in right):
        return Specifier(((op, right),)).contains(Version.parse(left))  # as packaging does
    if op == "==" or op == "===":
        return left == right
    if op == "!=":
        return left != right
    raise WheelError(f"{op} needs versions on both sides, got {left!r} and {right!r}")


def marker_holds(marker: Optional[str], env: Mapping[str, str], extras: Sequence[str] = ()) -> bool:
    """Whether `marker` holds in `env` (the box's marker environment) for any of `extras`."""
    if not marker:
        return True
    return any(_MarkerParser(marker, {**env, "extra": extra}).parse() for extra in (extras or [""]))


# ---- requirements -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Requirement:
    name: str                       # normalized
    specifier: Specifier
    extras: Tuple[str, ...] = ()
    marker: Optional[str] = None
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> Requirement:
        m = _REQ.match(text)
        if not m:
            raise WheelError(f"not a requirement: {text!r}")
        rest = m.group("rest")
        if rest.startswith("@"):
            raise WheelError(f"{text!r} names a URL; a box without an index cannot use it")
        extras = tuple(normalize(e.strip()) for e in (m.group("extras") or "").split(",") if e.strip())
        return cls(name=normalize(m.group("name")), specifier=Specifier.parse(rest), extras=extras,
                   marker=m.group("marker") or None, text=text.strip())

    def __str__(self) -> str:
        extras = f"[{','.join(self.extras)}]" if self.extras else ""
        return f"{self.name}{extras}{self.specifier}"


# ---- wheels -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Wheel:
    path: Path
    name: str                       # normalized
    version: Version
    tags: FrozenSet[str]

    @classmethod
    def from_path(cls, path: Path) -> Wheel:
        parts = path.name[:-len(".whl")].split("-") if path.name.endswith(".whl") else []
        if len(parts) not in (5, 6):
            raise WheelError(f"{path.name} is not a wheel file name")
        name, version, py, abi, plat = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
        tags = frozenset(f"{i}-{a}-{p}" for i in py.split(".") for a in abi.split(".")
                         for p in plat.split("."))
        return cls(path=path, name=normalize(name), version=Version.parse(version), tags=tags)

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
        req = Requirement.parse(line)
        if marker_holds(req.marker, env, extras):
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
    return not needs or Specifier.parse(needs).contains(python)


def best(candidates: Sequence[Wheel], req: Requirement, tags: Sequence[str],
         python: Optional[Version] = None) -> Optional[Wheel]:
    """The newest candidate the box accepts: its tags, the specifier, and Requires-Python for
    `python` (ties: the box's most preferred tag)."""
    rank = {tag: i for i, tag in enumerate(tags)}
    fits = [w for w in candidates if w.tags & rank.keys() and req.specifier.contains(w.version)
            and runs_on(w, python)]
    finals = [w for w in fits if not w.version.is_prerelease]
    pool = fits if req.specifier.allows_prereleases() or not finals else finals
    if not pool:
        return None
    return max(pool, key=lambda w: (w.version.key, -min(rank[t] for t in w.tags & rank.keys())))


def resolve(root: Path, wheelhouses: Sequence[Path], env: Mapping[str, str],
            tags: Sequence[str], optional: Sequence[Requirement] = ()) -> Resolution:
    """The root wheel and every wheel it needs on the box, from the local wheelhouses; `optional`
    requirements (py-spy) are added when a wheel fits, else listed in `optional_missing`."""
    available = scan(wheelhouses)
    python = Version.parse(env["python_full_version"]) if env.get("python_full_version") else None
    top = Wheel.from_path(root)
    chosen: Dict[str, Wheel] = {top.name: top}
    res = Resolution(wheels=[], missing=[])
    queue: List[Tuple[Requirement, str, bool]] = [(r, top.name, False) for r in requirements(top, env)]
    queue += [(r, "the sidecar (optional)", True) for r in optional]
    while queue:
        req, needed_by, opt = queue.pop(0)
        have = chosen.get(req.name)
        if have is not None:
            if not req.specifier.contains(have.version):
                (res.optional_missing if opt else res.missing).append(
                    (req, f"{needed_by} (conflicts with {have.name} {have.version.text})"))
            continue
        wheel = best(available.get(req.name, []), req, tags, python)
        if wheel is None:
            (res.optional_missing if opt else res.missing).append((req, needed_by))
            continue
        chosen[req.name] = wheel
        queue += [(r, wheel.name, opt) for r in requirements(wheel, env, req.extras)]
    res.wheels = list(chosen.values())
    return res


__all__ = ["Requirement", "Resolution", "Specifier", "Version", "Wheel", "WheelError", "best",
           "marker_holds", "normalize", "requirements", "resolve", "runs_on", "scan"]
