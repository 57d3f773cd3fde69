"""Datasets through Hugging Face `datasets` (data/hf_datasets.py): every file format, a Hub-layout folder,
a save_to_disk folder; the QA, SFT, preference and eval readers on them; streaming = eager; offline errors;
a rewritten file is never served from a stale cache."""
from __future__ import annotations

import csv
import json
import os
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_search.data.hf_datasets import RowTable, column_names, iter_rows, splits
from megatron_search.data.jsonl import DataError

# QA records in the common schema (data/records.py), written below in every format
QA = [
    {"id": "q1", "question": "Which river runs through Quarnby?", "answers": ["Ellow"], "source": "synthetic",
     "split": "train", "metadata": {"hops": "2"}},
    {"id": "q2", "question": "Who founded Talbeck Works?", "answers": ["Ivo Brand", "I. Brand"], "source": "synthetic",
     "split": "test", "metadata": {"hops": "3"}},
    {"id": "q3", "question": "When did the Dunmere gallery open?", "answers": ["1902"], "source": "synthetic",
     "split": "test", "metadata": {"hops": "2"}},
]
SFT = [
    {"id": "s1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    {"id": "s2", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
]
# SimpleQA's layout: metadata is a Python dict literal in a string
SIMPLEQA = [
    ("{'topic': 'Art', 'answer_type': 'Date'}", "When did Dunmere Evening first go on display?", "12 March, 1911"),
    ("{'topic': 'Geography', 'answer_type': 'Place'}", "Which river flows through Quarnby?", "Ellow"),
]


def write_jsonl(path, rows, blank_after_first=False):
    lines = [json.dumps(r) for r in rows]
    if blank_after_first:
        lines.insert(1, "")
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_table(path, header, rows, delimiter):
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, delimiter=delimiter)
        w.writerow(header)
        w.writerows(rows)
    return path


def saved_folder(path, rows, split=None):
    import datasets

    d = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({split: d}) if split else d).save_to_disk(str(path))
    return path


def data(path, **kw):
    return [r.data for r in iter_rows(path, **kw)]


def test_each_format_gives_the_rows_written_with_their_locations(tmp_path):
    jl = write_jsonl(tmp_path / "qa.jsonl", QA, blank_after_first=True)
    rows = list(iter_rows(jl))
    assert [r.data for r in rows] == QA
    assert [r.where for r in rows] == [f"{jl}:1", f"{jl}:3", f"{jl}:4"]  # the blank line 2 is skipped, not renumbered
    pqf = write_parquet(tmp_path / "qa.parquet", QA)
    assert data(pqf) == QA and [r.where for r in iter_rows(pqf)][2] == f"{pqf} (row 3)"
    arrow = tmp_path / "qa.arrow"  # the Arrow stream format datasets writes
    table = pa.Table.from_pylist(QA)
    with pa.ipc.new_stream(str(arrow), table.schema) as w:
        w.write_table(table)
    assert data(arrow) == QA
    js = tmp_path / "qa.json"
    js.write_text(json.dumps(QA), encoding="utf-8")
    assert data(js) == QA and [r.loc for r in iter_rows(js)] == ["item 1", "item 2", "item 3"]
    header = ["metadata", "problem", "answer"]
    c = write_table(tmp_path / "simple.csv", header, SIMPLEQA + [("{}", "multi\nline question?", "NA")], ",")
    got = list(iter_rows(c))
    assert [r.data for r in got] == [dict(zip(header, row)) for row in SIMPLEQA] + [
        {"metadata": "{}", "problem": "multi\nline question?", "answer": "NA"}]  # "NA" stays a string
    assert [r.index for r in got] == [2, 3, 4]
    t = write_table(tmp_path / "simple.tsv", header, SIMPLEQA, "\t")
    assert data(t) == [dict(zip(header, row)) for row in SIMPLEQA]
    assert column_names(t) == header and column_names(pqf) == list(QA[0])
    saved = saved_folder(tmp_path / "saved", QA)
    assert data(saved) == QA and splits(saved) == ["train"]


