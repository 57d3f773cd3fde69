"""Public QA converters on fixtures in each dataset's real column layout, quality filters, scale matching."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_search.cli import main
from megatron_search.data.jsonl import DataError, SkipCounter
from megatron_search.data.public import FilterReport, convert_file, match_scale, quality_filter
from megatron_search.data.records import QARecord
from megatron_search.text import normalize_answer as normalize_text

FIX = Path(__file__).parent / "fixtures" / "data"


def test_each_converter_reads_its_layout(tmp_path):
    dd = convert_file("deepdive", FIX / "deepdive.parquet")
    assert [r.id for r in dd] == ["deepdive-dd-1", "deepdive-dd-2", "deepdive-dd-3", "deepdive-dd-4"]
    assert dd[0].answers == ["Ellow"] and dd[0].metadata["turns"] == 2 and dd[0].split == "train"
    seal = convert_file("sealqa", FIX / "sealqa_seal-0.parquet")
    assert seal[1].answers == ["Harbor FC"] and seal[1].metadata["freshness"] == "never-changing"
    assert seal[0].metadata["question_types"] == ["counting"]
    ws = convert_file("webshaper", FIX / "webshaper.jsonl", on_error="skip")
    assert ws[0].id == "webshaper-1" and ws[1].answers == ["R. Velde"] and ws[0].metadata["urls"] == ["https://b.example/1"]
    ww = convert_file("webwalkerqa", FIX / "webwalkerqa.jsonl")
    assert ww[0].metadata["root_url"] == "https://harbor.example/" and ww[0].metadata["info"]["difficulty_level"] == "easy"
    sq = convert_file("simpleqa", FIX / "simpleqa.csv")
    assert sq[0].question == "Who founded the company that made the first pocket radio?"
    assert sq[0].metadata["answer_type"] == "Person" and sq[0].split == "test"
    fr = convert_file("frames", FIX / "frames.tsv")
    assert fr[1].answers == ["4"]
    assert fr[1].metadata["wikipedia_links"] == ["https://en.wikipedia.org/wiki/Quarnby", "https://en.wikipedia.org/wiki/Ellow"]
    # the common CSV copy of FRAMES (question, true_answer, the rest as upstream) converts to the same records
    import csv

    with open(FIX / "frames.tsv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    copy = tmp_path / "frames.csv"
    with open(copy, "w", newline="", encoding="utf-8") as f:
        names = ["question" if k == "Prompt" else "true_answer" if k == "Answer" else k for k in rows[0]]
        w = csv.writer(f)
        w.writerow(names)
        w.writerows([list(r.values()) for r in rows])
    fr_csv = convert_file("frames", copy)
    assert [(r.question, r.answers, r.metadata) for r in fr_csv] == [(r.question, r.answers, r.metadata) for r in fr]
    bam = convert_file("bamboogle", FIX / "bamboogle.csv", on_error="skip")
    assert bam[1].question == "What is the capital of the country whose flag has a red, wavy stripe?"


def test_bad_rows_name_file_and_line_or_are_counted(tmp_path):
    with pytest.raises(DataError, match=r"bamboogle\.csv:5: .*4 fields, header has 2"):
        convert_file("bamboogle", FIX / "bamboogle.csv")
    with pytest.raises(DataError, match=r"webshaper\.jsonl:3: .*not valid JSON"):
        convert_file("webshaper", FIX / "webshaper.jsonl")
    skips = SkipCounter()
    assert len(convert_file("webshaper", FIX / "webshaper.jsonl", "skip", skips)) == 2
    assert skips.skipped == 1 and "webshaper.jsonl:3" in skips.reasons[0]
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"question": "q?", "answer": "a"}) + "\n" + json.dumps({"query": "q?"}) + "\n")
    with pytest.raises(DataError, match=r"wrong\.jsonl:2: .*missing column 'question'"):
        convert_file("webshaper", wrong)
    with pytest.raises(DataError, match="unknown source"):
        convert_file("nq", wrong)


def test_quality_filter_and_overlap():
    train = (convert_file("deepdive", FIX / "deepdive.parquet") + convert_file("bamboogle", FIX / "bamboogle.csv", "skip")
             + convert_file("webshaper", FIX / "webshaper.jsonl", "skip") + convert_file("webwalkerqa", FIX / "webwalkerqa.jsonl"))
    evals = convert_file("simpleqa", FIX / "simpleqa.csv") + convert_file("frames", FIX / "frames.tsv")
    report = FilterReport()
    kept = quality_filter(train, evals, 200, report)
    # 4 + 3 + 2 + 2 = 11 rows: dd-3 duplicates dd-1 (normalised), dd-4 empty answer, one bamboogle
    # question is in SimpleQA, one webshaper question in FRAMES, one webwalkerqa answer is 400 chars.
    assert report.dropped == {"duplicate question": 1, "empty answer": 1, "overlaps an evaluation question": 2,
                              "over-long answer": 1}
    assert len(kept) == 6 and report.kept == 6
    assert not {normalize_text(r.question) for r in kept} & {normalize_text(r.question) for r in evals}


def test_match_scale_keeps_variants_together():
    syn = []
    for i in range(10):
        syn.append(QARecord(f"syn-{i}", f"q{i}", ["a"], "synthetic"))
        if i % 2:
            syn.append(QARecord(f"syn-{i}-fmt", f"q{i}", ["a"], "synthetic", format_instruction="List it."))
    s1, s2 = match_scale(syn, 7, seed=3), match_scale(syn, 7, seed=3)
    assert [r.id for r in s1] == [r.id for r in s2] and len(s1) == 7
    ids = [r.id for r in s1]
    for rid in ids:
        if rid.endswith("-fmt"):
            assert rid.removesuffix("-fmt") in ids
    with pytest.raises(DataError, match="synthesise more"):
        match_scale(syn, 100)


def test_cli_convert(tmp_path, capsys):
    syn = tmp_path / "syn.jsonl"
    syn.write_text("".join(json.dumps(QARecord(f"syn-{i}", f"q{i}", ["a"], "synthetic").to_dict()) + "\n"
                           for i in range(20)))
    out = tmp_path / "train.jsonl"
    rc = main(["data", "convert", "data.convert.on_error=skip", "data.convert.augment_fraction=0",
               "--input", f"deepdive={FIX / 'deepdive.parquet'}", f"bamboogle={FIX / 'bamboogle.csv'}",
               f"webshaper={FIX / 'webshaper.jsonl'}", f"webwalkerqa={FIX / 'webwalkerqa.jsonl'}",
               f"sealqa={FIX / 'sealqa_seal-0.parquet'}",
               "--eval", f"simpleqa={FIX / 'simpleqa.csv'}", f"frames={FIX / 'frames.tsv'}",
               "--out", str(out), "--synthetic", str(syn), "--synthetic-out", str(tmp_path / "syn_matched.jsonl")])
    assert rc == 0
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(rows) == 8 and {r["source"] for r in rows} == {"deepdive", "bamboogle", "webshaper", "webwalkerqa", "sealqa"}
    assert len((tmp_path / "syn_matched.jsonl").read_text().splitlines()) == 8
    assert "bad rows skipped: 2" in capsys.readouterr().out


def test_format_augment_keeps_answers_and_split():
    from megatron_search.data.public import format_augment

    recs = [QARecord(f"r{i}", f"q{i}?", [f"a{i}"], "bamboogle") for i in range(40)]
    out = format_augment(recs, {"json": 'Write the answer as a JSON object with a single key "answer".'}, 0.5, seed=1)
    fmt = [r for r in out if r.id.endswith("-fmt")]
    assert [r.id for r in out if not r.id.endswith("-fmt")] == [r.id for r in recs]
    assert 10 <= len(fmt) <= 30
    by_id = {r.id: r for r in recs}
    for r in fmt:
        base = by_id[r.id.removesuffix("-fmt")]
        assert r.answers == base.answers and r.split == base.split and r.question == base.question
        assert r.prompt == f"{base.question}\n\n{r.format_instruction}"
    assert format_augment(recs, {"json": "x"}, 0.0) == recs


def test_cli_bad_row_is_one_clear_error(tmp_path, capsys):
    rc = main(["data", "convert", "--input", f"bamboogle={FIX / 'bamboogle.csv'}", "--out", str(tmp_path / "o.jsonl")])
    assert rc == 2
    assert "bamboogle.csv:5: bad bamboogle row" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()  # nothing half-written
