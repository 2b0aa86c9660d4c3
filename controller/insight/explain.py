"""Find the catalog entries that explain a problem: by entry id, by event kind, or by free text.

Free text is ranked with BM25F, a classic search formula that anyone can check by hand:

- The text is lowercased and cut into words; a few multi-word phrases become one term first
  ("out of memory" -> oom, "learning rate" -> lr, "df -i" -> inode), words in SYNONYMS become their
  group's term (hung, stuck, frozen -> hang; card -> gpu), filler words are dropped, and a light
  stemmer strips common endings (crashes, crashed, crashing -> crash).
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
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from controller.insight.catalog import Catalog, Entry, default_catalog, known_kinds

K1 = 1.2
B = 0.75
XID_MATCH = 3          # a listed Xid code outweighs any number of `when` conditions
FIELD_WEIGHTS: Tuple[Tuple[str, float], ...] = (
    ("title", 3.0), ("symptoms", 2.0), ("signals", 1.0), ("cause", 0.5), ("kinds", 0.5))

STOPWORDS = frozenset("""
a about after again all also am an and any are as at be because been before being but by can could
did do does doing done each even ever for from had has have having he her here him his how i if in
into is it its just like me more most my no nor not now of on once only or other our out over own
same she should so some such than that the their them then there these they this those through to
too under until up very was we were what when where which while who why will with would you your
yet still got get gets getting keep keeps kept seems seem think really just thing things using use
used one way every whole instead ok okay anymore simply go goes going went says say said
""".split())

# Multi-word phrases first (on lowercased text with punctuation turned into spaces), in this order.
PHRASES: Tuple[Tuple[str, str], ...] = (
    (r"\b(?:(?:ran|run|runs|running) )?out of (?:gpu |cuda |video |host |system |cpu )?memory\b", "oom"),
    (r"\bnot a number\b", "nan"),
    (r"\bnon finite\b", "nan"),
    (r"\bno space left(?: on device)?\b", "disk full"),
    (r"\b(?:(?:ran|run|runs|running) )?out of (?:disk space|disk|space|storage)\b", "disk full"),
    (r"\bdf i\b", "inode"),
    (r"\b(?:gpu|cuda|video|device) memory\b", "vram"),
    (r"\b(?:host|system|cpu|main) memory\b", "ram"),
    (r"\blearning rate\b", "lr"),
    (r"\bwarm up\b", "warmup"),
    (r"\bhalf precision\b", "fp16"),
    (r"\bmixed precision\b", "amp"),
    (r"\bgrad(?:ient)? scaler\b", "scaler"),
    (r"\bloss scal(?:e|es|ing|er)\b", "scaler"),
    (r"\ball (?:reduce|gather)\b", "allreduce"),
    (r"\bdata ?load(?:er|ers|ing)\b", "dataloader"),
    (r"\binput pipeline\b", "dataloader"),
    (r"\bnum workers\b", "numworkers"),
    (r"\bweights (?:and|&) biases\b", "wandb"),
    (r"\bstart(?:s|ed|ing)? (?:over|from scratch)\b", "restart"),
    (r"\b\d{2,3} ?(?:c|deg|degc)\b", "hot"),
    (r"\bshot up\b", "spike"),
    (r"\bblew up\b", "spike"),
    (r"\btime[sd]? out\b", "timeout"),
    (r"\bfall(?:en|s)? off(?: the)? bus\b", "offbus"),
    (r"\bstack ?trace\b", "traceback"),
)

# word -> the term of its group (the group's first word). Applied before stemming.
_GROUPS: Tuple[Tuple[str, ...], ...] = (
    ("nan", "nans", "nonfinite"),
    ("inf", "infinity", "infinite", "infs"),
    ("oom", "oomed", "oomkilled"),
    ("hang", "hung", "hangs", "hanging", "stuck", "freeze", "freezes", "froze", "frozen", "freezing",
     "stall", "stalled", "stalls", "stalling", "deadlock", "deadlocked", "deadlocks"),
    ("crash", "crashed", "crashes", "crashing", "died", "dies", "die", "dying", "dead"),
    ("kill", "killed", "kills", "sigkill"),
    ("gpu", "gpus", "card", "cards"),
    ("util", "utilization", "utilisation", "utilized", "usage", "busy"),
    ("slow", "slower", "slowly", "sluggish", "slowdown", "crawl", "crawling"),
    ("restart", "restarted", "restarts", "restarting", "relaunch", "relaunched", "relaunching", "rerun",
     "reran", "again"),
    ("resume", "resumed", "resumes", "resuming"),
    ("checkpoint", "checkpoints", "ckpt", "ckpts", "snapshot", "snapshots"),
    ("step", "steps", "iteration", "iterations", "iter", "iters"),
    ("zero", "0", "zeros", "zeroes"),
    ("disk", "disks", "storage", "filesystem", "drive", "partition"),
    ("full", "filled", "fills", "fill"),
    ("inode", "inodes"),
    ("hot", "temperature", "temp", "heat", "overheating", "overheat", "overheated", "thermal",
     "degrees", "celsius"),
    ("throttle", "throttled", "throttling", "throttles"),
    ("log", "logs", "stdout"),
    ("wandb", "mlflow", "tensorboard", "comet", "tracker", "trackers"),
    ("ssh", "sshd", "connection", "disconnect", "disconnected", "disconnects"),
    ("preempt", "preempted", "preemption", "preemptible", "spot", "interruptible", "interrupted",
     "interruption", "reclaimed", "reclaim", "evicted", "eviction"),
    ("reboot", "rebooted", "rebooting", "reboots"),
    ("allreduce", "collective", "collectives", "barrier", "broadcast", "allgather"),
    ("dataloader", "loader", "loaders", "dataloaders"),
    ("eval", "evaluation", "evaluate", "evaluating", "validation", "validate", "validating", "val"),
    ("metric", "metrics", "accuracy", "acc", "map", "miou", "f1", "bleu", "auc"),
    ("spike", "spiked", "spikes", "jump", "jumped", "jumps", "surge", "surged"),
    ("fp16", "float16", "half", "f16"),
    ("bf16", "bfloat16", "bfloat"),
    ("fp32", "float32"),
    ("amp", "autocast"),
    ("scaler", "gradscaler", "scalers"),
    ("vanish", "vanished", "vanishes", "disappeared", "disappear", "disappears", "gone"),
    ("buffer", "buffered", "buffering", "unbuffered", "flush", "flushed", "flushing"),
    ("corrupt", "corrupted", "corruption", "truncated", "broken", "damaged", "garbled"),
    ("thread", "threads", "omp", "openmp", "mkl"),
    ("xid", "xids", "nvrm"),
    ("rank", "ranks"),
)
SYNONYMS: Dict[str, str] = {w: g[0] for g in _GROUPS for w in g if " " not in w}

_WORD = re.compile(r"[a-z0-9]+")
_NOT_WORD = re.compile(r"[^a-z0-9]+")
_XID_QUERY = re.compile(r"^\s*xid\s*(\d{1,4})\s*$", re.IGNORECASE)


# ---- text -----------------------------------------------------------------------------------


def stem(word: str) -> str:
    """A light suffix stripper (plural, -ed, -ing, -ly, final e); the same for queries and entries."""
    if len(word) <= 3 or word.isdigit():
        return word
    for suffix, repl in (("sses", "ss"), ("ies", "y"), ("xes", "x"), ("ches", "ch"), ("shes", "sh"),
                         ("zes", "z")):
        if word.endswith(suffix):
            return word[: -len(suffix)] + repl
    if word.endswith("ing") and len(word) > 5:
        word = _undouble(word[:-3])
    elif word.endswith("ed") and len(word) >= 4:
        word = _undouble(word[:-2])
    elif word.endswith("ly") and len(word) > 5:
        word = word[:-2]
    elif word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    if word.endswith("e") and len(word) > 3:
        word = word[:-1]
    return word


def _undouble(word: str) -> str:
    if len(word) > 2 and word[-1] == word[-2] and word[-1] not in "aeioulsz":
        return word[:-1]
    return word


@dataclasses.dataclass(frozen=True)
class Token:
    term: str   # what is indexed and compared
    word: str   # what the person wrote (for the "matched" list)


def tokenize(text: str) -> List[Token]:
    """Terms of `text` in order: phrases joined, synonyms merged, stopwords dropped, stemmed."""
    flat = _NOT_WORD.sub(" ", text.lower())
    for pattern, term in PHRASES:
        flat = re.sub(pattern, f" {term.replace(' ', '_')} ", flat)
    out: List[Token] = []
    for raw in flat.split():
        for piece in raw.split("_") if "_" in raw else (raw,):
            word = piece
            if word in STOPWORDS or (len(word) == 1 and not word.isdigit()):
                continue
            out.append(Token(stem(SYNONYMS.get(word, word)), word))
    return out


def terms(text: str) -> List[str]:
    return [t.term for t in tokenize(text)]


# ---- the index ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hit:
    """One ranked entry: its score and what made it match (query words, or kind/data conditions)."""

    entry: Entry
    score: float
    matched: Tuple[str, ...]

    def to_dict(self) -> Dict[str, Any]:
        e = self.entry
        return {"id": e.id, "title": e.title, "score": round(self.score, 3), "matched": list(self.matched),
                "cause": e.cause, "fix": list(e.fix), "kinds": list(e.kinds), "symptoms": list(e.symptoms),
                "signals": list(e.signals), "see": list(e.see)}


def _fields(entry: Entry) -> Dict[str, str]:
    return {"title": entry.title, "symptoms": "\n".join(entry.symptoms),
            "signals": "\n".join(entry.signals), "cause": entry.cause, "kinds": " ".join(entry.kinds)}


class Index:
    """BM25F over the catalog's entries (see the module doc)."""

    def __init__(self, catalog: Catalog, weights: Sequence[Tuple[str, float]] = FIELD_WEIGHTS) -> None:
        self.catalog = catalog
        self.tf: List[Dict[str, float]] = []
        self.length: List[float] = []
        self.df: Dict[str, int] = {}
        for entry in catalog.entries:
            counts: Dict[str, float] = {}
            size = 0.0
            fields = _fields(entry)
            for name, weight in weights:
                found = terms(fields[name])
                size += weight * len(found)
                for term in found:
                    counts[term] = counts.get(term, 0.0) + weight
            self.tf.append(counts)
            self.length.append(size)
            for term in counts:
                self.df[term] = self.df.get(term, 0) + 1
        self.avg_length = sum(self.length) / max(1, len(self.length))

    def idf(self, term: str) -> float:
        n, df = len(self.tf), self.df.get(term, 0)
        return math.log(1.0 + (n - df + 0.5) / (df + 0.5))

    def search(self, text: str, top: int = 3) -> List[Hit]:
        """Entries ranked by BM25F for `text`, best first; only entries with a positive score."""
        query: Dict[str, str] = {}
        for token in tokenize(text):
            query.setdefault(token.term, token.word)
        hits: List[Tuple[float, int, Tuple[str, ...]]] = []
        for i, counts in enumerate(self.tf):
            parts: List[Tuple[float, str]] = []
            norm = K1 * (1.0 - B + B * self.length[i] / self.avg_length)
            for term, word in query.items():
                tf = counts.get(term, 0.0)
                if tf > 0:
                    parts.append((self.idf(term) * tf * (K1 + 1.0) / (tf + norm), word))
            if parts:
                parts.sort(key=lambda p: -p[0])
                hits.append((sum(p[0] for p in parts), i, tuple(w for _, w in parts)))
        hits.sort(key=lambda h: (-h[0], h[1]))
        return [Hit(self.catalog.entries[i], score, matched) for score, i, matched in hits[:top]]


