"""Find the catalog entries that explain a problem: by entry id, by event kind, or by free text.

Free text is ranked with BM25F, a classic search formula that anyone can check by hand:

- The text is cut into terms by controller.insight.words (phrases joined, synonyms merged, filler
  dropped, a light stemmer; Chinese through a word list and character pairs).
- Each entry is one document with fields weighted by FIELD_WEIGHTS (the title counts most, then the
  symptoms, then the signals; its cause and kinds a little, for the words people borrow from them).
  A term's frequency in an entry is the weighted sum over the fields, then saturated and
  length-normalized with BM25's k1 and b.
- A term found in few entries is worth more (idf); the score is the sum over the query's terms.

Every hit carries the query words that matched, best first, so a ranking can always be explained.

Events map to entries through the data, not text: `entry_for_event(kind, data)` picks the entry
whose `when` conditions (and Xid codes) the event meets, else the kind's default (see
controller/data/catalog.toml's header). Nothing here runs at import time; the index is built once.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Collection, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from controller.insight import index_cache, platforms
from controller.insight.catalog import Catalog, Entry, default_catalog, known_kinds
from controller.insight.platforms import Fact, Platforms
from controller.insight.words import terms, tokenize

K1 = 1.2
B = 0.75
XID_MATCH = 3          # a listed Xid code outweighs any number of `when` conditions
FIELD_WEIGHTS: Tuple[Tuple[str, float], ...] = (
    ("title", 3.0), ("symptoms", 2.0), ("signals", 1.0), ("cause", 0.5), ("kinds", 0.5))

_XID_QUERY = re.compile(r"^\s*xid\s*(\d{1,4})\s*$", re.IGNORECASE)


# ---- the index ------------------------------------------------------------------------------


Doc = Union[Entry, Fact]
# The next command of an entry that names none and no event kind, by the field its source is in.
NEXT_BY_FIELD: Dict[str, str] = {
    "training": "rgt rehearse -- COMMAND",              # the fixed script's whole life, here, on CPU
    "run-local": "rgt rehearse -- COMMAND",
    "run-remote": "rgt status RUN",
    "verifying": "rgt compare RUN_A RUN_B",
    "delivering": "rgt reconcile REPORT.md --evidence RUN_DIR",
    "profiles": "rgt profile list",
}


@dataclasses.dataclass(frozen=True)
class Hit:
    """One ranked entry or platform fact: its score and what made it match (query words, or
    kind/data conditions)."""

    entry: Doc
    score: float
    matched: Tuple[str, ...]

    @property
    def next_command(self) -> Optional[str]:
        """The rgt command to run next for this hit: the entry's own, else where its events are, else
        what its field checks with (a training fix is rehearsed on CPU before renting)."""
        e = self.entry
        if e.command:
            return e.command
        if e.kinds:
            return f"rgt events RUN --kind {e.kinds[0]}"
        field = e.source[0].split("/", 1)[0] if e.source else ""
        return NEXT_BY_FIELD.get(field)

    def to_dict(self) -> Dict[str, Any]:
        e = self.entry
        out = {"id": e.id, "title": e.title, "score": round(self.score, 3), "matched": list(self.matched),
               "cause": e.cause, "fix": list(e.fix), "kinds": list(e.kinds), "symptoms": list(e.symptoms),
               "signals": list(e.signals), "see": list(e.see), "source": list(e.source),
               "verified": e.verified, "next": self.next_command,
               "type": "profile" if isinstance(e, Fact) else "entry"}
        if isinstance(e, Fact):
            out["profile"] = e.profile
        return out


def _fields(entry: Doc) -> Dict[str, str]:
    return {"title": entry.title, "symptoms": "\n".join(entry.symptoms),
            "signals": "\n".join(entry.signals), "cause": entry.cause, "kinds": " ".join(entry.kinds)}


def _counts(doc: Doc, weights: Sequence[Tuple[str, float]]) -> Tuple[Dict[str, float], float]:
    counts: Dict[str, float] = {}
    size = 0.0
    fields = _fields(doc)
    for name, weight in weights:
        found = terms(fields[name])
        size += weight * len(found)
        for term in found:
            counts[term] = counts.get(term, 0.0) + weight
    return counts, size


class Index:
    """BM25F over the catalog's entries and the platforms' facts (see the module doc). A fact
    counts, in the scores and in the document frequencies, only for a query that names its
    platform: a question about NaN ranks the same whatever profiles exist."""

    def __init__(self, catalog: Catalog, weights: Sequence[Tuple[str, float]] = FIELD_WEIGHTS,
                 facts: Sequence[Fact] = ()) -> None:
        self.catalog = catalog
        self.tf: List[Dict[str, float]] = []
        self.length: List[float] = []
        self.df: Dict[str, int] = {}
        for entry in catalog.entries:
            counts, size = _counts(entry, weights)
            self.tf.append(counts)
            self.length.append(size)
            for term in counts:
                self.df[term] = self.df.get(term, 0) + 1
        self.avg_length = sum(self.length) / max(1, len(self.length))
        self.facts = tuple(facts)
        self.fact_counts = [_counts(f, weights) for f in self.facts]

    def parts(self) -> Dict[str, Any]:
        """What the index computed, as JSON data (controller.insight.index_cache keeps it)."""
        return {"tf": self.tf, "length": self.length, "df": self.df,
                "fact_counts": [[c, n] for c, n in self.fact_counts]}

    @classmethod
    def from_parts(cls, catalog: Catalog, facts: Sequence[Fact], parts: Mapping[str, Any]) -> Index:
        """An index from `parts()` of one built over the same catalog and facts."""
        index = cls.__new__(cls)
        index.catalog, index.facts = catalog, tuple(facts)
        index.tf, index.length, index.df = parts["tf"], parts["length"], parts["df"]
        index.fact_counts = [(c, n) for c, n in parts["fact_counts"]]
        if len(index.tf) != len(catalog.entries) or len(index.fact_counts) != len(index.facts):
            raise ValueError("index parts do not match the catalog and facts")
        index.avg_length = sum(index.length) / max(1, len(index.length))
        return index

    def idf(self, term: str, extra_docs: int = 0, extra_df: int = 0) -> float:
        n, df = len(self.tf) + extra_docs, self.df.get(term, 0) + extra_df
        return math.log(1.0 + (n - df + 0.5) / (df + 0.5))

    def search(self, text: str, top: int = 3, platforms: Collection[str] = ()) -> List[Hit]:
        """Entries (and the facts of `platforms`) ranked by BM25F for `text`, best first; only those
        with a positive score."""
        query: Dict[str, str] = {}
        for token in tokenize(text):
            query.setdefault(token.term, token.word)
        docs: List[Tuple[Doc, Dict[str, float], float]] = [
            (e, self.tf[i], self.length[i]) for i, e in enumerate(self.catalog.entries)]
        docs += [(f, c, n) for f, (c, n) in zip(self.facts, self.fact_counts) if f.profile in platforms]
        extra = docs[len(self.tf):]
        idf = {term: self.idf(term, len(extra), sum(1 for _, c, _ in extra if term in c)) for term in query}
        hits: List[Tuple[float, int, Tuple[str, ...]]] = []
        for i, (_, counts, length) in enumerate(docs):
            parts: List[Tuple[float, str]] = []
            norm = K1 * (1.0 - B + B * length / self.avg_length)
            for term, word in query.items():
                tf = counts.get(term, 0.0)
                if tf > 0:
                    parts.append((idf[term] * tf * (K1 + 1.0) / (tf + norm), word))
            if parts:
                parts.sort(key=lambda p: -p[0])
                words = tuple(dict.fromkeys(w for _, w in parts))   # one word may give two terms
                hits.append((sum(p[0] for p in parts), i, words))
        hits.sort(key=lambda h: (-h[0], h[1]))
        return [Hit(docs[i][0], score, matched) for score, i, matched in hits[:top]]


def _build() -> index_cache.Built:
    cat, plats = default_catalog(), platforms.default_platforms()
    return cat, plats, Index(cat, facts=plats.facts).parts()


@functools.lru_cache(maxsize=1)
def _default() -> Tuple[Index, Platforms]:
    """The packaged catalog's index and the profiles' platforms: from the on-disk cache when it is
    current (controller.insight.index_cache), else built and cached."""
    cat, plats, parts = index_cache.load_or_build(_build)
    try:
        return Index.from_parts(cat, plats.facts, parts), plats
    except (ValueError, KeyError, TypeError):
        cat, plats, parts = _build()
        return Index.from_parts(cat, plats.facts, parts), plats


def default_index() -> Index:
    return _default()[0]


def default_platforms() -> Platforms:
    return _default()[1]


# ---- events ---------------------------------------------------------------------------------


def _lookup(data: Mapping[str, Any], dotted: str) -> Tuple[bool, Any]:
    value: Any = data
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return bool(a == b)


def _holds(wanted: Any, value: Any) -> bool:
    options = wanted if isinstance(wanted, tuple) else (wanted,)
    values = value if isinstance(value, list) else [value]
    return any(_same(v, o) for v in values for o in options)


@dataclasses.dataclass(frozen=True)
class _Fit:
    satisfied: Tuple[str, ...]
    contradicted: bool
    unknown: int
    xid: bool

    @property
    def candidate(self) -> bool:
        """Picked by the data: its Xid code, or all its conditions met (and none contradicted)."""
        met = bool(self.satisfied) and self.unknown == 0
        return not self.contradicted and (self.xid or met)

    @property
    def score(self) -> int:
        return len(self.satisfied) + (XID_MATCH if self.xid else 0)


def _fit(entry: Entry, kind: str, data: Mapping[str, Any]) -> _Fit:
    satisfied: List[str] = []
    contradicted, unknown = False, 0
    for field, wanted in entry.when.get(kind, {}).items():
        found, value = _lookup(data, field)
        if not found:
            unknown += 1
        elif _holds(wanted, value):
            satisfied.append(f"{field}={_show(value)}")
        else:
            contradicted = True
    code = data.get("code")
    xid = kind == "gpu.xid" and isinstance(code, int) and code in entry.xids
    if xid:
        satisfied.insert(0, f"code={code}")
    return _Fit(tuple(satisfied), contradicted, unknown, xid)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def rank_for_kind(kind: str, data: Optional[Mapping[str, Any]] = None,
                  catalog: Optional[Catalog] = None) -> List[Hit]:
    """Every entry that lists `kind`: those the data picks (most conditions first), then the kind's
    default, then the others the data does not contradict, in catalog order."""
    cat = catalog or default_catalog()
    data = data or {}
    picked: List[Tuple[int, int, Hit]] = []
    rest: List[Hit] = []
    default = cat.default_for(kind)
    for i, entry in enumerate(cat.for_kind(kind)):
        fit = _fit(entry, kind, data)
        if fit.contradicted:
            continue
        if fit.candidate:
            hit = Hit(entry, 1.0 + fit.score, (f"kind={kind}",) + fit.satisfied)
            picked.append((-fit.score, i, hit))
        else:
            rest.append(Hit(entry, 1.0, (f"kind={kind}",)))
    ordered = [h for _, _, h in sorted(picked, key=lambda p: (p[0], p[1]))]
    if default is not None and all(h.entry.id != default.id for h in ordered):
        ordered += [h for h in rest if h.entry.id == default.id]
    seen = {h.entry.id for h in ordered}
    return ordered + [h for h in rest if h.entry.id not in seen]


def entry_for_event(kind: str, data: Optional[Mapping[str, Any]] = None,
                    catalog: Optional[Catalog] = None) -> Optional[str]:
    """The id of the entry that best explains an event of `kind` with `data`; None if no entry
    lists the kind (an unknown kind from a newer sidecar)."""
    cat = catalog or default_catalog()
    data = data if isinstance(data, Mapping) else {}
    best: Optional[Tuple[int, int, Entry]] = None
    for i, entry in enumerate(cat.for_kind(kind)):
        fit = _fit(entry, kind, data)
        if fit.candidate and (best is None or fit.score > best[0]):
            best = (fit.score, i, entry)
    if best is not None:
        return best[2].id
    default = cat.default_for(kind)
    return default.id if default is not None else None


# ---- queries --------------------------------------------------------------------------------


class QueryError(ValueError):
    """The words given to `rgt explain` cannot be read (a usage error)."""


@dataclasses.dataclass(frozen=True)
class Query:
    mode: str                      # "kind", "id", "text", or "platform" (--platform alone)
    text: str                      # the query as the person gave it
    kind: Optional[str] = None
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    platform: Optional[str] = None  # --platform: only this profile's facts, named or not


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_query(words: Sequence[str], catalog: Optional[Catalog] = None,
                platform: Optional[str] = None) -> Query:
    """KIND [FIELD=VALUE ...] (or `xid CODE`), an entry or fact id, or free text. QueryError if empty, a
    kind's data hints cannot be read, or `platform` names no profile."""
    cat = catalog or default_index().catalog
    if platform is not None and platform not in default_platforms().known():
        known = ", ".join(default_platforms().known())
        raise QueryError(f"no platform profile {platform!r} (known: {known})")
    text = " ".join(w.strip() for w in words if w.strip())
    if not text and platform is not None:
        return Query("platform", "", platform=platform)
    if not text:
        raise QueryError("give an event kind, an entry id or a description of the problem")
    xid = _XID_QUERY.match(text)
    if xid:
        return Query("kind", text, "gpu.xid", {"code": int(xid.group(1))}, platform)
    head, rest = words[0].strip(), [w.strip() for w in words[1:] if w.strip()]
    if "." in head and (head in known_kinds() or head in cat.kinds()):   # every kind is dotted
        data: Dict[str, Any] = {}
        for item in rest:
            if head == "gpu.xid" and item.isdigit():
                data["code"] = int(item)
                continue
            name, eq, value = item.partition("=")
            if not eq or not name:
                raise QueryError(f"after a kind, give data as FIELD=VALUE (like code=79), not {item!r}")
            data[name] = _value(value)
        return Query("kind", text, head, data, platform)
    if not rest and (cat.get(head) is not None or _fact(head) is not None):
        return Query("id", text, platform=platform)
    return Query("text", text, platform=platform)


