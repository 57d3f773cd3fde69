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
question (split by a hash of the subject id). Practice worlds (other seeds, names of the demo
world filtered out) add trajectories about thousands more invented subjects, and the drills teach
the two skills on fresh names: copying a name (copy_drills) and reading an answer out of a
passage (reading_drills).
"""
from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
from dataclasses import asdict
from typing import Optional, Sequence

from megatron_search.config.demo import STRATEGIES
from megatron_search.search.local import LocalSearchBackend
from megatron_search.search.tool import SearchTool, format_results

from .records import QARecord
from .sft import SYSTEM_PROMPT, SFTExample, _call
from .world import NAME_VOCAB, PHRASINGS, World, _Names, build_world
from .world_schema import ENTITY_TYPES, RELATION_BY_NAME, RELATIONS


# Words of the world's sentences: the filler around a copy drill's name (layout "varied").
_FILLER_WORDS = ("the", "a", "of", "in", "is", "was", "by", "at", "to", "and", "for", "with", "from", "that", "this",
                 "it", "on", "as", "are", "be", "or", "an", "not", "which", "person", "city", "book", "company", "year",
                 "first", "name", "native")
_COPY_LAYOUTS = ("{f1} {y} {f2}. Repeat exactly: {x} {f2}", "Repeat exactly: {x}. {f1} {y} {f2}",
                 "{f1} Repeat exactly: {x} {f2}", "{y} {f1}. Repeat exactly: {x}")
COPY_LAYOUTS = ("end", "varied")
DRILL_ANSWERS = ("name", "sentence")


def _held_out(entity_id: str, seed: int, fraction: float) -> bool:
    h = hashlib.sha256(f"{seed}:{entity_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


QUERY_STYLES = ("subject", "fact")
# What a trajectory must search to find its fact in a world of each document layout (world.DOCUMENT_LAYOUTS).
QUERY_FOR_LAYOUT = {"profiles": "subject", "facts": "fact"}


def fact_query(relation: str, subject: str) -> str:
    """The fact's sentence up to its object ("X was born in"): the query that finds a "facts" world's page
    for exactly this fact (world.build_world, layout "facts"), whose sentence goes on with the answer."""
    return RELATION_BY_NAME[relation].templates[0].split("{o}")[0].format(s=subject).strip()


def one_hop_records(world: World, seed: int = 0, test_fraction: float = 0.2, query: str = "subject") -> list[QARecord]:
    """One question per (subject, functional relation) fact of the world. `query` (metadata["query"], what a
    trajectory searches): the subject's name ("subject") or fact_query ("fact")."""
    if query not in QUERY_STYLES:
        raise ValueError(f"one_hop_records: query must be one of {QUERY_STYLES}, got {query!r}")
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
            metadata={"subject": subject, "query": subject if query == "subject" else fact_query(f.relation, subject)},
        ))
    return out


def split_for_rl(records: list[QARecord], seed: int, fraction: float) -> tuple[list[QARecord], list[QARecord]]:
    """(SFT records, RL records): the training records whose subject hashes into `fraction` go to RL (GRPO's
    prompts), by subject, so that no SFT trajectory (whose search shows all of a subject's facts) reads the
    answer of an RL question. Held-out (test) records are in neither."""
    train = [r for r in records if r.split == "train"]
    rl = {r.metadata["subject"] for r in train if _held_out("rl:" + r.metadata["subject"], seed, fraction)}
    return [r for r in train if r.metadata["subject"] not in rl], [r for r in train if r.metadata["subject"] in rl]


def names_by_type(world: World) -> dict[str, list[str]]:
    """{entity type: its names}, sorted: the pool a guessing trajectory draws its wrong answer from."""
    out: dict[str, list[str]] = {}
    for e in world.entities.values():
        out.setdefault(e.type, []).append(e.name)
    return {t: sorted(v) for t, v in out.items()}


def miss_query(rec: QARecord) -> str:
    """A query about the question that leaves its subject out ("person wrote"): it finds documents, not the fact."""
    rel = RELATION_BY_NAME[rec.chain[0]["relation"]]
    return f"{ENTITY_TYPES[rel.obj][0]} {rel.top_inv}"


# What an episode did, for the report: STRATEGIES, plus "altered": its query keeps every word coined for the
# subject's name but changes or drops a shared one ("The Quiet Synunerk" for The Distant Synunerk), which the
# coined word alone lets bm25 find.
EPISODE_STRATEGIES = ("search", "altered", "no_search", "miss", "redundant")


