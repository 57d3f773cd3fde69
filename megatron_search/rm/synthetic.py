"""A synthetic preference set with a visible rule, for the tiny RM test and demo.

Questions and answers come from the embedded synthetic world (data/world.py): for a fact
"the <relation> of <subject> is <object>", the context asks for it and both answers state the
same fact in the same words. The preferred answer cites a document that states the fact
("... [source: <url>]"), the other does not: all else equal, so a model can only reach high
accuracy by learning "citing beats not citing". Presentation order and wording vary with a seed.
"""
from __future__ import annotations

import random
from typing import Optional

from megatron_search.data.world import build_world

from .data import PreferencePair

_QUESTION = ["What is the {rel} of {s}?", "Tell me the {rel} of {s}.", "Do you know the {rel} of {s}?",
             "Which {rel} does {s} have?"]
_ANSWER = ["The {rel} of {s} is {o}.", "{s} has {o} as its {rel}.", "It is {o}.", "Answer: {o}."]
_CITE = ["[source: {url}]", "(source: {url})", "Source: {url}"]


def _phrase(relation: str) -> str:
    return relation.replace("_", " ")


def synthetic_pairs(n: int, seed: int = 0, world=None, source: str = "synthetic:cite-rule") -> list[PreferencePair]:
    """`n` pairs where the answer citing its source is preferred (label says which one cites)."""
    if n < 1:
        raise ValueError(f"synthetic_pairs: n must be >= 1, got {n}")
    world = world if world is not None else build_world(seed=seed, num_entities=60, filler_docs=0)
    docs = {d.id: d for d in world.documents}
    facts = [f for f in world.facts if world.support.get(f.id)]
    if not facts:
        raise ValueError("synthetic_pairs: the world has no supported facts")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        fact = rng.choice(facts)
        subject = world.name(fact.subject)
        obj = fact.object if fact.literal else world.name(fact.object)
        rel = _phrase(fact.relation)
        url = docs[rng.choice(world.support[fact.id])].url
        question = rng.choice(_QUESTION).format(rel=rel, s=subject)
        body = rng.choice(_ANSWER).format(rel=rel, s=subject, o=obj)
        cited = f"{body} {rng.choice(_CITE).format(url=url)}"
        cite_first = rng.random() < 0.5
        a, b = (cited, body) if cite_first else (body, cited)
        out.append(PreferencePair(({"role": "user", "content": question},), a, b, int(cite_first), source))
    return out


def split_pairs(pairs: list[PreferencePair], held_out: float, seed: int = 0,
                rng: Optional[random.Random] = None) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out) split; held-out contexts never appear in train (split by question text)."""
    rng = rng or random.Random(seed)
    questions = sorted({p.context[-1]["content"] for p in pairs})
    rng.shuffle(questions)
    cut = max(1, int(round(held_out * len(questions))))
    test_q = set(questions[:cut])
    train = [p for p in pairs if p.context[-1]["content"] not in test_q]
    test = [p for p in pairs if p.context[-1]["content"] in test_q]
    return train, test
