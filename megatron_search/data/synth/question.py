"""Name-free nested questions by recursive substitution, and their parser.

A chain is an answer entity E0 linked to E1, E1 to E2, ... and an anchor (a literal attribute)
on the last entity. Each entity name after E0 is replaced by its type plus its linking claim,
innermost first, so the question names no entity: "Which book was written by a person who
studied at a university chartered in 1820?". The parser inverts the grammar; the scripted solvers
use it to know what to search for (they never see the chain itself).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .extract import VALUE_PATTERNS
from ..world_schema import ATTRIBUTE_BY_NAME, ATTRIBUTES, ENTITY_TYPES, RELATION_BY_NAME, RELATIONS, type_phrase


@dataclass(frozen=True)
class Link:
    """E_i --relation--> E_{i+1}; direction "fwd": E_i is the relation's subject, "inv": its object."""

    relation: str
    direction: str

    def next_type(self) -> str:
        rel = RELATION_BY_NAME[self.relation]
        return rel.obj if self.direction == "fwd" else rel.subj

    def this_type(self) -> str:
        rel = RELATION_BY_NAME[self.relation]
        return rel.subj if self.direction == "fwd" else rel.obj


@dataclass(frozen=True)
class QuestionPlan:
    """The structure of a nested question: answer type, links outward, anchor on the last entity."""

    answer_type: str
    links: tuple[Link, ...]
    anchor_attribute: str
    anchor_value: str

    @property
    def hops(self) -> int:
        return len(self.links) + 1

    def types(self) -> list[str]:
        return [self.answer_type] + [link.next_type() for link in self.links]


def _link_phrase(link: Link, top: bool) -> str:
    rel = RELATION_BY_NAME[link.relation]
    if link.direction == "fwd":
        return rel.top_fwd if top else rel.desc_fwd
    return rel.top_inv if top else rel.desc_inv


def render(plan: QuestionPlan) -> str:
    """The question text (no entity name appears in it: only types, relation phrases and the anchor)."""
    if not plan.links:
        raise ValueError("a nested question needs at least one link (2 hops)")
    types = plan.types()
    attr = ATTRIBUTE_BY_NAME[plan.anchor_attribute]
    if attr.subj != types[-1]:
        raise ValueError(f"anchor {attr.name} applies to {attr.subj}, not {types[-1]}")
    desc = f"{type_phrase(types[-1])} {attr.desc} {plan.anchor_value}"
    for i in range(len(plan.links) - 1, 0, -1):  # innermost substitution first
        desc = f"{type_phrase(types[i])} {_link_phrase(plan.links[i], False)} {desc}"
    noun = ENTITY_TYPES[plan.answer_type][0]
    return f"Which {noun} {_link_phrase(plan.links[0], True)} {desc}?"


def _parse_desc(text: str, etype: str) -> list[tuple[list[Link], str, str]]:
    """All parses of `text` as a description of an entity of type `etype`: (links, attr, value)."""
    head = type_phrase(etype) + " "
    if not text.startswith(head):
        return []
    rest = text[len(head):]
    out = []
    for attr in ATTRIBUTES:
        if attr.subj == etype and rest.startswith(attr.desc + " "):
            value = rest[len(attr.desc) + 1:]
            if re.fullmatch(VALUE_PATTERNS[attr.kind], value):
                out.append(([], attr.name, value))
    for rel in RELATIONS:
        for direction in ("fwd", "inv"):
            link = Link(rel.name, direction)
            if link.this_type() != etype:
                continue
            phrase = _link_phrase(link, False) + " "
            if rest.startswith(phrase):
                for links, a, v in _parse_desc(rest[len(phrase):], link.next_type()):
                    out.append(([link] + links, a, v))
    return out


def parse(question: str) -> list[QuestionPlan]:
    """Every plan whose rendering is `question` (a well-formed question has exactly one)."""
    q = question.strip()
    if not (q.startswith("Which ") and q.endswith("?")):
        return []
    body = q[len("Which "):-1]
    plans = []
    for etype, (noun, _) in ENTITY_TYPES.items():
        if not body.startswith(noun + " "):
            continue
        rest = body[len(noun) + 1:]
        for rel in RELATIONS:
            for direction in ("fwd", "inv"):
                link = Link(rel.name, direction)
                if link.this_type() != etype:
                    continue
                phrase = _link_phrase(link, True) + " "
                if rest.startswith(phrase):
                    for links, a, v in _parse_desc(rest[len(phrase):], link.next_type()):
                        plans.append(QuestionPlan(etype, tuple([link] + links), a, v))
    return [p for p in plans if render(p) == q]