def classify_strategy(queries: list[str], subject: str) -> str:
    """Which of EPISODE_STRATEGIES a transcript followed, from its search queries and the question's subject:
    search / redundant when one / several queries ran and one holds the subject's name, altered when none does
    but one holds every word coined for it (data/world.NAME_VOCAB: the words names share), else miss."""
    if not queries:
        return "no_search"
    if any(subject.lower() in q.lower() for q in queries):
        return "search" if len(queries) == 1 else "redundant"
    coined = {w for w in re.findall(r"\w+", subject.lower()) if w not in NAME_VOCAB}
    if coined and any(coined <= set(re.findall(r"\w+", q.lower())) for q in queries):
        return "altered"
    return "miss"


def pick_strategy(mix: dict[str, float], key: str, seed: int) -> str:
    """A strategy drawn with `mix`'s weights, fixed by (seed, key) so a record keeps its strategy run to run."""
    unknown = sorted(set(mix) - set(STRATEGIES))
    if unknown or not any(w > 0 for w in mix.values()) or any(w < 0 for w in mix.values()):
        raise ValueError(f"strategy mix: keys are {', '.join(STRATEGIES)}, weights >= 0, one positive; got {mix}")
    h = hashlib.sha256(f"{seed}:strategy:{key}".encode()).digest()
    u = int.from_bytes(h[:8], "big") / 2**64 * sum(mix.values())
    names = [k for k in STRATEGIES if mix.get(k, 0) > 0]
    for k in names:
        u -= mix[k]
        if u < 0:
            return k
    return names[-1]


def _guess(rec: QARecord, pool: dict[str, list[str]], seed: int, text: str = "") -> str:
    """A wrong answer of the right type: the first such name in `text` (the results a missed search returned),
    else one drawn from the world's names by (seed, record)."""
    typ = RELATION_BY_NAME[rec.chain[0]["relation"]].obj
    wrong = [n for n in pool.get(typ, []) if n not in rec.answers]
    if not wrong:
        raise ValueError(f"{rec.id}: the world has no other {typ} to guess")
    seen = [n for n in wrong if n in text]
    if seen:
        return min(seen, key=text.index)
    return wrong[int.from_bytes(hashlib.sha256(f"{seed}:guess:{rec.id}".encode()).digest()[:8], "big") % len(wrong)]


def one_hop_sft_examples(records: list[QARecord], tool: SearchTool, answer: str = "name",
                         strategies: Optional[dict[str, float]] = None, pool: Optional[dict[str, list[str]]] = None,
                         seed: int = 0) -> tuple[list[SFTExample], list[dict]]:
    """Trajectories: search the subject's name (a real search_web call with its real results), then
    answer with the name (answer "name") or the fact restated (answer "sentence", fact_sentence). A
    record whose search does not surface the answer is dropped (returned with the reason), never
    given a made-up tool response.

    With `strategies` ({strategy: weight} over STRATEGIES) each record follows one strategy, drawn by
    (seed, record id): "search" as above; "no_search" answers at once with a wrong name of the right type
    from `pool` (names_by_type); "miss" searches miss_query(record) and answers with a wrong name (one its
    results show, when they show one; dropped if they hold the answer); "redundant" searches the subject twice,
    then answers right. The metadata records the strategy."""
    if answer not in DRILL_ANSWERS:
        raise ValueError(f"one_hop_sft_examples: answer must be one of {DRILL_ANSWERS}, got {answer!r}")
    if strategies is not None and pool is None:
        raise ValueError("one_hop_sft_examples: a strategy mix needs `pool` (names_by_type) for the wrong guesses")

    def reply(rec: QARecord, name: str) -> str:
        return name if answer == "name" else fact_sentence(rec.chain[0]["relation"], rec.metadata["subject"], name)

    examples, dropped = [], []
    for rec in records:
        strategy = "search" if strategies is None else pick_strategy(strategies, rec.id, seed)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": rec.question}]
        query = miss_query(rec) if strategy == "miss" else rec.metadata["query"]
        text = ""
        if strategy != "no_search":
            text = format_results(query, tool.backend.search(query, tool.max_results))
            if strategy == "miss" and rec.answers[0] in text:
                dropped.append({"id": rec.id, "reason": f"the missing query {query!r} surfaced the answer"})
                continue
            if strategy != "miss" and rec.answers[0] not in text:
                dropped.append({"id": rec.id, "reason": f"search for {query!r} did not surface the answer"})
                continue
            for _ in range(2 if strategy == "redundant" else 1):
                messages += [{"role": "assistant", "content": "", "tool_calls": [_call(query)]},
                             {"role": "tool", "name": "search_web", "content": text}]
        right = strategy in ("search", "redundant")
        messages.append({"role": "assistant",
                         "content": reply(rec, rec.answers[0] if right else _guess(rec, pool, seed, text))})
        kind = "tool_single" if strategy == "search" else f"strategy_{strategy}"
        examples.append(SFTExample(f"{rec.id}-sft", kind, messages, [tool.spec],
                                   metadata={"qa_id": rec.id, "answers": rec.answers, "strategy": strategy}))
    return examples, dropped