def _fact(fact_id: str) -> Optional[Fact]:
    if not fact_id.startswith("profile:"):
        return None
    return next((f for f in default_platforms().facts if f.id == fact_id), None)


@dataclasses.dataclass(frozen=True)
class Answer:
    query: Query
    hits: Tuple[Hit, ...]
    platforms: Tuple[str, ...] = ()   # the profiles whose facts were eligible
    hint: Optional[str] = None        # what would make the answer better (name the platform)

    @property
    def next_command(self) -> Optional[str]:
        """The first hit's next command (or the first hit that has one)."""
        return next((h.next_command for h in self.hits if h.next_command), None)

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"query": self.query.text, "mode": self.query.mode,
                               "entries": [h.to_dict() for h in self.hits], "platforms": list(self.platforms),
                               "next": self.next_command, "hint": self.hint}
        if self.query.kind is not None:
            out["kind"] = self.query.kind
            out["data"] = dict(self.query.data)
        return out


def _platform_hint(text: str) -> Optional[str]:
    words = platforms.normalized(text).split()
    zh = [w for w in platforms.PLATFORM_WORDS if not w.isascii() and w in text]
    if not (platforms.asks_about_platforms(words) or zh):
        return None
    names = ", ".join(default_platforms().known())
    return ("name the platform (or give --platform NAME) for what stops its meter, what each action "
            f"deletes and what survives: {names}")