def test_hub_layout_folder_splits(tmp_path):
    hub = tmp_path / "hub"
    write_parquet(hub / "data" / "train-00000-of-00001.parquet", QA[:1])
    write_parquet(hub / "data" / "test-00000-of-00001.parquet", QA[1:])
    assert splits(hub) == ["test", "train"]
    assert data(hub, split="test") == QA[1:] and data(hub, split="train") == QA[:1]
    assert [r.where for r in iter_rows(hub, split="test")] == [
        f"{hub}/data/test-00000-of-00001.parquet (row {i})" for i in (1, 2)]
    with pytest.raises(DataError, match=r"has splits \['test', 'train'\]; name the one"):
        list(iter_rows(hub))
    with pytest.raises(DataError, match=r"no split 'validation' \(has \['test', 'train'\]\)"):
        list(iter_rows(hub, split="validation"))
    flat = tmp_path / "flat"  # <split>.jsonl at the top, as many Hub repos have
    flat.mkdir()
    write_jsonl(flat / "train.jsonl", QA[:2])
    write_jsonl(flat / "validation.jsonl", QA[2:])
    assert splits(flat) == ["train", "validation"] and data(flat, split="validation") == QA[2:]
    dd = saved_folder(tmp_path / "saved_dict", QA, split="test")
    assert splits(dd) == ["test"] and data(dd) == QA
    with pytest.raises(DataError, match="a single file has one split"):
        list(iter_rows(flat / "train.jsonl", split="test"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a dataset folder"):
        list(iter_rows(tmp_path / "empty"))
    with pytest.raises(DataError, match="unknown file type '.txt'"):
        list(iter_rows(write_jsonl(tmp_path / "x.txt", QA)))


def test_streaming_yields_the_rows_of_the_eager_read(tmp_path):
    hub = tmp_path / "hub"
    write_parquet(hub / "data" / "train-00000-of-00001.parquet", QA)
    paths = [write_jsonl(tmp_path / "qa.jsonl", QA, blank_after_first=True), write_parquet(tmp_path / "qa.parquet", QA),
             write_table(tmp_path / "s.csv", ["metadata", "problem", "answer"], SIMPLEQA, ","),
             saved_folder(tmp_path / "saved", QA), hub]
    for p in paths:
        eager, streamed = list(iter_rows(p)), list(iter_rows(p, streaming=True))
        assert streamed == eager and eager, p
    from megatron_search.data.public import convert_file

    simple = paths[2]
    assert convert_file("simpleqa", simple, streaming=True) == convert_file("simpleqa", simple)


def test_qa_sft_preference_and_public_readers_on_every_layout(tmp_path):
    from megatron_search.data.public import convert_file
    from megatron_search.data.records import QARecord, read_records
    from megatron_search.rm.data import read_pairs
    from megatron_search.train.sft_data import load_sft_datasets

    want = [QARecord(**r) for r in QA]
    hub = tmp_path / "hub"
    write_parquet(hub / "data" / "train-00000-of-00001.parquet", QA)
    for p in (write_jsonl(tmp_path / "qa.jsonl", QA), write_parquet(tmp_path / "qa.parquet", QA),
              saved_folder(tmp_path / "saved", QA), hub):
        assert list(read_records(p)) == want, p
        assert list(read_records(p, streaming=True)) == want, p
    # SFT: random access over memory-mapped Arrow, rows tagged with file:id
    sft_jl = write_jsonl(tmp_path / "sft.jsonl", SFT, blank_after_first=True)
    sft_hub = tmp_path / "sft_hub"
    write_parquet(sft_hub / "data" / "train-00000-of-00001.parquet", SFT)
    sets = load_sft_datasets({str(sft_jl): 0.5, str(sft_hub): 0.5})
    for path, rows in sets.items():
        assert len(rows) == 2
        assert [{k: v for k, v in rows[i].items() if k != "_where"} for i in range(2)] == SFT
        assert rows[-1]["_where"] == f"{path}:s2"
    # preference pairs from parquet read like the JSONL
    pair = {"context": "What is 2+2?", "answer_a": "4", "answer_b": "5", "label": 1, "source": "t"}
    pj, pp = write_jsonl(tmp_path / "p.jsonl", [pair]), write_parquet(tmp_path / "p.parquet", [pair])
    assert read_pairs(pj) == read_pairs(pp) == read_pairs(pp, streaming=True)
    assert read_pairs(pj)[0].messages == [{"role": "user", "content": "What is 2+2?"}]
    # a public converter on a Hub-layout folder (Bamboogle's Question / Answer columns)
    bam = tmp_path / "bamboogle"
    write_parquet(bam / "data" / "test-00000-of-00001.parquet", [{"Question": "Q one?", "Answer": "A1"},
                                                                  {"Question": "Q two?", "Answer": "A2"}])
    recs = convert_file("bamboogle", bam)
    assert [(r.question, r.answers, r.metadata["location"]) for r in recs] == [
        ("Q one?", ["A1"], f"{bam}/data/test-00000-of-00001.parquet row 1"),
        ("Q two?", ["A2"], f"{bam}/data/test-00000-of-00001.parquet row 2")]


def test_eval_readers_on_files_and_folders(tmp_path):
    import hashlib

    from megatron_search.eval.benchmarks import load_benchmark

    header = ["metadata", "problem", "answer"]
    csv_file = write_table(tmp_path / "simple_qa_test_set.csv", header, SIMPLEQA, ",")
    hub = tmp_path / "simpleqa"
    write_parquet(hub / "data" / "test-00000-of-00001.parquet", [dict(zip(header, r)) for r in SIMPLEQA])
    want = [("simpleqa-" + hashlib.sha256(q.encode()).hexdigest()[:12], q, (a,)) for _, q, a in SIMPLEQA]
    for p in (csv_file, hub):
        assert [(e.id, e.question, e.answers) for e in load_benchmark("simpleqa", p)] == want
    assert load_benchmark("simpleqa", hub, split="test")[1].metadata["topic"] == "Geography"
    facts = write_parquet(tmp_path / "facts.parquet", [{"id": "f1", "question": "Q?", "answer": "A"},
                                                       {"id": None, "question": "R?", "answer": "B"}])
    assert [(e.id, e.answers) for e in load_benchmark("facts", facts)] == [("f1", ("A",)), ("facts-2", ("B",))]
    frames = tmp_path / "frames"
    write_parquet(frames / "data" / "test-00000-of-00001.parquet",
                  [{"Prompt": "Which bridge?", "Answer": "Ellow Bridge", "wikipedia_link_1": "https://w/A",
                    "reasoning_types": "Multiple constraints"}])
    fr = load_benchmark("frames", frames)
    assert fr[0].answers == ("Ellow Bridge",) and fr[0].metadata["wikipedia_links"] == ["https://w/A"]
    rec_hub = tmp_path / "records"
    write_parquet(rec_hub / "data" / "train-00000-of-00001.parquet", QA[:1])
    write_parquet(rec_hub / "data" / "test-00000-of-00001.parquet", QA[1:])
    assert [e.id for e in load_benchmark("records", rec_hub, split="test")] == ["q2", "q3"]
    assert [e.id for e in load_benchmark("records", write_jsonl(tmp_path / "qa.jsonl", QA), split="test")] == ["q2", "q3"]
    bad = write_parquet(tmp_path / "bad.parquet", [{"question": "Q?", "answer": "A"}, {"question": "", "answer": "B"}])
    with pytest.raises(DataError, match=r"bad.parquet: row 2: no question"):
        load_benchmark("facts", bad)


def test_errors_name_the_file_and_line_or_row(tmp_path):
    from megatron_search.data.public import convert_file
    from megatron_search.data.records import read_records

    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    bad = hub / "data" / "train-00000-of-00001.jsonl"
    bad.write_text(json.dumps(QA[0]) + "\n\n{not json\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"{bad}:3: not valid JSON"):
        list(read_records(hub))
    pqf = write_parquet(tmp_path / "ws.parquet", [{"question": "ok?", "answer": "a"}, {"question": " ", "answer": "b"}])
    with pytest.raises(DataError, match=rf"{pqf} \(row 2\): bad webshaper row: empty question"):
        convert_file("webshaper", pqf)
    extra = write_parquet(tmp_path / "extra.parquet", [dict(QA[0], extra_col=1)])
    with pytest.raises(DataError, match=r"extra.parquet \(row 1\): unknown field\(s\) \['extra_col'\]"):
        list(read_records(extra))
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps(SFT[0]) + "\n{oops\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"sft.jsonl:2: not valid JSON"):
        RowTable(sft)


def test_no_network_and_a_clear_error_for_paths_that_are_not_local(tmp_path, monkeypatch):
    from megatron_search.data.records import read_records
    from megatron_search.eval.benchmarks import load_benchmark

    def no_network(*a, **k):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    with pytest.raises(DataError, match=r"no file or folder .*looks like a Hub dataset id.*--local-dir DIR"):
        list(read_records("basicv8vc/SimpleQA"))
    with pytest.raises(DataError, match=r"benchmark simpleqa: no file or folder user/name"):
        load_benchmark("simpleqa", "user/name")
    with pytest.raises(DataError, match=r"no file or folder .*missing.jsonl \(datasets are read from local paths only\)"):
        list(iter_rows(tmp_path / "missing.jsonl"))
    assert data(write_jsonl(tmp_path / "ok.jsonl", QA)) == QA  # a local read makes no connection either
    import datasets

    assert datasets.config.HF_HUB_OFFLINE is True


def test_a_rewritten_file_is_read_anew_even_with_the_same_size_and_mtime(tmp_path):
    p = write_jsonl(tmp_path / "qa.jsonl", [{"id": "a"}])
    st = os.stat(p)
    assert data(p) == [{"id": "a"}]
    write_jsonl(p, [{"id": "b"}])  # same size
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old mtime: only ctime tells
    assert data(p) == [{"id": "b"}]


def test_row_table_random_access(tmp_path):
    p = write_jsonl(tmp_path / "sft.jsonl", SFT, blank_after_first=True)
    t = RowTable(p)
    assert len(t) == 2 and t[1] == SFT[1] and t[-1] == SFT[1] and t[0:2] == SFT
    assert t.row(1).where == f"{p}:3"
    with pytest.raises(IndexError):
        t[2]
    with pytest.raises(DataError, match="random access needs JSONL, parquet, Arrow"):
        RowTable(write_table(tmp_path / "x.csv", ["a"], [("1",)], ","))


def test_grpo_mix_reads_a_hub_layout_folder(tmp_path):
    from megatron_search.config.loader import load_config
    from megatron_search.train.grpo_data import build_mix_sampler

    hub = tmp_path / "qa"
    write_parquet(hub / "data" / "train-00000-of-00001.parquet", QA)
    cfg = load_config(None, [f"data.qa_path={hub}", "data.mix={qa: 1.0}"])
    items = build_mix_sampler(cfg.data).take(3)
    assert sorted(it.id for it in items) == ["q1", "q1", "q1"]  # the only train-split record, drawn each epoch
    assert items[0].messages[-1] == {"role": "user", "content": QA[0]["question"]}