@functools.lru_cache(maxsize=1)
def default_index() -> Index:
    return Index(default_catalog())


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
    mode: str                      # "kind", "id" or "text"
    text: str                      # the query as the person gave it
    kind: Optional[str] = None
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)


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


def parse_query(words: Sequence[str], catalog: Optional[Catalog] = None) -> Query:
    """KIND [FIELD=VALUE ...] (or `xid CODE`), an entry id, or free text. QueryError if empty or a
    kind's data hints cannot be read."""
    cat = catalog or default_catalog()
    text = " ".join(w.strip() for w in words if w.strip())
    if not text:
        raise QueryError("give an event kind, an entry id or a description of the problem")
    xid = _XID_QUERY.match(text)
    if xid:
        return Query("kind", text, "gpu.xid", {"code": int(xid.group(1))})
    head, rest = words[0].strip(), [w.strip() for w in words[1:] if w.strip()]
    if head in known_kinds() or head in cat.kinds():
        data: Dict[str, Any] = {}
        for item in rest:
            if head == "gpu.xid" and item.isdigit():
                data["code"] = int(item)
                continue
            name, eq, value = item.partition("=")
            if not eq or not name:
                raise QueryError(f"after a kind, give data as FIELD=VALUE (like code=79), not {item!r}")
            data[name] = _value(value)
        return Query("kind", text, head, data)
    if not rest and cat.get(head) is not None:
        return Query("id", text)
    return Query("text", text)


@dataclasses.dataclass(frozen=True)
class Answer:
    query: Query
    hits: Tuple[Hit, ...]

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"query": self.query.text, "mode": self.query.mode,
                               "entries": [h.to_dict() for h in self.hits]}
        if self.query.kind is not None:
            out["kind"] = self.query.kind
            out["data"] = dict(self.query.data)
        return out


def answer(query: Query, top: int = 3, catalog: Optional[Catalog] = None) -> Answer:
    """The best `top` entries for a parsed query (an id answers with its one entry)."""
    cat = catalog or default_catalog()
    if query.mode == "id":
        entry = cat.get(query.text)
        return Answer(query, (Hit(entry, 1.0, ("id",)),) if entry else ())
    if query.mode == "kind":
        assert query.kind is not None
        return Answer(query, tuple(rank_for_kind(query.kind, query.data, cat)[:top]))
    index = default_index() if catalog is None else Index(cat)
    return Answer(query, tuple(index.search(query.text, top)))


__all__ = ["Answer", "FIELD_WEIGHTS", "Hit", "Index", "PHRASES", "Query", "QueryError", "SYNONYMS", "Token",
           "answer", "default_index", "entry_for_event", "parse_query", "rank_for_kind", "stem", "terms",
           "tokenize"]
