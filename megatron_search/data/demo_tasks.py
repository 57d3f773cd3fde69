"""Single-hop search tasks over the embedded world: the curriculum of the CPU demo.

RECIPE 4.1's synthetic QA chains 2-4 hops (data/synth/). A model trained from scratch on a
2-core CPU within minutes cannot learn multi-hop search, so the embedded demo trains and
evaluates on one-hop questions that still can only be answered by searching: every entity is
invented, so "Which person wrote The Ninth Dovrouvox?" has its answer only in the corpus. The
question names the subject; the agent must search for it and copy the answer from the results.
The trajectories' query is the subject's name alone: a pure copy from the question, and it finds
the answer as often as the name plus the relation (65 vs 67 of 85 held-out questions in the demo
world have the answer in the top 3 results).

Only functional relations are asked (the subject has exactly one object for the relation), so
the answer is unique. Held-out questions are about subjects that never appear in a training
question (split by a hash of the subject id).
"""
from __future__ import annotations

import hashlib
import random
import re
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
            metadata={"subject": subject, "query": subject},
        ))
    return out


def one_hop_sft_examples(records: list[QARecord], tool: SearchTool) -> tuple[list[SFTExample], list[dict]]:
    """Trajectories: search the subject's name (a real search_web call with its real results), then
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


class _FreshNames:
    """Invented names that neither contain nor are contained in a world name, so a drill teaches no
    world fact. Checked against the world with two C-level searches, so tens of thousands of names
    take seconds (world._Names compares every new name with all earlier ones)."""

    def __init__(self, world: World, rng):
        from .world import _Names

        self._names = _Names(rng)
        lows = sorted({e.name.lower() for e in world.entities.values()}, key=len, reverse=True)
        self._blob = "\x00".join(lows)  # candidate inside a world name
        self._pattern = re.compile("|".join(map(re.escape, lows))) if lows else None  # world name inside candidate

    def make(self, etype: str) -> str:
        for _ in range(1000):
            self._names.names.clear()  # repeats between drills are harmless; only the world must be avoided
            name = self._names.make(etype)
            low = name.lower()
            if low not in self._blob and not (self._pattern and self._pattern.search(low)):
                return name
        raise RuntimeError(f"could not invent a fresh {etype} name")


def copy_drills(world: World, n: int, seed: int = 0) -> list[SFTExample]:
    """ "Repeat exactly: Zorblat Quenix" -> "Zorblat Quenix", on freshly invented names.

    The skill the search agent needs first (the subject goes into the query, the answer comes out
    of the results). A model trained from scratch gets it from many short examples in a few hundred
    steps (an induction head), and almost never from the few copied tokens of tool trajectories."""
    rng = random.Random(seed + 7919)
    names = _FreshNames(world, rng)
    out = []
    for i in range(n):
        name = names.make(rng.choice(list(ENTITY_TYPES)))
        messages = [{"role": "user", "content": f"Repeat exactly: {name}"}, {"role": "assistant", "content": name}]
        out.append(SFTExample(f"copy-{seed}-{i}", "instruction", messages, []))
    return out


def reading_drills(world: World, n: int, seed: int = 0) -> list[SFTExample]:
    """ "<3 sentences stating facts> Which person wrote X?" -> the person the passage names, on
    freshly invented names: reading the answer to a question out of a passage, as from results."""
    from .world_schema import RELATIONS

    rng = random.Random(seed + 104729)
    names = _FreshNames(world, rng)
    out = []
    for i in range(n):
        facts = []
        for rel in rng.sample(RELATIONS, 3):
            s, o = names.make(rel.subj), names.make(rel.obj)
            facts.append((rel, s, o, rng.choice(rel.templates).format(s=s, o=o)))
        rel, s, o, _ = rng.choice(facts)
        passage = " ".join(f[3] for f in facts)
        question = f"Which {ENTITY_TYPES[rel.obj][0]} {rel.top_inv} {s}?"
        messages = [{"role": "user", "content": f"{passage}\n\n{question}"}, {"role": "assistant", "content": o}]
        out.append(SFTExample(f"read-{seed}-{i}", "instruction", messages, []))
    return out
