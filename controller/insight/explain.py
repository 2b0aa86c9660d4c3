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


Postings = Dict[int, float]   # document number -> the term's weighted frequency in it


def _invert(counts: Sequence[Mapping[str, float]]) -> Dict[str, Postings]:
    out: Dict[str, Postings] = {}
    for i, c in enumerate(counts):
        for term, weight in c.items():
            out.setdefault(term, {})[i] = weight
    return out


def _pack(postings: Postings) -> str:
    return " ".join(f"{i}:{w!r}" for i, w in postings.items())   # repr: the float comes back exact


def _unpack(text: str, docs: int) -> Postings:
    """The postings `_pack` wrote; an item that is not one (a cache edited by hand) is left out."""
    out: Postings = {}
    for item in text.split() if isinstance(text, str) else ():
        i, _, w = item.partition(":")
        try:
            if 0 <= int(i) < docs:
                out[int(i)] = float(w)
        except ValueError:
            continue
    return out


class Index:
    """BM25F over the catalog's entries and the platforms' facts (see the module doc). A fact
    counts, in the scores and in the document frequencies, only for a query that names its
    platform: a question about NaN ranks the same whatever profiles exist.

    Term counts are kept inverted (term -> the documents holding it): a question reads the postings
    of its own few terms only, and a cached index (`parts()`) keeps each term's postings as one
    string, unpacked when a question first asks for that term."""

    def __init__(self, catalog: Catalog, weights: Sequence[Tuple[str, float]] = FIELD_WEIGHTS,
                 facts: Sequence[Fact] = ()) -> None:
        self.catalog = catalog
        self.facts = tuple(facts)
        entry_counts = [_counts(e, weights) for e in catalog.entries]
        fact_counts = [_counts(f, weights) for f in self.facts]
        self.length = [n for _, n in entry_counts]
        self.fact_length = [n for _, n in fact_counts]
        self._postings = _invert([c for c, _ in entry_counts])
        self._fact_postings = _invert([c for c, _ in fact_counts])
        self._packed: Dict[str, str] = {}
        self._fact_packed: Dict[str, str] = {}
        self.avg_length = sum(self.length) / max(1, len(self.length))

    def parts(self) -> Dict[str, Any]:
        """What the index computed, as JSON data (controller.insight.index_cache keeps it)."""
        return {"postings": {t: _pack(p) for t, p in self._postings.items()}, "length": self.length,
                "fact_postings": {t: _pack(p) for t, p in self._fact_postings.items()},
                "fact_length": self.fact_length}

    @classmethod
    def from_parts(cls, catalog: Catalog, facts: Sequence[Fact], parts: Mapping[str, Any]) -> Index:
        """An index from `parts()` of one built over the same catalog and facts."""
        index = cls.__new__(cls)
        index.catalog, index.facts = catalog, tuple(facts)
        index.length, index.fact_length = list(parts["length"]), list(parts["fact_length"])
        if len(index.length) != len(catalog.entries) or len(index.fact_length) != len(index.facts):
            raise ValueError("index parts do not match the catalog and facts")
        packed, fact_packed = parts["postings"], parts["fact_postings"]
        if not isinstance(packed, dict) or not isinstance(fact_packed, dict):
            raise ValueError("index postings are not term -> postings")
        index._packed, index._fact_packed = packed, fact_packed
        index._postings, index._fact_postings = {}, {}
        index.avg_length = sum(index.length) / max(1, len(index.length))
        return index

    def postings(self, term: str) -> Postings:
        """Entry number -> the term's weighted frequency there."""
        found = self._postings.get(term)
        if found is None:
            found = self._postings[term] = _unpack(self._packed.get(term, ""), len(self.length))
        return found

    def fact_postings(self, term: str) -> Postings:
        """Fact number -> the term's weighted frequency there."""
        found = self._fact_postings.get(term)
        if found is None:
            packed = self._fact_packed.get(term, "")
            found = self._fact_postings[term] = _unpack(packed, len(self.fact_length))
        return found

    def idf(self, term: str, extra_docs: int = 0, extra_df: int = 0) -> float:
        n, df = len(self.length) + extra_docs, len(self.postings(term)) + extra_df
        return math.log(1.0 + (n - df + 0.5) / (df + 0.5))

    def search(self, text: str, top: int = 3, platforms: Collection[str] = ()) -> List[Hit]:
        """Entries (and the facts of `platforms`) ranked by BM25F for `text`, best first; only those
        with a positive score. Documents are numbered entries first, then the eligible facts in
        order; a tie goes to the lower number."""
        query: Dict[str, str] = {}
        for token in tokenize(text):
            query.setdefault(token.term, token.word)
        n = len(self.length)
        eligible = [j for j, f in enumerate(self.facts) if f.profile in platforms] if platforms else []
        number = {j: n + k for k, j in enumerate(eligible)}
        lengths = self.length + [self.fact_length[j] for j in eligible]
        found: Dict[int, List[Tuple[float, str]]] = {}
        for term, word in query.items():
            held = dict(self.postings(term))
            extra = {number[j]: w for j, w in self.fact_postings(term).items() if j in number} \
                if number else {}
            idf = self.idf(term, len(eligible), len(extra))
            held.update(extra)
            for i, tf in held.items():
                if tf > 0:
                    norm = K1 * (1.0 - B + B * lengths[i] / self.avg_length)
                    found.setdefault(i, []).append((idf * tf * (K1 + 1.0) / (tf + norm), word))
        hits: List[Tuple[float, int, Tuple[str, ...]]] = []
        for i, parts in found.items():
            parts.sort(key=lambda p: -p[0])
            words = tuple(dict.fromkeys(w for _, w in parts))   # one word may give two terms
            hits.append((sum(p[0] for p in parts), i, words))
        hits.sort(key=lambda h: (-h[0], h[1]))
        return [Hit(self._doc(i, eligible), score, matched) for score, i, matched in hits[:top]]

    def _doc(self, i: int, eligible: Sequence[int]) -> Doc:
        n = len(self.length)
        return self.catalog.entries[i] if i < n else self.facts[eligible[i - n]]


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
