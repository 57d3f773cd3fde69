"""SFT trajectories with real search calls, the 90/10 prompt mix, and the `data` CLI end to end."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from megatron_search.chat.format import ChatFormat
from megatron_search.cli import main
from megatron_search.data.mix import MixItem, MixSampler
from megatron_search.data.records import QARecord
from megatron_search.data.sft import SFTBuilder
from megatron_search.data.world import build_world
from megatron_search.search.local import LocalSearchBackend
from megatron_search.search.tool import SearchTool, format_results


@pytest.fixture(scope="module")
def world():
    return build_world(seed=11, num_entities=120, filler_docs=20, single_source_fraction=0.0)


@pytest.fixture(scope="module")
def tool(world):
    return SearchTool(LocalSearchBackend.from_docs([asdict(d) for d in world.documents]), 10, 250, 5)


def _hand_record(world, fmt=None) -> QARecord:
    """book --written_by--> person, anchored on the person's birth year (built from ground truth)."""
    f = next(f for f in world.facts if f.relation == "written_by")
    year = next(g.object for g in world.facts if g.subject == f.object and g.relation == "birth_year")
    book, person = world.name(f.subject), world.name(f.object)
    chain = [{"subject": book, "relation": "written_by", "object": person, "literal": False, "direction": "fwd"},
             {"subject": person, "relation": "birth_year", "object": year, "literal": True}]
    return QARecord("hand-1", f"Which book was written by a person born in the year {year}?", [book], "synthetic",
                    hops=2, chain=chain, format_instruction=fmt, metadata={"format_key": "json"} if fmt else {})


