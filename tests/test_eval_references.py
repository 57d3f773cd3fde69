"""The write-up's reference points: the data file (figures by hand from RECIPE 8), and how the report places
them beside ours (markdown rows, plot markers) without mixing them into our curve."""
import json

import pytest

from megatron_search.eval.references import ReferencePoint, load_references
from megatron_search.eval.report import build_report, markdown, reference_series, write_outputs

LARGE, GPT, SONNET = "Qwen3.5-397B-A17B SFT+RL", "GPT-5.4", "Claude Sonnet 4.6"


def test_reference_file_holds_recipe_8_figures():
    refs = load_references()
    got = {(p.benchmark, p.model, p.budget): (round(100 * p.accuracy, 6), p.cents_per_query, p.how) for p in refs.points}
    # RECIPE 8: "Large SFT+RL reached 57.3% on FRAMES with a single tool call (5.7 points above GPT-5.4, 4.7 above
    # Sonnet 4.6); at b=4, 73.9% at 2.0 cents/query vs GPT-5.4 67.8% at 8.5 cents and Sonnet 4.6 62.4% at 15.3 cents"
    assert got == {
        ("frames", LARGE, 1): (57.3, None, "quoted"),
        ("frames", GPT, 1): (51.6, None, "derived: 57.3 - 5.7"),
        ("frames", SONNET, 1): (52.6, None, "derived: 57.3 - 4.7"),
        ("frames", LARGE, 4): (73.9, 2.0, "quoted"),
        ("frames", GPT, 4): (67.8, 8.5, "quoted"),
        ("frames", SONNET, 4): (62.4, 15.3, "quoted"),
    }
    assert "facts" in refs.missing and not any(p.benchmark == "facts" for p in refs.points)  # no figure invented
    assert refs.source["date"] == "2026-04-22" and refs.source["url"].startswith("https://research.perplexity.ai/")
    assert refs.notes == ("gains are largest at b=2..7 and every model shows diminishing returns near b=7",)
    assert len(refs.assumptions) == 3


def summary(acc, cents=None):
    return {"n": 10, "accuracy": acc, "correct": acc, "not_attempted": 0.1, "accuracy_given_attempted": acc / 0.9,
            "f1": 0.5, "token_f1": 0.5, "mean_tool_calls": 1.0, "mean_tokens_in": 1000.0, "mean_tokens_out": 100.0,
            "judge_malformed": 0, "protocols": ["facts"], "cents_per_query": cents}


def test_report_places_reference_points_beside_ours(tmp_path):
    curve = {"ours": {"frames": {0: summary(0.2), 1: summary(0.5, 1.234)}, "facts": {1: summary(0.4)},
                      "demo": {1: summary(0.9)}}}
    rep = build_report("r", curve, {}, {}, references=load_references())
    assert rep["budget_curve"] is curve and set(curve["ours"]["frames"]) == {0, 1}  # our curve is untouched
    assert {p["benchmark"] for p in rep["references"]["points"]} == {"frames"}
    assert set(rep["references"]["missing"]) == {"facts"}  # nothing about "demo"
    md = markdown(rep)
    assert "| model | b=0 | b=1 | b=4 |" in md  # the write-up's b=4 column joins ours
    assert "| ours | 20.0 | 50.0 / 1.23c | - |" in md
    assert f"| write-up: {LARGE} | - | 57.3 | 73.9 / 2.00c |" in md
    assert f"| write-up: {GPT} | - | 51.6 | 67.8 / 8.50c |" in md
    assert f"| write-up: {SONNET} | - | 52.6 | 62.4 / 15.30c |" in md
    assert "No write-up figures for facts: RECIPE 8 records the write-up's budget curve on FRAMES and Facts Open" in md
    assert "### facts: grades, tool calls and tokens per b (graded by: facts)" in md
    assert f"| frames | {GPT} | 1 | 51.6 | - | derived: 57.3 - 5.7 |" in md
    assert "## Write-up reference points (not ours)" in md and "diminishing returns near b=7" in md
    assert "- Assumed: the b = 4 figures are FRAMES" in md
    demo = next(sec for sec in md.split("\n## ") if sec.startswith("demo:"))
    assert "write-up" not in demo  # no reference rows for a set the write-up has no figures for
    # a report with none of the write-up's sets carries no reference entry at all
    assert "references" not in build_report("r", {"ours": {"demo": {1: summary(0.9)}}}, {}, {}, references=load_references())
    # the plots come out with the markers drawn
    paths = write_outputs(rep, tmp_path, tb=False)
    assert (tmp_path / "accuracy_vs_budget.png").stat().st_size > 0 and "accuracy_vs_cost" in paths
    assert "write-up" not in json.dumps(json.loads((tmp_path / "report.json").read_text())["budget_curve"])


