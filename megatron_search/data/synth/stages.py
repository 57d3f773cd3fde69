"""The stages of sequential expansion (RECIPE 4.1), offline backend.

Each stage is a function from typed records to (kept, dropped) records; a dropped record carries the
reason. Knowledge comes only from search results parsed by the claim extractor (`Evidence`), never
from the world's ground truth, so the same stages run on any corpus written in the world's language.

    seed queries -> retrieval -> entity cards confirmed by several sources -> chains of 2-4 hops with
    distinct entities -> name-free nested questions -> verification by several solvers -> format
    augmentation (augment.py)
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from tqdm import tqdm

from megatron_search.text import normalize_answer
from ..llm_client import LLMError, LLMOutputError
from ..world_schema import ATTRIBUTES, ENTITY_TYPES
from .evidence import Evidence
from .extract import Claim
from .question import Link, QuestionPlan, render
from .solver import SolverResult, SolverSpec, solve


@dataclass
class Dropped:
    stage: str
    item: dict
    reason: str


@dataclass
class SeedHit:
    query: str
    doc_ids: list[str]
    entities: list[str]


@dataclass
class EntityCard:
    """An entity and its claims confirmed by >= min_support distinct sites."""

    name: str
    type: str
    claims: list[dict]  # Claim fields + "support"
    seed_query: str = ""


@dataclass
class ChainRecord:
    id: str
    answer: str
    answer_type: str
    entities: list[str]  # E0 (answer) .. E_{n}
    links: list[dict]  # {subject, relation, object, direction, support}
    anchor: dict  # {subject, relation, object, support}
    seed_query: str
    checks: dict = field(default_factory=dict)

    @property
    def hops(self) -> int:
        return len(self.links) + 1

    def plan(self) -> QuestionPlan:
        return QuestionPlan(self.answer_type, tuple(Link(l["relation"], l["direction"]) for l in self.links),
                            self.anchor["relation"], self.anchor["object"])

    def claims(self) -> list[dict]:
        return list(self.links) + [self.anchor]


@dataclass
class QuestionRecord:
    chain: ChainRecord
    question: str

    def to_dict(self) -> dict:
        return {"chain": asdict(self.chain), "question": self.question}

    @classmethod
    def from_dict(cls, d: dict) -> "QuestionRecord":
        return cls(ChainRecord(**d["chain"]), d["question"])


@dataclass
class VerifiedRecord:
    chain: ChainRecord
    question: str
    solvers: list[dict]

    def to_dict(self) -> dict:
        return {"chain": asdict(self.chain), "question": self.question, "solvers": self.solvers}

    @classmethod
    def from_dict(cls, d: dict) -> "VerifiedRecord":
        return cls(ChainRecord(**d["chain"]), d["question"], d["solvers"])


# ---------------------------------------------------------------- seed queries and retrieval

def make_seed_queries(n: int, seed: int) -> list[str]:
    """n seed queries: an entity type and an attribute phrase with a value in the attribute's range."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        attr = rng.choice(ATTRIBUTES)
        year = rng.randint(attr.lo, attr.hi)
        out.append(f"{ENTITY_TYPES[attr.subj][0]} {attr.desc} {year}")
    return out


def seed_stage(queries: list[str], ev: Evidence, progress: bool = False) -> list[SeedHit]:
    """Retrieve documents for each seed query; the entities they name are the seed candidates."""
    hits = []
    for q in tqdm(queries, desc="synth: seeds", disable=not progress):
        ids = ev.query(q)
        names = sorted({c.subject for d in ids for c in ev.doc_claims.get(d, []) if c.relation == "is_a"})
        hits.append(SeedHit(q, ids, names))
    return hits


# ---------------------------------------------------------------- confirmed entity cards

class CardBook:
    """Builds (and caches) the confirmed card of an entity by searching its name."""

    def __init__(self, ev: Evidence, min_support: int):
        self.ev = ev
        self.min_support = min_support
        self._cards: dict[str, EntityCard | Dropped] = {}

    def get(self, name: str, seed_query: str = "") -> EntityCard | Dropped:
        if name in self._cards:
            return self._cards[name]
        self.ev.query(name)
        etype = self.ev.entity_type(name, self.min_support)
        claims = [c for c in self.ev.claims_about(name) if c.relation != "is_a"]
        kept = [dict(asdict(c), support=self.ev.support(c)) for c in sorted(claims, key=Claim.text)
                if self.ev.confirmed(c, self.min_support)]
        if etype is None:
            out: EntityCard | Dropped = Dropped("confirm", {"name": name}, f"type not confirmed by >= {self.min_support} sites")
        elif not kept:
            out = Dropped("confirm", {"name": name, "type": etype},
                          f"no claim confirmed by >= {self.min_support} sites ({len(claims)} single-source)")
        else:
            out = EntityCard(name, etype, kept, seed_query)
        self._cards[name] = out
        return out


def confirm_stage(hits: list[SeedHit], book: CardBook, progress: bool = False) -> tuple[list[EntityCard], list[Dropped]]:
    kept, dropped, seen = [], [], set()
    for hit in tqdm(hits, desc="synth: confirm", disable=not progress):
        for name in hit.entities:
            if name in seen:
                continue
            seen.add(name)
            card = book.get(name, hit.query)
            (dropped if isinstance(card, Dropped) else kept).append(card)
    return kept, dropped


# ---------------------------------------------------------------- chains

