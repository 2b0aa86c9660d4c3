"""The symptom catalog: controller/data/catalog.toml and controller/data/knowledge/*.toml, loaded once
and checked.

Each entry names a problem (title), how people describe it (symptoms), what our events and the box
show (signals), the root cause and the fix, and the event kinds it belongs to. `rgt explain` ranks
entries (controller.insight.explain); `rgt watch` attaches the best entry's id to a material event.

Validation is strict so that a typo in the data fails the tests, not a person at 3 a.m.: unknown
keys are refused, every message names the entry id and the key, kinds must be ones the protocol (or
the controller) knows, `see` must point at entries that exist, and every kind that more than one
entry lists needs a `[defaults]` line naming the entry an event of that kind gets when no `when`
condition picks a more specific one.

catalog.toml holds the entries events point at (and the `[defaults]`); each knowledge file holds the
entries of one field (training, the remote box, verifying and delivering) with the same keys and no
defaults. Ids are unique across all files and `see` may cross them. `source` names where an entry's
knowledge comes from; `command` the `rgt` command that checks or fixes it.

Nothing is read at import time; `default_catalog()` parses the packaged files on first use.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

SCHEMA_VERSIONS = (1,)
# Kinds the catalog may name beyond protocol's registry: the dead-man's life, written by the box's
# dead-man and the controller (the registry gains them as they are built).
EXTRA_KINDS = ("deadman.armed", "deadman.renewed", "deadman.expiring", "deadman.firing", "deadman.fired",
               "deadman.disarmed", "deadman.held",
               "verify.done")   # the controller's own: `rgt verify` records it
TOP_KEYS = ("schema", "verified", "defaults", "entry")
REQUIRED_KEYS = ("id", "title", "kinds", "symptoms", "signals", "cause", "fix")
OPTIONAL_KEYS = ("see", "xids", "when", "source", "command")
KNOWLEDGE_DIR = "knowledge"
_ID = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_VERIFIED = re.compile(r"^\d{4}-(0[1-9]|1[0-2])$")

Scalar = Union[str, int, float, bool]
Wanted = Union[Scalar, Tuple[Scalar, ...]]


class CatalogError(ValueError):
    """The catalog is not valid TOML or breaks its schema; the message names the entry and key."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One problem. `when` maps an event kind to the data that makes this entry its best one."""

    id: str
    title: str
    kinds: Tuple[str, ...]
    symptoms: Tuple[str, ...]
    signals: Tuple[str, ...]
    cause: str
    fix: Tuple[str, ...]
    see: Tuple[str, ...] = ()
    xids: Tuple[int, ...] = ()
    when: Mapping[str, Mapping[str, Wanted]] = dataclasses.field(default_factory=dict)
    source: Tuple[str, ...] = ()
    command: Optional[str] = None
    verified: str = ""           # the month of the file the entry is in

    def to_dict(self) -> Dict[str, Any]:
        return {"id": self.id, "title": self.title, "kinds": list(self.kinds),
                "symptoms": list(self.symptoms), "signals": list(self.signals), "cause": self.cause,
                "fix": list(self.fix), "see": list(self.see), "xids": list(self.xids),
                "when": {k: {f: list(v) if isinstance(v, tuple) else v for f, v in c.items()}
                         for k, c in self.when.items()},
                "source": list(self.source), "command": self.command, "verified": self.verified}


@dataclasses.dataclass(frozen=True)
class Catalog:
    """The validated entries in file order, with lookups by id and by kind."""

    schema: int
    verified: str
    entries: Tuple[Entry, ...]
    defaults: Mapping[str, str]

    @functools.cached_property
    def by_id(self) -> Dict[str, Entry]:
        return {e.id: e for e in self.entries}

    def get(self, entry_id: str) -> Optional[Entry]:
        return self.by_id.get(entry_id)

    def for_kind(self, kind: str) -> List[Entry]:
        """Entries that list `kind`, in file order."""
        return [e for e in self.entries if kind in e.kinds]

    def default_for(self, kind: str) -> Optional[Entry]:
        """The entry an event of `kind` gets when no `when` condition picks another."""
        if kind in self.defaults:
            return self.by_id[self.defaults[kind]]
        listed = self.for_kind(kind)
        return listed[0] if len(listed) == 1 else None

    def kinds(self) -> List[str]:
        """Every kind some entry lists, sorted."""
        return sorted({k for e in self.entries for k in e.kinds})


def known_kinds() -> Tuple[str, ...]:
    from protocol import kinds as protocol_kinds  # here: a free-text question never needs the protocol
    return tuple(sorted(set(protocol_kinds.all_kinds()) | set(EXTRA_KINDS)))


