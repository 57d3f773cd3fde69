"""Single-hop demo tasks: unique answers, held-out subjects disjoint, trajectories with real results."""
from collections import defaultdict

from megatron_search.config import load_config
from megatron_search.data.demo_tasks import one_hop_records, one_hop_sft_examples
from megatron_search.data.world import build_world
from megatron_search.search.local import LocalSearchBackend
from megatron_search.search.tool import SearchTool


def test_one_hop_records_and_trajectories():
    world = build_world(seed=3, num_entities=80)
    recs = one_hop_records(world, seed=0, test_fraction=0.3)
    assert recs and {r.split for r in recs} == {"train", "test"}
    # every question names its subject, and its answer is the unique object of that fact
    objects = defaultdict(set)
    for f in world.facts:
        if not f.literal:
            objects[(world.name(f.subject), f.relation)].add(world.name(f.object))
    for r in recs:
        subject, rel = r.metadata["subject"], r.chain[0]["relation"]
        assert subject in r.question and objects[(subject, rel)] == {r.answers[0]}
    train_subjects = {r.metadata["subject"] for r in recs if r.split == "train"}
    assert not train_subjects & {r.metadata["subject"] for r in recs if r.split == "test"}

    cfg = load_config(None, ["search.max_results=3"])
    docs = [{"id": d.id, "title": d.title, "url": d.url, "text": d.text} for d in world.documents]
    tool = SearchTool.from_config(cfg.search, backend=LocalSearchBackend.from_docs(docs))
    examples, dropped = one_hop_sft_examples(recs, tool)
    assert len(examples) + len(dropped) == len(recs) and examples
    for ex in examples:
        user, call, tool_msg, answer = ex.messages[1:]
        assert answer["content"] in tool_msg["content"]  # copied from real search results
        subject = next(r for r in recs if r.id == ex.metadata["qa_id"]).metadata["subject"]
        assert call["tool_calls"][0]["function"]["arguments"]["query"] == subject
        assert subject in user["content"]
        assert tool_msg["content"].startswith("[1] ")


def test_drills_use_fresh_names():
    from megatron_search.data.demo_tasks import copy_drills, reading_drills

    world = build_world(seed=3, num_entities=80)
    world_names = [e.name.lower() for e in world.entities.values()]
    copies, reads = copy_drills(world, 200, seed=1), reading_drills(world, 40, seed=1)
    assert len(copies) == 200 and len(reads) == 40
    for d in copies + reads:
        user, answer = d.messages[0]["content"], d.messages[1]["content"]
        assert answer in user  # copied from the prompt
        assert not any(n in user.lower() for n in world_names)  # teaches no world fact
        assert not any(answer.lower() in n for n in world_names)
    assert all(d.messages[0]["content"] == "Repeat exactly: " + d.messages[1]["content"] for d in copies)
    assert len({d.messages[1]["content"] for d in copies}) > 150  # mostly distinct names
    q = reads[0].messages[0]["content"].split("\n\n")
    assert len(q) == 2 and q[1].startswith("Which ") and reads[0].messages[1]["content"] in q[0]
