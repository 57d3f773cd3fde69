"""SFT data (RECIPE 2): production-format tool-use trajectories on the synthetic world, plus
preference-oriented examples (instruction following, language consistency, formatting, abstention).

Every search in a trajectory is a real `search_web` call through the SearchTool (RECIPE 6 limits)
against the index; its real result text becomes the tool message, and a trajectory is kept only
when the entity each step needs is in the results it got (so the final answer is supported by
the transcript). Examples are chat messages for chat/format.py: OpenAI-style assistant
`tool_calls`, `tool` messages. The loss covers assistant messages only; each example lists
`loss_roles` and the trainer masks everything else.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Optional

from tqdm import tqdm

from ..search.tool import SearchTool, format_results
from .prompts import load_keyed
from .records import QARecord
from .synth.extract import Claim, extract_claims
from .world import World, _Names
from .world_schema import ATTRIBUTE_BY_NAME, ENTITY_TYPES, RELATION_BY_NAME

SYSTEM_PROMPT = ("You are a helpful search assistant. Use the search_web tool to find evidence before answering "
                 "factual questions, answer in the language of the user, and say so when you cannot find "
                 "reliable evidence.")
ABSTAIN_TEXT = ("I could not find reliable evidence about {name} in my searches, so I cannot answer this "
                "question with confidence.")
LOSS_ROLES = ["assistant"]


@dataclass
class SFTExample:
    id: str
    kind: str  # tool_single | tool_two_turn | tool_multi_turn | instruction | language | format | abstention
    messages: list[dict]
    tools: list[dict]
    loss_roles: list[str] = field(default_factory=lambda: list(LOSS_ROLES))
    metadata: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "messages": self.messages, "tools": self.tools,
                "loss_roles": self.loss_roles, "metadata": self.metadata}


class StepFailed(Exception):
    """A search did not return what the step needs: the trajectory is dropped (reason recorded)."""


def _call(query: str) -> dict:
    return {"type": "function", "function": {"name": "search_web", "arguments": {"query": query}}}


class TrajectoryWriter:
    """Builds transcripts whose tool messages are the real results of each query."""

    def __init__(self, tool: SearchTool):
        self.tool = tool
        self.last_results_text = ""

    def search_step(self, messages: list[dict], thought: str, query: str, must_contain: Optional[str | Claim]) -> str:
        """One real search_web call; `must_contain`: a name, or a claim the results must state."""
        results = self.tool.backend.search(query[: self.tool.max_query_chars], self.tool.max_results)
        text = format_results(query, results)
        self.last_results_text = " ".join(f"{r.title} {r.snippet}" for r in results)
        if isinstance(must_contain, Claim):
            if must_contain not in extract_claims(" ".join(r.snippet for r in results)):
                raise StepFailed(f"query {query!r} did not surface the claim {must_contain.text()!r}")
        elif must_contain is not None and must_contain not in text:
            raise StepFailed(f"query {query!r} did not surface {must_contain!r}")
        messages.append({"role": "assistant", "content": thought, "tool_calls": [_call(query)]})
        messages.append({"role": "tool", "name": "search_web", "content": text})
        return text

    def chain_turn(self, messages: list[dict], rec: QARecord) -> list[str]:
        """Anchor first, then each link outward; returns the facts used (for the final answer)."""
        chain = rec.chain
        anchor = chain[-1]
        attr = ATTRIBUTE_BY_NAME[anchor["relation"]]
        noun = ENTITY_TYPES[attr.subj][0]
        self.search_step(messages, f"First I look for the {noun} {attr.desc} {anchor['object']}.",
                         f"{noun} {attr.desc} {anchor['object']}", anchor["subject"])
        facts = [attr.templates[0].format(s=anchor["subject"], v=anchor["object"])]
        known = anchor["subject"]
        for link in reversed(chain[:-1]):
            rel = RELATION_BY_NAME[link["relation"]]
            target = link["subject"] if link["object"] == known else link["object"]
            query = f"{rel.desc_fwd} {known}" if link["object"] == known else f"{known} {rel.desc_fwd}"
            self.search_step(messages, f"{facts[-1]} Next I need the entity linked to {known} ({rel.name.replace('_', ' ')}).",
                             query, target)
            facts.append(rel.templates[0].format(s=link["subject"], o=link["object"]))
            known = target
        if len(messages) and self.tool.max_calls < sum(1 for m in messages if m.get("tool_calls")):
            raise StepFailed("more searches than the tool budget allows")
        return facts


def render_answer(answer: str, facts: list[str], format_key: Optional[str]) -> str:
    """A final answer that complies with the format instruction (RECIPE 4.1 format augmentation)."""
    if format_key == "name_only":
        return answer
    if format_key == "list":
        return "\n".join(f"- {f}" for f in facts) + f"\n\n{answer}"
    if format_key == "table":
        rows = "\n".join(f"| {i} | {f} |" for i, f in enumerate(facts, 1))
        return f"| step | fact |\n|---|---|\n{rows}\n\nThe answer is {answer}."
    if format_key == "bold_sentence":
        return f"Following the chain of facts in the search results, the answer is **{answer}**."
    if format_key == "json":
        return json.dumps({"answer": answer})
    return " ".join(facts) + f" So the answer is {answer}."


# Follow-up questions in several languages (language consistency): attribute -> lang -> (question, answer)
_FOLLOWUPS = {
    "en": {"q": "{name} {top} which date, according to the sources?",
           "a": "According to the sources, {fact}"},
    "fr": {"q": "Selon vos recherches, quelle est la date clé de {name} ?", "a": "D'après les sources, la date clé de {name} est {v}."},
    "es": {"q": "Según tus búsquedas, ¿cuál es la fecha clave de {name}?", "a": "Según las fuentes, la fecha clave de {name} es {v}."},
    "de": {"q": "Was ist laut deiner Suche das wichtige Datum von {name}?", "a": "Laut den Quellen ist das wichtige Datum von {name} {v}."},
}


class SFTBuilder:
    def __init__(self, tool: SearchTool, world: World, seed: int = 0):
        self.writer = TrajectoryWriter(tool)
        self.tool = tool
        self.world = world
        self.rng = random.Random(seed)
        self.format_keys = load_keyed("format_instructions_v1")
        self.dropped: list[dict] = []
        self._literal = {(world.name(f.subject)): f for f in world.facts if f.literal}

    def _base(self) -> list[dict]:
        return [{"role": "system", "content": SYSTEM_PROMPT}]

    def _followup(self, messages: list[dict], name: str, lang: str) -> None:
        """One more user turn about `name`'s date attribute, answered after a real search."""
        fact = self._literal.get(name)
        if fact is None:
            raise StepFailed(f"no date attribute for {name}")
        attr = ATTRIBUTE_BY_NAME[fact.relation]
        sentence = attr.templates[0].format(s=name, v=fact.object)
        tpl = _FOLLOWUPS[lang]
        messages.append({"role": "user", "content": tpl["q"].format(name=name, top=attr.top)})
        self.writer.search_step(messages, f"I search for {name} {attr.desc}.", f"{name} {attr.desc}",
                                Claim(name, fact.relation, fact.object, True))
        messages.append({"role": "assistant", "content": tpl["a"].format(name=name, v=fact.object, fact=sentence)})

    def tool_example(self, rec: QARecord, turns: int, lang: str = "en") -> SFTExample:
        msgs = self._base()
        msgs.append({"role": "user", "content": rec.prompt})
        facts = self.writer.chain_turn(msgs, rec)
        key = (rec.metadata or {}).get("format_key")
        msgs.append({"role": "assistant", "content": render_answer(rec.answers[0], facts, key)})
        names = [c["subject"] for c in rec.chain] + [c["object"] for c in rec.chain if not c.get("literal")]
        for t in range(turns - 1):
            self._followup(msgs, names[t % len(names)], lang if t == turns - 2 else "en")
        kind = {1: "tool_single", 2: "tool_two_turn"}.get(turns, "tool_multi_turn")
        if lang != "en":
            kind = "language"
        elif key:
            kind = "format"
        return SFTExample(f"{rec.id}-t{turns}-{lang}", kind, msgs, [self.tool.spec],
                          metadata={"qa_id": rec.id, "answers": rec.answers, "turns": turns, "lang": lang})

    def abstention_example(self, i: int) -> SFTExample:
        """A question about an entity that does not exist: a real search finds nothing about it."""
        names = _Names(random.Random(10_000 + i))
        names.names = [e.name for e in self.world.entities.values()]
        names.words = {w for n in names.names for w in n.split()}
        etype = self.rng.choice(["person", "company", "book", "city"])
        name = names.make(etype)
        msgs = self._base()
        msgs.append({"role": "user", "content": f"What is known about the {ENTITY_TYPES[etype][0]} {name}?"})
        self.writer.search_step(msgs, f"I search for {name}.", name, None)
        if name in self.writer.last_results_text:
            raise StepFailed(f"invented name {name!r} occurs in the corpus")
        msgs.append({"role": "assistant", "content": ABSTAIN_TEXT.format(name=name)})
        return SFTExample(f"abstain-{i}", "abstention", msgs, [self.tool.spec], metadata={"name": name})

    def instruction_example(self, i: int) -> SFTExample:
        """Instruction following without search: deterministic rewrites with checkable constraints."""
        ents = self.rng.sample(sorted(e.name for e in self.world.entities.values()), 3)
        task = self.rng.choice(["upper", "bullets", "count", "reverse"])
        listed = ", ".join(ents)
        q, a = {
            "upper": (f"Rewrite this list in capital letters, keeping the commas: {listed}", listed.upper()),
            "bullets": (f"Turn this comma-separated list into a bullet list, one item per line: {listed}",
                        "\n".join(f"- {e}" for e in ents)),
            "count": (f"How many items are in this list? Reply with a digit only: {listed}", str(len(ents))),
            "reverse": (f"Write these items in reverse order, separated by ' | ': {listed}", " | ".join(reversed(ents))),
        }[task]
        msgs = self._base() + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return SFTExample(f"instr-{i}", "instruction", msgs, [self.tool.spec], metadata={"task": task})

    def build(self, records: list[QARecord], n_instruction: int, n_abstention: int, progress: bool = False) -> list[SFTExample]:
        """One example per record, cycling single/two/multi-turn and English/other-language follow-ups."""
        out = []
        langs = [l for l in _FOLLOWUPS if l != "en"]
        for i, rec in enumerate(tqdm(records, desc="sft: trajectories", disable=not progress)):
            turns = 1 + i % 3
            lang = langs[i % len(langs)] if turns > 1 and i % 2 else "en"
            try:
                out.append(self.tool_example(rec, turns, lang))
            except StepFailed as e:
                self.dropped.append({"id": rec.id, "reason": str(e)})
        for i in range(n_abstention):
            try:
                out.append(self.abstention_example(i))
            except StepFailed as e:
                self.dropped.append({"id": f"abstain-{i}", "reason": str(e)})
        out.extend(self.instruction_example(i) for i in range(n_instruction))
        return out
