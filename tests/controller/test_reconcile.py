"""`rgt reconcile`: claims in Markdown and LaTeX against a run's evidence (controller.insight.reconcile*).

The documents under data/reconcile/ carry planted drifts; the evidence is a real run directory
written here (metrics.jsonl, an eval JSON, a config that must be skipped, rgt/PULL_VERIFIED.json).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, List, Set, Tuple

import pytest
from click.testing import CliRunner, Result

from controller.cli.base import RgtGroup
from controller.cli.reconcile import reconcile_command
from controller.insight.claims_doc import Claim, claims_in
from controller.insight.reconcile import (
    Evidence,
    ReconcileError,
    Report,
    compare,
    flatten,
    key_metric,
    load_evidence,
    reconcile,
)

DATA = Path(__file__).parent / "data" / "reconcile"
MD = DATA / "results.md"
TEX = DATA / "results.tex"
OURS = re.compile("ours", re.I)

METRICS_ROWS = [
    {"step": 100, "epoch": 1, "loss": 1.2, "val_acc": 0.70, "lr": 0.1},
    {"step": 500, "epoch": 5, "loss": 0.6, "val_acc": 0.852, "lr": 0.1},
    {"step": 900, "epoch": 9, "loss": 0.35, "val_acc": 0.9151, "lr": 0.01},
    {"step": 1000, "epoch": 10, "loss": 0.3112, "val_acc": 0.9127, "lr": 0.001},
]
EVAL = {"test": {"top1": 90.14, "top5": 98.61}, "psnr_set5": 32.07, "psnr_set14": 28.46,
        "ssim_set14": 0.7803, "results": [{"metric": "bleu", "value": 27.36}], "per_class_acc": [0.9, 0.8]}
VERIFIED = {"schema": "rgt.pull_verified", "version": 1, "ok": True,
            "proofs": {"metric": {"status": "passed", "metric": "loss", "evaluated": [
                {"step": 1000, "recomputed": 0.31118, "reported": 0.3112, "ok": True}]}}}


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A pulled run directory as `rgt pull` + `rgt verify` leave it."""
    root = tmp_path / "run"
    (root / "rgt").mkdir(parents=True)
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS_ROWS) + '{"step": 11')
    (root / "eval.json").write_text(json.dumps(EVAL))
    (root / "config.json").write_text(json.dumps({"acc": 0.5, "grad_acc_steps": 4}))
    (root / "run.json").write_text(json.dumps({"id": "r1", "command": "python train.py --acc 0.99"}))
    (root / "rgt" / "PULL_VERIFIED.json").write_text(json.dumps(VERIFIED))
    return root


def line_of(doc: Path, snippet: str) -> int:
    """The 1-based line of the one line of doc that holds snippet."""
    hits = [i for i, line in enumerate(doc.read_text().splitlines(), 1) if snippet in line]
    assert len(hits) == 1, (snippet, hits)
    return hits[0]


def at(report: Report, status: str) -> Set[Tuple[int, str]]:
    return {(f.claim.line, f.claim.shown) for f in report.having(status)}


def pairs(text: str, latex: bool = False) -> List[Tuple[str, str]]:
    return [(c.metric, c.shown) for c in claims_in(text, latex)]


# ---- the planted documents ----------------------------------------------------------------------


def test_markdown_every_planted_drift_is_found_at_its_line(run: Path) -> None:
    report = reconcile(MD, [run])
    assert at(report, "drifted") == {
        (line_of(MD, "Test top-1 accuracy: 90.3"), "90.3"),  # prose, the test key (90.14)
        (line_of(MD, "final loss of 0.35"), "0.35"),  # the loss at step 900, not the final one
        (line_of(MD, "Validation accuracy 91.2%"), "91.2%"),  # 91.27 is not 91.2 at one decimal
        (line_of(MD, "| Ours (test, rerun) |"), "89.9"),  # a Markdown table cell
    }
    drift = next(f for f in report.drifted if f.claim.shown == "90.3")
    assert (drift.claim.col, drift.evidence and drift.evidence.key) == (22, "test.top1")


