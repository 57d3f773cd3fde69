"""The embedded synthetic world: invented entities, typed facts and the documents that state them.

Deterministic from a seed. Names are built from invented syllables, so no fact can come from
pretraining: answers are only obtainable by searching the corpus. Each true fact is stated by
several documents on different sites (so "confirmed by several sources" is a real, checkable
property); a configurable fraction of facts is stated only once, and rumour posts assert wrong
attribute values once each, so single-source claims must not be trusted. Filler documents mention
entities without stating facts (distractors for retrieval).

Output: a corpus (JSONL id, title, url, text — the search index's input) and world.json with the
ground truth (entities, facts, which documents state each fact), used by tests and by the
uniqueness check of question generation, never by the solvers.
"""
from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from tqdm import tqdm

from .jsonl import atomic_write_json, read_jsonl, write_jsonl
from .world_schema import (ATTRIBUTE_BY_NAME, ATTRIBUTES, ENTITY_TYPES, MONTHS, RELATION_BY_NAME, RELATIONS,
                           TYPE_TEMPLATES)

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "st",
           "t", "tr", "v", "vr", "z", "th", "sh"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "y"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "x", "m", "nd", "rk", "v"]
_BOOK_ADJ = ["Silent", "Hollow", "Amber", "Distant", "Crooked", "Winter", "Gilded", "Quiet", "Broken",
             "Sunken", "Final", "Restless", "Pale", "Burning", "Ninth"]
_COMPANY_SUFFIX = ["Systems", "Labs", "Dynamics", "Works", "Analytics", "Robotics", "Foods", "Press",
                   "Networks", "Holdings"]
_FESTIVAL_KIND = ["Lantern", "Harvest", "Film", "Jazz", "Kite", "Poetry", "Light", "Folk"]
# the words names share (every other word of a name is coined for it, once per world)
NAME_VOCAB = frozenset(w.lower() for w in ["The", "Launchpad", "University", "Festival", *_BOOK_ADJ,
                                           *_COMPANY_SUFFIX, *_FESTIVAL_KIND])
_SITES = ["wikiverse.example", "almanac.example", "dailyledger.example", "atlasnotes.example"]
_RUMOR_SITE = "forum.example"
_RUMOR_PREFIX = ["Someone on this board claimed that", "I read somewhere that", "Unconfirmed:"]
_FILLER = [
    "Visitors often mention {n} when they write about their travels.",
    "A reader asked whether {n} deserves more attention.",
    "{n} came up in a long discussion thread last week.",
    "Opinions about {n} differ widely among enthusiasts.",
]

# Share of each type in the world (relative weights).
_TYPE_WEIGHTS = {"person": 0.28, "book": 0.18, "company": 0.16, "accelerator": 0.06,
                 "university": 0.08, "city": 0.14, "festival": 0.10}


@dataclass
class Entity:
    id: str
    type: str
    name: str


@dataclass
class Fact:
    id: str
    subject: str  # entity id
    relation: str  # relation or attribute name
    object: str  # entity id (relation) or literal value (attribute)
    literal: bool


@dataclass
class Document:
    id: str
    title: str
    url: str
    text: str


@dataclass
class World:
    seed: int
    entities: dict[str, Entity]
    facts: list[Fact]
    documents: list[Document]
    support: dict[str, list[str]] = field(default_factory=dict)  # fact id -> doc ids stating it
    rumors: list[dict] = field(default_factory=list)  # wrong single-source claims (ground truth)

    def name(self, eid: str) -> str:
        return self.entities[eid].name

    def facts_of(self, eid: str) -> list[Fact]:
        return [f for f in self.facts if f.subject == eid or (not f.literal and f.object == eid)]

    def save(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        write_jsonl(out / "corpus.jsonl", (asdict(d) for d in self.documents))
        atomic_write_json(out / "world.json", {
            "seed": self.seed,
            "entities": [asdict(e) for e in self.entities.values()],
            "facts": [asdict(f) for f in self.facts],
            "support": self.support,
            "rumors": self.rumors,
        })

    @classmethod
    def load(cls, out_dir: str | Path) -> "World":
        out = Path(out_dir)
        meta = json.loads((out / "world.json").read_text(encoding="utf-8"))
        docs = [Document(**d) for d in read_jsonl(out / "corpus.jsonl")]
        ents = {e["id"]: Entity(**e) for e in meta["entities"]}
        return cls(meta["seed"], ents, [Fact(**f) for f in meta["facts"]], docs, meta["support"], meta["rumors"])


def _invent_word(rng: random.Random, syllables: tuple[int, int] = (2, 3)) -> str:
    n = rng.randint(*syllables)
    w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n))
    return (w + rng.choice(_CODAS)).capitalize()


