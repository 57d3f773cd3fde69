"""Scripted multi-hop search solvers: the verification step of the embedded world (RECIPE 4.1 step 4).

A solver reads only the question text and the search results. It parses the nested question,
searches for the anchor first, then walks the links outward, keeping a set of candidates at each
level (a description can match several entities) and accepting a claim only when it is confirmed by
several sites. Solvers differ in how they phrase queries, how many results they read and how much
support they demand, so they fail differently; a question is kept only when they agree on one answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..world_schema import ATTRIBUTE_BY_NAME, ENTITY_TYPES, RELATION_BY_NAME
from .evidence import Evidence, SearchLike
from .extract import Claim
from .question import Link, QuestionPlan, parse


@dataclass(frozen=True)
class SolverSpec:
    name: str
    style: str  # "phrase" | "keywords" | "entity"
    k: int = 10
    min_support: int = 2
    max_candidates: int = 8


DEFAULT_SOLVERS = (
    SolverSpec("phrase-k10", "phrase", k=10),
    SolverSpec("keywords-k8", "keywords", k=8),
    SolverSpec("entity-k6", "entity", k=6, min_support=2),
)


@dataclass
class SolverResult:
    solver: str
    answers: list[str]
    queries: list[str] = field(default_factory=list)
    failure: str | None = None

    @property
    def unique(self) -> str | None:
        return self.answers[0] if len(self.answers) == 1 else None


def _anchor_query(spec: SolverSpec, etype: str, attr: str, value: str) -> str:
    a = ATTRIBUTE_BY_NAME[attr]
    noun = ENTITY_TYPES[etype][0]
    if spec.style == "keywords":
        return f"{value} {a.top}"
    return f"{noun} {a.desc} {value}"


def _link_query(spec: SolverSpec, link: Link, known: str) -> str:
    rel = RELATION_BY_NAME[link.relation]
    if spec.style == "entity":
        return known
    if spec.style == "keywords":
        return f"{known} {rel.name.replace('_', ' ')}"
    # E_j (unknown) relates to `known` (E_{j+1}): phrase from the known side.
    return f"{rel.desc_fwd} {known}" if link.direction == "fwd" else f"{known} {rel.desc_fwd}"


def _link_matches(link: Link, c: Claim, known: str) -> str | None:
    """The unknown entity named by claim `c` when it realises `link` with `known` on the far side."""
    if c.literal or c.relation != link.relation:
        return None
    if link.direction == "fwd" and c.object == known:
        return c.subject
    if link.direction == "inv" and c.subject == known:
        return c.object
    return None


def solve(question: str, search: SearchLike, spec: SolverSpec) -> SolverResult:
    plans = parse(question)
    if len(plans) != 1:
        return SolverResult(spec.name, [], failure=f"question parses {len(plans)} ways")
    plan: QuestionPlan = plans[0]
    ev = Evidence(search, spec.k)
    types = plan.types()

    # Anchor: entities of the last type with the literal value, confirmed by several sites.
    ev.query(_anchor_query(spec, types[-1], plan.anchor_attribute, plan.anchor_value))
    pending = {c.subject for c in ev.filter(lambda c: c.relation == plan.anchor_attribute and c.object == plan.anchor_value)}
    cands: set[str] = set()
    for name in sorted(pending):
        claim = Claim(name, plan.anchor_attribute, plan.anchor_value, True)
        if not ev.confirmed(claim, spec.min_support):
            ev.query(name)  # read the entity's own pages to confirm (or refute) the value
        if ev.confirmed(claim, spec.min_support):
            cands.add(name)
    # Links, innermost first: E_j is whatever relates to a candidate of E_{j+1}.
    for link in reversed(plan.links):
        if not cands:
            break
        if len(cands) > spec.max_candidates:
            return SolverResult(spec.name, [], ev.calls, f"{len(cands)} candidates exceed {spec.max_candidates}")
        nxt: set[str] = set()
        for known in sorted(cands):
            ev.query(_link_query(spec, link, known))
            found = {(x, c) for c in ev.claims_about(known) if (x := _link_matches(link, c, known))}
            for x, claim in sorted(found, key=lambda t: t[0]):
                if not ev.confirmed(claim, spec.min_support):
                    ev.query(x)
                if ev.confirmed(claim, spec.min_support):
                    nxt.add(x)
        cands = nxt
    if not cands:
        return SolverResult(spec.name, [], ev.calls, "no candidate survived")
    return SolverResult(spec.name, sorted(cands), ev.calls)
