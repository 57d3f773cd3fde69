"""Deployment metrics, cost and sbs pairing: values by hand."""
import pytest
import torch

from megatron_search.config import load_config
from megatron_search.eval.benchmarks import EvalExample
from megatron_search.eval.cost import Price, cents_per_query, load_prices
from megatron_search.eval.metrics import (LanguageID, abstention, broken_tool_calls, budget_curve, language_mismatch,
                                          sbs_metric, sbs_rows, withhold_evidence)


def row(model="m", b=1, i="a", grade="CORRECT", calls=1, broken=None, pred="x", q="q?", variant="budget", t=(10, 2)):
    return {"model": model, "benchmark": "demo", "variant": variant, "budget": b, "id": i, "grade": grade,
            "exact": grade == "CORRECT", "substring": grade == "CORRECT", "f1": float(grade == "CORRECT"),
            "tool_calls": calls, "broken": broken or {}, "prediction": pred, "question": q,
            "tokens_in": t[0], "tokens_out": t[1]}


def test_withhold_evidence_removes_answer_and_linked_documents():
    docs = [{"id": "1", "title": "Ivo Brand", "url": "u1", "text": "Founder of Talbeck Works."},
            {"id": "2", "title": "Talbeck Works", "url": "u2", "text": "It was founded by Ivo  Brand in 1901."},
            {"id": "3", "title": "Bridge", "url": "https://en.wikipedia.org/wiki/C", "text": "A bridge."},
            {"id": "4", "title": "Brandt", "url": "u4", "text": "Ivo Brandt is a different man."},
            {"id": "5", "title": "Sea", "url": "u5", "text": "Waves."}]
    ex = [EvalExample("e1", "Who founded Talbeck Works?", ("Ivo Brand",), "demo"),
          EvalExample("e2", "When?", ("1999",), "frames", {"wikipedia_links": ["https://en.wikipedia.org/wiki/C"]})]
    kept, withheld = withhold_evidence(docs, ex)
    assert withheld == ["1", "2", "3"]  # "Ivo Brandt" is not "Ivo Brand" on word boundaries
    assert [d["id"] for d in kept] == ["4", "5"]
    with pytest.raises(ValueError, match="nothing left"):
        withhold_evidence(docs[:2], ex)


def test_language_mismatch_with_lingua():
    lid = LanguageID(["ENGLISH", "FRENCH", "GERMAN"], min_chars=20, min_confidence=0.5)
    rows = [row(q="Quelle est la capitale de la France, s'il vous plait ?", pred="The capital of France is Paris, of course."),
            row(q="Quelle est la capitale de la France, s'il vous plait ?", pred="La capitale de la France est Paris."),
            row(q="Which river flows through the old town of Quarnby?", pred="Ellow"),  # too short: undetermined
            row(q="Wer hat das Unternehmen im Jahr neunzehnhundert gegruendet?", pred=None)]
    m = language_mismatch(rows, lid)
    assert (m["determined"], m["undetermined"], m["mismatch_rate"]) == (2, 2, 0.5)
    with pytest.raises(ValueError, match="eval.languages"):
        LanguageID(["ENGLISH", "KLINGON"])


def test_broken_calls_abstention_and_curve():
    rows = [row(calls=2, broken={"over_budget": 1}), row(i="b", calls=3, broken={"malformed": 1, "bad_arguments": 1}),
            row(i="c", calls=0, grade="NOT_ATTEMPTED")]
    btc = broken_tool_calls(rows)
    assert btc["calls"] == 5 and btc["count"]["malformed"] == 1
    assert btc["rate_per_call"]["over_budget"] == 0.2 and btc["broken_total_rate"] == pytest.approx(0.6)
    assert btc["episodes_with_broken"] == pytest.approx(2 / 3)
    ab = abstention([row(grade="NOT_ATTEMPTED", pred="I don't know"), row(grade="INCORRECT"),
                     row(grade="NOT_ATTEMPTED", pred=None), row(grade="CORRECT")])
    assert (ab["abstention_rate"], ab["no_answer"], ab["answered_wrong"], ab["answered_right"]) == (0.25, 0.25, 0.25, 0.25)
    curve = budget_curve(rows + [row(b=0, calls=0, grade="INCORRECT", t=(8, 4))])
    assert curve["m"]["demo"][1]["accuracy"] == pytest.approx(2 / 3)
    assert curve["m"]["demo"][1]["mean_tool_calls"] == pytest.approx(5 / 3)
    assert curve["m"]["demo"][0]["mean_tokens_in"] == 8.0