def _expand(card: EntityCard, chain_names: list[str], book: CardBook, rng: random.Random,
            links_left: int) -> Optional[tuple[list[dict], dict, list[str]]]:
    """Depth-first sequential expansion from `card`: `links_left` more links, then an anchor."""
    if links_left == 0:
        anchors = [c for c in card.claims if c["literal"]]  # cards hold no is_a claims
        return ([], rng.choice(anchors), []) if anchors else None
    options = [c for c in card.claims if not c["literal"]]
    rng.shuffle(options)
    for c in options:
        direction = "fwd" if c["subject"] == card.name else "inv"
        other = c["object"] if direction == "fwd" else c["subject"]
        if other in chain_names:
            continue  # every entity in a chain is distinct
        nxt = book.get(other)
        if isinstance(nxt, Dropped):
            continue
        rest = _expand(nxt, chain_names + [other], book, rng, links_left - 1)
        if rest is not None:
            links, anchor, names = rest
            return [dict(c, direction=direction)] + links, anchor, [other] + names
    return None


def chain_checks(chain: ChainRecord) -> dict[str, bool]:
    """The structural rules of RECIPE 4.1 step 2, evaluated on a chain."""
    answer = chain.answer.lower()
    later = chain.links[1:] + [chain.anchor]  # every claim except the one linking the answer itself
    return {
        "distinct_entities": len(set(chain.entities)) == len(chain.entities),
        "hops_in_range": 2 <= chain.hops <= 4,
        "anchor_not_on_answer": chain.anchor["subject"] != chain.answer,
        "no_later_claim_names_answer": all(answer not in f"{c['subject']} {c['object']}".lower() for c in later),
        "anchor_value_not_answer": answer not in chain.anchor["object"].lower(),
    }


def chain_stage(cards: list[EntityCard], book: CardBook, hops: tuple[int, int], seed: int,
                per_entity: int = 1, progress: bool = False) -> tuple[list[ChainRecord], list[Dropped]]:
    rng = random.Random(seed)
    kept, dropped = [], []
    seen: set[str] = set()
    for card, attempt in tqdm([(c, a) for c in cards for a in range(per_entity)], desc="synth: chains",
                              disable=not progress):
        target = rng.randint(*hops)
        got = _expand(card, [card.name], book, rng, target - 1)
        if got is None:
            dropped.append(Dropped("chain", {"answer": card.name, "attempt": attempt},
                                   f"no {target}-hop chain of distinct confirmed entities"))
            continue
        links, anchor, names = got
        key = json.dumps([links, anchor], sort_keys=True)
        if key in seen:
            dropped.append(Dropped("chain", {"answer": card.name, "attempt": attempt}, "same chain as an earlier attempt"))
            continue
        seen.add(key)
        chain = ChainRecord(f"syn-{seed}-{len(kept) + len(dropped):05d}", card.name, card.type,
                            [card.name] + names, links, anchor, card.seed_query)
        chain.checks = chain_checks(chain)
        failed = [k for k, ok in chain.checks.items() if not ok]
        if failed:
            dropped.append(Dropped("chain", asdict(chain), f"failed checks {failed}"))
        else:
            kept.append(chain)
    return kept, dropped


# ---------------------------------------------------------------- questions

def question_stage(chains: list[ChainRecord]) -> tuple[list[QuestionRecord], list[Dropped]]:
    """Name-free nested question by recursive substitution; drops leaks and duplicates."""
    kept, dropped, seen = [], [], set()
    for chain in chains:
        q = render(chain.plan())
        leaked = [n for n in chain.entities if n.lower() in q.lower()]
        if leaked:
            dropped.append(Dropped("question", {"id": chain.id, "question": q}, f"names entities {leaked}"))
        elif q in seen:
            dropped.append(Dropped("question", {"id": chain.id, "question": q}, "duplicate question"))
        else:
            seen.add(q)
            kept.append(QuestionRecord(chain, q))
    return kept, dropped


# ---------------------------------------------------------------- verification

def verify_one(rec: QuestionRecord, solver: Callable[[str, SolverSpec], SolverResult], specs: tuple[SolverSpec, ...],
               quorum: int) -> VerifiedRecord | Dropped:
    """Keep the question when >= quorum solvers each find exactly one answer, all the same, equal to
    the chain's answer (a solver that finds several candidates counts against uniqueness)."""
    results = [solver(rec.question, s) for s in specs]
    report = [{"solver": r.solver, "answers": r.answers, "queries": len(r.queries), "failure": r.failure} for r in results]
    gold = normalize_answer(rec.chain.answer)
    multi = [r for r in results if len(r.answers) > 1]
    agree = [r for r in results if r.unique is not None and normalize_answer(r.unique) == gold]
    if multi:
        reason = f"not unique: {multi[0].solver} found {len(multi[0].answers)} answers"
    elif len({normalize_answer(r.unique) for r in results if r.unique}) > 1:
        reason = "solvers disagree"
    elif len(agree) < quorum:
        reason = f"only {len(agree)} of {len(specs)} solvers confirmed the answer (quorum {quorum})"
    else:
        return VerifiedRecord(rec.chain, rec.question, report)
    return Dropped("verify", dict(rec.to_dict(), solvers=report), reason)


def make_solver(search) -> Callable[[str, SolverSpec], SolverResult]:
    return lambda question, spec: solve(question, search, spec)


def llm_question_stage(chains: list[ChainRecord], write: Callable[[ChainRecord], str]) -> tuple[list[QuestionRecord], list[Dropped]]:
    """LLM-backed question writing: `write` returns the question or raises (leaks, bad output)."""
    kept, dropped, seen = [], [], set()
    for chain in chains:
        try:
            q = write(chain)
        except (LLMError, LLMOutputError) as e:
            dropped.append(Dropped("question", {"id": chain.id}, str(e)))
            continue
        if q in seen:
            dropped.append(Dropped("question", {"id": chain.id, "question": q}, "duplicate question"))
            continue
        seen.add(q)
        kept.append(QuestionRecord(chain, q))
    return kept, dropped