def short_trajectories(examples: Sequence[SFTExample]) -> list[SFTExample]:
    """The trajectories that search once and answer (strategy "search"), without the system prompt and the
    tool schema: the copying an agent does (the subject into its query, the found fact into its answer) at
    the same relative offsets (RoPE) as in the full trajectory, in rows about a third as long. A warm-up on
    them teaches that copying before the agent SFT (demo.reading_warmup_mix, part "short"). Trajectories that
    search twice ("redundant") are left out: after the first result they search again where these answer,
    and with both in the warm-up, its check of the answer measured that coin flip (0-77% from check to check,
    with empty answers: another call) instead of the copying."""
    out = []
    for ex in examples:
        if ex.metadata.get("strategy", "search") != "search":
            continue
        messages = [m for m in ex.messages if m["role"] != "system"]
        out.append(SFTExample(f"short-{ex.id}", ex.kind, messages, [], list(ex.loss_roles), dict(ex.metadata)))
    return out


class _FreshNames:
    """Invented names that neither contain nor are contained in a world name, so a drill teaches no
    world fact. Checked against the world with two C-level searches, so tens of thousands of names
    take seconds (world._Names compares every new name with all earlier ones)."""

    def __init__(self, world: World, rng, words: Optional[Sequence[str]] = None):
        self._names = _Names(rng, words)
        lows = sorted({e.name.lower() for e in world.entities.values()}, key=len, reverse=True)
        self._blob = "\x00".join(lows)  # candidate inside a world name
        self._pattern = re.compile("|".join(map(re.escape, lows))) if lows else None  # world name inside candidate

    def make(self, etype: str) -> str:
        for _ in range(1000):
            self._names.names.clear()  # repeats between drills are harmless; only the world must be avoided
            if self._names.pool is not None:  # a pool would run dry: its words repeat across drills
                self._names.words.clear()
            name = self._names.make(etype)
            low = name.lower()
            if low not in self._blob and not (self._pattern and self._pattern.search(low)):
                return name
        raise RuntimeError(f"could not invent a fresh {etype} name")


def copy_drills(world: World, n: int, seed: int = 0, layout: str = "end", max_filler: int = 10,
                words: Optional[Sequence[str]] = None) -> list[SFTExample]:
    """Copy drills on freshly invented names: the skill the search agent needs first (the subject
    goes into the query, the answer comes out of the results).

    layout "end": "Repeat exactly: Zorblat Quenix" -> "Zorblat Quenix". A model trained from scratch
    gets it in a few hundred steps, but as a copy from a fixed offset before the end of the prompt:
    97% on this layout, 0% with a word appended or a sentence prepended (measured).
    layout "varied": the same cue, with the name among up to `max_filler` filler words on either side
    and a distractor name, so the name must be found by content and copied by an induction head.
    `words`: names are built from this word pool (world.word_pool), as the world's are."""
    if layout not in COPY_LAYOUTS:
        raise ValueError(f"copy_drills: layout must be one of {COPY_LAYOUTS}, got {layout!r}")
    rng = random.Random(seed + 7919)
    names = _FreshNames(world, rng, words)
    out = []
    for i in range(n):
        x = names.make(rng.choice(list(ENTITY_TYPES)))
        prompt = f"Repeat exactly: {x}"
        if layout == "varied":
            y = names.make(rng.choice(list(ENTITY_TYPES)))
            f1, f2 = (" ".join(rng.choice(_FILLER_WORDS) for _ in range(rng.randint(0, max_filler))) for _ in range(2))
            prompt = " ".join(rng.choice(_COPY_LAYOUTS).format(x=x, y=y, f1=f1, f2=f2).split())
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": x}]
        out.append(SFTExample(f"copy-{seed}-{i}", "instruction", messages, []))
    return out