def answer(query: Query, top: int = 3, catalog: Optional[Catalog] = None) -> Answer:
    """The best `top` entries for a parsed query (an id answers with its one entry). Free text that
    names a platform, or a query with --platform, ranks that profile's facts beside the entries."""
    cat = catalog or default_index().catalog
    if query.mode == "id":
        entry: Optional[Doc] = cat.get(query.text) or _fact(query.text)
        return Answer(query, (Hit(entry, 1.0, ("id",)),) if entry else ())
    if query.mode == "kind":
        assert query.kind is not None
        return Answer(query, tuple(rank_for_kind(query.kind, query.data, cat)[:top]))
    if query.mode == "platform":
        facts = [f for f in default_platforms().facts if f.profile == query.platform]
        return Answer(query, tuple(Hit(f, 1.0, (f"platform={query.platform}",)) for f in facts),
                      (str(query.platform),))
    index = default_index() if catalog is None else Index(cat, facts=default_platforms().facts)
    text = platforms.normalized(query.text)
    named = default_platforms().named_in(query.text)
    for _, phrase in named:
        text = text.replace(f" {phrase} ", " ") if phrase.isascii() else text.replace(phrase, " ")
    eligible = (query.platform,) if query.platform else tuple(dict.fromkeys(n for n, _ in named))
    hint = None if eligible else _platform_hint(query.text)
    return Answer(query, tuple(index.search(text, top, eligible)), eligible, hint)


__all__ = ["Answer", "FIELD_WEIGHTS", "Hit", "Index", "NEXT_BY_FIELD", "Query", "QueryError", "answer",
           "default_index", "default_platforms", "entry_for_event", "parse_query", "rank_for_kind"]
