"""The multi-turn search agent loop: many rollouts in flight, token in, token out.

One rollout: render the prompt once (system + search_web tool + budget sentence), then repeat:
the engine samples an assistant turn from the transcript ids; the turn's ids and the engine's
logprobs are appended (loss mask 1); its tool calls are parsed, classified and run by the
search tool session (budget, broken-call classes, c/e accounting); the tool responses are
tokenised ONCE and appended as ids (loss mask 0). The transcript is never re-tokenised, so the
trainer scores exactly the tokens the engine sampled.

Routed experts (routing replay): each turn asks only for the rows not yet held
(`routed_experts_start_len` = rows so far), so rows always cover positions [0, len - 1).

Stop reasons: answer (a turn without tool calls), length (a turn hit max_new_tokens),
unclosed_reasoning (stopped inside <think>), max_total_tokens, max_turns, abort (the engine
aborted the request, e.g. for a weight update), undecodable (sampled ids outside the tokenizer).
A rollout whose engine call fails is lost instead: `run` raises (an EngineError; a reply that
breaks the engine contract is a MalformedReply) and `run_many` stops or, with
`return_failures=True`, returns a classified `RolloutFailed` in its place (rollout/engine/failures.py).
Search failures never end a rollout; they are counted in `Rollout.search_failures`.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
from tqdm import tqdm

from megatron_search.chat.tokenizer import ChatEncoder
from megatron_search.rollout.engine.base import Engine, MalformedReply
from megatron_search.rollout.engine.failures import RolloutFailed
from megatron_search.rollout.engine.types import GenerateRequest, GenerateResult, Rollout, SamplingParams, Segment
from megatron_search.search.tool import SearchTool, ToolChoice


@dataclass(frozen=True)
class AgentTask:
    """One episode to roll out: the conversation so far plus per-episode tool limits."""

    messages: list[dict]
    budget: Optional[int] = None  # hard tool-call budget b (eval sweeps); None = search.max_calls
    tool_choice: ToolChoice = "auto"
    seed: Optional[int] = None
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class AgentSettings:
    """Sampling and length limits of the loop (from `rollout` in training, `eval` in evaluation)."""

    max_new_tokens: int = 1024
    max_total_tokens: int = 8192
    max_turns: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    concurrency: int = 64
    return_routed_experts: bool = False

    @classmethod
    def for_training(cls, rollout, routed_experts: bool = False) -> "AgentSettings":
        """From a RolloutConfig; `routed_experts`: ask the engine for each token's experts (GRPO's routing replay
        or agreement, GRPOConfig.wants_routed_experts)."""
        r = rollout
        return cls(r.max_new_tokens, r.max_total_tokens, r.max_turns, r.temperature, r.top_p, r.concurrency,
                   routed_experts)

    @classmethod
    def for_eval(cls, cfg) -> "AgentSettings":
        """RECIPE 8 defaults: eval.max_new_tokens (8192) output tokens, eval.temperature (0.6)."""
        r, e = cfg.rollout, cfg.eval
        return cls(e.max_new_tokens, max(r.max_total_tokens, e.max_new_tokens), r.max_turns, e.temperature,
                   r.top_p, r.concurrency, False)


class SearchAgent:
    """Runs search-agent episodes against an `Engine` with the `search_web` tool."""

    def __init__(self, engine: Engine, encoder: ChatEncoder, tool: SearchTool, settings: AgentSettings = AgentSettings()):
        if settings.max_new_tokens < 1 or settings.max_total_tokens < 2 or settings.max_turns < 1:
            raise ValueError(f"agent settings: need max_new_tokens >= 1, max_total_tokens >= 2, max_turns >= 1: {settings}")
        self.engine = engine
        self.encoder = encoder
        self.tool = tool
        self.settings = settings
        self.tools = [tool.spec]

    async def run_many(self, tasks: Sequence[AgentTask], progress: bool = True, desc: str = "rollouts",
                       return_failures: bool = False) -> list:
        """All tasks, at most `settings.concurrency` in flight; results in task order.

        A lost rollout either stops the batch (default: the others are cancelled and awaited, then its
        exception is raised) or, with `return_failures`, takes its place as a `RolloutFailed` (its class in
        `.kind`; `failures.failure_counts(results)` counts them). Nothing is left running on return."""
        gate = asyncio.Semaphore(self.settings.concurrency)
        bar = tqdm(total=len(tasks), desc=desc, unit="rollout", disable=not progress)

        async def one(i: int, task: AgentTask):
            async with gate:
                try:
                    return await self.run(task)
                except Exception as e:
                    if not return_failures:
                        raise
                    return RolloutFailed.wrap(i, e)
                finally:
                    bar.update(1)

        jobs = [asyncio.ensure_future(one(i, t)) for i, t in enumerate(tasks)]
        try:
            return list(await asyncio.gather(*jobs))
        finally:
            for j in jobs:
                j.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)  # no orphan keeps using the engine
            bar.close()

    async def run(self, task: AgentTask) -> Rollout:
        """One episode."""
        s = self.settings
        session = self.tool.session(task.budget, task.tool_choice)
        ids = self.encoder.prompt_ids(task.messages, self.tools, budget=task.budget, tool_choice=task.tool_choice)
        if len(ids) >= s.max_total_tokens:
            raise ValueError(f"agent: the prompt has {len(ids)} tokens, no room under max_total_tokens={s.max_total_tokens}")
        prompt_len = len(ids)
        logprobs = [0.0] * prompt_len
        mask = [0] * prompt_len
        segments = [Segment(0, prompt_len, "prompt")]
        expert_chunks: list[np.ndarray] = []
        expert_rows = 0
        messages = list(task.messages)
        final_answer, stop_reason = None, "max_turns"

        for turn in range(s.max_turns):
            sampling = SamplingParams(
                max_new_tokens=min(s.max_new_tokens, s.max_total_tokens - len(ids)),
                temperature=s.temperature, top_p=s.top_p, stop_token_ids=tuple(self.encoder.stop_ids),
                seed=None if task.seed is None else task.seed * 1000 + turn,
            )
            res = await self.engine.generate(GenerateRequest(
                list(ids), sampling, return_logprob=True, return_routed_experts=s.return_routed_experts,
                routed_experts_start_len=expert_rows,
            ))
            _check_turn(res, sampling.max_new_tokens)
            out = res.output_ids
            start = len(ids)
            ids += out
            logprobs += res.output_logprobs
            mask += [1] * len(out)
            segments.append(Segment(start, len(ids), "model", res.weight_version))
            if res.routed_experts_NLK is not None:
                expert_chunks.append(res.routed_experts_NLK)
                expert_rows += res.routed_experts_NLK.shape[0]
            try:
                parsed = self.encoder.parse_turn(out, self.tools)
            except ValueError:  # ids the tokenizer cannot decode (a model vocab padded past the tokenizer's)
                stop_reason = "undecodable"
                break
            messages.append({"role": "assistant", "content": parsed.text})
            if res.finish_reason.type == "abort":
                stop_reason = "abort"
                break
            if res.finish_reason.type == "length":
                stop_reason = "max_total_tokens" if len(ids) >= s.max_total_tokens else "length"
                break
            if not parsed.calls:
                final_answer = parsed.answer
                stop_reason = "answer" if parsed.answer is not None else "unclosed_reasoning"
                break
            results = await session.execute_all(parsed.calls)
            texts = [r.text for r in results]
            messages += [{"role": "tool", "content": t} for t in texts]
            tool_ids = self.encoder.tool_response_ids(texts, out)
            # The transcript always ends on a model turn (routed rows stay aligned): when no further
            # turn may follow, the calls still count (they were made) but their responses are not appended.
            if len(ids) + len(tool_ids) >= s.max_total_tokens:
                stop_reason = "max_total_tokens"
                break
            if turn == s.max_turns - 1:
                break
            segments.append(Segment(len(ids), len(ids) + len(tool_ids), "tool"))
            ids += tool_ids
            logprobs += [0.0] * len(tool_ids)
            mask += [0] * len(tool_ids)

        stats = session.stats
        experts = np.concatenate(expert_chunks, axis=0) if expert_chunks else None
        if experts is not None and experts.shape[0] != len(ids) - 1:
            # only an aborted request can come back without its rows; never hand misaligned rows on
            if stop_reason != "abort":
                raise MalformedReply(f"routed experts: the engine returned {experts.shape[0]} rows for {len(ids)} tokens")
            experts = None
        rollout = Rollout(
            prompt_len=prompt_len, token_ids=ids, logprobs=logprobs, loss_mask=mask, segments=segments,
            tool_calls=stats.calls, failed_executions=stats.failed, broken_calls=dict(stats.broken),
            final_answer=final_answer, stop_reason=stop_reason,
            routed_experts_NLK=experts,
            messages=messages, metadata=dict(task.metadata, queries=list(stats.queries)),
            search_failures=dict(stats.failed_kinds),
        )
        rollout.check()
        return rollout


def _check_turn(res: GenerateResult, max_new_tokens: int) -> None:
    """The engine contract the transcript relies on, whatever the engine: one finite logprob per sampled id,
    no more ids than asked for."""
    n = len(res.output_ids)
    if res.output_logprobs is None or len(res.output_logprobs) != n:
        got = "no" if res.output_logprobs is None else len(res.output_logprobs)
        raise MalformedReply(f"engine turn: {got} logprobs for {n} sampled ids")
    if not all(math.isfinite(lp) for lp in res.output_logprobs):
        raise MalformedReply("engine turn: a sampled token's logprob is not finite (NaN or infinity)")
    if n > max_new_tokens:
        raise MalformedReply(f"engine turn: {n} sampled ids for max_new_tokens={max_new_tokens}")