def test_markdown_numbers_that_match_at_their_shown_precision_are_not_drift(run: Path) -> None:
    report = reconcile(MD, [run])
    assert at(report, "matched") == {
        (line_of(MD, "Final validation accuracy is 91.3%"), "91.3%"),
        (line_of(MD, "best validation accuracy was 91.5%"), "91.5%"),  # best: 0.9151 at step 900
        (line_of(MD, "at step 500 validation accuracy reached 85.2"), "85.2"),  # logged at step 500
        (line_of(MD, "top-5 accuracy is 0.986"), "0.986"),
        (line_of(MD, "training loss ends at 0.311"), "0.311"),
        (line_of(MD, "ResNet50 v2 is 91.27"), "91.27"),
        (line_of(MD, "PSNR on Set5: 32.1 dB"), "32.1 dB"),
        (line_of(MD, "BLEU 27.4"), "27.4"),  # from a list of {"metric", "value"}
        (line_of(MD, "| Ours (test) |"), "90.14"),
        (line_of(MD, "| Ours (test) |"), "98.6"),  # 98.61 shown at one decimal
        (line_of(MD, "| Ours (test, rerun) |"), "98.61"),
        (line_of(MD, "| val loss |"), "0.3112"),  # a table without metric headers reads as prose
    }
    assert at(report, "unbacked") == {(line_of(MD, "F1 score of 0.88"), "0.88"),
                                      (line_of(MD, "| mAP@0.5 |"), "45.2")}
    assert {(v.key, v.value) for v in report.missing} == {("psnr_set14", 28.46), ("ssim_set14", 0.7803)}


def test_percent_and_fraction_are_scaled_only_when_nothing_fits_as_is(run: Path) -> None:
    report = reconcile(MD, [run])
    by_shown = {f.claim.shown: f for f in report.findings}
    assert (by_shown["91.3%"].scaled, by_shown["91.3%"].evidence.value) == ("x100", 0.9127)  # type: ignore[union-attr]
    assert (by_shown["0.986"].scaled, by_shown["0.986"].evidence.value) == ("/100", 98.61)  # type: ignore[union-attr]
    assert by_shown["90.14"].scaled is None
    loss = claims_in("the loss is 31.1")[0]
    assert compare(loss, Evidence().values + _values("loss", 0.311), 0.0).status == "drifted"  # not a ratio
    acc = claims_in("accuracy 0.9")[0]
    assert compare(acc, _values("acc", 0.9), 0.0).scaled is None


def test_code_blocks_inline_code_links_and_glued_tokens_hold_no_claims(run: Path) -> None:
    text = MD.read_text()
    assert "accuracy = 12.5" in text and "`acc 55.5`" in text and "acc/77.7" in text
    shown = {f.claim.shown for f in reconcile(MD, [run]).findings}
    assert not shown & {"12.5", "0.99", "55.5", "77.7", "50", "2", "5", "10", "90", "8", "1.2"}
    assert pairs("We train ResNet50 v2 (ResNet-50) on CIFAR-10, PSNR on Set5 with x4 and mAP50-95.") == []
    assert pairs("accuracy 50k steps") == [] and pairs("accuracy 2x better") == []


def test_latex_table_and_prose_drifts_are_found_with_their_lines(run: Path) -> None:
    report = reconcile(TEX, [run], rows=OURS)
    big, swap = line_of(TEX, "Ours-big &"), line_of(TEX, "Ours-swap &")
    assert at(report, "drifted") == {
        (line_of(TEX, "top-5 accuracy is 98.9"), "98.9%"),
        (big, "32.10"), (big, "0.7810"),
        (swap, "28.46"), (swap, "32.07"),  # real values, but under the other dataset's column
    }
    ours = line_of(TEX, "Ours &")
    assert at(report, "matched") == {
        (line_of(TEX, "PSNR of 32.07"), "32.07"), (line_of(TEX, "validation accuracy is 91.3"), "91.3%"),
        (ours, "32.07"), (ours, "28.46"), (ours, "0.7803"), (big, "28.46"), (swap, "0.780"),
    }
    assert report.unbacked == []
    assert min(f.claim.line for f in report.findings) == line_of(TEX, "PSNR of 32.07")  # not the comment


def test_latex_baseline_rows_are_claims_unless_rows_filters_them(run: Path) -> None:
    bicubic = line_of(TEX, "Bicubic")
    report = reconcile(TEX, [run])
    assert {(bicubic, "28.42"), (bicubic, "26.00"), (bicubic, "0.7027")} <= at(report, "drifted")
    assert at(report, "unbacked") == {(bicubic, "0.8104")}  # Set5 SSIM: only Set14's is in the evidence