def _fail(where: str, what: str) -> CatalogError:
    return CatalogError(f"catalog: {where}: {what}")


def _text(raw: Mapping[str, Any], key: str, where: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value.strip():
        raise _fail(where, f"{key!r} must be a non-empty string")
    return value.strip()


def _texts(raw: Mapping[str, Any], key: str, where: str, allow_empty: bool = False) -> Tuple[str, ...]:
    value = raw.get(key, [] if key in OPTIONAL_KEYS else None)
    if not isinstance(value, list) or (not value and not allow_empty):
        raise _fail(where, f"{key!r} must be a {'' if allow_empty else 'non-empty '}list of strings")
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise _fail(where, f"{key!r} holds {item!r}, not a non-empty string")
    return tuple(item.strip() for item in value)


def _wanted(value: Any, where: str) -> Wanted:
    if isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, list) and value and all(isinstance(v, (str, int, float, bool)) for v in value):
        return tuple(value)
    raise _fail(where, f"{value!r} must be a string, number, boolean or a non-empty list of them")


def _when(raw: Any, kinds: Tuple[str, ...], where: str) -> Dict[str, Dict[str, Wanted]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _fail(where, "'when' must be a table of kind = { field = value }")
    out: Dict[str, Dict[str, Wanted]] = {}
    for kind, conds in raw.items():
        if kind not in kinds:
            raise _fail(where, f"'when' names {kind!r}, which is not in this entry's kinds")
        if not isinstance(conds, dict) or not conds:
            raise _fail(where, f"'when.{kind}' must be a non-empty table of field = value")
        out[kind] = {str(f): _wanted(v, f"{where}: when.{kind}.{f}") for f, v in conds.items()}
    return out


def _xids(raw: Any, kinds: Tuple[str, ...], where: str) -> Tuple[int, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw or not all(isinstance(x, int) and not isinstance(x, bool)
                                                         and x > 0 for x in raw):
        raise _fail(where, "'xids' must be a non-empty list of positive Xid codes")
    if "gpu.xid" not in kinds:
        raise _fail(where, "'xids' needs gpu.xid in kinds")
    return tuple(raw)


def parse_entry(raw: Any, index: int, known: Tuple[str, ...], verified: str = "") -> Entry:
    """One [[entry]] table checked; CatalogError naming the entry (id, or its position) and key."""
    if not isinstance(raw, dict):
        raise _fail(f"entry #{index + 1}", "must be a table")
    where = f"entry {raw.get('id')!r}" if isinstance(raw.get("id"), str) else f"entry #{index + 1}"
    unknown = sorted(set(raw) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if unknown:
        raise _fail(where, f"unknown key(s) {', '.join(map(repr, unknown))} "
                           f"(known: {', '.join(REQUIRED_KEYS + OPTIONAL_KEYS)})")
    missing = [k for k in REQUIRED_KEYS if k not in raw]
    if missing:
        raise _fail(where, f"missing key(s) {', '.join(map(repr, missing))}")
    entry_id = _text(raw, "id", where)
    if not _ID.match(entry_id):
        raise _fail(where, "'id' must be kebab-case: lowercase letters, digits and single dashes")
    kinds = _texts(raw, "kinds", where, allow_empty=True)
    for kind in kinds:
        if kind not in known:
            raise _fail(where, f"kind {kind!r} is not a known event kind")
    command = _text(raw, "command", where) if "command" in raw else None
    if command is not None and not command.startswith("rgt "):
        raise _fail(where, f"'command' must be an rgt command line, not {command!r}")
    return Entry(id=entry_id, title=_text(raw, "title", where), kinds=kinds,
                 symptoms=_texts(raw, "symptoms", where), signals=_texts(raw, "signals", where),
                 cause=" ".join(_text(raw, "cause", where).split()), fix=_texts(raw, "fix", where),
                 see=_texts(raw, "see", where, allow_empty=True), xids=_xids(raw.get("xids"), kinds, where),
                 when=_when(raw.get("when"), kinds, where),
                 source=_texts(raw, "source", where, allow_empty=True), command=command,
                 verified=verified)


def _defaults(raw: Any, by_id: Mapping[str, Entry], entries: Tuple[Entry, ...]) -> Dict[str, str]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _fail("defaults", "must be a table of kind = entry id")
    for kind, entry_id in raw.items():
        entry = by_id.get(entry_id) if isinstance(entry_id, str) else None
        if entry is None:
            raise _fail(f"defaults.{kind}", f"{entry_id!r} is not an entry id")
        if kind not in entry.kinds:
            raise _fail(f"defaults.{kind}", f"entry {entry_id!r} does not list {kind!r} in its kinds")
    listed: Dict[str, int] = {}
    for e in entries:
        for kind in e.kinds:
            listed[kind] = listed.get(kind, 0) + 1
    ambiguous = sorted(k for k, n in listed.items() if n > 1 and k not in raw)
    if ambiguous:
        raise _fail("defaults", f"kinds listed by several entries need a default: {', '.join(ambiguous)}")
    return {str(k): str(v) for k, v in raw.items()}


def _toml() -> Any:
    """tomllib, imported when a catalog is parsed (a cached index never parses one)."""
    if sys.version_info >= (3, 11):
        import tomllib  # novermin: 3.11 only, tomli below it
    else:  # pragma: no cover - the controller runs on 3.10 only with tomli
        import tomli as tomllib
    return tomllib


def _document(text: str, source: str, main: bool) -> Dict[str, Any]:
    tomllib = _toml()
    try:
        doc: Dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise CatalogError(f"catalog: {source} is not valid TOML: {e}") from e
    allowed = TOP_KEYS if main else tuple(k for k in TOP_KEYS if k != "defaults")
    unknown = sorted(set(doc) - set(allowed))
    if unknown:
        raise _fail(source, f"unknown top-level key(s) {', '.join(map(repr, unknown))} "
                            f"(known: {', '.join(allowed)})")
    if doc.get("schema") not in SCHEMA_VERSIONS:
        raise _fail(f"{source}: schema",
                    f"{doc.get('schema')!r} is not supported (supported: {SCHEMA_VERSIONS})")
    verified = doc.get("verified")
    if not isinstance(verified, str) or not _VERIFIED.match(verified):
        raise _fail(f"{source}: verified", "must be a YYYY-MM month")
    if not isinstance(doc.get("entry"), list) or not doc["entry"]:
        raise _fail(source, "needs at least one [[entry]]")
    return doc


def parse(text: str, source: str = "catalog.toml", more: Sequence[Tuple[str, str]] = ()) -> Catalog:
    """Parse and validate catalog TOML, with `more` knowledge files as (name, text) after it;
    CatalogError with a clear message if anything is off."""
    doc = _document(text, source, main=True)
    known = known_kinds()
    entries = tuple(parse_entry(raw, i, known, doc["verified"]) for i, raw in enumerate(doc["entry"]))
    for name, more_text in more:
        extra = _document(more_text, name, main=False)
        entries += tuple(parse_entry(raw, i, known, extra["verified"])
                         for i, raw in enumerate(extra["entry"]))
    by_id: Dict[str, Entry] = {}
    for entry in entries:
        if entry.id in by_id:
            raise _fail(f"entry {entry.id!r}", "the id is used twice")
        by_id[entry.id] = entry
    for entry in entries:
        for other in entry.see:
            if other not in by_id or other == entry.id:
                raise _fail(f"entry {entry.id!r}", f"'see' names {other!r}, which is not another entry")
    return Catalog(schema=int(doc["schema"]), verified=doc["verified"], entries=entries,
                   defaults=_defaults(doc.get("defaults"), by_id, entries))


def _read_packaged() -> Tuple[str, List[Tuple[str, str]]]:
    """catalog.toml's text and each knowledge file's (name, text), in name order."""
    import importlib.resources  # only to read the files (tempfile, shutil, lzma come with it)

    try:
        data = importlib.resources.files("controller.data")
        main = data.joinpath("catalog.toml").read_text(encoding="utf-8")
        folder = data.joinpath(KNOWLEDGE_DIR)
        files = sorted((f for f in folder.iterdir() if f.name.endswith(".toml")), key=lambda f: f.name) \
            if folder.is_dir() else []
        return main, [(f"{KNOWLEDGE_DIR}/{f.name}", f.read_text(encoding="utf-8")) for f in files]
    except (OSError, ModuleNotFoundError) as e:
        raise CatalogError(f"catalog: cannot read the packaged catalog or its knowledge files: {e}") from e


@functools.lru_cache(maxsize=1)
def default_catalog() -> Catalog:
    """The catalog shipped in the package, parsed once per process."""
    main, more = _read_packaged()
    return parse(main, more=more)


def load(text: Optional[str] = None) -> Catalog:
    """`text` parsed and checked; without it, the packaged catalog (cached)."""
    return default_catalog() if text is None else parse(text)


__all__ = ["Catalog", "CatalogError", "EXTRA_KINDS", "Entry", "default_catalog", "known_kinds", "load",
           "parse", "parse_entry"]
