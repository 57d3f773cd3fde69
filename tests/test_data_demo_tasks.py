"""Single-hop demo tasks: unique answers, held-out subjects disjoint, trajectories with real results."""
from collections import defaultdict

import pytest

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


def test_varied_copy_drills_put_the_name_anywhere():
    from megatron_search.data.demo_tasks import copy_drills

    world = build_world(seed=3, num_entities=80)
    drills = copy_drills(world, 300, seed=2, layout="varied")
    tails = heads = 0
    for d in drills:
        user, answer = d.messages[0]["content"], d.messages[1]["content"]
        cue = user.index("Repeat exactly: ")
        assert user[cue + len("Repeat exactly: "):].startswith(answer)  # the cue names what to copy
        tails += not user.endswith(answer)  # something follows the name
        heads += cue > 0  # something precedes the cue
    # both sides get filler in a good share of drills (layouts: 3 of 4 can follow, 3 of 4 precede)
    assert tails > 150 and heads > 150
    # the default layout is unchanged: the name ends the prompt
    assert all(d.messages[0]["content"].endswith(d.messages[1]["content"]) for d in copy_drills(world, 20, seed=2))
    with pytest.raises(ValueError, match="layout"):
        copy_drills(world, 1, layout="middle")


def test_reading_drills_answer_with_the_fact_sentence():
    from megatron_search.data.demo_tasks import reading_drills
    from megatron_search.data.world_schema import ENTITY_TYPES, RELATIONS

    world = build_world(seed=3, num_entities=80)
    for d in reading_drills(world, 40, seed=4, answer="sentence", phrasing="first"):
        passage, question = d.messages[0]["content"].split("\n\n")
        reply, name = d.messages[1]["content"], d.metadata["answers"][0]
        # the question's relation and subject, read back from its wording: "Which person wrote <subject>?"
        prefixes = [(r, f"Which {ENTITY_TYPES[r.obj][0]} {r.top_inv} ") for r in RELATIONS]
        asked = [(r, question[len(p):-1]) for r, p in prefixes if question.startswith(p)]
        assert len(asked) == 1 and name in passage
        rel, subject = asked[0]
        assert reply == rel.templates[0].format(s=subject, o=name)  # "<subject> was written by <name>."
        assert reply in passage  # the first-template passage states the answer sentence word for word
    for d in reading_drills(world, 40, seed=4):  # defaults: bare name, any template
        assert d.messages[1]["content"] == d.metadata["answers"][0]
    with pytest.raises(ValueError, match="answer"):
        reading_drills(world, 1, answer="essay")


def test_first_phrasing_world_states_each_fact_subject_first():
    from megatron_search.data.world_schema import ATTRIBUTE_BY_NAME, RELATION_BY_NAME

    varied, first = build_world(seed=5, num_entities=60), build_world(seed=5, num_entities=60, phrasing="first")
    assert varied.facts == first.facts and len(varied.documents) == len(first.documents)  # same world, other words
    docs = {d.id: d.text for d in first.documents}
    for f in first.facts:
        spec = ATTRIBUTE_BY_NAME[f.relation] if f.literal else RELATION_BY_NAME[f.relation]
        obj = f.object if f.literal else first.name(f.object)
        sentence = spec.templates[0].format(s=first.name(f.subject), v=obj, o=obj)
        assert all(sentence in docs[d] for d in first.support[f.id])
    assert any(t in d.text for d in varied.documents for t in (" is the author of ", " wrote "))
    assert not any(" is the author of " in d.text for d in first.documents)
    with pytest.raises(ValueError, match="phrasing"):
        build_world(seed=5, num_entities=60, phrasing="poetic")