def test_cost_by_hand_and_price_table_errors(tmp_path):
    p = Price("x", 2.0, 8.0, "2025-08", "s")
    # 12,000 in at $2/M = $0.024, 1,500 out at $8/M = $0.012 -> 3.6 cents
    assert cents_per_query(12_000, 1_500, p) == pytest.approx(3.6)
    table = load_prices()
    assert all(r.date and r.source for r in table.values())
    bad = tmp_path / "p.yaml"
    bad.write_text("models:\n  m: {input_usd_per_1m: 1.0, output_usd_per_1m: 2.0}\n")
    with pytest.raises(ValueError, match="'m' needs"):
        load_prices(bad)
    bad.write_text("models:\n  m: {input_usd_per_1m: -1, output_usd_per_1m: 2.0, date: d, source: s}\n")
    with pytest.raises(ValueError, match=">= 0"):
        load_prices(bad)


def test_comparison_model_prices_are_dated_and_cost_by_hand():
    table = load_prices()
    got = {k: (table[k].input_usd_per_1m, table[k].output_usd_per_1m, table[k].date)
           for k in ("gpt-5.4", "claude-sonnet-4.6", "qwen3.5-plus", "qwen3.5-397b-a17b", "qwen3.5-122b-a10b")}
    assert got == {"gpt-5.4": (2.5, 15.0, "2026-03-05"), "claude-sonnet-4.6": (3.0, 15.0, "2026-02-17"),
                   "qwen3.5-plus": (0.4, 2.4, "2026-02-16"), "qwen3.5-397b-a17b": (0.6, 3.6, "2026-04-27"),
                   "qwen3.5-122b-a10b": (0.4, 3.2, "2026-04-27")}
    assert all(table[k].source.startswith("https://") for k in got)
    assert all("secondary source" in table[k].note for k in ("qwen3.5-plus", "qwen3.5-397b-a17b", "qwen3.5-122b-a10b"))
    assert "secondary" not in table["gpt-5.4"].note + table["claude-sonnet-4.6"].note  # read from the vendors' pages
    # 30,000 tokens in and 1,000 out (a few searches): GPT-5.4 $0.075 + $0.015 = 9.0 cents; Sonnet 4.6
    # $0.090 + $0.015 = 10.5 cents; Qwen3.5-397B-A17B on Model Studio $0.018 + $0.0036 = 2.16 cents
    assert cents_per_query(30_000, 1_000, table["gpt-5.4"]) == pytest.approx(9.0)
    assert cents_per_query(30_000, 1_000, table["claude-sonnet-4.6"]) == pytest.approx(10.5)
    assert cents_per_query(30_000, 1_000, table["qwen3.5-397b-a17b"]) == pytest.approx(2.16)
    assert table["gpt-5"].note == ""  # the note is optional


def test_sbs_pairs_and_metric():
    rows = [row(model="cand", i="a", pred="A1"), row(model="cand", i="b", pred=None), row(model="cand", i="c", pred="C1"),
            row(model="base", i="a", pred="A0"), row(model="base", i="b", pred="B0"), row(model="base", i="c", b=2, pred="C0")]
    pairs = sbs_rows(rows, "cand", "base", budget=1)
    assert [(p["id"], p["candidate"], p["baseline"]) for p in pairs] == [("a", "A1", "A0"), ("b", "", "B0")]

    class Scorer:  # P_bar = 0.9 when the candidate is non-empty, else 0.2
        def p_bar(self, ctx, cand, base):
            return torch.tensor([0.9 if c else 0.2 for c in cand])

    s = sbs_metric(Scorer(), pairs)
    assert s["sbs"] == pytest.approx(0.55) and s["win"] == 0.5 and s["loss"] == 0.5


