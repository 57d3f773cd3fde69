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