def fact_sentence(relation: str, subject: str, obj: str) -> str:
    """A fact restated with its relation's first (subject-first) template: "X was written by Y."
    Answered this way, the object comes right after words that preceded it in the passage, so an
    induction head can copy it; a bare name needs the fact located and its object read in one step."""
    return RELATION_BY_NAME[relation].templates[0].format(s=subject, o=obj)


def reading_drills(world: World, n: int, seed: int = 0, answer: str = "name",
                   phrasing: str = "any", words: Optional[Sequence[str]] = None) -> list[SFTExample]:
    """ "<3 sentences stating facts> Which person wrote X?" -> the person the passage names, on
    freshly invented names: reading the answer to a question out of a passage, as from results.

    answer "name" gives the bare name, "sentence" the fact restated (fact_sentence). phrasing "any"
    states each fact with any of its relation's templates (as the world's documents do), "first"
    with the subject-first one only, which the sentence answer repeats word for word. `words`: as copy_drills."""
    if answer not in DRILL_ANSWERS or phrasing not in PHRASINGS:
        raise ValueError(f"reading_drills: answer must be one of {DRILL_ANSWERS} and phrasing one of "
                         f"{PHRASINGS}, got {answer!r}, {phrasing!r}")
    rng = random.Random(seed + 104729)
    names = _FreshNames(world, rng, words)
    out = []
    for i in range(n):
        facts = []
        for rel in rng.sample(RELATIONS, 3):
            s, o = names.make(rel.subj), names.make(rel.obj)
            template = rel.templates[0] if phrasing == "first" else rng.choice(rel.templates)
            facts.append((rel, s, o, template.format(s=s, o=o)))
        rel, s, o, _ = rng.choice(facts)
        passage = " ".join(f[3] for f in facts)
        question = f"Which {ENTITY_TYPES[rel.obj][0]} {rel.top_inv} {s}?"
        reply = fact_sentence(rel.name, s, o) if answer == "sentence" else o
        messages = [{"role": "user", "content": f"{passage}\n\n{question}"}, {"role": "assistant", "content": reply}]
        out.append(SFTExample(f"read-{seed}-{i}", "instruction", messages, [], metadata={"answers": [o]}))
    return out


def practice_trajectories(demo_world: World, num_worlds: int, seed: int, search_cfg, answer: str = "name",
                          phrasing: str = "any",
                          strategies: Optional[dict[str, float]] = None,
                          words: Optional[Sequence[str]] = None,
                          layout: str = "profiles") -> tuple[list[SFTExample], int]:
    """Trajectories over `num_worlds` extra invented worlds (each with its own in-memory index), so
    the agent SFT sees thousands of subjects instead of the demo world's few hundred training ones
    and must learn to search and read rather than recall. A trajectory that contains any name of
    the demo world (even inside a longer word) is dropped, so no demo fact, held out or not, is
    taught; returns the examples and how many were dropped that way. `strategies`: as
    one_hop_sft_examples, each world guessing among its own names. `words`: the worlds' word pool
    (world.word_pool; the demo world's own names are still filtered out). `layout`: the worlds' documents
    (world.build_world); with "facts" the trajectories search fact_query, as they must to find the fact."""
    names = sorted({e.name for e in demo_world.entities.values()}, key=len, reverse=True)
    clash = re.compile("|".join(map(re.escape, names)))  # inside a longer word too: the safe side
    out, clashes = [], 0
    for k in range(num_worlds):
        world = build_world(seed=seed * 1000 + 1 + k, phrasing=phrasing, words=words, layout=layout)
        backend = LocalSearchBackend.from_docs([asdict(d) for d in world.documents], search_cfg.snippet_chars)
        tool = SearchTool.from_config(search_cfg, backend=backend)
        records = one_hop_records(world, seed=seed, query=QUERY_FOR_LAYOUT[layout])
        examples, _ = one_hop_sft_examples(records, tool, answer=answer,
                                           strategies=strategies, pool=names_by_type(world), seed=seed + k)
        for ex in examples:
            if clash.search(" ".join(m["content"] for m in ex.messages[1:])):
                clashes += 1
                continue
            ex.id = f"practice{k}-{ex.id}"
            out.append(ex)
    return out, clashes
