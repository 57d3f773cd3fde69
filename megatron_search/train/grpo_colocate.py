"""Colocated GRPO: the engines and the trainer take turns on the same memory (rollout.mode=colocated).

Per step, in this order (the phases are logged to <output_dir>/colocate_phases.jsonl with the bytes
each side holds, and timed as time/release_s, time/resume_s, time/offload_s):
  rollout   the trainer's parameters, gradient buffers and optimizer state, and the reward model's
            parameters, are offloaded to host (train/offload.py); the engines hold weights and KV cache
            and generate
  scoring   once rollouts and reference answers are in, the engines release weights and KV cache
            (release_memory_occupation; they are idle: every rollout has finished) and the reward
            model comes back to score on the training ranks
  train     the reward model leaves again, the trainer's state comes back, the policy trains
  sync      gradients and optimizer state leave first (the export needs only the parameters), then the
            engines get their weight memory back (resume_memory_occupation(weights): contents
            undefined until pushed), the weight sync pushes the new policy, then the KV cache returns;
            the parameters leave at the next rollout phase
A step without signal trains nothing; its engines still come back before the push. The reward model
(as large as the policy, RECIPE 1, on the training ranks) is resident only while it scores.
Engines that are down (rollout/engine/health.py) are skipped; memory comes back only to the engine processes
that released it (a restarted engine holds its own), and an engine that fails a release or resume is
marked down, to be restarted before the push (train/grpo_run.py push_weights).
"""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from megatron_search.distributed import collectives as coll
from megatron_search.distributed.init import host_group
from megatron_search.plan.residency import (
    ENGINE_KV_CACHE,
    ENGINE_TAGS,
    ENGINE_WEIGHTS,
    POLICY_GRADS,
    POLICY_OPTIMIZER,
    POLICY_PARAMS,
    RM_PARAMS,
    Ledger,
)
from megatron_search.rollout.engine.base import EngineError
from megatron_search.rollout.engine.health import DOWN

from .offload import StateOffloader


async def paused_release(client, tags: list[str]) -> None:
    """pause (abort) -> release `tags` -> continue on one engine: SGLang asserts its scheduler is fully idle on a
    release (weight_updater.py; a cancelled attempt or the last probe may still be in it, waiting requests are
    ignored only while paused), and /ready answers 503 while paused; nothing is sent before the KV cache is back."""
    await client.pause_generation("abort")
    await client.release_memory_occupation(tags)
    await client.continue_generation()