def word_pool(seed: int, size: int) -> list[str]:
    """`size` invented words (2-3 syllables, at least 5 letters), none inside another (case-insensitive), so
    each can be one token of a tokenizer (chat/tokenizer.BPETokenizer.train's `words`) and a name built from
    them is a few whole tokens. Deterministic from `seed`."""
    rng = random.Random(f"word-pool:{seed}")
    words: list[str] = []
    lows: set[str] = set()
    for _ in range(200 * size):
        if len(words) == size:
            return words
        w = _invent_word(rng)
        low = w.lower()
        if len(w) >= 5 and low not in lows and not any(low in o or o in low for o in lows):
            words.append(w)
            lows.add(low)
    raise RuntimeError(f"word_pool: could not invent {size} words that do not contain one another")


class _Names:
    """Invented, globally unique names; no name is contained in another (so substring checks on
    questions and claims are meaningful). With `words`, every invented word is drawn from that pool
    (each at most once per _Names) instead of being made up from syllables."""

    def __init__(self, rng: random.Random, words: Optional[Sequence[str]] = None):
        self.rng = rng
        self.words: set[str] = set()
        self.names: list[str] = []
        self.pool = list(words) if words is not None else None

    def word(self, syllables: tuple[int, int] = (2, 3)) -> str:
        if self.pool is not None:
            for _ in range(1000):
                w = self.rng.choice(self.pool)
                if w not in self.words:
                    self.words.add(w)
                    return w
            raise RuntimeError(f"word pool of {len(self.pool)} exhausted; lower the world size or grow the pool")
        for _ in range(1000):
            w = _invent_word(self.rng, syllables)
            if w not in self.words and len(w) >= 5:
                self.words.add(w)
                return w
        raise RuntimeError("name space exhausted; lower the world size")

    def make(self, etype: str) -> str:
        for _ in range(1000):
            r = self.rng
            name = {
                "person": lambda: f"{self.word((1, 2))} {self.word()}",
                "book": lambda: f"The {r.choice(_BOOK_ADJ)} {self.word()}",
                "company": lambda: f"{self.word()} {r.choice(_COMPANY_SUFFIX)}",
                "accelerator": lambda: f"{self.word()} Launchpad",
                "university": lambda: f"{self.word()} University",
                "city": lambda: self.word(),
                "festival": lambda: f"{self.word()} {r.choice(_FESTIVAL_KIND)} Festival",
            }[etype]()
            low = name.lower()
            if all(low not in o.lower() and o.lower() not in low for o in self.names):
                self.names.append(name)
                return name
        raise RuntimeError("could not find a fresh name")


def _value(attr, rng: random.Random) -> str:
    year = rng.randint(attr.lo, attr.hi)
    return f"{rng.choice(MONTHS)} {year}" if attr.kind == "month_year" else str(year)


PHRASINGS = ("any", "first")
# How documents state facts: a profile page per (entity, site) with several of its facts, or one page per
# (fact, site) stating that fact alone (the CPU demo's world: a search for the fact finds its one sentence).
DOCUMENT_LAYOUTS = ("profiles", "facts")


