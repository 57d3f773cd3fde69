"""Which rollout engines serve, their heartbeats, and bringing a failed one back (issue 25.1).

Every engine (one server, `RolloutEngines.clients[i]`) is in one of three states:
  up     serving the current weights: rollouts go there and heartbeats probe it
  down   it missed a heartbeat (no answer to /health_generate within rollout.health.heartbeat_timeout_s),
         or a request to it failed and a probe right after failed too: nothing is sent to it
  stale  running again (restarted, or an attached engine answering again) without the current
         weights: it receives the next weight update, and is up once that update has reached it
A down engine comes back at the next recovery point (`recover`, run before every weight update, as
slime recovers its engines before each update): one this job started is killed (whatever is left of
it) and started again at the same URL, at most rollout.health.max_restarts times a run; one it only
attached to (rollout.engine_urls) is waited for, up to rollout.health.reattach_timeout_s. An engine
still down after its recovery is `unrecovered` (lost capacity, bounded by
rollout.health.max_lost_capacity). `incarnation[i]` counts engine i's returns, so whoever keeps state in
an engine process (a weight-update group, released memory) can tell the new process from the old.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from megatron_search.rollout.engine.base import EngineError

log = logging.getLogger(__name__)

UP, DOWN, STALE = "up", "down", "stale"


class EngineHealth:
    """Health state of `engines.clients` (a rollout.launch.RolloutEngines), driven from one asyncio loop."""

    def __init__(self, engines, settings):
        self.engines = engines
        self.settings = settings  # config.rollout.EngineHealthConfig
        n = len(engines.clients)
        self.state = [UP] * n
        self.incarnation = [0] * n
        self.restarts = [0] * n
        self.unrecovered: set[int] = set()
        self.reason: list[str] = [""] * n
        self._on_down: list[Callable[[int], None]] = []
        self.counts = {"restarts": 0, "marked_down": 0, "restart_failures": 0}  # since take_counts

    def __len__(self) -> int:
        return len(self.state)

    # ------------------------------------------------------------------ state
    def serving(self) -> list[int]:
        return [i for i, s in enumerate(self.state) if s == UP]

    def on_down(self, fn: Callable[[int], None]) -> None:
        """`fn(i)` is called when engine i is marked down (the dispatcher cancels what runs there)."""
        self._on_down.append(fn)

    def mark_down(self, i: int, why: str) -> None:
        if self.state[i] == DOWN:
            return
        self.state[i], self.reason[i] = DOWN, why
        self.counts["marked_down"] += 1
        log.warning("engine %d (%s) is down: %s", i, self.engines.clients[i].base_url, why)
        for fn in list(self._on_down):
            fn(i)

    def synced(self, engines) -> None:
        """A weight update reached these engines: the stale ones among them serve again."""
        for i in engines:
            if self.state[i] == STALE:
                self.state[i] = UP

    def lost_share(self) -> float:
        """The share of engines still down after their recovery."""
        return len(self.unrecovered) / max(len(self.state), 1)

    def take_counts(self) -> dict[str, float]:
        """Events since the last call (TensorBoard engine/marked_down, engine/restarts, engine/restart_failures)."""
        out = {f"engine/{k}": float(v) for k, v in self.counts.items()}
        self.counts = dict.fromkeys(self.counts, 0)
        return out

    def gauges(self) -> dict[str, float]:
        """The state now: engines down, of which unrecovered (engine/down, engine/unrecovered), restarts in all."""
        return {"engine/down": float(self.state.count(DOWN)), "engine/unrecovered": float(len(self.unrecovered)),
                "engine/restarts_total": float(sum(self.restarts))}

    # ------------------------------------------------------------------ probes
    async def probe(self, i: int, generate: bool = True) -> str:
        """'' if engine i answers within the heartbeat timeout, else why not. generate: /health_generate (the
        scheduler produces tokens); otherwise /health (the server is up: used while its KV cache may be released)."""
        client = self.engines.clients[i]
        timeout = self.settings.heartbeat_timeout_s
        try:
            if generate:
                await asyncio.wait_for(client.health_generate(), timeout)
            elif not await asyncio.wait_for(client.health(), timeout):
                return "GET /health did not answer 200"
            return ""
        except asyncio.TimeoutError:
            return f"no heartbeat answer within {timeout:g} s"
        except EngineError as e:
            return f"heartbeat failed: {e}"

    async def heartbeat(self) -> None:
        """Probe every serving engine once, concurrently; a failed probe marks that engine down."""
        up = self.serving()
        for i, why in zip(up, await asyncio.gather(*(self.probe(i) for i in up))):
            if why and self.state[i] == UP:
                self.mark_down(i, why)

    async def monitor(self) -> None:
        """Heartbeats every rollout.health.heartbeat_interval_s until cancelled."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            await self.heartbeat()

    # ------------------------------------------------------------------ recovery
    async def recover(self) -> dict[int, int]:
        """Before a weight update: serving engines probed (/health), down ones restarted or waited for. Returns
        {engine: incarnation} of every engine the update must reach (up and stale)."""
        up = self.serving()
        for i, why in zip(up, await asyncio.gather(*(self.probe(i, generate=False) for i in up))):
            if why:
                self.mark_down(i, why)
        down = [i for i, s in enumerate(self.state) if s == DOWN]
        await asyncio.gather(*(self._bring_back(i) for i in down))
        return {i: self.incarnation[i] for i, s in enumerate(self.state) if s != DOWN}

    async def _bring_back(self, i: int) -> None:
        url = self.engines.clients[i].base_url
        if self.engines.started(i):
            if self.restarts[i] >= self.settings.max_restarts:
                self.unrecovered.add(i)
                log.error("engine %d (%s) stays down: restarted %d times (rollout.health.max_restarts)", i, url,
                          self.restarts[i])
                return
            self.restarts[i] += 1
            self.counts["restarts"] += 1
            t0 = time.perf_counter()
            try:
                await asyncio.to_thread(self.engines.restart, i)
            except Exception as e:  # the restart failed: the engine stays down, the next recovery tries again
                self.counts["restart_failures"] += 1
                self.unrecovered.add(i)
                log.error("engine %d (%s): restart %d failed: %s", i, url, self.restarts[i], e)
                return
            log.warning("engine %d (%s) restarted in %.1f s (restart %d); it serves again after the weight update",
                        i, url, time.perf_counter() - t0, self.restarts[i])
        elif not await self._answers_again(i):
            self.unrecovered.add(i)
            log.error("attached engine %d (%s) still down after %g s (rollout.health.reattach_timeout_s)", i, url,
                      self.settings.reattach_timeout_s)
            return
        await self.engines.clients[i].close()  # no pooled connection to the old process survives
        self.unrecovered.discard(i)
        self.incarnation[i] += 1
        self.state[i] = STALE

    async def _answers_again(self, i: int) -> bool:
        deadline = time.monotonic() + self.settings.reattach_timeout_s
        while True:
            if not await self.probe(i, generate=False):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(1.0, self.settings.reattach_timeout_s))
