"""Preference pairs: JSONL checks (error or counted skip), converters, the label-noise filter,
the synthetic cite-rule set, held-out metrics and sbs by hand, the reference-answer cache."""
import json

import pytest
import torch

from megatron_search.rm.data import (
    PreferenceDataError,
    PreferencePair,
    ReadStats,
    convert_chosen_rejected,
    convert_file,
    filter_by_agreement,
    read_pairs,
    with_votes,
    write_pairs,
)

GOOD = {"context": "What is 2+2?", "answer_a": "4", "answer_b": "5", "label": 1, "source": "t"}


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


BAD_ROWS = [
    ({**GOOD, "answer_b": " 4 "}, "identical"),
    ({k: v for k, v in GOOD.items() if k != "label"}, "missing field(s) label"),
    ({**GOOD, "label": 2}, "'label' must be 0 or 1"),
    ({**GOOD, "label": 0.5}, "'label' must be 0 or 1"),
    ({**GOOD, "label": True}, "'label' must be 0 or 1"),
    ({**GOOD, "context": []}, "'context'"),
    ({**GOOD, "answer_a": None}, "'answer_a' must be a string"),
    ("{not json", "not valid JSON"),
]


@pytest.mark.parametrize("row,msg", BAD_ROWS)
def test_bad_pair_is_a_clear_error_naming_file_and_line(tmp_path, row, msg):
    f = _write(tmp_path / "p.jsonl", [GOOD, row])
    with pytest.raises(PreferenceDataError) as e:
        read_pairs(f, on_bad="error")
    assert f"{f}:2:" in str(e.value) and msg in str(e.value)


def test_bad_pairs_skipped_and_counted(tmp_path):
    f = _write(tmp_path / "p.jsonl", [GOOD] + [r for r, _ in BAD_ROWS] + [{**GOOD, "label": 0}])
    stats = ReadStats()
    pairs = read_pairs(f, on_bad="skip", stats=stats)
    assert [p.label for p in pairs] == [1, 0]
    assert stats.read == 10 and stats.kept == 2
    assert sum(stats.skipped.values()) == 8
    assert stats.skipped["identical"] == 1 and stats.skipped["label"] == 3 and stats.skipped["missing"] == 1


def test_roundtrip_and_string_context(tmp_path):
    pairs = read_pairs(_write(tmp_path / "p.jsonl", [GOOD]))
    assert pairs[0].messages == [{"role": "user", "content": "What is 2+2?"}]
    write_pairs(tmp_path / "q.jsonl", pairs)
    assert read_pairs(tmp_path / "q.jsonl") == pairs
    assert pairs[0].swapped().answer_a == "5" and pairs[0].swapped().label == 0


def test_converters_three_shapes():
    msgs = [{"role": "user", "content": "hi"}]
    p1 = convert_chosen_rejected({"prompt": "hi", "chosen": "good", "rejected": "bad"}, "w", "s")
    p2 = convert_chosen_rejected({"chosen": msgs + [{"role": "assistant", "content": "good"}],
                                  "rejected": msgs + [{"role": "assistant", "content": "bad"}]}, "w", "s")
    p3 = convert_chosen_rejected({"chosen": "\n\nHuman: hi\n\nAssistant: good",
                                  "rejected": "\n\nHuman: hi\n\nAssistant: bad"}, "w", "s")
    for p in (p1, p2, p3):
        assert p.messages == msgs
        preferred = p.answer_a if p.label == 1 else p.answer_b
        assert preferred == "good" and {p.answer_a, p.answer_b} == {"good", "bad"}
    with pytest.raises(PreferenceDataError, match="different conversations"):
        convert_chosen_rejected({"chosen": "\n\nHuman: hi\n\nAssistant: good",
                                 "rejected": "\n\nHuman: yo\n\nAssistant: bad"}, "w", "s")


def test_converter_order_is_balanced_and_reproducible(tmp_path):
    rows = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(200)]
    f = _write(tmp_path / "c.jsonl", rows + [{"prompt": "q", "chosen": "same", "rejected": "same"}])
    with pytest.raises(PreferenceDataError, match="c.jsonl:201: answer_a and answer_b are identical"):
        convert_file(f, "src")
    stats = ReadStats()
    a = convert_file(f, "src", on_bad="skip", stats=stats)
    assert stats.kept == 200 and stats.skipped["identical"] == 1
    assert a == convert_file(f, "src", on_bad="skip")
    ones = sum(p.label for p in a)
    assert 70 <= ones <= 130  # each record's order is a fair coin (sha256 bit)
    assert all((p.answer_a if p.label else p.answer_b).startswith("good") for p in a)


def test_noise_filter_keeps_pairs_the_models_agree_on():
    base = PreferencePair(({"role": "user", "content": "x"},), "a", "b", 1)
    pairs = [base] * 4
    pairs = with_votes(pairs, "m1", [0.9, 0.9, 0.2, 0.9])
    pairs = with_votes(pairs, "m2", [0.8, 0.3, 0.1, 0.9])
    pairs = with_votes(pairs, "m3", [0.7, 0.6, 0.4, 0.5])  # 0.5 is not a vote for a
    # agreement with label 1: [3/3, 2/3, 0/3, 2/3]
    stats = ReadStats()
    assert filter_by_agreement(pairs, 1.0, 2, stats) == [pairs[0]]
    assert stats.skipped["models disagree with label"] == 3
    kept = filter_by_agreement(pairs, 0.6, 2)
    assert [pairs.index(p) for p in kept] == [0, 0, 0]  # equal pairs: index finds the first
    assert len(kept) == 3
    stats = ReadStats()
    assert filter_by_agreement(pairs, 0.5, 4, stats) == [] and stats.skipped["too few votes"] == 4


