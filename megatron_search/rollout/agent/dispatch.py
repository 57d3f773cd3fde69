"""Rollouts spread over engines: each job ends in the results once, or lost, never both (issue 25.1).

    results = await Dispatcher(agents, engine_of, health, max_attempts, concurrency).run(jobs)

A job is (agent index, AgentTask); the caller picks the first agent (GRPO: round-robin by task, so
a run without failures is unchanged). At most `concurrency` jobs run; while they do, `health`
heartbeats every serving engine. A job's attempts run one after the other, never two at once, so
at most one of them can produce its Rollout. An attempt ends one of three ways:
  a Rollout            the job's result
  its engine is down   a heartbeat failed (the attempt is cancelled, with every other attempt on
                       that engine), or the attempt failed and a probe of the engine right after
                       failed too: the job runs again, same task and seed, on the serving engine
                       with the fewest attempts in flight, up to `max_attempts` engines in all
  it failed, the engine answers probes
                       the job is lost: a request a healthy engine refuses (an error status, a
                       malformed reply, a timeout of the request itself) is not retried elsewhere
A job whose agent is not on a health-managed engine (engine_of None: sglang-router, which places
requests itself; a reference engine) gets one attempt. With no engine serving, a job is lost.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from megatron_search.rollout.agent.loop import AgentTask, SearchAgent
from megatron_search.rollout.engine.base import EngineError
from megatron_search.rollout.engine.health import UP, EngineHealth
from megatron_search.rollout.engine.types import Rollout


@dataclass
class JobResult:
    """A job's Rollout, or why it was lost; `agents`: the agent of each attempt, in order."""

    rollout: Optional[Rollout]
    agents: list[int] = field(default_factory=list)
    error: Optional[BaseException] = None

    @property
    def retries(self) -> int:
        return max(len(self.agents) - 1, 0)


class Dispatcher:
    def __init__(self, agents: Sequence[SearchAgent], engine_of: Sequence[Optional[int]],
                 health: Optional[EngineHealth], max_attempts: int, concurrency: int):
        if len(agents) != len(engine_of):
            raise ValueError(f"{len(agents)} agents but {len(engine_of)} engine_of entries")
        if max_attempts < 1 or concurrency < 1:
            raise ValueError(f"max_attempts and concurrency must be >= 1, got {max_attempts}, {concurrency}")
        self.agents, self.engine_of, self.health = list(agents), list(engine_of), health
        self.max_attempts, self.concurrency = max_attempts, concurrency
        self._running: dict[int, set[asyncio.Task]] = {}  # engine -> attempts in flight there
        if health is not None:
            health.on_down(self._engine_down)

    async def run(self, jobs: Sequence[tuple[int, AgentTask]],
                  on_done: Optional[Callable[[JobResult], None]] = None) -> list[JobResult]:
        """Every job's result, in job order."""
        for a, _ in jobs:
            if not 0 <= a < len(self.agents):
                raise ValueError(f"job for agent {a}: there are {len(self.agents)} agents")
        gate = asyncio.Semaphore(self.concurrency)
        managed = self.health is not None and any(e is not None for e in self.engine_of)
        monitor = asyncio.ensure_future(self.health.monitor()) if managed else None

        async def job(agent: int, task: AgentTask) -> JobResult:
            async with gate:
                out = await self._job(agent, task)
            if on_done is not None:
                on_done(out)
            return out

        try:
            return list(await asyncio.gather(*(job(a, t) for a, t in jobs)))
        finally:
            if monitor is not None:
                monitor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await monitor

    async def _job(self, agent: int, task: AgentTask) -> JobResult:
        tried: list[int] = []
        if not self._serving(agent):
            agent = self._pick(exclude=None)
            if agent is None:
                return JobResult(None, tried, EngineError("no engine is serving"))
        while True:
            tried.append(agent)
            engine = self.engine_of[agent]
            attempt = asyncio.ensure_future(self.agents[agent].run(task))
            if engine is not None:
                self._running.setdefault(engine, set()).add(attempt)
            try:
                return JobResult(await attempt, tried)
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling() or not attempt.cancelled():
                    raise  # the job itself was cancelled
                error: BaseException = EngineError(f"engine {engine} went down: {self.health.reason[engine]}")
            except Exception as e:
                error = e
                if engine is None or not await self._engine_failed(engine, e):
                    return JobResult(None, tried, e)
            finally:
                if engine is not None:
                    self._running[engine].discard(attempt)
            nxt = self._pick(exclude=engine)
            if len(tried) >= self.max_attempts or nxt is None:
                return JobResult(None, tried, error)
            agent = nxt

    # ------------------------------------------------------------------ engines
    def _serving(self, agent: int) -> bool:
        e = self.engine_of[agent]
        return e is None or self.health is None or self.health.state[e] == UP

    def _pick(self, exclude: Optional[int]) -> Optional[int]:
        """The managed agent on a serving engine (not `exclude`) with the fewest attempts in flight."""
        live = [a for a, e in enumerate(self.engine_of)
                if e is not None and e != exclude and self.health is not None and self.health.state[e] == UP]
        return min(live, key=lambda a: (len(self._running.get(self.engine_of[a], ())), a), default=None)

    async def _engine_failed(self, engine: int, error: BaseException) -> bool:
        """After an attempt failed on `engine`: is the engine down (already marked, or a probe now fails)?"""
        if self.health is None:
            return False
        if self.health.state[engine] == UP:
            why = await self.health.probe(engine)
            if why and self.health.state[engine] == UP:
                self.health.mark_down(engine, f"{type(error).__name__}: {error}; then {why}")
        return self.health.state[engine] != UP

    def _engine_down(self, engine: int) -> None:
        for attempt in list(self._running.get(engine, ())):
            attempt.cancel()
