"""The built `rgt explain` index kept on disk, so a question is answered without parsing the catalog,
the profiles and 300 entries' words again (about 160 ms of CPU) in every new process.

One JSON file, <state dir>/cache/explain-index.json (the state directory is private, 0700; JSON, never
pickle: reading it runs no code); RGT_EXPLAIN_CACHE=off keeps none, RGT_EXPLAIN_CACHE=DIR keeps it in DIR
(made private the same way). It holds the catalog, the platforms' facts and naming phrases, the
index's term counts, and the key they were built for: the size and modification time of
every file they come from (catalog.toml, the knowledge files, the profiles) and of the code that turns
them into an index. Any change there, a torn or foreign file, or a state directory that cannot be
written means a fresh build; a cache never makes a question fail.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from controller import paths
from controller.insight.catalog import Catalog, Entry
from controller.insight.platforms import Fact, Platforms

log = logging.getLogger(__name__)

FORMAT = 2
NAME = "explain-index.json"
Built = Tuple[Catalog, Platforms, Dict[str, Any]]   # the index's parts (explain.Index.parts)


def _package_dir(name: str) -> Optional[Path]:
    spec = importlib.util.find_spec(name)   # finds the package without running it
    places = list(spec.submodule_search_locations or []) if spec else []
    return Path(places[0]) if places else None


def sources(environ: Optional[Mapping[str, str]] = None) -> List[Path]:
    """Every file the index is built from, and the code that builds it."""
    env = os.environ if environ is None else environ
    here = Path(__file__).resolve().parent
    data = here.parent / "data"
    found = [data / "catalog.toml", *sorted((data / "knowledge").glob("*.toml"))]
    code = _package_dir("profiles")
    where = Path(env["RGT_PROFILES_DIR"]) if env.get("RGT_PROFILES_DIR") else code
    if where is not None:
        found += sorted(where.glob("*.toml"))
    found += [here / f"{m}.py" for m in ("catalog", "explain", "platforms", "words", "index_cache")]
    if code is not None:
        found += [code / f"{m}.py" for m in ("loader", "model", "schema")]
    return found


def key(files: List[Path]) -> str:
    """What the cache must match: every file's size and mtime (the text itself, compared whole: a
    hash would cost the OpenSSL import at every start)."""
    marks: List[Any] = [FORMAT, sys.version]
    for f in files:
        try:
            st = f.stat()
            marks.append([str(f), st.st_size, st.st_mtime_ns])
        except OSError:
            marks.append([str(f), None])
    return json.dumps(marks)


def _tuples(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _entry(d: Mapping[str, Any]) -> Entry:
    when = {k: {f: _tuples(v) for f, v in c.items()} for k, c in d["when"].items()}
    return Entry(id=d["id"], title=d["title"], kinds=tuple(d["kinds"]), symptoms=tuple(d["symptoms"]),
                 signals=tuple(d["signals"]), cause=d["cause"], fix=tuple(d["fix"]), see=tuple(d["see"]),
                 xids=tuple(d["xids"]), when=when, source=tuple(d["source"]), command=d["command"],
                 verified=d["verified"])


def encode(built: Built, cache_key: str) -> str:
    cat, plats, parts = built
    return json.dumps({
        "format": FORMAT, "key": cache_key,
        "catalog": {"schema": cat.schema, "verified": cat.verified, "defaults": dict(cat.defaults),
                    "entries": [e.to_dict() for e in cat.entries]},
        "facts": [{k: list(v) if isinstance(v, tuple) else v for k, v in vars(f).items()}
                  for f in plats.facts],
        "names": {n: list(p) for n, p in plats.names.items()},
        "index": parts,
    }, ensure_ascii=False, separators=(",", ":"))


def decode(text: str, cache_key: str) -> Optional[Built]:
    """The cached parts, or None when the text is not a cache for `cache_key` (stale, torn, foreign)."""
    try:
        doc = json.loads(text)
        if doc.get("format") != FORMAT or doc.get("key") != cache_key:
            return None
        c = doc["catalog"]
        cat = Catalog(schema=c["schema"], verified=c["verified"],
                      entries=tuple(_entry(e) for e in c["entries"]), defaults=c["defaults"])
        facts = tuple(Fact(**{k: _tuples(v) for k, v in f.items()}) for f in doc["facts"])
        plats = Platforms(facts=facts, names={n: tuple(p) for n, p in doc["names"].items()})
        parts = doc["index"]
        if not all(k in parts for k in ("postings", "length", "fact_postings", "fact_length")):
            return None
        return cat, plats, parts
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        log.debug("explain cache unreadable: %s", e)
        return None


def _save(path: Path, text: str) -> None:
    import tempfile  # only on a cache miss

    fd, tmp = tempfile.mkstemp(prefix=".explain-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_or_build(build: Callable[[], Built], environ: Optional[Mapping[str, str]] = None) -> Built:
    """The cached parts when the cache matches the files, else `build()` (saved for next time)."""
    env = os.environ if environ is None else environ
    chosen = env.get("RGT_EXPLAIN_CACHE", "")
    if chosen == "off":
        return build()
    cache_key = key(sources(environ))
    try:
        where = paths.private_dir(Path(chosen) if chosen else paths.state_dir(environ) / "cache")
    except Exception as e:
        log.debug("explain cache off: %s", e)
        return build()
    path = where / NAME
    try:
        found = decode(path.read_bytes().decode("utf-8"), cache_key)
    except (OSError, UnicodeDecodeError):
        found = None
    if found is not None:
        return found
    built = build()
    try:
        _save(path, encode(built, cache_key))
    except OSError as e:
        log.debug("explain cache not saved: %s", e)
    return built


__all__ = ["Built", "NAME", "decode", "encode", "key", "load_or_build", "sources"]
