"""Running eval episodes: the budget protocol b = 0..10 and the deployment-metric variants.

Budget protocol (RECIPE 8): for each budget b the system prompt states the hard limit (the
agent renders chat_format.budget_instruction(b)) and the search tool session enforces it (a call
beyond b is rejected as over_budget and counted); b = 0 is parametric knowledge only. One run
covers every b, so the whole curve comes from one command.

Variants (the `variant` field of a result): "budget" (the sweep, one result per b), "standard"
(RECIPE 8's default protocol: no budget stated in the prompt, which is then the training prompt, and
at most eval.max_calls calls enforced by the tool), "abstention" (evidence withheld from the index,
default call limit), "tool_choice_none" (tools listed but disabled; any call is a broken
tool_choice_none call).

With eval.samples = k > 1 every (example, variant, b) runs k episodes with their own sampling seeds
(the `sample` field, 0..k-1); the report's means are over all of them (avg@k), which narrows the
sampling noise of a small set (sample 0 keeps the seed a single-sample run uses).

Tokens per example, as a provider would bill them without prompt caching: tokens_in sums the
input length of every model turn (the whole transcript so far), tokens_out the sampled tokens.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from tqdm import tqdm

from megatron_search.rollout.agent.loop import AgentTask, SearchAgent
from megatron_search.rollout.engine.base import EngineError
from megatron_search.rollout.engine.types import Rollout

from .benchmarks import EvalExample
from .results import ResultStore, result_key

log = logging.getLogger(__name__)
VARIANTS = ("budget", "standard", "abstention", "tool_choice_none")


@dataclass(frozen=True)
class EvalJob:
    example: EvalExample
    variant: str = "budget"
    budget: Optional[int] = None  # None: the tool's default call limit (eval.max_calls)
    tool_choice: str = "auto"
    sample: int = 0  # which of the eval.samples episodes of this example

    def key(self, model: str) -> str:
        return result_key(model, self.example.benchmark, self.variant, self.budget, self.example.id, self.sample)


def budget_jobs(examples: Sequence[EvalExample], budgets: Sequence[int], samples: int = 1) -> list[EvalJob]:
    if any(b < 0 for b in budgets):
        raise ValueError(f"budgets must be >= 0, got {list(budgets)}")
    return [EvalJob(e, "budget", b, sample=k) for b in budgets for e in examples for k in range(samples)]


def variant_jobs(examples: Sequence[EvalExample], variant: str, samples: int = 1,
                 tool_choice: str = "auto") -> list[EvalJob]:
    """Jobs of a variant without a budget sweep (the tool's default call limit), `samples` per example."""
    return [EvalJob(e, variant, None, tool_choice, k) for e in examples for k in range(samples)]


def example_seed(seed: int, job: EvalJob) -> int:
    """A per-example (and per-sample) sampling seed, stable across runs and resumes."""
    extra = f":{job.sample}" if job.sample else ""
    h = hashlib.sha256(f"{seed}:{job.example.benchmark}:{job.example.id}:{job.variant}:{job.budget}{extra}".encode())
    return int.from_bytes(h.digest()[:4], "big") >> 1


def rollout_tokens(r: Rollout) -> tuple[int, int]:
    """(tokens_in, tokens_out) as billed without caching (module docstring)."""
    model = [s for s in r.segments if s.source == "model"]
    return sum(s.start for s in model), sum(s.end - s.start for s in model)


def result_row(model: str, job: EvalJob, r: Rollout, grade) -> dict:
    t_in, t_out = rollout_tokens(r)
    ex = job.example
    return {
        "model": model, "benchmark": ex.benchmark, "variant": job.variant, "budget": job.budget, "id": ex.id,
        "tool_choice": job.tool_choice, "sample": job.sample, "question": ex.question, "answers": list(ex.answers),
        "prediction": r.final_answer, "stop_reason": r.stop_reason, **grade.to_dict(),
        "tool_calls": r.tool_calls, "failed_calls": r.failed_executions, "broken": dict(r.broken_calls),
        "queries": list(r.metadata.get("queries", [])), "turns": sum(s.source == "model" for s in r.segments),
        "tokens_in": t_in, "tokens_out": t_out,
    }


def messages_for(example: EvalExample, system_prompt: Optional[str]) -> list[dict]:
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return msgs + [{"role": "user", "content": example.question}]


async def run_jobs(model: str, agent: SearchAgent, grader, jobs: Sequence[EvalJob], store: ResultStore,
                   system_prompt: Optional[str], seed: int = 0, progress: bool = True) -> dict:
    """Run every job whose result is not yet in `store`; each result is appended as soon as it is graded.

    Returns {"done": new results, "skipped": already recorded, "errors": [messages]}. An engine
    error loses only that example (reported, not recorded, so a re-run retries it).
    """
    pending = [j for j in jobs if j.key(model) not in store]
    errors: list[str] = []
    gate = asyncio.Semaphore(agent.settings.concurrency)
    bar = tqdm(total=len(pending), desc=f"eval {model}", unit="ex", disable=not progress)
    done = 0

    async def one(job: EvalJob) -> None:
        nonlocal done
        async with gate:
            task = AgentTask(messages_for(job.example, system_prompt), budget=job.budget, tool_choice=job.tool_choice,
                             seed=example_seed(seed, job), metadata={"id": job.example.id})
            try:
                r = await agent.run(task)
            except EngineError as e:
                errors.append(f"{job.example.benchmark}/{job.example.id} b={job.budget} {job.variant}: {e}")
                bar.update(1)
                return
            grade = await grader.grade(job.example.benchmark, job.example.question, job.example.answers,
                                       r.final_answer)
            store.add(result_row(model, job, r, grade))
            done += 1
            bar.update(1)

    try:
        await asyncio.gather(*(one(j) for j in pending))
    finally:
        bar.close()
    for e in errors[:10]:
        log.warning("eval: %s", e)
    return {"done": done, "skipped": len(jobs) - len(pending), "errors": errors}
