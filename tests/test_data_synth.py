"""Embedded world + synthetic multi-hop QA by sequential expansion (RECIPE 4.1)."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from megatron_search.config.data import SynthConfig
from megatron_search.data.jsonl import DataError
from megatron_search.data.synth.evidence import Evidence
from megatron_search.data.synth.extract import Claim, extract_claims
from megatron_search.data.synth.pipeline import SynthPipeline
from megatron_search.data.synth.question import Link, QuestionPlan, parse, render
from megatron_search.data.world import World, build_world
from megatron_search.search.local import LocalSearchBackend

SMALL = SynthConfig(num_seed_queries=12, chains_per_entity=2, seed=3)


class CountingSearch:
    def __init__(self, backend):
        self.backend, self.calls = backend, 0

    def search(self, q, k):
        self.calls += 1
        return self.backend.search(q, k)


@pytest.fixture(scope="module")
def world() -> World:
    return build_world(seed=7, num_entities=200, filler_docs=40)


@pytest.fixture(scope="module")
def backend(world):
    return LocalSearchBackend.from_docs([asdict(d) for d in world.documents], snippet_chars=2000)


@pytest.fixture(scope="module")
def run(world, backend, tmp_path_factory):
    work = tmp_path_factory.mktemp("synth")
    counting = CountingSearch(backend)
    pipe = SynthPipeline(SMALL, counting, work, world=world)
    records = pipe.run()
    pipe.search_calls = counting.calls
    return pipe, records, work


def test_world_is_deterministic_and_seed_dependent():
    a, b, c = build_world(1, 60, filler_docs=5), build_world(1, 60, filler_docs=5), build_world(2, 60, filler_docs=5)
    assert [asdict(d) for d in a.documents] == [asdict(d) for d in b.documents]
    assert {e.name for e in a.entities.values()} != {e.name for e in c.entities.values()}


def test_world_facts_are_stated_by_several_sites(world):
    by_id = {d.id: d for d in world.documents}
    multi = 0
    for f in world.facts:
        docs = [by_id[i] for i in world.support[f.id]]
        hosts = {d.url.split("/")[2] for d in docs}
        assert len(hosts) == len(docs)  # one statement per site
        subj = world.name(f.subject)
        obj = f.object if f.literal else world.name(f.object)
        for d in docs:
            assert subj in d.text and obj in d.text
        multi += len(hosts) >= 2
    # single_source_fraction=0.1 by default: the large majority is confirmed by >= 2 sites
    assert multi / len(world.facts) > 0.8
    names = [e.name.lower() for e in world.entities.values()]
    assert all(a == b or a not in b for a in names for b in names)  # no name inside another


def test_extract_claims_by_hand():
    text = ("Tovrik Selvane wrote The Amber Quolith. The birth year of Tovrik Selvane is 1961. "
            "Tovrik Selvane was born in Brastovel. Zeirak Launchpad opened its doors in March 2005. "
            "Zeirak Launchpad is a startup accelerator. Someone liked it.")
    assert extract_claims(text) == [
        Claim("The Amber Quolith", "written_by", "Tovrik Selvane", False),
        Claim("Tovrik Selvane", "birth_year", "1961", True),
        Claim("Tovrik Selvane", "born_in", "Brastovel", False),
        Claim("Zeirak Launchpad", "launched_in", "March 2005", True),
        Claim("Zeirak Launchpad", "is_a", "accelerator", True),
    ]


def test_question_render_and_parse():
    plan = QuestionPlan("book", (Link("written_by", "fwd"), Link("founded_by", "inv"), Link("went_through", "fwd")),
                        "launched_in", "March 2005")
    q = render(plan)
    assert q == ("Which book was written by a person who founded a company that went through a startup "
                 "accelerator launched in March 2005?")
    assert parse(q) == [plan]
    assert parse("Which book is great?") == []


def test_rumours_are_not_confirmed(world, backend):
    ev = Evidence(backend, 10)
    checked = 0
    for r in world.rumors[:10]:
        name = world.name(r["subject"])
        ev.query(name)
        ev.query(f"{name} {r['wrong']}")
        wrong = Claim(name, r["relation"], r["wrong"], True)
        assert ev.support(wrong) == 1
        assert not ev.confirmed(wrong, 2)
        true_support = len(world.support[next(f.id for f in world.facts if f.subject == r["subject"]
                                              and f.relation == r["relation"])])
        if true_support >= 2:
            assert ev.confirmed(Claim(name, r["relation"], r["true"], True), 2)
            checked += 1
    assert checked >= 3


def _satisfies(world, eid, plan, level):
    """Top-down check of the nested description (independent of truth.world_answers' bottom-up walk)."""
    types = plan.types()
    if world.entities[eid].type != types[level]:
        return False
    if level == len(plan.links):
        return any(f.literal and f.subject == eid and f.relation == plan.anchor_attribute
                   and f.object == plan.anchor_value for f in world.facts)
    link = plan.links[level]
    for f in world.facts:
        if f.literal or f.relation != link.relation:
            continue
        if link.direction == "fwd" and f.subject == eid and _satisfies(world, f.object, plan, level + 1):
            return True
        if link.direction == "inv" and f.object == eid and _satisfies(world, f.subject, plan, level + 1):
            return True
    return False


def test_synth_questions_meet_the_recipe_rules(run, world):
    pipe, records, _ = run
    assert len(records) >= 5
    name_set = {e.name for e in world.entities.values()}
    hop_counts = set()
    for r in records:
        chain = r.chain
        ents = [chain[0]["subject"] if chain[0]["direction"] == "fwd" else chain[0]["object"]]
        for c in chain[:-1]:
            ents.append(c["object"] if c["subject"] in ents else c["subject"])
        assert ents[0] == r.answers[0]
        assert len(set(ents)) == len(ents), "entities of a chain are distinct"
        assert 2 <= r.hops <= 4 and r.hops == len(chain)
        hop_counts.add(r.hops)
        # no claim except the one linking the answer mentions the answer
        for c in chain[1:]:
            assert r.answers[0] not in (c["subject"], c["object"]) and r.answers[0] not in c["object"]
        for name in ents:
            assert name not in r.question, "question is name-free"
        assert not any(n in r.question for n in name_set)
        assert r.source == "synthetic" and r.split in ("train", "validation")
        # every solver found exactly this answer
        assert all(s["answers"] == r.answers for s in r.metadata["solvers"])
        # and it is the unique answer under the world's ground truth
        (plan,) = parse(r.question)
        winners = [e.name for e in world.entities.values() if _satisfies(world, e.id, plan, 0)]
        assert winners == r.answers
    assert len(hop_counts) >= 2
    m = pipe.manifest["stages"]
    assert m["verify"]["dropped"] > 0 and sum(m["verify"]["dropped_by_reason"].values()) == m["verify"]["dropped"]


def test_dropped_items_record_why(run):
    _, _, work = run
    for stage in ("chain", "question", "verify"):
        for line in (work / f"{stage}.dropped.jsonl").read_text().splitlines():
            row = json.loads(line)
            assert row["stage"] == stage and row["reason"]


def test_pipeline_resumes_without_searching_again(run, world, backend):
    _, records, work = run
    counting = CountingSearch(backend)
    again = SynthPipeline(SMALL, counting, work, world=world).run()
    assert counting.calls == 0
    assert [r.to_dict() for r in again] == [r.to_dict() for r in records]
    with pytest.raises(DataError, match="different data.synth config"):
        SynthPipeline(SMALL.model_copy(update={"seed": 4}), backend, work, world=world)


def test_verification_resumes_per_question(run, world, backend, tmp_path):
    pipe, records, work = run
    # copy the finished stages up to questions, keep only half of the verification checkpoint
    manifest = json.loads((work / "manifest.json").read_text())
    for stage in ("seed", "confirm", "chain", "question"):
        for suffix in (".jsonl", ".dropped.jsonl"):
            (tmp_path / f"{stage}{suffix}").write_text((work / f"{stage}{suffix}").read_text())
    manifest["stages"] = {k: v for k, v in manifest["stages"].items() if k in ("seed", "confirm", "chain", "question")}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    lines = (work / "verify.partial.jsonl").read_text().splitlines()
    half = len(lines) // 2
    (tmp_path / "verify.partial.jsonl").write_text("\n".join(lines[:half]) + "\n{\"torn")
    counting = CountingSearch(backend)
    resumed = SynthPipeline(SMALL, counting, tmp_path, world=world).run()
    assert [r.to_dict() for r in resumed] == [r.to_dict() for r in records]
    assert 0 < counting.calls < pipe.search_calls
    assert len((tmp_path / "verify.partial.jsonl").read_text().splitlines()) == len(lines)


# ---------------------------------------------------------------- LLM-backed steps

class DoubleLLM:
    """In-process stand-in for an LLM endpoint (the HTTP client itself is tested in test_data_llm.py).
    It answers the three versioned prompts by doing the task the prompt describes with the offline
    tools, so the LLM backend's plumbing (prompts, JSON parsing, checks, stages) runs for real."""

    def __init__(self, search):
        self.search = search
        self.calls = 0

    async def close(self):
        pass

    async def chat_json(self, messages, required=None, **kw):
        from megatron_search.data.llm_client import parse_json_reply
        from megatron_search.data.synth.solver import DEFAULT_SOLVERS, solve

        self.calls += 1
        text = messages[-1]["content"]
        if "Extract the atomic factual claims" in text:
            doc = text.split("Document:\n", 1)[1].split("\n\nReply with JSON", 1)[0]
            reply = {"claims": [asdict(c) for c in extract_claims(doc)]}
        elif "Write one question" in text:
            lines = text.split("first entity first):\n", 1)[1].split("\n\nReply", 1)[0].splitlines()
            parts = [l[2:].split(" | ") for l in lines]
            answer = parts[0][0] if parts[0][0] != parts[1][0] and parts[0][0] != parts[1][2] else parts[0][2]
            ents, links = [answer], []
            for s, rel, o in parts[:-1]:
                links.append(Link(rel, "fwd" if s == ents[-1] else "inv"))
                ents.append(o if s == ents[-1] else s)
            atype = text.split("(a ", 1)[1].split(")", 1)[0]
            reply = {"question": render(QuestionPlan(atype, tuple(links), parts[-1][1], parts[-1][2]))}
        else:  # solver turn: search once for real, then answer with the scripted solver's result
            if messages[-1]["role"] == "user" and not messages[-1]["content"].startswith("["):
                reply = {"action": "search", "query": messages[-1]["content"][:200]}
            else:
                res = solve(messages[1]["content"], self.search, DEFAULT_SOLVERS[0])
                reply = {"action": "answer", "answer": res.answers[0]} if res.unique else {"action": "answer", "answer": "?"}
        return parse_json_reply(json.dumps(reply), required)


def test_llm_backend_runs_the_same_stages(world, backend, tmp_path):
    cfg = SMALL.model_copy(update={"backend": "llm", "num_seed_queries": 6, "chains_per_entity": 1, "llm_solvers": 2,
                                   "quorum": 2})
    llm = DoubleLLM(backend)
    pipe = SynthPipeline(cfg, backend, tmp_path, world=world, llm=llm)
    records = pipe.run()
    assert records and llm.calls > 0 and "truth" not in pipe.manifest["stages"]
    for r in records:
        assert r.source == "synthetic" and len(r.metadata["solvers"]) == 2
        assert all(s["answers"] == r.answers for s in r.metadata["solvers"])


def test_llm_steps_reject_bad_output(backend):
    import asyncio

    from megatron_search.data.llm_client import LLMOutputError
    from megatron_search.data.synth.llm_steps import LLMExtractor, SyncRunner, llm_question, llm_solve

    class Canned:
        def __init__(self, replies):
            self.replies = list(replies)

        async def chat_json(self, messages, required=None, **kw):
            from megatron_search.data.llm_client import parse_json_reply
            return parse_json_reply(self.replies.pop(0), required)

    runner = SyncRunner()
    try:
        ex = LLMExtractor(Canned(['{"claims": [{"subject": "A", "relation": "", "object": "B"}]}']), runner)
        assert ex("A wrote B.") == [] and "non-empty strings" in ex.errors[0]
    finally:
        runner.close()
    leak = Canned(['{"question": "Which book was written by Tovrik Selvane?"}'])
    with pytest.raises(LLMOutputError, match="names chain entities"):
        asyncio.run(llm_question(leak, "book", [{"subject": "X", "relation": "written_by", "object": "Tovrik Selvane"}],
                                 ["X", "Tovrik Selvane"]))
    chatty = Canned(['{"action": "search", "query": "festival"}', "I am not sure"])
    res = asyncio.run(llm_solve(chatty, "Which festival ...?", backend, "llm-0"))
    assert res.queries == ["festival"] and res.answers == [] and "unreadable action" in res.failure
