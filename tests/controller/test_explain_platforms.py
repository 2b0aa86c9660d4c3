"""`rgt explain` answers platform questions from the profiles, and reads Chinese.

A question that names a platform ranks that profile's facts beside the catalog's entries, each with
the month its facts were verified; --platform narrows to one profile; a billing question that names
no platform says how to get the facts. Facts never change how a question without a platform ranks.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest
from click.testing import CliRunner

import profiles
from controller.cli.explain import explain_command
from controller.insight import explain, platforms
from controller.insight.catalog import default_catalog
from controller.insight.explain import Index
from controller.insight.words import tokenize


def ask(*args: str) -> dict:
    out = CliRunner().invoke(explain_command, [*args, "--json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def ids(doc: dict) -> List[str]:
    return [e["id"] for e in doc["entries"]]


def test_the_vastai_teardown_question_is_answered_from_its_profile() -> None:
    doc = ask("On vast.ai, what action actually stops billing, and how do I tear down without losing "
              "my checkpoints?")
    assert doc["platforms"] == ["vastai"] and ids(doc)[0] == "profile:vastai/teardown"
    top = doc["entries"][0]
    assert top["type"] == "profile" and top["profile"] == "vastai" and top["verified"] == "2026-06"
    assert any(line.startswith("destroy: stops the meter: yes") for line in top["signals"])
    assert top["source"] and doc["next"] == "rgt teardown RUN --plan" and doc["hint"] is None
    text = CliRunner().invoke(explain_command, ["how do I tear down on vast.ai and stop billing"]).output
    assert "from profile vastai, verified 2026-06" in text and "next  rgt teardown RUN --plan" in text


def test_a_chinese_question_names_autodl_and_gets_its_facts() -> None:
    doc = ask("第一次用 AutoDL，关机以后还扣费吗？释放实例会不会把数据盘删掉？")
    assert doc["platforms"] == ["autodl"]
    assert {"profile:autodl/teardown", "profile:autodl/storage"} <= set(ids(doc))
    assert "关机" in doc["entries"][0]["matched"]


def test_chinese_platform_names_are_found() -> None:
    found = platforms.default_platforms()
    assert [n for n, _ in found.named_in("恒源云 数据盘 关机后保留吗")] == ["gpushare"]
    assert [n for n, _ in found.named_in("矩池云和揽睿星舟哪个便宜")] == ["lanrui", "matpool"]
    assert found.named_in("a lambda in my collate_fn cannot be pickled") == []   # a plain word
    assert found.named_in("a vast amount of host memory") == []


def test_a_training_question_on_a_named_platform_still_ranks_the_training_entries() -> None:
    doc = ask("my loss goes nan after switching to fp16 autocast on runpod")
    assert doc["platforms"] == ["runpod"]
    assert all(e["type"] == "entry" for e in doc["entries"]) and "nan" in ids(doc)[0]


def test_billing_words_without_a_platform_give_a_hint_and_no_facts() -> None:
    doc = ask("how do I stop paying for the instance once training is done")
    assert doc["platforms"] == [] and all(e["type"] == "entry" for e in doc["entries"])
    assert "--platform" in doc["hint"] and "vastai" in doc["hint"]
    assert ask("loss is nan")["hint"] is None


def test_platform_narrows_to_one_profile_named_or_not() -> None:
    doc = ask("--platform", "runpod", "which folder survives a stop and what still bills")
    assert doc["platforms"] == ["runpod"] and ids(doc)[0] == "profile:runpod/storage"
    assert all(e.get("profile") in (None, "runpod") for e in doc["entries"])
    every = ask("--platform", "autodl")
    assert ids(every)[:2] == ["profile:autodl/teardown", "profile:autodl/storage"]
    out = CliRunner().invoke(explain_command, ["--platform", "nowhere", "billing"])
    assert out.exit_code == 2 and "no platform profile 'nowhere'" in out.output and "vastai" in out.output


def test_a_fact_id_answers_with_that_fact() -> None:
    doc = ask("profile:lambda/teardown")
    assert doc["mode"] == "id" and ids(doc) == ["profile:lambda/teardown"]
    assert "terminate" in doc["entries"][0]["cause"].lower()


def test_facts_leave_a_question_without_a_platform_ranked_as_before() -> None:
    cat = default_catalog()
    bare, full = Index(cat), Index(cat, facts=platforms.default_platforms().facts)
    for text in ("the stopped instance still bills the disk", "checkpoints lost after release", "显存不够"):
        assert [(h.entry.id, h.score) for h in bare.search(text, 5)] == \
            [(h.entry.id, h.score) for h in full.search(text, 5)]


def test_each_fact_carries_its_oldest_stamp_and_sources() -> None:
    p = profiles.load("runpod")
    teardown = next(f for f in platforms.facts_of(p) if f.id.endswith("/teardown"))
    assert teardown.verified == min(a.verified for a in p.actions.values())
    assert set(teardown.source) == {a.source for a in p.actions.values() if a.source}
    assert teardown.fix[0].startswith("Pull the run and prove the copy first")


def test_a_broken_profile_is_left_out_of_the_facts(tmp_path: Path) -> None:
    (tmp_path / "good.toml").write_text('name = "good"\nkind = "ssh"\naliases = ["GoodCloud"]\n'
                                        '[surface]\nmeter_stop = "Delete it."\n')
    (tmp_path / "bad.toml").write_text('name = "bad"\nkind = "ssh"\naliases = "not a list"\n')
    built = platforms.build(profiles.load_all(tmp_path))
    assert built.known() == ["good"] and [f.id for f in built.facts] == ["profile:good/teardown"]
    assert built.named_in("on goodcloud what stops the meter") == [("good", "goodcloud")]


@pytest.mark.parametrize("chinese,english", [
    ("显存不够", "out of gpu memory"), ("训练卡住了", "training hung"), ("断点续训", "resume"),
    ("释放实例", "release the instance")])
def test_chinese_words_become_the_english_terms(chinese: str, english: str) -> None:
    zh, en = {t.term for t in tokenize(chinese)}, {t.term for t in tokenize(english)}
    assert zh & en, (zh, en)


def test_chinese_without_a_dictionary_word_is_indexed_as_bigrams() -> None:
    assert [t.term for t in tokenize("梯度裁剪")] == ["gradient", "裁剪"]
    assert [t.term for t in tokenize("模型权重文件")] == ["模型", "weight", "文件"]
    assert [t.term for t in tokenize("的了吗")] == []   # grammar alone indexes nothing


def test_the_answer_names_a_next_command() -> None:
    a = explain.answer(explain.parse_query(["job.exited", "oom_killed=true"]))
    assert a.next_command and a.next_command.startswith("rgt ")