def test_reference_series_by_hand():
    refs = load_references()
    budget = reference_series(refs, "frames", "budget")
    assert [(label, xs, [round(y, 6) for y in ys]) for label, xs, ys, _ in budget] == [
        (f"write-up: {LARGE}", [1, 4], [57.3, 73.9]),
        (f"write-up: {GPT}", [1, 4], [51.6, 67.8]),
        (f"write-up: {SONNET}", [1, 4], [52.6, 62.4]),
    ]
    cost = reference_series(refs, "frames", "cost")  # only the b=4 points have a cost
    assert [(label, xs, bs) for label, xs, _, bs in cost] == [
        (f"write-up: {LARGE}", [2.0], [4]), (f"write-up: {GPT}", [8.5], [4]), (f"write-up: {SONNET}", [15.3], [4])]
    assert reference_series(refs, "facts", "budget") == [] and reference_series(None, "frames", "budget") == []


def test_make_report_overlays_by_default_and_can_leave_them_out(tmp_path):
    from megatron_search.config import load_config
    from megatron_search.eval.results import ResultStore
    from megatron_search.eval.run import make_report

    store = ResultStore(tmp_path / "results.jsonl")
    for i, grade in enumerate(["CORRECT", "INCORRECT"]):
        store.add({"model": "m", "benchmark": "frames", "variant": "budget", "budget": 4, "id": f"f{i}", "grade": grade,
                   "exact": False, "substring": False, "f1": 0.0, "tool_calls": 2, "broken": {}, "prediction": "x",
                   "question": "q?", "tokens_in": 30_000, "tokens_out": 1_000, "protocol": "frames"})
    cfg = load_config(None, [])
    rep = make_report(cfg.eval, store, tmp_path, ["m"], ["budget"], {"m": "qwen3.5-397b-a17b"}, None, None, None,
                      language=False, tensorboard=False)
    pt = rep["budget_curve"]["m"]["frames"][4]
    assert pt["accuracy"] == 0.5 and pt["cents_per_query"] == pytest.approx(2.16) and pt["protocols"] == ["frames"]
    assert len(rep["references"]["points"]) == 6
    md = (tmp_path / "report.md").read_text()
    assert "| model | b=1 | b=4 |" in md and "| m | - | 50.0 / 2.16c |" in md  # ours at b=4 beside theirs
    assert f"| write-up: {LARGE} | 57.3 | 73.9 / 2.00c |" in md
    assert "secondary source" in md  # the price row's note is shown
    rep = make_report(cfg.eval, store, tmp_path, ["m"], ["budget"], {}, None, None, None, language=False, tensorboard=False,
                      references=None)
    assert "references" not in rep and "write-up" not in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("point,match", [
    ("{benchmark: frames, model: X, budget: 1, how: quoted}", "needs"),
    ("{benchmark: frames, model: X, budget: 1, accuracy_pct: 157.3, how: quoted}", r"\[0, 100\]"),
    ("{benchmark: frames, model: X, budget: -1, accuracy_pct: 50, how: quoted}", "integer >= 0"),
    ("{benchmark: frames, model: X, budget: 1, accuracy_pct: 50, how: guessed}", "how must be"),
    ("{benchmark: frames, model: X, budget: 1, accuracy_pct: 50, cents_per_query: -2, how: quoted}", "cents_per_query"),
])
def test_bad_reference_rows_name_file_and_row(tmp_path, point, match):
    p = tmp_path / "refs.yaml"
    good = "{benchmark: frames, model: Y, budget: 2, accuracy_pct: 1, how: quoted}"
    p.write_text(f"source: {{url: https://x}}\npoints:\n  - {good}\n  - {point}\n")
    with pytest.raises(ValueError, match=match) as e:
        load_references(p)
    assert f"{p}: point 2" in str(e.value)


def test_bad_reference_files(tmp_path):
    p = tmp_path / "refs.yaml"
    p.write_text("points: []\n")
    with pytest.raises(ValueError, match="'source' must name at least the url"):
        load_references(p)
    row = "{benchmark: frames, model: X, budget: 1, accuracy_pct: 50, how: quoted}"
    p.write_text(f"source: {{url: https://x}}\npoints:\n  - {row}\n  - {row}\n")
    with pytest.raises(ValueError, match="two points for"):
        load_references(p)
    assert ReferencePoint("frames", "X", 1, 0.5, None, "quoted").label == "write-up: X"