class ColocatedCycle:
    def __init__(self, cfg, trainer, driver, out_dir: Path, is_driver: bool, reward_model_chunks=(),
                 ledger: Optional[Ledger] = None, released: Optional[dict[int, int]] = None):
        """`released`: engines the run released at start-up, before the trainer was built ({engine: incarnation});
        their memory comes back at the first push."""
        self.enabled = cfg.rollout.mode == "colocated"
        self.best_effort_timeout_s = cfg.rollout.health.heartbeat_timeout_s  # _release_down, per engine
        self.ledger = ledger if ledger is not None else Ledger()
        self.offloader = StateOffloader(list(trainer.ddp), trainer.optimizer, ledger=self.ledger, holders={
            "params": POLICY_PARAMS, "grads": POLICY_GRADS, "optimizer": POLICY_OPTIMIZER})
        self.rm = StateOffloader(list(reward_model_chunks), None, ledger=self.ledger,  # parameters only: it never
                                 holders={"params": RM_PARAMS})  # trains here
        self.driver, self.is_driver = driver, is_driver
        self.log = out_dir / "colocate_phases.jsonl"
        # engine -> incarnation of the process that released its memory
        self.released: dict[int, int] = dict(released or {})
        self.released_down: dict[int, int] = {}  # engines released while marked down (best effort, _release_down)
        self.metrics: dict[str, float] = {}

    @property
    def trainer_offloaded(self) -> bool:
        return self.offloader.offloaded

    # ------------------------------------------------------------------ phases
    def to_rollout(self, step: int) -> None:
        """Before rollouts: the trainer leaves the device (every rank)."""
        self.metrics = {}
        if self.enabled:
            with self._timed("time/offload_s"):
                self.offloader.offload()  # what is still resident: the parameters after a sync
                self.rm.offload(("params",))
            self._record(step, "rollout")
        self.ledger.moment("rollout", step)

    def to_scoring(self, step: int) -> None:
        """Rollouts and references done (every rank, before the reward model scores): the engines release."""
        if not self.enabled:
            return
        with self._timed("time/release_s"):
            self.released = self._release(["weights", "kv_cache"], self._serving())
            self._release_down()
        self._handover()  # every rank's engine memory is gone before any rank allocates
        with self._timed("time/offload_s"):
            self.rm.reload(("params",))
        self._record(step, "scoring")

    def to_train(self, step: int) -> None:
        """Before the policy step: the reward model leaves, the trainer's state returns."""
        if not self.enabled:
            return
        with self._timed("time/offload_s"):
            self.rm.offload(("params",))
            self.offloader.reload()
        self._record(step, "train")

    def to_sync(self, step: Optional[int]) -> None:
        """Before the weight push (`step` None: the initial one): gradients and optimizer state leave, the
        parameters are resident (the exporter reads them), and the engines' weight memory comes back (the push
        fills it)."""
        if not self.enabled:
            return
        with self._timed("time/offload_s"):
            self.rm.offload(("params",))  # a step without signal went from scoring straight here
            self.offloader.offload(("grads", "optimizer"))
            self.offloader.reload(("params",))  # a step without signal trained nothing: its parameters come back
        self._handover()  # every rank's gradients and optimizer state are gone before the engines' weights return
        if self.released:
            with self._timed("time/resume_s"):
                self._engines("resume_memory_occupation", ["weights"], self._same_process(self.released))
        self._record(step, "sync")
        self.ledger.moment("push: engine weights back", step)

    def adopt_restarted(self, live: dict[int, int], step: Optional[int]) -> None:
        """After recovery, before the push (driver): an engine restarted since its release holds its whole memory
        beside the trainer's parameters (gradients, optimizer and reward model are gone by then); its KV cache
        leaves until after the push, as every other engine's."""
        if not self.enabled or not self.is_driver:
            return
        back = {i: n for i, n in live.items() if self.released.get(i) != n}
        # an attached engine released while it was down answers again as the same process: memory released
        same = {i: n for i, n in back.items() if i in self.released_down and not self.driver.rollout_engines.started(i)}
        restarted = {i: n for i, n in back.items() if i not in same}
        for i in back:
            self.released_down.pop(i, None)
        if same:
            with self._timed("time/resume_s"):
                self.released.update(self._engines("resume_memory_occupation", ["weights"], same))
        if not restarted:
            return
        self.ledger.arrive(ENGINE_WEIGHTS, ENGINE_KV_CACHE)
        self.ledger.moment("push: engine restarted", step)
        with self._timed("time/release_s"):
            self.released.update(self._release(["kv_cache"], restarted))

    def after_sync(self, step: Optional[int]) -> None:
        """After the push: the trainer's parameters leave, then the KV cache returns and generation can start
        again (the parameters and the KV cache never share the GPU)."""
        if not self.enabled:
            return
        with self._timed("time/offload_s"):
            self.offloader.offload(("params",))
        self._handover()  # every rank's parameters are gone before the KV caches return
        if self.released:
            with self._timed("time/resume_s"):
                self._engines("resume_memory_occupation", ["kv_cache"], self._same_process(self.released))
            self.released = {}
        self._record(step, "resumed")
        self.ledger.moment("push done: kv cache back", step)

    def to_checkpoint(self) -> None:
        """Before a save (every rank): the engines release their memory if they still hold it (a stop or a
        lost-capacity stop, after which the run ends; after the update they are released already) and the reward
        model leaves, then the trainer's state returns: a save never shares the GPU with an engine."""
        if self.enabled and not self.released:
            with self._timed("time/release_s"):
                self.released = self._release(["weights", "kv_cache"], self._serving())
        if self.enabled:
            self._release_down()
            self.rm.offload(("params",))  # a step without signal went from scoring straight to its save
            self._handover()  # the engines' memory is gone on every rank before any rank reloads the trainer
        self.ensure_resident()

    def ensure_resident(self) -> None:
        """The trainer's state back on the device (checkpoints, the end of the run)."""
        if self.offloader.offloaded:
            self.offloader.reload()

    # ------------------------------------------------------------------ internals
    def _handover(self) -> None:
        """Every rank waits here for the driver's engine calls (and the others' offloads) before memory changes
        hands on its GPU: the driver alone talks to the engines, whose TP ranks share the other ranks' GPUs.
        The host group: no GPU work follows, and engines may take minutes to answer."""
        coll.barrier(group=host_group())

    @contextmanager
    def _timed(self, key: str):
        """Adds the block's seconds to this step's metric `key` (a phase may time several moves under one key)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.metrics[key] = self.metrics.get(key, 0.0) + time.perf_counter() - t0

    def _serving(self) -> dict[int, int]:
        """{engine: incarnation} of the engines up now (driver; other ranks hold no engines)."""
        if not self.is_driver:
            return {}
        h = self.driver.health
        return {i: h.incarnation[i] for i in h.serving()}

    def _same_process(self, engines: dict[int, int]) -> dict[int, int]:
        """Those of `engines` still up in the same process (not down, not restarted since)."""
        if not self.is_driver:
            return {}
        h = self.driver.health
        return {i: n for i, n in engines.items() if h.state[i] != DOWN and h.incarnation[i] == n}

    def _release(self, tags: list[str], engines: dict[int, int]) -> dict[int, int]:
        """Release `tags` on these engines in paused_release's order, each step's failures marked down."""
        paused = self._engines("pause_generation", None, engines, "abort")
        done = self._engines("release_memory_occupation", tags, paused)
        self._engines("continue_generation", None, paused)  # a failed release too: /ready 503s while paused
        return done

    def _release_down(self) -> None:
        """Best effort (driver): an engine marked down may still be alive and hold its memory beside the trainer
        about to come back; release it too (a dead one cannot answer: ignored). An attached engine released so
        and answering again later gets its memory back at the push (adopt_restarted)."""
        if not self.is_driver:
            return
        h = self.driver.health
        down = {i: h.incarnation[i] for i in range(len(self.driver.engines)) if h.state[i] == DOWN
                and self.released.get(i) != h.incarnation[i] and self.released_down.get(i) != h.incarnation[i]}

        async def quiet(i: int) -> bool:  # bounded: a hung scheduler never answers a pause
            try:
                await asyncio.wait_for(paused_release(self.driver.engines[i], ["weights", "kv_cache"]),
                                       self.best_effort_timeout_s)
                return True
            except (EngineError, asyncio.TimeoutError):
                return False

        async def all_down():
            return await asyncio.gather(*(quiet(i) for i in down))

        if down:
            self.released_down.update({i: n for (i, n), ok in zip(down.items(), self.driver.run(all_down())) if ok})

    def _engines(self, method: str, tags: Optional[list[str]], engines: dict[int, int], *args) -> dict[int, int]:
        """`method(tags)` (or `method(*args)`) on these engines (driver only); one that fails is marked down.
        Returns those that did it."""
        if not self.is_driver or not engines:
            return {}
        call_args = args if tags is None else (tags,)

        async def call():
            return await asyncio.gather(*(getattr(self.driver.engines[i], method)(*call_args) for i in engines),
                                        return_exceptions=True)

        done = {}
        for (i, n), r in zip(engines.items(), self.driver.run(call())):
            if isinstance(r, EngineError):
                self.driver.health.mark_down(i, f"{method} failed: {r}")
            elif isinstance(r, BaseException):
                raise r
            else:
                done[i] = n
        if done and tags is not None:  # the driver's GPU: engine 0's first TP rank shares it
            holders = [ENGINE_TAGS[t] for t in tags]
            (self.ledger.arrive if method.startswith("resume") else self.ledger.leave)(*holders)
        return done

    def _record(self, step: int, phase: str) -> None:
        if not self.is_driver:
            return

        async def held(i: int):  # None: SGLang (no such route), or an engine that is down
            if self.driver.health.state[i] == DOWN:
                return None
            try:
                return await self.driver.engines[i].local_memory()
            except EngineError:
                return None

        async def memory():
            return [await held(i) for i in range(len(self.driver.engines))]

        engines = self.driver.run(memory())
        row = {"step": step, "phase": phase, "trainer_bytes": self.offloader.resident_bytes(),
               "reward_model_bytes": self.rm.resident_bytes(),
               "engine_weights_bytes": [m["weights"] if m else None for m in engines],
               "engine_kv_cache_bytes": [m["kv_cache"] if m else None for m in engines]}
        with open(self.log, "a") as f:
            f.write(json.dumps(row) + "\n")
