"""The language of the embedded synthetic world, declared as data.

Entity types, the typed relations between entities, the literal attributes (the anchors of
multi-hop questions), and for each of them: the sentence templates documents use to state a fact
(several per fact, so documents vary), and the phrases questions use to describe an entity by that
fact. The world generator renders facts with these templates; the offline claim extractor and the
scripted solvers parse text with the same tables, which is what makes the offline pipeline honest:
everything they know comes from document text retrieved by search.
"""
from __future__ import annotations

from dataclasses import dataclass

# type -> (noun used in questions, article)
ENTITY_TYPES: dict[str, tuple[str, str]] = {
    "person": ("person", "a"),
    "book": ("book", "a"),
    "company": ("company", "a"),
    "accelerator": ("startup accelerator", "a"),
    "university": ("university", "a"),
    "city": ("city", "a"),
    "festival": ("festival", "a"),
}

# Sentence stating an entity's type (also lets the extractor type the names it reads).
TYPE_TEMPLATES = ["{s} is {article} {noun}.", "{s} is the name of {article} {noun}."]


@dataclass(frozen=True)
class Relation:
    """A typed relation subject -> object between two entities."""

    name: str
    subj: str
    obj: str
    templates: tuple[str, ...]  # sentences with {s} and {o}
    desc_fwd: str  # "a book <desc_fwd> <object description>"
    top_fwd: str  # "Which book <top_fwd> <object description>?"
    desc_inv: str  # "a person <desc_inv> <subject description>"
    top_inv: str  # "Which person <top_inv> <subject description>?"


@dataclass(frozen=True)
class Attribute:
    """A literal-valued attribute: the anchor at the end of a chain."""

    name: str
    subj: str
    kind: str  # "year" or "month_year"
    lo: int
    hi: int
    templates: tuple[str, ...]  # sentences with {s} and {v}
    desc: str  # "a city <desc> <value>"
    top: str  # "Which city <top> <value>?"


RELATIONS: tuple[Relation, ...] = (
    Relation("written_by", "book", "person",
             ("{s} was written by {o}.", "{o} is the author of {s}.", "{o} wrote {s}."),
             "written by", "was written by", "who wrote", "wrote"),
    Relation("published_by", "book", "company",
             ("{s} was published by {o}.", "{o} published {s}.", "The publisher of {s} is {o}."),
             "published by", "was published by", "that published", "published"),
    Relation("born_in", "person", "city",
             ("{s} was born in {o}.", "{s} is a native of {o}.", "{o} is the birthplace of {s}."),
             "who was born in", "was born in", "that is the birthplace of", "is the birthplace of"),
    Relation("studied_at", "person", "university",
             ("{s} studied at {o}.", "{s} graduated from {o}.", "{s} is an alumnus of {o}."),
             "who studied at", "studied at", "attended by", "was attended by"),
    Relation("founded_by", "company", "person",
             ("{s} was founded by {o}.", "{o} founded {s}.", "{o} is the founder of {s}."),
             "founded by", "was founded by", "who founded", "founded"),
    Relation("headquartered_in", "company", "city",
             ("{s} is headquartered in {o}.", "{s} has its headquarters in {o}.",
              "The headquarters of {s} are in {o}."),
             "headquartered in", "is headquartered in", "that hosts the headquarters of",
             "hosts the headquarters of"),
    Relation("went_through", "company", "accelerator",
             ("{s} went through the {o} program.", "{o} accepted {s} into its program.",
              "{s} is a graduate of the {o} program."),
             "that went through", "went through", "that accepted", "accepted"),
    Relation("based_in", "accelerator", "city",
             ("{s} is based in {o}.", "{s} operates from {o}.", "{o} is home to {s}."),
             "based in", "is based in", "that is home to", "is home to"),
    Relation("located_in", "university", "city",
             ("{s} is located in {o}.", "{s} has its campus in {o}.", "The campus of {s} is in {o}."),
             "located in", "is located in", "that hosts the campus of", "hosts the campus of"),
    Relation("held_in", "festival", "city",
             ("{s} is held in {o}.", "{s} takes place every year in {o}.", "{o} is the venue of {s}."),
             "held in", "is held in", "that is the venue of", "is the venue of"),
)

ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute("published_in", "book", "year", 1950, 2023,
              ("{s} was first published in {v}.", "{s} came out in {v}.", "{s} appeared in print in {v}."),
              "first published in", "was first published in"),
    Attribute("birth_year", "person", "year", 1930, 2000,
              ("The birth year of {s} is {v}.", "{s} was born in the year {v}."),
              "born in the year", "was born in the year"),
    Attribute("founded_in", "company", "year", 1960, 2022,
              ("{s} was founded in {v}.", "{s} has been operating since {v}.", "{s} was incorporated in {v}."),
              "founded in", "was founded in"),
    Attribute("launched_in", "accelerator", "month_year", 1995, 2020,
              ("{s} launched in {v}.", "{s} opened its doors in {v}.", "{s} started its first cohort in {v}."),
              "launched in", "launched in"),
    Attribute("chartered_in", "university", "year", 1700, 1990,
              ("{s} received its charter in {v}.", "{s} admitted its first students in {v}."),
              "chartered in", "was chartered in"),
    Attribute("settled_in", "city", "year", 1100, 1900,
              ("{s} was first settled in {v}.", "The settlement of {s} dates to {v}."),
              "first settled in", "was first settled in"),
    Attribute("first_held_in", "festival", "year", 1950, 2020,
              ("{s} was first held in {v}.", "The first edition of {s} took place in {v}."),
              "first held in", "was first held in"),
)

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")

RELATION_BY_NAME = {r.name: r for r in RELATIONS}
ATTRIBUTE_BY_NAME = {a.name: a for a in ATTRIBUTES}


def type_phrase(etype: str) -> str:
    noun, article = ENTITY_TYPES[etype]
    return f"{article} {noun}"
