"""LLM-backed variants of the sequential-expansion steps (RECIPE 4.1) for corpora not written in
the world's template language (the open web): claim extraction, nested-question writing, and a
search solver, all through LLMClient (cached, retried) with versioned prompts. They plug into the
same stages as the offline backend: `LLMExtractor` replaces extract.extract_claims inside Evidence,
`llm_question` replaces question.render, `llm_solve` replaces solver.solve.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine

from ...search.tool import format_results
from ..llm_client import LLMClient, LLMOutputError
from ..prompts import load_prompt
from ..world_schema import ATTRIBUTES, RELATIONS
from .evidence import SearchLike
from .extract import Claim
from .solver import SolverResult


class SyncRunner:
    """Runs coroutines on one private event loop thread, so sync stages can call the async client."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def _relations_listing() -> str:
    rel = [f"- {r.name}: {r.subj} -> {r.obj}" for r in RELATIONS]
    att = [f"- {a.name}: {a.subj} -> value" for a in ATTRIBUTES]
    return "\n".join(rel + att)


class LLMExtractor:
    """Claim extraction by an LLM; a callable text -> list[Claim] for Evidence(extractor=...)."""

    def __init__(self, client: LLMClient, runner: SyncRunner, version: str = "v1", relations: str | None = None):
        self.client, self.runner = client, runner
        self.prompt = load_prompt(f"claims_extract_{version}")
        self.relations = relations or _relations_listing()
        self.errors: list[str] = []

    async def aextract(self, text: str) -> list[Claim]:
        msg = self.prompt.format(relations=self.relations, document=text)
        out = await self.client.chat_json([{"role": "user", "content": msg}], required={"claims": list})
        claims = []
        for i, c in enumerate(out["claims"]):
            if not (isinstance(c, dict) and all(isinstance(c.get(k), str) and c.get(k).strip()
                                                for k in ("subject", "relation", "object"))):
                raise LLMOutputError(f"claim {i} needs non-empty strings subject/relation/object, got {c!r:.120}")
            literal = bool(c.get("literal", False)) or c["relation"] == "is_a"
            claims.append(Claim(c["subject"].strip(), c["relation"].strip(), c["object"].strip(), literal))
        return claims

    def __call__(self, text: str) -> list[Claim]:
        try:
            return self.runner.run(self.aextract(text))
        except LLMOutputError as e:  # an unreadable reply loses this document's claims, recorded
            self.errors.append(str(e))
            return []


async def llm_question(client: LLMClient, answer_type: str, claims: list[dict], entities: list[str],
                       version: str = "v1") -> str:
    """A name-free nested question written by the LLM; LLMOutputError when it leaks a chain entity."""
    listing = "\n".join(f"- {c['subject']} | {c['relation']} | {c['object']}" for c in claims)
    out = await client.chat_json([{"role": "user", "content": load_prompt(f"question_write_{version}").format(
        answer_type=answer_type, claims=listing)}], required={"question": str})
    q = out["question"].strip()
    leaked = [n for n in entities if n.lower() in q.lower()]
    if leaked:
        raise LLMOutputError(f"question names chain entities {leaked}: {q!r}")
    return q


async def llm_solve(client: LLMClient, question: str, search: SearchLike, name: str, max_calls: int = 5,
                    k: int = 10, temperature: float = 0.6, sample_index: int = 0, version: str = "v1") -> SolverResult:
    """A search agent over chat completions: JSON actions (search / answer), real search results fed back.
    Independent solvers differ by sample_index (separate samples, separate cache entries)."""
    messages = [{"role": "system", "content": load_prompt(f"solver_{version}").format(max_calls=max_calls)},
                {"role": "user", "content": question}]
    queries: list[str] = []
    for _ in range(max_calls + 1):
        try:
            act = await client.chat_json(messages, required={"action": str}, temperature=temperature,
                                         sample_index=sample_index)
        except LLMOutputError as e:
            return SolverResult(name, [], queries, f"unreadable action: {e}")
        messages.append({"role": "assistant", "content": str(act)})
        if act["action"] == "answer" and isinstance(act.get("answer"), str) and act["answer"].strip():
            return SolverResult(name, [act["answer"].strip()], queries)
        if act["action"] != "search" or not isinstance(act.get("query"), str):
            return SolverResult(name, [], queries, f"invalid action {act!r:.100}")
        if len(queries) >= max_calls:
            return SolverResult(name, [], queries, f"no answer within {max_calls} searches")
        queries.append(act["query"])
        messages.append({"role": "user", "content": format_results(act["query"], search.search(act["query"], k))})
    return SolverResult(name, [], queries, "no answer")
