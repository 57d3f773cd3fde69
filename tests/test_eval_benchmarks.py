"""Benchmark loaders on fixtures in each set's real layout; deterministic sub-sampling."""
import hashlib
import json
from pathlib import Path

import pytest

from megatron_search.data.jsonl import DataError
from megatron_search.eval.benchmarks import EvalExample, load_benchmark, subsample

FIX = Path(__file__).parent / "fixtures" / "eval"


def test_simpleqa_csv_layout():
    ex = load_benchmark("simpleqa", FIX / "simple_qa_test_set.csv")
    assert [e.answers for e in ex] == [("Orrin Vale",), ("41",), ("12 March, 1911",)]
    assert ex[2].question == 'On what date, month and year, did the painting "Dunmere, Evening" first go on display?'
    assert ex[0].metadata["urls"] == ["https://en.example.org/wiki/Orrin_Vale", "https://news.example.com/vale"]
    assert {e.benchmark for e in ex} == {"simpleqa"}
    assert len({e.id for e in ex}) == 3


def test_frames_tsv_layout():
    ex = load_benchmark("frames", FIX / "frames_test.tsv")
    assert [e.answers for e in ex] == [("Jane Ballou",), ("37",)]
    assert ex[0].metadata["wikipedia_links"] == ["https://en.wikipedia.org/wiki/A", "https://en.wikipedia.org/wiki/B"]
    assert ex[1].metadata["reasoning_types"] == "Numerical reasoning | Temporal reasoning"


def test_facts_jsonl_field_names_and_default_ids():
    ex = load_benchmark("facts", FIX / "facts_open.jsonl")
    assert [(e.id, e.question, e.answers) for e in ex] == [
        ("fo-1", "Which river flows through Quarnby?", ("Ellow",)),
        ("fo-2", "Name the two founders of Talbeck Works.", ("Ivo Brand and Orrin Vale", "Orrin Vale and Ivo Brand")),
        ("facts-3", "What year did the Dunmere gallery open?", ("1902",)),
    ]
    assert ex[0].metadata == {"topic": "geography"}


def test_records_split_and_format_instruction():
    ex = load_benchmark("records", FIX / "qa_records.jsonl", split="test", name="demo")
    assert [e.id for e in ex] == ["q-test-1", "q-test-2", "q-test-3"]
    assert ex[2].question == "Which company published Dunmere Evening?\n\nAnswer with the name only."
    assert {e.benchmark for e in ex} == {"demo"}
    with pytest.raises(DataError, match="no examples in split 'validation'"):
        load_benchmark("records", FIX / "qa_records.jsonl", split="validation")


def test_bad_inputs_name_the_problem(tmp_path):
    p = tmp_path / "f.jsonl"
    p.write_text(json.dumps({"id": "a", "question": "Q?"}) + "\n")
    with pytest.raises(DataError, match="row 1: gold answer"):
        load_benchmark("facts", p)
    p.write_text(json.dumps({"id": "a", "question": "Q?", "answer": "x"}) + "\n"
                 + json.dumps({"id": "a", "question": "R?", "answer": "y"}) + "\n")
    with pytest.raises(DataError, match="duplicate example id 'a'"):
        load_benchmark("facts", p)
    with pytest.raises(DataError, match="unknown benchmark kind"):
        load_benchmark("mmlu", p)
    with pytest.raises(DataError, match="no file"):
        load_benchmark("facts", tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="split applies only"):
        load_benchmark("facts", FIX / "facts_open.jsonl", split="test")


def test_subsample_is_deterministic_nested_and_order_preserving():
    ex = [EvalExample(f"id{i}", f"q{i}", ("a",), "b") for i in range(40)]
    rank = sorted(ex, key=lambda e: hashlib.sha256(f"7:{e.id}".encode()).hexdigest())
    want = {e.id for e in rank[:10]}
    got = subsample(ex, 10, seed=7)
    assert {e.id for e in got} == want
    assert [e.id for e in got] == [e.id for e in ex if e.id in want]  # file order kept
    assert {e.id for e in subsample(ex, 5, 7)} <= want  # nested
    assert {e.id for e in subsample(list(reversed(ex)), 10, 7)} == want  # independent of file order
    assert subsample(ex, 0, 7) == ex and subsample(ex, 99, 7) == ex
    assert {e.id for e in subsample(ex, 10, 8)} != want