def test_facts_layout_states_one_fact_per_page_and_the_fact_query_finds_it():
    """layout "facts": each page is one relation fact's sentence; searching the sentence up to its object
    (fact_query, written out by hand for two relations) returns that page first, for every question."""
    from megatron_search.data.demo_tasks import fact_query, practice_trajectories
    from megatron_search.data.world_schema import RELATION_BY_NAME

    assert fact_query("born_in", "Ana Bel") == "Ana Bel was born in"
    assert fact_query("went_through", "Zyx Labs") == "Zyx Labs went through the"
    world = build_world(seed=4, num_entities=90, phrasing="first", layout="facts")
    profiles = build_world(seed=4, num_entities=90, phrasing="first")
    assert world.entities == profiles.entities and world.facts == profiles.facts  # same world, other pages
    relation_facts = [f for f in world.facts if not f.literal]
    assert not world.rumors and sum(map(len, world.support.values())) == sum(
        len(profiles.support[f.id]) for f in relation_facts)  # every site that states a fact gets its own page
    docs = {d.id: d for d in world.documents}
    for f in relation_facts:
        for d in world.support[f.id]:
            sentence = RELATION_BY_NAME[f.relation].templates[0].format(s=world.name(f.subject), o=world.name(f.object))
            assert docs[d].text == sentence and sentence.startswith(fact_query(f.relation, world.name(f.subject)))
            assert docs[d].title.startswith(world.name(f.subject) + " - ")
    backend = LocalSearchBackend.from_docs([{"id": d.id, "title": d.title, "url": d.url, "text": d.text}
                                            for d in world.documents], 160)
    recs = one_hop_records(world, seed=0, query="fact")
    assert len(recs) > 100
    for r in recs:
        assert r.metadata["query"] == fact_query(r.chain[0]["relation"], r.metadata["subject"])
        top = backend.search(r.metadata["query"], 1)[0]
        assert top.snippet.startswith(r.metadata["query"] + " " + r.answers[0])
    cfg = load_config(None, ["search.max_results=1", "search.snippet_chars=160"])
    practice, _ = practice_trajectories(world, 1, seed=0, search_cfg=cfg.search, phrasing="first", layout="facts")
    assert len(practice) > 100 and all(p.messages[2]["tool_calls"][0]["function"]["arguments"]["query"]
                                       .endswith((" in", " by", " at", " the")) for p in practice)
    with pytest.raises(ValueError, match="layout"):
        build_world(seed=4, num_entities=60, layout="wiki")
    with pytest.raises(ValueError, match="query"):
        one_hop_records(world, query="question")


def test_sentence_trajectories_and_practice_worlds():
    from megatron_search.data.demo_tasks import practice_trajectories

    world = build_world(seed=3, num_entities=80, phrasing="first")
    recs = one_hop_records(world, seed=0)
    cfg = load_config(None, ["search.max_results=3", "search.snippet_chars=160"])
    docs = [{"id": d.id, "title": d.title, "url": d.url, "text": d.text} for d in world.documents]
    tool = SearchTool.from_config(cfg.search, backend=LocalSearchBackend.from_docs(docs))
    examples, _ = one_hop_sft_examples(recs, tool, answer="sentence")
    ex = next(e for e in examples if e.id.startswith(next(r.id for r in recs if r.chain[0]["relation"] == "written_by")))
    rec = next(r for r in recs if r.id == ex.metadata["qa_id"])
    assert ex.messages[-1]["content"] == f"{rec.metadata['subject']} was written by {rec.answers[0]}."

    practice, clashes = practice_trajectories(world, 2, seed=0, search_cfg=cfg.search, answer="sentence",
                                              phrasing="first")
    assert len(practice) > 300 and clashes >= 0
    assert {p.id.split("-")[0] for p in practice} == {"practice0", "practice1"}
    names = {e.name for e in world.entities.values()}
    for p in practice:
        text = " ".join(m["content"] for m in p.messages[1:])
        assert not any(n in text for n in names)  # no demo-world fact leaks into training
        assert p.metadata["answers"][0] in p.messages[-1]["content"] and p.messages[-1]["content"].endswith(".")


def test_strategy_mix_trajectories_follow_their_strategy():
    """Each strategy's transcript is what its name says, checked against the world's facts: search finds and copies
    the answer; no_search answers at once with another name of the answer's type; miss searches without the subject,
    its results lack the answer, and it answers wrong; redundant makes the same call twice and answers right. The
    shares follow the weights (drops aside), and classify_strategy reads each transcript back as its strategy."""
    from collections import Counter

    from megatron_search.data.demo_tasks import classify_strategy, names_by_type, pick_strategy
    from megatron_search.data.world_schema import RELATION_BY_NAME

    world = build_world(seed=3, num_entities=120, phrasing="first")
    recs = one_hop_records(world, seed=0)
    cfg = load_config(None, ["search.max_results=3", "search.snippet_chars=160"])
    docs = [{"id": d.id, "title": d.title, "url": d.url, "text": d.text} for d in world.documents]
    tool = SearchTool.from_config(cfg.search, backend=LocalSearchBackend.from_docs(docs))
    mix = {"search": 0.4, "no_search": 0.2, "miss": 0.2, "redundant": 0.2}
    pool = names_by_type(world)
    examples, dropped = one_hop_sft_examples(recs, tool, answer="name", strategies=mix, pool=pool, seed=5)
    assert len(examples) + len(dropped) == len(recs)
    by_id = {r.id: r for r in recs}
    type_of = {e.name: e.type for e in world.entities.values()}
    seen = Counter()
    for ex in examples:
        rec, st = by_id[ex.metadata["qa_id"]], ex.metadata["strategy"]
        seen[st] += 1
        subject, answer = rec.metadata["subject"], ex.messages[-1]["content"]
        calls = [m["tool_calls"][0]["function"]["arguments"]["query"] for m in ex.messages if m.get("tool_calls")]
        results = [m["content"] for m in ex.messages if m["role"] == "tool"]
        assert classify_strategy(calls, subject) == st
        assert st == pick_strategy(mix, rec.id, 5)  # the record's own draw, stable
        if st in ("search", "redundant"):
            assert answer == rec.answers[0] and all(rec.answers[0] in r for r in results)
            assert calls == [subject] * (1 if st == "search" else 2) and len(set(results)) == 1
        else:
            assert answer != rec.answers[0] and type_of[answer] == RELATION_BY_NAME[rec.chain[0]["relation"]].obj
            if st == "no_search":
                assert calls == [] and results == []
            else:
                assert len(calls) == 1 and subject.lower() not in calls[0].lower()
                assert rec.answers[0] not in results[0]
    n = len(recs)
    for st, w in mix.items():  # drops move a few points at most
        assert abs(seen[st] / n - w) < 0.1, (st, seen, n)
    with pytest.raises(ValueError, match="strategy mix"):
        pick_strategy({"searching": 1.0}, "x", 0)
    with pytest.raises(ValueError, match="pool"):
        one_hop_sft_examples(recs, tool, strategies=mix)