def test_eval_config_defaults_are_recipe_8():
    e = load_config(None, []).eval
    assert (e.max_calls, e.max_results, e.max_new_tokens, e.temperature, e.budgets) == (5, 10, 8192, 0.6, list(range(11)))


def test_report_sbs_pairs_file_and_scorer(tmp_path):
    from megatron_search.eval.results import ResultStore
    from megatron_search.eval.run import make_report

    store = ResultStore(tmp_path / "results.jsonl")
    for r in [row(model="cand", b=2, i="a", pred="A1"), row(model="cand", b=2, i="b", pred="B1", grade="INCORRECT"),
              row(model="base", b=2, i="a", pred="A0"), row(model="base", b=2, i="b", pred="B0")]:
        store.add(r)
    cfg = load_config(None, [])
    rep = make_report(cfg.eval, store, tmp_path, ["cand", "base"], ["budget"], {"cand": "gpt-5"}, "base", None, 2,
                      language=False, tensorboard=False)
    pairs = [__import__("json").loads(l) for l in open(rep["deployment"]["cand"]["sbs_pairs"])]
    assert [(p["candidate"], p["baseline"]) for p in pairs] == [("A1", "A0"), ("B1", "B0")]
    assert "sbs_pairs" not in rep["deployment"]["base"]
    assert rep["budget_curve"]["cand"]["demo"][2]["accuracy"] == 0.5
    assert rep["budget_curve"]["base"]["demo"][2]["cents_per_query"] is None  # no price row for base

    class Scorer:
        def p_bar(self, ctx, cand, base):
            return torch.tensor([0.75] * len(cand))

    rep = make_report(cfg.eval, store, tmp_path, ["cand", "base"], ["budget"], {}, "base", Scorer(), 2,
                      language=False, tensorboard=False)
    assert rep["deployment"]["cand"]["sbs"]["sbs"] == 0.75 and rep["deployment"]["cand"]["sbs"]["baseline"] == "base"
    assert "| cand | sbs vs base | 0.750 |" in (tmp_path / "report.md").read_text()
    with pytest.raises(ValueError, match="no row"):
        make_report(cfg.eval, store, tmp_path, ["cand"], ["budget"], {"cand": "gpt-99"}, None, None, None,
                    language=False, tensorboard=False)


def test_paired_accuracy_difference_by_hand():
    from megatron_search.eval.metrics import paired_accuracy_difference

    def rows(grades):  # {question: [grades of its samples]}
        return [{"id": q, "grade": "CORRECT" if g else "INCORRECT"} for q, gs in grades.items() for g in gs]

    cand = rows({"a": [1, 1, 0], "b": [0, 0, 0], "c": [1, 1, 1], "only_cand": [1]})
    base = rows({"a": [1, 0, 0], "b": [1, 0, 0], "c": [1, 1, 1], "only_base": [0]})
    out = paired_accuracy_difference(cand, base)
    # per-question differences: a 2/3-1/3 = 1/3, b 0-1/3 = -1/3, c 0; mean 0, sample var (1/9+1/9)/2 = 1/9
    assert out["questions"] == 3
    assert out["difference"] == pytest.approx(0.0, abs=1e-12)
    assert out["stderr"] == pytest.approx((1 / 9 / 3) ** 0.5)
    one = paired_accuracy_difference(rows({"a": [1]}), rows({"a": [0]}))
    assert one == {"difference": 1.0, "stderr": 0.0, "questions": 1}


def test_curve_names_the_grading_protocols_of_its_rows():
    rows = [dict(row(i="a"), protocol="facts"), dict(row(i="b"), protocol="facts")]
    assert budget_curve(rows)["m"]["demo"][1]["protocols"] == ["facts"]
    # a row from before results recorded the protocol shows up, so a mixed (resumed) run is visible
    assert budget_curve(rows + [row(i="c")])["m"]["demo"][1]["protocols"] == ["facts", "unrecorded"]