FRAMES_ROWS = [  # (index, question, answer, wikipedia_link_1, wikipedia_link_11+, reasoning_types, wiki_links)
    ("0", "Which bridge did the second mayor of Quarnby open?", "Ellow Bridge", "https://en.wikipedia.org/wiki/A", "",
     "Multiple constraints", '["https://en.wikipedia.org/wiki/A"]'),
    ("1", "How many years after 1901 did the Dunmere gallery open?", "1", "", "https://en.wikipedia.org/wiki/D",
     "Numerical reasoning", "[]"),
]
FRAMES_TAIL = ["wikipedia_link_1", "wikipedia_link_11+", "reasoning_types", "wiki_links"]


def write_table(path, header, rows, delimiter):
    import csv

    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(header)
        w.writerows(rows)
    return path


def test_frames_csv_copy_reads_like_the_upstream_tsv(tmp_path):
    from megatron_search.eval.benchmarks import frames_layout

    tsv = write_table(tmp_path / "test.tsv", ["", "Prompt", "Answer"] + FRAMES_TAIL, FRAMES_ROWS, "\t")
    csv_copy = write_table(tmp_path / "frames.csv", ["Unnamed: 0", "question", "true_answer"] + FRAMES_TAIL,
                           FRAMES_ROWS, ",")
    assert (frames_layout(tsv), frames_layout(csv_copy)) == ("upstream", "csv_copy")
    up, copy = load_benchmark("frames", tsv), load_benchmark("frames", csv_copy)
    # ids by hand: frames-<first 12 hex digits of sha256(question)>, the same in both layouts
    want_ids = ["frames-" + hashlib.sha256(r[1].encode()).hexdigest()[:12] for r in FRAMES_ROWS]
    assert [e.id for e in up] == [e.id for e in copy] == want_ids
    assert [e.answers for e in copy] == [("Ellow Bridge",), ("1",)]
    assert copy[0].question == "Which bridge did the second mayor of Quarnby open?"
    assert copy[0].metadata["wikipedia_links"] == ["https://en.wikipedia.org/wiki/A"]
    assert copy[1].metadata["wikipedia_links"] == ["https://en.wikipedia.org/wiki/D"]  # the 11+ column counts too
    assert copy[1].metadata["reasoning_types"] == "Numerical reasoning"
    assert [e.metadata for e in up] == [e.metadata for e in copy]  # locations included: line 2, line 3
    assert {e.benchmark for e in copy} == {"frames"}
    # the layout is told by the header, not the suffix: the copy's columns in a .tsv, upper-cased, load too
    odd = write_table(tmp_path / "copy.tsv", ["QUESTION", "True_Answer"] + FRAMES_TAIL,
                      [r[1:] for r in FRAMES_ROWS], "\t")
    assert [(e.id, e.answers) for e in load_benchmark("frames", odd)] == [(e.id, e.answers) for e in copy]


def test_frames_bad_headers_and_rows_name_the_file(tmp_path):
    bad = write_table(tmp_path / "other.csv", ["id", "query", "gold"], [("1", "Q?", "A")], ",")
    with pytest.raises(DataError) as e:
        load_benchmark("frames", bad)
    msg = str(e.value)
    assert str(bad) in msg and "columns found: ['id', 'query', 'gold']" in msg
    assert "Prompt + Answer (upstream) or question + true_answer (csv_copy)" in msg
    both = write_table(tmp_path / "both.csv", ["Prompt", "Answer", "question", "true_answer"],
                       [("a", "b", "c", "d")], ",")
    with pytest.raises(DataError, match="columns of both layouts"):
        load_benchmark("frames", both)
    empty_answer = write_table(tmp_path / "gap.csv", ["question", "true_answer"], [("Q1?", "A1"), ("Q2?", "")], ",")
    with pytest.raises(DataError, match=r"gap.csv:3: example 'frames-[0-9a-f]{12}' has no gold answer"):
        load_benchmark("frames", empty_answer)
    short = tmp_path / "short.csv"
    short.write_text("question,true_answer,reasoning_types\nQ1?,A1\n")
    with pytest.raises(DataError, match=r"short.csv:2: bad frames row: 2 fields, header has 3"):
        load_benchmark("frames", short)