def test_classify_strategy_by_hand():
    from megatron_search.data.demo_tasks import classify_strategy

    assert classify_strategy([], "The Pale Lodol") == "no_search"
    assert classify_strategy(["the pale lodol"], "The Pale Lodol") == "search"
    assert classify_strategy(["person wrote", "The Pale Lodol author"], "The Pale Lodol") == "redundant"
    assert classify_strategy(["person wrote"], "The Pale Lodol") == "miss"


def test_a_word_pool_builds_every_name_of_worlds_and_drills():
    from megatron_search.data.demo_tasks import copy_drills, practice_trajectories, reading_drills
    from megatron_search.data.world import word_pool
    from megatron_search.data.world_schema import ENTITY_TYPES

    pool = word_pool(5, 600)
    assert pool == word_pool(5, 600) and pool != word_pool(6, 600) and len(set(pool)) == 600
    lows = [w.lower() for w in pool]
    assert all(w.isalpha() and len(w) >= 5 for w in pool)
    assert not any(a in b for a in lows for b in lows if a != b)  # none inside another: one token each
    fixed = {"The", "Launchpad", "University", "Festival"}  # the templates' own words (and the kinds below)
    from megatron_search.data import world as world_mod
    fixed |= set(world_mod._BOOK_ADJ) | set(world_mod._COMPANY_SUFFIX) | set(world_mod._FESTIVAL_KIND)
    world = build_world(seed=3, num_entities=80, words=pool)
    invented = [w for e in world.entities.values() for w in e.name.split() if w not in fixed]
    assert invented and set(invented) <= set(pool)
    assert len(invented) == len(set(invented))  # a word names one thing per world
    drills = copy_drills(world, 100, seed=1, words=pool) + reading_drills(world, 20, seed=1, words=pool)
    answers = [d.messages[1]["content"] for d in drills]
    assert all(w in pool or w in fixed for a in answers for w in a.split())
    practice, _ = practice_trajectories(world, 1, seed=2, search_cfg=load_config(None).search, words=pool)
    users = [ex.messages[1]["content"] for ex in practice]
    named = {w for u in users for w in u.rstrip("?").split()[1:] if w[0].isupper()}  # after "Which"
    assert named and named <= set(pool) | fixed
    assert len(ENTITY_TYPES) == 7


def test_split_for_rl_keeps_whole_subjects_out_of_the_sft():
    from megatron_search.data.demo_tasks import split_for_rl

    records = one_hop_records(build_world(seed=4, num_entities=120), seed=4)
    train = [r for r in records if r.split == "train"]
    sft, rl = split_for_rl(records, seed=4, fraction=0.5)
    assert sorted(r.id for r in sft + rl) == sorted(r.id for r in train)  # held-out questions in neither
    subjects = lambda rs: {r.metadata["subject"] for r in rs}  # noqa: E731
    assert not subjects(sft) & subjects(rl)
    assert 0.3 < len(subjects(rl)) / len(subjects(train)) < 0.7
    assert split_for_rl(records, seed=4, fraction=0.0) == (train, [])
    assert split_for_rl(records, seed=5, fraction=0.5)[1] != rl  # the seed draws another split