def test_synthetic_pairs_follow_the_cite_rule():
    from megatron_search.rm.synthetic import split_pairs, synthetic_pairs

    pairs = synthetic_pairs(200, seed=5)
    for p in pairs:
        preferred, other = (p.answer_a, p.answer_b) if p.label else (p.answer_b, p.answer_a)
        assert preferred.startswith(other + " ") and "source" in preferred.lower() and "source" not in other.lower()
    assert 70 <= sum(p.label for p in pairs) <= 130
    train, held = split_pairs(pairs, 0.25)
    assert len(train) + len(held) == 200 and held
    q = lambda ps: {p.messages[-1]["content"] for p in ps}  # noqa: E731
    assert not q(train) & q(held)


def test_pair_metrics_and_sbs_by_hand():
    from megatron_search.rm.sbs import pair_metrics, sbs

    d_ab = torch.tensor([2.0, -1.0, 0.5, 0.0])
    d_ba = torch.tensor([-2.0, 1.0, 0.5, 0.0])  # pair 3: position bias only -> Delta_bar 0
    labels = torch.tensor([1.0, 1.0, 0.0, 1.0])
    m = pair_metrics(d_ab, d_ba, labels)
    # Delta_bar = [2, -1, 0, 0]; signed = [2, -1, -0, 0]; correct only pair 0
    assert m["accuracy"] == 0.25 and m["margin"] == pytest.approx(0.25)
    sp = lambda z: float(torch.nn.functional.softplus(torch.tensor(z)))  # noqa: E731
    exp = (sp(-2.0) + sp(1.0) + 0.5 * (sp(0.5) + sp(-0.5)) + 0.5 * (sp(-0.0) + sp(0.0))) / 4
    assert m["loss"] == pytest.approx(exp, rel=1e-6)

    class Fixed:
        def p_bar(self, x, a, b):
            return torch.tensor([0.9, 0.5, 0.1, 0.7])

    r = sbs(Fixed(), ["x"] * 4, ["a"] * 4, ["b"] * 4)
    assert r["sbs"] == pytest.approx(0.55) and r["win"] == 0.5 and r["tie"] == 0.25 and r["loss"] == 0.25


def test_reference_cache_generates_each_prompt_once_and_persists(tmp_path):
    from megatron_search.rm.service import ReferenceCache, prompt_key
    from megatron_search.rewards.preference import ReferenceAnswer

    calls = []

    def gen(prompts, samples):
        calls.append([p[0]["content"] for p in prompts])
        return [ReferenceAnswer(f"ref:{p[0]['content']}" + (f"#{k}" if k else ""), len(p[0]["content"]) + k)
                for p, k in zip(prompts, samples)]

    path = tmp_path / "refs.jsonl"
    cache = ReferenceCache(path, gen)
    q = lambda s: [{"role": "user", "content": s}]  # noqa: E731
    got = cache.get([q("a"), q("bb"), q("a")])
    assert [r.answer for r in got] == ["ref:a", "ref:bb", "ref:a"] and calls == [["a", "bb"]]
    assert [r.answer for r in cache.get([q("bb"), q("ccc")])] == ["ref:bb", "ref:ccc"]
    assert calls == [["a", "bb"], ["ccc"]]
    again = ReferenceCache(path, gen)  # a new process reads the file: nothing regenerated
    assert [r.generated_tokens for r in again.get([q("ccc"), q("a")])] == [3, 1] and len(calls) == 2
    with pytest.raises(ValueError, match="2 answers for 1 prompts"):
        ReferenceCache(tmp_path / "x.jsonl", lambda ps, ks: [ReferenceAnswer("a", 1)] * 2).get([q("z")])
    # One reference per rollout: sample k of a prompt is its own answer, generated once, persisted with k.
    calls.clear()
    got = cache.get([q("a"), q("a"), q("a")], samples=[0, 1, 2])
    assert [r.answer for r in got] == ["ref:a", "ref:a#1", "ref:a#2"] and calls == [["a", "a"]]
    assert [r.generated_tokens for r in ReferenceCache(path, gen).get([q("a")], samples=[2])] == [3]
    assert len(calls) == 1
    with pytest.raises(ValueError, match="2 prompts, 1 sample indices"):
        cache.get([q("a"), q("b")], samples=[0])
    # A record written before sample indices existed is sample 0; a malformed one names file and line.
    legacy = tmp_path / "legacy.jsonl"
    legacy.write_text('{"key": "%s", "answer": "old", "generated_tokens": 4}\n' % prompt_key(q("a")))
    assert ReferenceCache(legacy, gen).get([q("a")])[0] == ReferenceAnswer("old", 4)
    legacy.write_text('{"key": "k", "sample": -1, "answer": "x", "generated_tokens": 1}\n')
    with pytest.raises(ValueError, match=r"legacy.jsonl:1: not a reference-answer record"):
        ReferenceCache(legacy, gen)
