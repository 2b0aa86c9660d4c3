"""controller.insight.index_cache: the explain index kept on disk as JSON, rebuilt whenever a source
changes, and never the reason a question fails."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Dict, List

import pytest

from controller.insight import explain, index_cache, platforms
from controller.insight.catalog import default_catalog
from controller.insight.explain import Index


def built() -> index_cache.Built:
    cat, plats = default_catalog(), platforms.default_platforms()
    return cat, plats, Index(cat, facts=plats.facts).parts()


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Dict[str, str]:
    """A private state dir, and two stand-in source files whose changes the key must see."""
    (tmp_path / "src").mkdir()
    files = [tmp_path / "src" / "a.toml", tmp_path / "src" / "b.py"]
    for f in files:
        f.write_text("one")
    monkeypatch.setattr(index_cache, "sources", lambda environ=None: files)
    return {"RGT_HOME": str(tmp_path / "home")}   # and no RGT_EXPLAIN_CACHE: the default place


def never() -> index_cache.Built:
    raise AssertionError("built again although the cache is current")


def test_built_once_then_read_back_as_json_in_a_private_place(env: Dict[str, str]) -> None:
    calls: List[int] = []

    def build() -> index_cache.Built:
        calls.append(1)
        return built()

    first = index_cache.load_or_build(build, env)
    path = Path(env["RGT_HOME"]) / "cache" / index_cache.NAME
    assert calls == [1] and json.loads(path.read_text(encoding="utf-8"))["format"] == index_cache.FORMAT
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0
    again = index_cache.load_or_build(never, env)
    assert again[0] == first[0] and again[1] == first[1] and again[2] == json.loads(json.dumps(first[2]))


def test_a_changed_source_rebuilds(env: Dict[str, str]) -> None:
    index_cache.load_or_build(built, env)
    source = index_cache.sources()[0]
    source.write_text("two, longer")
    calls: List[int] = []
    index_cache.load_or_build(lambda: calls.append(1) or built(), env)
    assert calls == [1]
    index_cache.load_or_build(never, env)


@pytest.mark.parametrize("junk", ["", "{", '{"format": 1, "key": "someone else"}', "[1, 2]", "\0\0\0"])
def test_a_torn_or_foreign_cache_is_rebuilt_and_replaced(env: Dict[str, str], junk: str) -> None:
    index_cache.load_or_build(built, env)
    path = Path(env["RGT_HOME"]) / "cache" / index_cache.NAME
    path.write_text(junk)
    calls: List[int] = []
    index_cache.load_or_build(lambda: calls.append(1) or built(), env)
    assert calls == [1] and json.loads(path.read_text())["format"] == index_cache.FORMAT


def test_a_state_dir_that_cannot_be_used_builds_every_time(env: Dict[str, str], tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    calls: List[int] = []
    for _ in range(2):
        index_cache.load_or_build(lambda: calls.append(1) or built(), {"RGT_HOME": str(blocker)})
    assert calls == [1, 1]


def test_the_cached_index_answers_exactly_like_a_fresh_one(env: Dict[str, str]) -> None:
    fresh = built()
    cat, plats, parts = index_cache.decode(index_cache.encode(fresh, "k"), "k") or never()
    cached, live = Index.from_parts(cat, plats.facts, parts), Index(fresh[0], facts=fresh[1].facts)
    assert cat == fresh[0] and plats == fresh[1]
    for text in ("loss is nan after fp16", "显存不够 batch 调不上去", "what stops billing and what survives"):
        for names in ((), ("vastai",), ("autodl", "runpod")):
            assert [(h.entry.id, h.score) for h in cached.search(text, 5, names)] == \
                [(h.entry.id, h.score) for h in live.search(text, 5, names)]


def test_parts_that_do_not_fit_the_catalog_are_refused() -> None:
    cat, plats, parts = built()
    with pytest.raises(ValueError):
        Index.from_parts(cat, plats.facts, {**parts, "length": parts["length"][:-1]})


def test_off_keeps_nothing_and_a_chosen_dir_is_used(env: Dict[str, str], tmp_path: Path) -> None:
    calls: List[int] = []
    for _ in range(2):
        index_cache.load_or_build(lambda: calls.append(1) or built(), {**env, "RGT_EXPLAIN_CACHE": "off"})
    assert calls == [1, 1] and not (Path(env["RGT_HOME"]) / "cache").exists()
    chosen = tmp_path / "mine"
    index_cache.load_or_build(built, {**env, "RGT_EXPLAIN_CACHE": str(chosen)})
    assert (chosen / index_cache.NAME).is_file() and stat.S_IMODE(os.stat(chosen).st_mode) == 0o700


def test_the_key_follows_every_source_file(tmp_path: Path) -> None:
    f = tmp_path / "x.toml"
    f.write_text("a")
    first = index_cache.key([f])
    assert index_cache.key([f]) == first
    f.write_text("ab")
    assert index_cache.key([f]) != first
    f.unlink()
    assert index_cache.key([f]) not in (first, "")


def test_the_sources_are_the_data_the_profiles_and_the_code(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    names = {p.name for p in index_cache.sources({})}
    assert {"catalog.toml", "training.toml", "vastai.toml", "explain.py", "index_cache.py",
            "loader.py"} <= names
    (tmp_path / "mine.toml").write_text("")
    assert "mine.toml" in {p.name for p in index_cache.sources({"RGT_PROFILES_DIR": str(tmp_path)})}


def test_the_default_index_answers_through_load_or_build() -> None:
    got = explain.answer(explain.parse_query(["on vast.ai what stops billing"]))
    assert got.hits[0].entry.id == "profile:vastai/teardown"