def _render(fact: Fact, world_names: dict[str, str], rng: random.Random, phrasing: str = "any") -> str:
    """The fact as a sentence, with a random template of its relation (phrasing "any") or the first
    one (phrasing "first"; the random draw still happens, so the rest of the world is the same)."""
    spec = ATTRIBUTE_BY_NAME[fact.relation] if fact.literal else RELATION_BY_NAME[fact.relation]
    template = rng.choice(spec.templates)
    if phrasing == "first":
        template = spec.templates[0]
    if fact.literal:
        return template.format(s=world_names[fact.subject], v=fact.object)
    return template.format(s=world_names[fact.subject], o=world_names[fact.object])


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def build_world(seed: int = 0, num_entities: int = 300, min_sources: int = 2,
                single_source_fraction: float = 0.1, rumor_fraction: float = 0.05,
                filler_docs: int = 100, progress: bool = False, phrasing: str = "any",
                words: Optional[Sequence[str]] = None, layout: str = "profiles") -> World:
    """Generate the world. Every fact is stated by >= min_sources documents on distinct sites except
    a `single_source_fraction` of them (stated once); `rumor_fraction` x #facts rumour posts each
    assert one wrong attribute value once. `phrasing`: documents state a fact with any of its
    templates ("any") or always the first, subject-first one ("first": the CPU demo's easier world).
    `words`: the invented words names are built from (word_pool), instead of fresh syllable words.
    `layout`: "profiles" (a page per entity and site, several facts each) or "facts" (a page per fact and
    site stating only that fact, titled by its subject: a search for the fact finds exactly its sentence; the
    attribute facts (years) and the rumours about them are then left out, since an attribute's sentence
    shares the words of a relation's: "was first published in" / "was published by")."""
    if phrasing not in PHRASINGS:
        raise ValueError(f"phrasing must be one of {PHRASINGS}, got {phrasing!r}")
    if layout not in DOCUMENT_LAYOUTS:
        raise ValueError(f"layout must be one of {DOCUMENT_LAYOUTS}, got {layout!r}")
    if min_sources < 2 or min_sources > len(_SITES):
        raise ValueError(f"min_sources must be in [2, {len(_SITES)}], got {min_sources}")
    if num_entities < 30:
        raise ValueError(f"num_entities must be >= 30 for every type to be populated, got {num_entities}")
    rng = random.Random(seed)
    names = _Names(rng, words)
    entities: dict[str, Entity] = {}
    by_type: dict[str, list[str]] = defaultdict(list)
    for etype, w in _TYPE_WEIGHTS.items():
        for _ in range(max(3, round(w * num_entities))):
            eid = f"e{len(entities):05d}"
            entities[eid] = Entity(eid, etype, names.make(etype))
            by_type[etype].append(eid)

    facts: list[Fact] = []

    def add(s: str, rel: str, o: str, literal: bool) -> None:
        facts.append(Fact(f"f{len(facts):06d}", s, rel, o, literal))

    # Relations: each subject gets one object (founded_by: 1-2 founders; went_through: 70% of companies).
    for rel in RELATIONS:
        for s in by_type[rel.subj]:
            if rel.name == "went_through" and rng.random() > 0.7:
                continue
            k = rng.choice([1, 1, 2]) if rel.name == "founded_by" else 1
            for o in rng.sample(by_type[rel.obj], k):
                add(s, rel.name, o, False)
    for attr in ATTRIBUTES:
        for s in by_type[attr.subj]:
            add(s, attr.name, _value(attr, rng), True)

    names_by_id = {e.id: e.name for e in entities.values()}
    # Which sites state each fact: >= min_sources distinct sites, or exactly one for weak facts.
    fact_sites: dict[str, list[str]] = {}
    for f in facts:
        n = 1 if rng.random() < single_source_fraction else rng.randint(min_sources, len(_SITES) - 1)
        fact_sites[f.id] = rng.sample(_SITES, n)

    documents: list[Document] = []
    support: dict[str, list[str]] = defaultdict(list)
    if layout == "facts":  # one page per (relation fact, site), the fact alone, titled by its subject
        for f in tqdm([f for f in facts if not f.literal], desc="world docs", disable=not progress):
            subject = names_by_id[f.subject]
            for site in fact_sites[f.id]:
                did = f"d{len(documents):06d}"
                documents.append(Document(did, f"{subject} - {site.split('.')[0]}",
                                          f"https://{site}/{_slug(subject)}/{f.relation}",
                                          _render(f, names_by_id, rng, phrasing)))
                support[f.id].append(did)
    # Else one profile page per (entity, site) stating the entity's facts that this site carries.
    pages: dict[tuple[str, str], list[str]] = defaultdict(list)
    for f in facts if layout == "profiles" else ():  # "facts": no profile pages
        for site in fact_sites[f.id]:
            # A relation fact lives on the subject's or the object's page, chosen at random.
            host = f.subject if f.literal or rng.random() < 0.6 else f.object
            pages[(host, site)].append(f.id)
    fact_by_id = {f.id: f for f in facts}
    for (host, site), fids in tqdm(sorted(pages.items()), desc="world docs", disable=not progress):
        ent = entities[host]
        noun, article = ENTITY_TYPES[ent.type]
        sentences = [rng.choice(TYPE_TEMPLATES).format(s=ent.name, article=article, noun=noun)]
        rng.shuffle(fids)
        for fid in fids:
            sentences.append(_render(fact_by_id[fid], names_by_id, rng, phrasing))
        did = f"d{len(documents):06d}"
        documents.append(Document(did, f"{ent.name} - {site.split('.')[0]}", f"https://{site}/{_slug(ent.name)}",
                                  " ".join(sentences)))
        for fid in fids:
            support[fid].append(did)

    # Rumours: a wrong attribute value, stated once on a forum.
    rumors = []
    literal_facts = [f for f in facts if f.literal]
    for f in rng.sample(literal_facts, int(rumor_fraction * len(facts))) if layout == "profiles" else ():
        attr = next(a for a in ATTRIBUTES if a.name == f.relation)
        wrong = _value(attr, rng)
        if wrong == f.object:
            continue
        did = f"d{len(documents):06d}"
        claim = rng.choice(attr.templates).format(s=names_by_id[f.subject], v=wrong)
        documents.append(Document(did, f"Thread about {names_by_id[f.subject]}",
                                  f"https://{_RUMOR_SITE}/t/{len(rumors)}",
                                  f"{rng.choice(_RUMOR_PREFIX)} the following is true. {claim} Can anyone confirm?"))
        rumors.append({"doc": did, "subject": f.subject, "relation": f.relation, "wrong": wrong, "true": f.object})

    # Filler: mentions without facts.
    all_ids = list(entities)
    for i in range(filler_docs):
        picked = rng.sample(all_ids, 2)
        text = " ".join(rng.choice(_FILLER).format(n=entities[e].name) for e in picked)
        did = f"d{len(documents):06d}"
        documents.append(Document(did, f"Notes {i}", f"https://{_RUMOR_SITE}/notes/{i}", text))

    return World(seed, entities, facts, documents, dict(support), rumors)