# ---- claims ----------------------------------------------------------------------------------------


def test_prose_pairs_names_and_numbers_by_nearness_and_lists() -> None:
    assert pairs("91.3 accuracy and 0.27 loss") == [("accuracy", "91.3"), ("loss", "0.27")]
    assert pairs("accuracy and loss are 91.3 and 0.27.") == [("accuracy", "91.3"), ("loss", "0.27")]
    assert pairs("PSNR/SSIM of 32.1/0.89") == [("psnr", "32.1"), ("ssim", "0.89")]
    assert pairs("PSNR/SSIM of 32.1") == []  # counts differ: nothing is paired
    assert pairs("top-1 accuracy 76.1 top-5 accuracy 92.9") == [("accuracy", "76.1"), ("top5", "92.9")]
    assert pairs("accuracy 91.3 and 92.1") == [("accuracy", "91.3")]
    assert pairs("accuracy after 90 epochs on 8 GPUs is 91.3") == [("accuracy", "91.3")]
    assert pairs("Besides accuracy, the model reaches 0.27 loss") == [("loss", "0.27")]  # fewer words
    assert pairs("accuracy improved from 88.1 to 91.3 (+3.2) after 9 epochs") == [("accuracy", "91.3")]
    assert pairs("accuracy. 91.3 is unrelated") == []  # a sentence ends in between
    assert pairs("mAP@0.5 of 45.2, perplexity = 12.40, ROUGE-L 41") == [
        ("map", "45.2"), ("perplexity", "12.40"), ("rouge", "41")]
    assert pairs("the map shows 3 roads") == []  # mAP only in that spelling
    assert pairs("Acc. & $91.3_{\\pm 0.2}$ \\\\", latex=True) == [("accuracy", "91.3")]


def test_claims_carry_precision_percent_step_and_best() -> None:
    c = claims_in("accuracy at epoch 5 was 85.20%, best accuracy 1.5e-1")
    assert [(x.half, x.percent, x.step, x.best) for x in c] == [
        (pytest.approx(0.005), True, ("epoch", 5.0), False), (pytest.approx(0.05e-1), False, None, True)]
    assert [(x.line, x.col) for x in claims_in("intro\n\n  loss: 0.25")] == [(3, 9)]


def test_latex_percent_header_multicolumn_and_step_column() -> None:
    tex = ("\\begin{tabular}{lcc}\n Step & Acc. (\\%) & \\multicolumn{1}{c}{Loss} \\\\ \\hline\n"
           " 500 & 85.2 & 0.6 \\\\ 1,000 & 91.3 & 0.31 \\\\\n\\end{tabular}\n")
    c = claims_in(tex, latex=True)
    assert [(x.line, x.metric, x.shown, x.percent, x.step) for x in c] == [
        (3, "accuracy", "85.2", True, ("step", 500.0)), (3, "loss", "0.6", False, ("step", 500.0)),
        (3, "accuracy", "91.3", True, ("step", 1000.0)), (3, "loss", "0.31", False, ("step", 1000.0))]


# ---- evidence and comparing ----------------------------------------------------------------------


def _values(key: str, value: float) -> List[Any]:
    ev = Evidence()
    ev.add_json(Path("e.json"), {key: value})
    return list(ev.values)


def test_precision_window_and_tolerance() -> None:
    claim = claims_in("accuracy 91.3")[0]
    for value, status in [(91.27, "matched"), (91.34, "matched"), (91.25, "matched"), (91.36, "drifted"),
                          (91.2, "drifted")]:
        assert compare(claim, _values("acc", value), 0.0).status == status, value
    assert compare(claims_in("accuracy 91.30")[0], _values("acc", 91.27), 0.0).status == "drifted"
    assert compare(claim, _values("acc", 91.36), 0.02).status == "matched"
    assert compare(claim, [], 0.0).status == "unbacked"


