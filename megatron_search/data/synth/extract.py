"""Offline claim extraction: parse document text into atomic claims with the world's sentence
templates (world_schema). This is the offline backend of the "atomic claims from documents" step;
the LLM-backed variant lives in llm_steps.py. Only text goes in, so whatever search returned is all
the extractor (and the solvers built on it) can know.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from ..world_schema import ATTRIBUTES, ENTITY_TYPES, RELATIONS, TYPE_TEMPLATES

# Entity names are sequences of capitalised words (the world never puts periods in names).
NAME = r"[A-Z][A-Za-z'\-]*(?: [A-Z][A-Za-z'\-]*)*"
VALUE_PATTERNS = {"year": r"\d{4}", "month_year": r"(?:January|February|March|April|May|June|July|August|September|October|November|December) \d{4}"}
_SENTENCE_END = re.compile(r"(?<=[.?!])\s+")


@dataclass(frozen=True)
class Claim:
    """One atomic claim: subject --relation--> object (an entity name, or a literal value)."""

    subject: str
    relation: str  # relation/attribute name, or "is_a" (object = entity type)
    object: str
    literal: bool

    def text(self) -> str:
        return f"{self.subject} | {self.relation} | {self.object}"


def _compile(template: str, groups: dict[str, str]) -> re.Pattern:
    out = re.escape(template)
    for key, pat in groups.items():
        out = out.replace(re.escape("{" + key + "}"), f"(?P<{key}>{pat})")
    return re.compile(out)


@lru_cache(maxsize=1)
def _patterns() -> list[tuple[re.Pattern, str, bool]]:
    pats: list[tuple[re.Pattern, str, bool]] = []
    for attr in ATTRIBUTES:  # literal templates first: "born in the year 1970" must not read as a city
        for t in attr.templates:
            pats.append((_compile(t, {"s": NAME, "v": VALUE_PATTERNS[attr.kind]}), attr.name, True))
    for rel in RELATIONS:
        for t in rel.templates:
            pats.append((_compile(t, {"s": NAME, "o": NAME}), rel.name, False))
    for etype, (noun, article) in ENTITY_TYPES.items():
        for t in TYPE_TEMPLATES:
            filled = t.replace("{article}", article).replace("{noun}", noun)
            pats.append((_compile(filled, {"s": NAME}), f"is_a:{etype}", True))
    return pats


def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def extract_claims(text: str) -> list[Claim]:
    """Every claim stated by a full sentence of `text` (partial sentences, e.g. cut snippets, are ignored)."""
    out: list[Claim] = []
    for sent in split_sentences(text):
        for pat, rel, literal in _patterns():
            m = pat.fullmatch(sent)
            if not m:
                continue
            if rel.startswith("is_a:"):
                out.append(Claim(m["s"], "is_a", rel.split(":", 1)[1], True))
            elif literal:
                out.append(Claim(m["s"], rel, m["v"], True))
            else:
                out.append(Claim(m["s"], rel, m["o"], False))
            break
    return out
