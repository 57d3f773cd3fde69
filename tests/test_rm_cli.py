"""`megatron-search rm`: convert writes valid pairs; bad preference data ends with one clear error
line (exit 2) before any model is built; skip mode counts what it dropped."""
import json

from megatron_search.cli import main
from megatron_search.rm.data import read_pairs


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_convert_chosen_rejected(tmp_path, capsys):
    src = _jsonl(tmp_path / "hh.jsonl", [
        {"chosen": "\n\nHuman: hi\n\nAssistant: hello!", "rejected": "\n\nHuman: hi\n\nAssistant: go away"},
        {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
        {"prompt": "same", "chosen": "x", "rejected": "x"},
    ])
    out = tmp_path / "pairs.jsonl"
    assert main(["rm", "convert", "--input", src, "--out", str(out), "--source", "hh"]) == 2
    assert "hh.jsonl:3: answer_a and answer_b are identical" in capsys.readouterr().err
    assert not out.exists()  # nothing half-written
    assert main(["rm", "convert", "--input", src, "--out", str(out), "--source", "hh", "--skip-bad"]) == 0
    assert "2/3 pairs kept (skipped identical: 1)" in capsys.readouterr().out
    pairs = read_pairs(out)
    assert [p.source for p in pairs] == ["hh", "hh"]
    assert [(p.answer_a if p.label else p.answer_b) for p in pairs] == ["hello!", "4"]
    assert pairs[0].messages == [{"role": "user", "content": "hi"}]


def test_train_rejects_bad_pairs_with_one_line(tmp_path, capsys):
    good = {"context": "q", "answer_a": "a", "answer_b": "b", "label": 1}
    data = _jsonl(tmp_path / "p.jsonl", [good, {**good, "label": 3}])
    assert main(["rm", "train", f"rm.train_data={data}", f"run.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {data}:2: 'label' must be 0 or 1, got 3"]
    assert not (tmp_path / "run").exists()


def test_train_without_data_is_an_error(tmp_path, capsys):
    assert main(["rm", "train", f"run.output_dir={tmp_path / 'run'}"]) == 2
    assert "rm.train_data" in capsys.readouterr().err