def test_evidence_keys_name_metrics_and_qualifiers() -> None:
    assert key_metric("val_acc") == (key_metric("acc")[0], frozenset({"val"}))  # type: ignore[index]
    named = key_metric("metrics/mAP50(B)")
    assert named is not None and (named[0].name, named[1]) == ("map", frozenset({"50"}))
    assert key_metric("eval.top5_acc")[0].name == "top5"  # type: ignore[index]
    assert key_metric("valLoss")[1] == frozenset({"val"})  # type: ignore[index]
    assert key_metric("grad_acc_steps") is None and key_metric("lr") is None
    assert dict(flatten({"a": {"b": 1, "ok": True}, "r": [{"name": "f1", "score": 0.8}, {"x": 2}],
                         "per": [1, 2], "s": "text"})) == {"a.b": 1.0, "r.f1": 0.8, "r.1.x": 2.0}


def test_a_run_directory_reads_metrics_evals_and_pull_verified_but_not_configs(run: Path) -> None:
    (run / "broken.json").write_text("{")
    ev = load_evidence([run])
    assert [Path(f).name for f in ev.files] == ["metrics.jsonl", "eval.json", "PULL_VERIFIED.json"]
    assert any("broken.json" in n for n in ev.notes)
    assert {(v.key, v.value) for v in ev.all_values()} >= {("val_acc", 0.9127), ("loss", 0.31118)}
    assert all(v.value != 0.5 for v in ev.all_values())  # config.json's "acc"
    with pytest.raises(ReconcileError, match="broken.json"):
        load_evidence([run / "broken.json"])
    with pytest.raises(ReconcileError, match="no metric values"):
        reconcile(MD, [run / "run.json"])  # named on its own it is read, and holds no metric


# ---- the command ----------------------------------------------------------------------------------


def rgt(*args: str) -> Result:
    group = RgtGroup("rgt")
    group.add_command(reconcile_command)
    return CliRunner().invoke(group, ["reconcile", *args], catch_exceptions=False)


def test_cli_exits_1_on_drift_with_a_table_and_the_lines(run: Path) -> None:
    res = rgt(str(MD), "--evidence", str(run))
    assert res.exit_code == 1
    rows = res.stdout.splitlines()
    assert rows[0].split() == ["LINE:COL", "STATUS", "METRIC", "SHOWN", "EVIDENCE", "SOURCE"]
    assert any(r.split()[:4] == ["6:22", "drifted", "accuracy", "90.3"] for r in rows)
    assert rows[-1].startswith("18 claims: 4 drifted, 2 unbacked, 12 matched")
    assert "error: 4 claims have drifted from the evidence (lines 6, 8, 12, 24)" in res.stderr
    assert "warning: 2 claims have no evidence" in res.stderr


def test_cli_exits_0_when_every_claim_matches_and_unbacked_fails_only_with_strict(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "ok.md"
    doc.write_text("Validation accuracy: 91.3%; the loss ends at 0.31.\nWe get an F1 of 0.9.\n")
    monkeypatch.chdir(run)  # without --evidence: the current directory
    res = rgt(str(doc))
    assert res.exit_code == 0, res.output
    assert "warning: 1 claim has no evidence for their metric (unbacked, lines 2)" in res.stderr
    strict = rgt(str(doc), "--strict")
    assert strict.exit_code == 1 and "--strict" in strict.stderr


def test_cli_json_is_one_object(run: Path) -> None:
    res = rgt(str(TEX), "--evidence", str(run / "eval.json"), "--evidence", str(run / "metrics.jsonl"),
              "--rows", "ours", "--json")
    assert res.exit_code == 1
    (line,) = res.stdout.splitlines()
    obj = json.loads(line)
    assert obj["ok"] is False and obj["counts"]["drifted"] == 5
    assert {(d["line"], d["shown"], d["evidence"]["key"]) for d in obj["drifted"]} >= {
        (line_of(TEX, "Ours-big &"), "32.10", "psnr_set5")}
    assert obj["evidence"] == [str(run / "eval.json"), str(run / "metrics.jsonl")]


def test_cli_usage_and_evidence_errors(run: Path, tmp_path: Path) -> None:
    assert rgt(str(tmp_path / "nope.md"), "--evidence", str(run)).exit_code == 2
    bad = rgt(str(MD), "--evidence", str(run), "--rows", "(")
    assert bad.exit_code == 2 and "--rows" in bad.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    res = rgt(str(MD), "--evidence", str(empty))
    assert res.exit_code == 1 and "error: no metric values in the evidence" in res.stderr


def test_claim_is_plain_data() -> None:
    c = claims_in("loss 0.25")[0]
    assert isinstance(c, Claim) and c.to_dict()["plus_minus"] == pytest.approx(0.005)