def test_tool_trajectory_uses_real_results(world, tool):
    rec = _hand_record(world)
    ex = SFTBuilder(tool, world).tool_example(rec, turns=1)
    roles = [m["role"] for m in ex.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    for call_msg, tool_msg in zip(ex.messages[2::2], ex.messages[3::2]):
        q = call_msg["tool_calls"][0]["function"]["arguments"]["query"]
        assert tool_msg["content"] == format_results(q, tool.backend.search(q, 10))  # the real results
    person = rec.chain[0]["object"]
    assert person in ex.messages[3]["content"] and rec.answers[0] in ex.messages[5]["content"]
    assert ex.messages[-1]["content"].endswith(f"the answer is {rec.answers[0]}.")
    assert ex.loss_roles == ["assistant"]
    # the chat format renders it and parses the same search call back out of the assistant turn
    cf = ChatFormat("qwen3_5")
    text = cf.render(ex.messages, tools=ex.tools)
    first_turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    call = cf.parse_turn(first_turn, ex.tools).calls[0]
    assert call.arguments == ex.messages[2]["tool_calls"][0]["function"]["arguments"]


def test_multi_turn_language_and_format(world, tool):
    b = SFTBuilder(tool, world)
    rec = _hand_record(world, fmt='Write the answer as a JSON object with a single key "answer".')
    ex = b.tool_example(rec, turns=3, lang="fr")
    assert sum(m["role"] == "user" for m in ex.messages) == 3
    assert json.loads(ex.messages[6]["content"]) == {"answer": rec.answers[0]}
    assert ex.messages[-1]["content"].startswith("D'après les sources")
    assert ex.kind == "language"


def test_abstention_and_instruction_examples(world, tool):
    b = SFTBuilder(tool, world, seed=5)
    ab = b.abstention_example(0)
    name = ab.metadata["name"]
    assert all(name not in d.text and name not in d.title for d in world.documents)
    assert "could not find reliable evidence" in ab.messages[-1]["content"]
    for i in range(8):
        ex = b.instruction_example(i)
        q, a = ex.messages[1]["content"], ex.messages[2]["content"]
        items = q.split(": ", 1)[1].split(", ")
        expected = {"upper": ", ".join(items).upper(), "bullets": "\n".join("- " + x for x in items),
                    "count": str(len(items)), "reverse": " | ".join(items[::-1])}[ex.metadata["task"]]
        assert a == expected


def _items(prefix, n):
    name = {"q": "qa", "r": "rubric"}[prefix]
    return [MixItem(f"{prefix}{i}", name, name, []) for i in range(n)]


def test_mix_ratio_holds_in_every_window():
    s = MixSampler({"qa": _items("q", 13), "rubric": _items("r", 4)}, {"qa": 0.9, "rubric": 0.1}, seed=1)
    draws = [it.dataset for it in s.take(200)]
    assert draws.count("rubric") == 20
    assert all(draws[i:i + 10].count("rubric") == 1 for i in range(0, 200, 10))
    # within a dataset, each epoch is a permutation of its items
    qa = [it.id for it in MixSampler({"qa": _items("q", 13)}, {"qa": 1.0}, 3).take(26)]
    assert sorted(qa[:13]) == sorted(qa[13:]) == sorted(f"q{i}" for i in range(13))
    assert qa[:13] != qa[13:]


def test_mix_resumes_exactly():
    data = {"qa": _items("q", 9), "rubric": _items("r", 3)}
    full = [it.id for it in MixSampler(data, {"qa": 0.9, "rubric": 0.1}, seed=2).take(87)]
    a = MixSampler(data, {"qa": 0.9, "rubric": 0.1}, seed=2)
    head = [it.id for it in a.take(37)]
    state = json.loads(json.dumps(a.state_dict()))
    b = MixSampler(data, {"qa": 0.9, "rubric": 0.1}, seed=2)
    b.load_state_dict(state)
    assert head + [it.id for it in b.take(50)] == full
    with pytest.raises(ValueError, match="not provided"):
        MixSampler({"qa": _items("q", 2)}, {"qa": 0.9, "chat": 0.1})


def test_cli_world_synth_sft_mix(tmp_path, capsys):
    w, work = tmp_path / "w", tmp_path / "work"
    assert main(["data", "world", "data.world.num_entities=80", "data.world.filler_docs=10", "--out", str(w)]) == 0
    assert main(["data", "synth", "data.synth.num_seed_queries=6", "data.synth.chains_per_entity=1",
                 "--world", str(w), "--work", str(work), "--out", str(tmp_path / "qa.jsonl")]) == 0
    qa = [json.loads(l) for l in (tmp_path / "qa.jsonl").read_text().splitlines()]
    assert qa and all(r["source"] == "synthetic" and 2 <= r["hops"] <= 4 for r in qa)
    assert main(["data", "sft", "data.sft.instruction_examples=2", "data.sft.abstention_examples=1", "--world", str(w),
                 "--qa", str(tmp_path / "qa.jsonl"), "--out", str(tmp_path / "sft.jsonl")]) == 0
    kinds = {json.loads(l)["kind"] for l in (tmp_path / "sft.jsonl").read_text().splitlines()}
    assert {"tool_single", "instruction", "abstention"} <= kinds
    rub = tmp_path / "rub.jsonl"
    rub.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": "hi"}],
                                       "rubrics": ["The answer is in English."]}) + "\n" for i in range(3)))
    state = tmp_path / "state.json"
    args = ["data", "mix", "--qa", str(tmp_path / "qa.jsonl"), "--rubric", str(rub), "-n", "20", "--state", str(state)]
    assert main(args + ["--out", str(tmp_path / "p1.jsonl")]) == 0
    assert main(args + ["--out", str(tmp_path / "p2.jsonl")]) == 0
    p = [json.loads(l) for f in ("p1", "p2") for l in (tmp_path / f"{f}.jsonl").read_text().splitlines()]
    assert len(p) == 40 and sum(x["kind"] == "rubric" for x in p) == 4
    assert json.loads(state.read_text())["step"] == 40


def test_rubric_rows_are_checked():
    from megatron_search.data.jsonl import DataError
    from megatron_search.data.mix import rubric_item

    ok = rubric_item({"id": "r1", "messages": [{"role": "user", "content": "x"}], "rubrics": ["The answer is in English."]})
    assert ok.kind == "rubric" and ok.rubrics == ["The answer is in English."]
    with pytest.raises(DataError, match="rubric row r2: 'rubrics' must be a non-empty list"):
        rubric_item({"id": "r2", "messages": [{"role": "user", "content": "x"}], "rubrics": []})
