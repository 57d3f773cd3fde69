"""`megatron-search eval` on a real tiny checkpoint (random init, in-process local engine): the budget
table and plots come out, and a second run resumes with nothing left to ask."""
import json
from pathlib import Path

import pytest

from megatron_search.chat.tokenizer import BPETokenizer
from megatron_search.cli import main
from megatron_search.cli.eval_cmd import parse_budgets
from megatron_search.search.local import build_index

FIX = Path(__file__).parent / "fixtures" / "eval"
MODEL = "configs/models/tiny_qwen3_moe"


def test_parse_budgets():
    assert parse_budgets("0-10") == list(range(11)) and parse_budgets("0,1,4") == [0, 1, 4]
    for bad in ("3-1", "a", "-1", ""):
        with pytest.raises(ValueError, match="--budgets"):
            parse_budgets(bad)


def test_eval_cli_on_tiny_checkpoint_resumes(tmp_path, capsys):
    docs = [{"id": f"d{i}", "title": t, "url": f"https://w.example/{i}", "text": f"{t} is in the record {i}."}
            for i, t in enumerate(["Ivo Brand", "Ellow", "Velde Press", "Quarnby"])]
    build_index(docs, tmp_path / "index", progress=False)
    qa = [json.loads(l) for l in (FIX / "qa_records.jsonl").read_text().splitlines()]
    texts = [json.dumps(d) for d in docs] + [r["question"] for r in qa]
    BPETokenizer.train(texts * 4, vocab_size=600).save(tmp_path / "tok")
    args = ["eval", f"model.tokenizer={tmp_path / 'tok'}", "eval.max_new_tokens=6", "rollout.max_turns=2",
            "--model", f"tiny={MODEL}", "--records", str(FIX / "qa_records.jsonl"), "--split", "test",
            "--index", str(tmp_path / "index"), "--out", str(tmp_path / "run"), "--budgets", "0,2", "--limit", "2",
            "--price", "tiny=gpt-5-mini", "--quiet", "--no-language"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tiny: 4 new results, 0 already on file, 0 engine errors" in out
    assert "| model | b=0 | b=2 |" in out
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    pts = report["budget_curve"]["tiny"]["synthetic-1hop"]
    assert sorted(pts) == ["0", "2"] and all(p["n"] == 2 for p in pts.values())
    assert all(p["mean_tokens_out"] <= 2 * 6 for p in pts.values())  # at most max_turns turns of max_new_tokens
    assert (tmp_path / "run" / "accuracy_vs_budget.png").stat().st_size > 0
    assert (tmp_path / "run" / "accuracy_vs_cost.png").stat().st_size > 0
    assert main(args) == 0
    assert "tiny: 0 new results, 4 already on file" in capsys.readouterr().out


def test_eval_cli_errors(tmp_path, capsys):
    base = ["eval", "--model", f"tiny={MODEL}", "--out", str(tmp_path / "r")]
    assert main(base) == 2
    assert "no benchmark given" in capsys.readouterr().err
    assert main(base + ["--records", str(FIX / "qa_records.jsonl"), "--price", "other=gpt-5"]) == 2
    assert "not among the --model names" in capsys.readouterr().err
    assert main(["eval", "--model", "x=/nonexistent", "--records", str(FIX / "qa_records.jsonl"),
                 "--out", str(tmp_path / "r"), "--index", str(tmp_path)]) == 2
    assert "is not a search index" in capsys.readouterr().err
