"""Rank 0's side of a GRPO step: engines, search agents, reference answers, preference scores.

The driver owns everything that talks to rollout engines. It runs on the first training rank
(the other ranks wait for the packed batch), with one asyncio loop for its lifetime so the
in-process CPU engine's scheduler and the HTTP clients live on one loop.

Engines come from rollout/launch.py's `start_engines` (attach to `engine_urls`, or start local CPU
engine servers or SGLang servers, optionally behind sglang-router): every one is an HTTP client of
the same API. Rollouts are spread over the generation endpoints round-robin by task; weight
updates go to every server.

Engine failures (issue 25.1; docs/ROLLOUT.md, "Failure model"): rollout/engine/health.py keeps each
engine's state and heartbeats, rollout/agent/dispatch.py runs every job (training rollouts, reference
answers, held-out evaluation) so that it ends in the results once or is counted lost; a rollout whose
engine went down runs again on a live engine with the same task and seed. Down engines are restarted
(or waited for) at `recover_engines`, before each weight update, and serve again once it reached them.
Every training rollout's attempts go to <output_dir>/rollout_dispatch.jsonl.

Reference answers (RECIPE 5.1: s compares each rollout with the reference model's answer to the
same prompt; 5.2: its length anchors the rollout's) are G per prompt: rollout k of a group is
compared with reference sample k (its own seed), so the group's reference lengths vary and every
branch of the length penalty can fire. They are generated once per (prompt, k) and cached in
<output_dir>/reference_answers.jsonl (rm/service.py's ReferenceCache), so a resumed run reuses them. They come from a frozen reference
engine holding the initial policy (grpo.reference_urls, or an in-process one for small models), or,
with grpo.reference_source=rollout_engines, from the rollout engines themselves: every prompt of the
run is answered up front, while those engines still hold the initial policy, and a prompt missing
from the cache later is an error (the engines have moved on).
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from tqdm import tqdm

from megatron_search.chat.format import ChatFormat
from megatron_search.chat.tokenizer import ChatEncoder, load_tokenizer
from megatron_search.data.llm_client import LLMClient
from megatron_search.data.mix import MixItem
from megatron_search.data.rubrics import RubricJudge
from megatron_search.rewards.answer import qa_reward
from megatron_search.rewards.preference import ReferenceAnswer
from megatron_search.rm.service import ReferenceCache, reference_seed
from megatron_search.rollout.agent.dispatch import Dispatcher, JobResult
from megatron_search.rollout.agent.loop import AgentSettings, AgentTask, SearchAgent
from megatron_search.rollout.engine.base import Engine
from megatron_search.rollout.engine.health import EngineHealth
from megatron_search.rollout.engine.types import Rollout
from megatron_search.search.tool import SearchTool

from .scoring import rubric_jobs


def build_encoder(model) -> ChatEncoder:
    """The token encoder of a ModelConfig: its tokenizer and chat style."""
    return ChatEncoder(load_tokenizer(model.tokenizer), ChatFormat(style=model.chat_style))


@dataclass
class Collected:
    """Rollouts of one step, flattened group by group (group ids contiguous from 0)."""

    items: list[MixItem]  # the prompt item of each rollout
    rollouts: list[Rollout]
    group_ids: list[int]
    samples: list[int]  # k of each rollout within its group (0..G-1, kept when others failed)
    failed: int  # rollouts lost (their groups are ragged): kept + failed = prompts x G
    retried: int = 0  # attempts run again on another engine after theirs went down


class RolloutDriver:
    def __init__(self, cfg, output_dir: Path, engines, reference: Optional[Engine]):
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self.encoder = build_encoder(cfg.model)
        self.tool = SearchTool.from_config(cfg.search)
        settings = AgentSettings.for_training(cfg.rollout, cfg.grpo.wants_routed_experts())
        self.rollout_engines = engines  # rollout.launch.RolloutEngines
        self.engines = list(engines.clients)
        self.health = EngineHealth(engines, cfg.rollout.health)
        self.agents = [SearchAgent(e, self.encoder, self.tool, settings) for e in engines.for_generation()]
        self.reference = None if reference is None else SearchAgent(
            reference, self.encoder, self.tool, AgentSettings.for_training(cfg.rollout))  # answers only
        # agent i runs on engine i; behind sglang-router (one agent) the router places requests itself
        engine_of = list(range(len(self.agents))) if engines.router is None else [None]
        extra = [] if self.reference is None else [self.reference]
        self.dispatcher = Dispatcher(self.agents + extra, engine_of + [None] * len(extra), self.health,
                                     cfg.rollout.health.max_attempts, cfg.rollout.concurrency)
        self.dispatch_log = output_dir / "rollout_dispatch.jsonl"
        self.reference_engine = reference
        self.references_frozen = False  # rollout_engines: the engines no longer hold the initial policy
        self.references = ReferenceCache(output_dir / "reference_answers.jsonl", self._generate_references)
        jc, rc = cfg.reward.rubric_judge, cfg.data.rubric
        self.judge = None if jc is None else RubricJudge(LLMClient.from_config(jc), rc.prompt_version, rc.max_tokens)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    # ------------------------------------------------------------------ rollouts
    async def _gather(self, jobs: Sequence[tuple[int, AgentTask]], desc: str) -> list[JobResult]:
        """Every job (agent index, task) run by the dispatcher: its Rollout or why it was lost, in job order."""
        bar = tqdm(total=len(jobs), desc=desc, unit="rollout", leave=False, disable=not self.cfg.logging.progress_bars)
        try:
            return await self.dispatcher.run(jobs, on_done=lambda _: bar.update(1))
        finally:
            bar.close()

    def _reference_agent(self) -> int:
        return len(self.agents)

    def collect(self, items: Sequence[MixItem], step: int) -> Collected:
        """G rollouts per item; lost ones (rollout/agent/dispatch.py: after any retries) are left out and counted."""
        g = self.cfg.grpo.group_size
        jobs = []
        for j, item in enumerate(items):
            for k in range(g):
                seed = (self.cfg.run.seed * 1_000_003 + step) * 100_003 + j * g + k
                agent = (j * g + k) % len(self.agents)
                jobs.append((agent, AgentTask(item.messages, seed=seed, metadata={"id": item.id, "kind": item.kind})))
        done = self.run(self._gather(jobs, f"rollouts step {step}"))
        self._log_dispatch(step, jobs, done)
        results = [d.rollout if d.rollout is not None else d.error for d in done]
        out = Collected([], [], [], [], 0, retried=sum(d.retries for d in done))
        group = -1
        for j, item in enumerate(items):
            kept = [(k, r) for k, r in enumerate(results[j * g:(j + 1) * g]) if isinstance(r, Rollout)]
            out.failed += g - len(kept)
            if not kept:
                continue
            group += 1
            out.items += [item] * len(kept)
            out.rollouts += [r for _, r in kept]
            out.samples += [k for k, _ in kept]
            out.group_ids += [group] * len(kept)
        return out

    def _log_dispatch(self, step: int, jobs, done: Sequence[JobResult]) -> None:
        """One line per training rollout: its seed, the engine of each attempt, and whether it was lost (and why)."""
        engine_of = self.dispatcher.engine_of
        with open(self.dispatch_log, "a") as f:
            for j, ((_, task), d) in enumerate(zip(jobs, done)):
                row = {"step": step, "job": j, "seed": task.seed, "engines": [engine_of[a] for a in d.agents],
                       "lost": d.rollout is None}
                if d.rollout is None:
                    row["error"] = f"{type(d.error).__name__}: {d.error}"[:300]
                f.write(json.dumps(row) + "\n")

    # ------------------------------------------------------------------ engine recovery
    def recover_engines(self) -> dict[int, int]:
        """Before a weight update: down engines restarted (ours) or waited for (attached); {engine: incarnation}
        of every engine the update must reach."""
        return self.run(self.health.recover())

    def engines_synced(self, engines) -> None:
        """The update reached these engines: restarted ones serve again."""
        self.health.synced(engines)

    # ------------------------------------------------------------------ reference answers
    def _generate_references(self, prompts: list[list[dict]], samples: list[int]) -> list[ReferenceAnswer]:
        if self.reference is None and self.references_frozen:
            raise RuntimeError(f"reference answers for {len(prompts)} prompt(s) are not in the cache, and the rollout "
                               f"engines no longer hold the initial policy (grpo.reference_source=rollout_engines "
                               f"answers every prompt of the run before the first update)")
        seeds = [reference_seed(self.cfg.run.seed, k) for k in samples]
        if self.reference is not None:
            jobs = [(self._reference_agent(), AgentTask(p, seed=s)) for p, s in zip(prompts, seeds)]
        else:  # the rollout engines, still holding the initial policy
            jobs = [(i % len(self.agents), AgentTask(p, seed=s)) for i, (p, s) in enumerate(zip(prompts, seeds))]
        out = []
        for p, d in zip(prompts, self.run(self._gather(jobs, "reference answers"))):
            if d.rollout is None:
                raise RuntimeError(f"reference rollout failed for prompt {p[-1].get('content', '')[:80]!r}: "
                                   f"{d.error!r}")
            out.append(ReferenceAnswer(d.rollout.final_answer or "", d.rollout.num_model_tokens))
        return out

    def pregenerate_references(self, items: Sequence[MixItem], fresh: bool) -> int:
        """rollout_engines: answer every prompt the run will use G times now (fresh run), or check the cache
        holds them all (resumed run); afterwards a missing one is an error. Returns the answers generated."""
        g = self.cfg.grpo.group_size
        prompts = [it.messages for it in items for _ in range(g)]
        samples = [k for _ in items for k in range(g)]
        before = self.references.generated
        if fresh:
            self.references.get(prompts, samples)
        self.references_frozen = True
        if not fresh:
            self.references.get(prompts, samples)  # raises if any is missing
        return self.references.generated - before

    def reference_answers(self, items: Sequence[MixItem], samples: Sequence[int]) -> list[ReferenceAnswer]:
        """Reference sample samples[i] for items[i] (each generated once, cached on disk)."""
        return self.references.get([it.messages for it in items], samples)

    # ------------------------------------------------------------------ held-out evaluation
    def evaluate(self, items: Sequence[MixItem]) -> dict[str, float]:
        """One rollout per held-out QA item on the rollout engines (the policy just pushed), seeded alike at
        every evaluation so the curve compares like with like: accuracy (reward.answer_match), effective
        tool calls (calls minus failed executions) and the share without a final answer."""
        jobs = [(i % len(self.agents), AgentTask(it.messages, seed=self.cfg.run.seed * 7_919 + i))
                for i, it in enumerate(items)]
        results = [d.rollout if d.rollout is not None else d.error
                   for d in self.run(self._gather(jobs, "held-out evaluation"))]
        done = [(it, r) for it, r in zip(items, results) if isinstance(r, Rollout)]
        if not done:
            raise RuntimeError(f"every held-out evaluation rollout failed; first error: {results[0]!r}")
        n = len(done)
        return {"eval/accuracy": sum(qa_reward(r.final_answer, it.answers, mode=self.cfg.reward.answer_match)
                                     for it, r in done) / n,
                "eval/effective_calls": sum(r.tool_calls - r.failed_executions for _, r in done) / n,
                "eval/no_answer": sum(r.final_answer is None for _, r in done) / n,
                "eval/failed": float(len(items) - n)}

    # ------------------------------------------------------------------ rubric judge
    def judge_rubrics(self, items: Sequence[MixItem], rollouts: Sequence[Rollout]) -> tuple[dict, dict[str, float]]:
        """The judge's verdicts for every rubric rollout with an answer ({rollout index: per-rubric verdicts})
        and counts; without reward.rubric_judge nothing is judged here (scoring then grades mechanically)."""
        index, jobs = rubric_jobs(items, rollouts)
        if self.judge is None or not jobs:
            return {}, {}
        batch = self.run(self.judge.grade_many(jobs))
        return dict(zip(index, batch.verdicts)), {
            "reward/rubric_judge_calls": float(batch.calls), "reward/rubric_judged": float(batch.judged),
            "reward/rubric_mechanical": float(batch.mechanical), "reward/rubric_judge_malformed": float(batch.malformed)}

    def close(self) -> None:
        try:
            if self.judge is not None:
                self.run(self.judge.client.close())
            self.run(self.rollout_engines.aclose())
            if self.reference_engine is not None:
                self.run(self.reference_engine.close())
        finally:
            self.rollout_engines.stop_servers()
            self.loop.close()
