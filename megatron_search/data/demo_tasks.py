"""Single-hop search tasks over the embedded world: the curriculum of the CPU demo.

RECIPE 4.1's synthetic QA chains 2-4 hops (data/synth/). A model trained from scratch on a
2-core CPU within minutes cannot learn multi-hop search, so the embedded demo trains and
evaluates on one-hop questions that still can only be answered by searching: every entity is
invented, so "Which person wrote The Ninth Dovrouvox?" has its answer only in the corpus. The
question names the subject; the agent must search for it and copy the answer from the results.

Only functional relations are asked (the subject has exactly one object for the relation), so
the answer is unique. Held-out questions are about subjects that never appear in a training
question (split by a hash of the subject id).
"""
from __future__ import annotations

import hashlib
from collections import Counter

from megatron_search.search.tool import SearchTool, format_results

from .records import QARecord
from .sft import SYSTEM_PROMPT, SFTExample, _call
from .world import World
from .world_schema import ENTITY_TYPES, RELATION_BY_NAME


def _held_out(entity_id: str, seed: int, fraction: float) -> bool:
    h = hashlib.sha256(f"{seed}:{entity_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def one_hop_records(world: World, seed: int = 0, test_fraction: float = 0.2) -> list[QARecord]:
    """One question per (subject, functional relation) fact of the world."""
    arity = Counter((f.subject, f.relation) for f in world.facts if not f.literal)
    out = []
    for f in world.facts:
        if f.literal or arity[(f.subject, f.relation)] != 1:
            continue
        rel = RELATION_BY_NAME[f.relation]
        noun = ENTITY_TYPES[rel.obj][0]
        subject = world.name(f.subject)
        split = "test" if _held_out(f.subject, seed, test_fraction) else "train"
        out.append(QARecord(
            id=f"hop1-{f.id}", question=f"Which {noun} {rel.top_inv} {subject}?", answers=[world.name(f.object)],
            source="synthetic-1hop", split=split, hops=1,
            chain=[{"subject": subject, "relation": f.relation, "object": world.name(f.object), "literal": False}],
            metadata={"subject": subject, "query": f"{subject} {rel.desc_fwd}"},
        ))
    return out


def one_hop_sft_examples(records: list[QARecord], tool: SearchTool) -> tuple[list[SFTExample], list[dict]]:
    """Trajectories: search the subject's name and the relation (a real search_web call with its real results), then
    answer with the name. A record whose search does not surface the answer is dropped (returned
    with the reason), never given a made-up tool response."""
    examples, dropped = [], []
    for rec in records:
        query = rec.metadata["query"]
        results = tool.backend.search(query, tool.max_results)
        text = format_results(query, results)
        if rec.answers[0] not in text:
            dropped.append({"id": rec.id, "reason": f"search for {query!r} did not surface the answer"})
            continue
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": rec.question},
            {"role": "assistant", "content": "", "tool_calls": [_call(query)]},
            {"role": "tool", "name": "search_web", "content": text},
            {"role": "assistant", "content": rec.answers[0]},
        ]
        examples.append(SFTExample(f"{rec.id}-sft", "tool_single", messages, [tool.spec],
                                   metadata={"qa_id": rec.id, "answers": rec.answers}))
    return examples, dropped


def reading_drills(world: World, n: int, seed: int = 0) -> list[SFTExample]:
    """Instruction-following examples that exercise the two skills the demo's search agent needs,
    copying a name and reading the answer out of a passage, on freshly invented names that are not
    in the world (so they teach no world fact):
      "Repeat exactly: Zorblat Quenix"                       -> "Zorblat Quenix"
      "<3 sentences stating facts> Which person wrote X?"   -> the person the passage names
    A from-scratch tiny model learns copying far sooner from many short examples than from the
    few copied tokens of the tool trajectories alone."""
    import random

    from .world import _Names
    from .world_schema import RELATIONS

    rng = random.Random(seed + 7919)
    names = _Names(rng)
    names.names.extend(e.name for e in world.entities.values())  # never reuse (or contain) a world name
    out = []
    for i in range(n):
        if i % 2 == 0:
            etype = rng.choice(list(ENTITY_TYPES))
            name = names.make(etype)
            messages = [{"role": "user", "content": f"Repeat exactly: {name}"}, {"role": "assistant", "content": name}]
        else:
            facts = []
            for rel in rng.sample(RELATIONS, 3):
                s, o = names.make(rel.subj), names.make(rel.obj)
                facts.append((rel, s, o, rng.choice(rel.templates).format(s=s, o=o)))
            rel, s, o, _ = rng.choice(facts)
            passage = " ".join(f[3] for f in facts)
            question = f"Which {ENTITY_TYPES[rel.obj][0]} {rel.top_inv} {s}?"
            messages = [{"role": "user", "content": f"{passage}\n\n{question}"}, {"role": "assistant", "content": o}]
        out.append(SFTExample(f"drill-{seed}-{i}", "instruction", messages, []))
    return out
