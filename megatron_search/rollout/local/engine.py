"""The local engine: SGLang's engine semantics over an HF transformers model, in process.

A scheduler task steps all in-flight requests together: every running request advances one token
in a single forward over the persistent batched cache (`RunningBatch`, local_runner.py), then the
requests admitted this step are prefilled together into new rows (reusing cached state: an earlier
turn's sequence that prefixes the input, or for attention-only models any shared head of it, cut
at a block boundary; when inputs admitted together share a head that the store lacks, that head
is prefilled once and stored first, so each input feeds only its own tail). Finished requests
leave the batch at the end of the step, their state kept in the prefix store. Control operations
(weight updates, flush, pause) take the same lock as a step, so they happen between steps, never
inside one. All torch work (the model's load included) runs on one worker thread of
the engine, so an HTTP server on the same event loop keeps answering and the process has one
OpenMP team (see `__init__`); only broadcast weights are received on a thread of their own (no
OpenMP there), so that one bucket is copied into the model while the next arrives. The model runs
on `device` (CPU by default, or one CUDA device); sampling stays on the host (local_runner.py), so
seeded requests give the same tokens on either.

Logprobs are fp32 log-softmax of logits / temperature (the sampling distribution, before top-p
truncation), or of the raw logits with `return_original_logprob` (SGLang's env switch of the
same name). temperature 0 samples greedily and reports raw-logit logprobs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_search.rollout.engine.base import Engine, EngineError, MemoryTag, ModelInfo, PauseMode
from megatron_search.rollout.engine.types import FinishReason, GenerateRequest, GenerateResult
from megatron_search.rollout.local.runner import ModelRunner, PrefixStore, RunningBatch, load_hf_model
from megatron_search.rollout.local.weights import (check_dtypes, load_named_tensors, plan_named_tensors,
                                                   read_safetensors_dir, weights_sha256, write_plan)
from megatron_search.rollout.sglang.weight_group import (FLAT, close_weight_group, grow_buffer, open_weight_group,
                                                         receive_flat_bucket, receive_named_tensors)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Active:
    """One in-flight request and everything sampled for it so far."""

    req: GenerateRequest
    future: asyncio.Future
    generator: torch.Generator
    stop_ids: frozenset
    seated: bool = False  # holds a row of the running batch (its model state)
    experts: Optional[np.ndarray] = None  # routed experts, taken when the row is freed
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    finish: Optional[FinishReason] = None

    @property
    def fed_target(self) -> list[int]:
        """Tokens whose state must exist before the next sample: input + every output so far."""
        return list(self.req.input_ids) + self.output_ids


def sample_tokens(
    logits_BV: torch.Tensor, actives: Sequence[_Active], original_logprob: bool
) -> list[tuple[int, float]]:
    """Sample one token per row with that request's params and seeded generator; fp32 logprobs.

    Rows are computed together; each row draws from its own generator exactly what `torch.multinomial(p, 1)`
    draws (one Exp(1) per vocabulary entry, token = argmax p / q), so a seed gives the same tokens as sampling
    row by row, at a fraction of the per-call cost."""
    B = logits_BV.shape[0]
    raw_logp = torch.log_softmax(logits_BV, dim=-1)
    temps = [float(a.req.sampling.temperature) for a in actives]
    toks: list[int] = [0] * B
    cold = [r for r in range(B) if temps[r] == 0]
    hot = [r for r in range(B) if temps[r] != 0]
    if cold:
        for r, tok in zip(cold, logits_BV[cold].argmax(dim=-1).tolist()):
            toks[r] = tok
    scaled = None
    if hot:
        scaled = torch.log_softmax(logits_BV[hot] / torch.tensor([temps[r] for r in hot])[:, None], dim=-1)
        probs = scaled.exp()
        plain = [j for j, r in enumerate(hot) if actives[r].req.sampling.top_p >= 1.0]
        if plain:
            q = torch.empty(len(plain), probs.shape[1])
            for i, j in enumerate(plain):
                q[i].exponential_(1, generator=actives[hot[j]].generator)
            for j, tok in zip(plain, (probs[plain] / q).argmax(dim=-1).tolist()):
                toks[hot[j]] = tok
        for j, r in enumerate(hot):
            top_p = actives[r].req.sampling.top_p
            if top_p < 1.0:
                sorted_p, order = torch.sort(probs[j], descending=True)
                # keep the smallest head whose mass reaches top_p (the first token always stays)
                drop = (torch.cumsum(sorted_p, 0) - sorted_p) > top_p  # as SGLang's torch sampler
                sorted_p = sorted_p.masked_fill(drop, 0.0)
                toks[r] = int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=actives[r].generator)])
    index = torch.tensor(toks)[:, None]
    lps = raw_logp.gather(1, index)[:, 0].tolist()
    if scaled is not None and not original_logprob:
        for r, lp in zip(hot, scaled.gather(1, index[hot])[:, 0].tolist()):
            lps[r] = lp
    return list(zip(toks, lps))


class LocalEngine(Engine):
    """In-process engine (CPU or one CUDA device); `server.py` puts SGLang's HTTP API in front of it."""

    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "float32",
        seed: int = 0,
        max_running_requests: int = 64,
        prefix_cache_entries: int = 256,
        prefix_cache_block: int = 32,
        weight_version: str = "default",
        return_original_logprob: bool = False,
        device: str | torch.device = "cpu",
        max_prefill_tokens: int = 8192,
    ):
        self.model_path = str(model_path)
        self.device = torch.device(device)
        # Every torch call of the engine runs on this one thread, the model's load included. OpenMP gives each
        # thread that enters a parallel region a team of its own; once two teams exist on a small machine
        # (more OpenMP threads than cores) libgomp stops spinning between regions and every region pays a
        # wake-up: a decode step ran 1.7x and a GDN prefill 2x slower with the model loaded on the event
        # loop's thread and stepped on a worker. The worker keeps the constructing thread's thread count.
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="local-engine", initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),))
        self.runner = self._worker.submit(
            lambda: ModelRunner(load_hf_model(model_path, dtype=dtype, seed=seed, device=self.device))).result()
        self.vocab_size = int(self.runner.config.vocab_size)
        self.seed = seed
        self.max_running = max_running_requests
        self.prefix = PrefixStore(prefix_cache_entries, prefix_cache_block if self.runner.can_crop else 0)
        self.head_block = prefix_cache_block  # shared heads of inputs admitted together are cut at multiples of it
        # the running requests' state; `max_prefill_tokens` bounds one prefill forward (padded tokens), like
        # SGLang's chunked-prefill size (a longer single input still goes in one forward)
        self.batch = RunningBatch(self.runner, max_running_requests, max_prefill_tokens)
        self.weight_version = weight_version
        self.original_logprob = return_original_logprob
        self._counter = itertools.count()
        self._waiting: list[_Active] = []
        self._running: list[_Active] = []
        self._lock: Optional[asyncio.Lock] = None
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._paused = False
        self._released: set[str] = set()
        self._weight_shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._groups: dict[str, object] = {}
        self._group_devices: dict[str, torch.device] = {}  # where each group's broadcasts land (CUDA for NCCL)
        # Broadcast weights are received on a thread of their own, into two flat buffers in turn, and copied into
        # the model on the worker: bucket k's copy overlaps bucket k+1's receive (see update_weights_from_distributed)
        self._receiver = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-engine-recv")
        self._flat_buffers: list[Optional[torch.Tensor]] = [None, None]
        self._copies: list[Optional[concurrent.futures.Future]] = [None, None]  # each buffer's copy, still pending
        self._slot = 0  # the buffer the last bucket went to
        self._session = False  # a weight-update session is open (begin/end_weight_update)
        self.steps = 0

    @classmethod
    def from_config(cls, cfg, device: Optional[str | torch.device] = None) -> "LocalEngine":
        """Build from the root Config (rollout.local + model sections) on `device` (default rollout.local.device)."""
        lc = cfg.rollout.local
        path = lc.model_path or str(cfg.model.engine_dir())
        return cls(
            path, dtype=lc.dtype or cfg.model.params_dtype, seed=lc.seed,
            max_running_requests=lc.max_running_requests, prefix_cache_entries=lc.prefix_cache_entries,
            prefix_cache_block=lc.prefix_cache_block,
            weight_version=lc.weight_version, return_original_logprob=cfg.rollout.return_original_logprob,
            device=lc.device if device is None else device,
        )

    # -- scheduler ---------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # asyncio primitives belong to one event loop; a new loop (e.g. a later asyncio.run) gets
            # fresh ones. Requests of a finished loop cannot be answered any more: drop them.
            self._loop = loop
            self._lock, self._wake, self._task = asyncio.Lock(), asyncio.Event(), None
            self._running, self._waiting = [], []
            self.batch.clear()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._schedule())

    def _can_step(self) -> bool:
        return not self._paused and not self._released and bool(self._waiting or self._running)

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._can_step():
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._lock:
                if not self._can_step():
                    continue
                room = max(0, self.max_running - len(self._running))
                admitted, self._waiting = self._waiting[:room], self._waiting[room:]
                batch = self._running + admitted
                try:
                    await loop.run_in_executor(self._worker, self._step, batch)
                except Exception as e:  # a bug in one step fails its requests, not the engine
                    log.exception("local engine step failed")
                    for a in batch:
                        a.seated = False
                        if not a.future.done():
                            a.future.set_exception(EngineError(f"local engine step failed: {type(e).__name__}: {e}"))
                    self._running = []
                    self.batch.clear()
                    continue
                self.steps += 1
                self._running = [a for a in batch if a.finish is None]
                for a in batch:
                    if a.finish is not None:
                        self._complete(a)

    def _step(self, batch: list[_Active]) -> None:
        """Worker thread: bring every request one sampled token further; finished ones leave the batch."""
        if self.batch.owners:  # every seated request is in `batch`: the scheduler steps all running ones
            ongoing = list(self.batch.owners)
            self._accept(ongoing, self.batch.decode([a.output_ids[-1] for a in ongoing]))
        joining = [a for a in batch if not a.seated]
        # Requests with identical inputs (a GRPO group) share one prefill; the others copy its row.
        groups: dict[tuple, list[_Active]] = {}
        for a in joining:
            groups.setdefault(tuple(a.fed_target), []).append(a)
        if len(groups) > 1 and self.prefix.enabled:
            self._prefill_shared_heads([list(k) for k in groups])
        entries = []
        for key, members in groups.items():
            target = list(key)
            prefix, cached = self.prefix.longest_prefix(target)
            if prefix is not None and cached < len(prefix.tokens):
                prefix = self.runner.crop(prefix, cached)
            entries.append((target, prefix, members))
            for i, a in enumerate(members):
                a.seated, a.cached_tokens = True, cached if i == 0 else len(target)
        if entries:
            for (_, _, members), row in zip(entries, self.batch.admit(entries)):
                if self.prefix.enabled:  # a later input sharing a head of this one reuses it
                    self.prefix.put(self.batch.export(members[0]), owned=True)
                self._accept(members, row[None].expand(len(members), -1))
        for a in batch:
            if a.finish is not None:
                self._release(a)
        self.batch.fit()

    def _prefill_shared_heads(self, targets: list[list[int]]) -> None:
        """Inputs admitted together that share a head (the system prompt and tool list of different questions)
        longer than what the prefix store holds for them: prefill each such head once, at a multiple of
        `head_block` tokens, and store it, so every input then feeds only its own tail. For hybrid models too:
        a stored head is an exact prefix, and the GDN state after it is exact."""
        block = self.head_block
        if block < 1:
            return
        order = sorted(range(len(targets)), key=lambda i: targets[i])  # sharers of a head end up adjacent
        arrays = [np.asarray(t) for t in targets]

        def lcp(i: int, j: int) -> int:
            a, b = arrays[i], arrays[j]
            n = min(len(a), len(b))
            diff = np.flatnonzero(a[:n] != b[:n])
            return int(diff[0]) if len(diff) else n

        heads: dict[tuple, None] = {}
        for pos, i in enumerate(order):
            shared = max([lcp(i, order[p]) for p in (pos - 1, pos + 1) if 0 <= p < len(order)], default=0)
            shared = min(shared, len(targets[i]) - 1) // block * block  # a reused head leaves a token to feed
            if shared and shared > self.prefix.longest_prefix(targets[i])[1]:
                heads[tuple(targets[i][:shared])] = None
        if not heads:
            return
        entries = []
        for head in heads:
            prefix, cached = self.prefix.longest_prefix(list(head))
            if prefix is not None and cached < len(prefix.tokens):
                prefix = self.runner.crop(prefix, cached)
            entries.append((list(head), prefix, [object()]))
        self.batch.admit(entries)
        for _, _, (owner,) in entries:
            self.prefix.put(self.batch.export(owner), owned=True)
            self.batch.remove(owner)

    def _accept(self, actives: list[_Active], logits_BV: torch.Tensor) -> None:
        for a, (tok, lp) in zip(actives, sample_tokens(logits_BV, actives, self.original_logprob)):
            a.output_ids.append(tok)
            a.logprobs.append(lp)
            if tok in a.stop_ids:
                a.finish = FinishReason("stop", matched=tok)
            elif len(a.output_ids) >= a.req.sampling.max_new_tokens:
                a.finish = FinishReason("length")
            elif len(a.req.input_ids) + len(a.output_ids) >= self.runner.max_positions:
                a.finish = FinishReason("length", message="context length reached")

    def _release(self, a: _Active) -> None:
        """Free `a`'s row (worker thread in a step, or the loop under the lock): its state goes to the prefix
        store unless aborted, its routed experts are kept for the answer."""
        if not a.seated:
            return
        if a.req.return_routed_experts and self.runner.num_moe_layers:
            # rows for positions [start_len, seqlen - 1): the row holds exactly seqlen - 1 fed tokens
            a.experts = self.batch.routed_experts(a, a.req.routed_experts_start_len)
        if a.finish is not None and a.finish.type != "abort" and self.prefix.enabled:
            self.prefix.put(self.batch.export(a), owned=True)
        self.batch.remove(a)
        a.seated = False

    def _complete(self, a: _Active) -> None:
        if a.future.done():
            return
        self._release(a)
        experts = a.experts
        a.future.set_result(
            GenerateResult(
                output_ids=list(a.output_ids),
                output_logprobs=list(a.logprobs) if a.req.return_logprob else None,
                finish_reason=a.finish,
                weight_version=self.weight_version,
                prompt_tokens=len(a.req.input_ids),
                cached_tokens=a.cached_tokens,
                routed_experts_NLK=experts,
            )
        )

    def _validate(self, req: GenerateRequest) -> None:
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids: token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if len(req.input_ids) >= self.runner.max_positions:
            raise ValueError(f"input_ids: {len(req.input_ids)} tokens exceed the context length {self.runner.max_positions}")
        if req.return_routed_experts and not self.runner.num_moe_layers:
            raise ValueError("return_routed_experts: the served model has no MoE layers")

    # -- Engine API ----------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._validate(request)
        if self._released:  # SGLang would run it on unmapped memory (torch_memory_saver): a fault, the engine dies
            raise EngineError(f"generate: the engine's {' and '.join(sorted(self._released))} are released; a "
                              "request (or a generating health probe) must wait for resume_memory_occupation")
        self._ensure_loop()
        seed = request.sampling.seed if request.sampling.seed is not None else self.seed * 1_000_003 + next(self._counter)
        stop = set(request.sampling.stop_token_ids)
        if not request.sampling.ignore_eos:
            stop.update(self.runner.eos_token_ids())
        a = _Active(request, asyncio.get_running_loop().create_future(), torch.Generator().manual_seed(seed), frozenset(stop))
        self._waiting.append(a)
        self._wake.set()
        return await a.future

    async def _control(self, fn, *args, abort_all: bool = False):
        """Run `fn` between steps (worker thread), optionally aborting in-flight requests first."""
        self._ensure_loop()
        async with self._lock:
            if abort_all:
                self._abort_all("aborted for a weight update")
            await self._settle()
            result = await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)
        self._wake.set()
        return result

    def _abort_all(self, message: str) -> None:
        """Answer every request as aborted; the whole batch is dropped (no torch work on the loop's thread)."""
        for a in self._running + self._waiting:
            a.finish = FinishReason("abort", message=message)
            if a.seated and a.req.return_routed_experts and self.runner.num_moe_layers:
                a.experts = self.batch.routed_experts(a, a.req.routed_experts_start_len)
            a.seated = False
        self.batch.clear()
        for a in self._running + self._waiting:
            self._complete(a)
        self._running, self._waiting = [], []

    def _idle(self) -> bool:
        """SGLang's is_fully_idle(ignore_waiting=paused): nothing running; queued requests count unless paused."""
        return not self._running and (self._paused or not self._waiting)

    def _not_idle_reason(self) -> str:
        return (f"{len(self._running)} running and {len(self._waiting)} queued request(s) "
                f"({'paused in place' if self._paused and self._running else 'not paused' if not self._paused else 'paused'})")

    def _after_update(self, weight_version: Optional[str], flush_cache: bool) -> None:
        if weight_version is not None:  # SGLang records the version on a successful load, before the flush
            self.weight_version = str(weight_version)
        if flush_cache:
            if not self._idle():
                raise EngineError("Weights were updated, but the cache was not flushed because requests are still "
                                  f"running or queued ({self._not_idle_reason()}); retract or finish them, then flush")
            self.prefix.clear()

    def _require_session(self, what: str) -> None:
        if not self._session:
            raise EngineError(f"{what} must run between begin_weight_update() and end_weight_update()")

    async def begin_weight_update(self) -> None:
        if self._session:
            raise EngineError("begin_weight_update: a weight-update session is already open; call end_weight_update() first")
        self._session = True

    async def end_weight_update(self) -> None:
        if not self._session:
            raise EngineError("end_weight_update: no weight-update session is open")
        self._session = False
        await self._settle()  # the session's last copies are in the model (a failed one raises here)

    async def _settle(self, *slots: int) -> None:
        """Wait for the deferred copies into the model (of these buffers; default all); one that failed raises."""
        for i in slots or range(len(self._copies)):
            copy, self._copies[i] = self._copies[i], None
            if copy is not None:
                await asyncio.wrap_future(copy)

    async def weights_sha256(self) -> dict[str, str]:
        """sha256 of every parameter by name, once every update received so far is in the model."""
        return await self._control(weights_sha256, self.runner.model)

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> None:
        def run():
            self.weight_version = str(new_version)
        await self._control(run, abort_all=abort_all_requests)

    async def update_weights_from_tensor(self, named_tensors, weight_version=None, flush_cache=True, abort_all_requests=False):
        self._require_session("update_weights_from_tensor")

        def run():
            if "weights" in self._released:
                raise EngineError("update_weights_from_tensor: weights are released; resume_memory_occupation first")
            load_named_tensors(self.runner.model, named_tensors)
            self._after_update(weight_version, flush_cache)
        await self._control(run, abort_all=abort_all_requests)

    async def update_weights_from_disk(self, model_path, weight_version=None, abort_all_requests=False):
        def run():
            load_named_tensors(self.runner.model, read_safetensors_dir(model_path))
            self._after_update(weight_version, True)
        await self._control(run, abort_all=abort_all_requests)

    async def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                        group_name="weight_update_group", backend="gloo"):
        if backend not in ("gloo", "nccl"):
            raise EngineError(f"init_weights_update_group: backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and self.device.type != "cuda":
            raise EngineError(f"init_weights_update_group: backend 'nccl' needs the engine on a CUDA device (this one "
                              f"runs on {self.device}; rollout.local.device)")
        if group_name in self._groups:
            raise EngineError(f"init_weights_update_group: group {group_name!r} already exists")
        # Joining blocks until the trainer joins too: do it off the event loop, outside the step lock.
        try:
            group = await asyncio.to_thread(open_weight_group, master_address, int(master_port), int(rank_offset),
                                            int(world_size), group_name, backend)
        except RuntimeError as e:
            if "already registered" not in str(e):
                raise
            raise EngineError(f"init_weights_update_group: group {group_name!r} is already open in this process: an "
                              f"engine in its trainer's own process cannot join the trainer's group (use the tensor "
                              f"or disk path, or serve the engine in its own process)") from None
        self._groups[group_name] = group
        self._group_devices[group_name] = self.device if backend == "nccl" else torch.device("cpu")

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                              weight_version=None, flush_cache=True, abort_all_requests=False,
                                              load_format=None):
        self._require_session("update_weights_from_distributed")
        if load_format not in (None, FLAT):  # SGLang raises NotImplementedError (and its server dies)
            raise EngineError(f"update_weights_from_distributed: unknown load_format {load_format!r}")
        group = self._groups.get(group_name)
        if group is None:
            raise EngineError(f"update_weights_from_distributed: no group {group_name!r}; call init_weights_update_group")
        torch_dtypes = check_dtypes(dtypes)
        device = self._group_devices[group_name]

        def receive(slot: int):
            if load_format == FLAT:
                self._flat_buffers[slot] = grow_buffer(self._flat_buffers[slot], torch_dtypes, shapes, device)
                named = receive_flat_bucket(group, names, torch_dtypes, shapes, device=device,
                                            buffer=self._flat_buffers[slot])
            else:
                named = receive_named_tensors(group, names, torch_dtypes, shapes, device=device)
            return plan_named_tensors(self.runner.model, named)[0]  # a bad name or shape raises before any write

        # The bucket is received (on the receiver thread) and checked whole; its copy into the model is queued on
        # the worker, and the answer does not wait for it when it carries no version and no flush (the weight
        # sync's buckets): the sender's next bucket then arrives while this one is copied. Everything that reads
        # the weights (steps, version, flush, digest, release) runs on the worker after the copy, and the
        # buffer is received into again only once its copy is done (_settle), so no answer reports weights the
        # model does not hold yet. Costs one more bucket of receive buffer.
        self._ensure_loop()
        loop = asyncio.get_running_loop()
        async with self._lock:
            if abort_all_requests:
                self._abort_all("aborted for a weight update")
            slot = self._slot = 1 - self._slot
            await self._settle(slot)
            copy = self._worker.submit(write_plan, await loop.run_in_executor(self._receiver, receive, slot))
            if weight_version is None and not flush_cache:
                self._copies[slot] = copy
            else:
                await asyncio.wrap_future(copy)
                await loop.run_in_executor(self._worker, self._after_update, weight_version, flush_cache)
        self._wake.set()

    async def destroy_weights_update_group(self, group_name="weight_update_group"):
        group = self._groups.pop(group_name, None)
        if group is None:
            raise EngineError(f"destroy_weights_update_group: no group {group_name!r}")
        self._group_devices.pop(group_name, None)
        if not self._groups:
            self._flat_buffers = [None, None]
        close_weight_group(group)

    async def flush_cache(self) -> None:
        def run():
            if not self._idle():
                raise EngineError(f"Cache not flushed: {self._not_idle_reason()}; SGLang flushes only when idle")
            self.prefix.clear()
        await self._control(run)

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_generation: mode must be abort, retract or in_place, got {mode!r}")
        self._ensure_loop()
        async with self._lock:
            self._paused = True
            if mode == "abort":
                self._abort_all("aborted by pause_generation")
            elif mode == "retract":
                self._retract()

    def _retract(self) -> None:
        """Drop running requests' states (the batch's tensors are freed); they are recomputed (prefill of input
        + output) later."""
        for a in self._running:
            a.seated = False
        self._waiting = self._running + self._waiting
        self._running = []
        self.batch.clear()

    async def continue_generation(self) -> None:
        self._ensure_loop()
        self._paused = False
        self._wake.set()

    async def release_memory_occupation(self, tags: Optional[Sequence[MemoryTag]] = None) -> None:
        tags = set(tags or ("weights", "kv_cache"))
        unknown = tags - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"release_memory_occupation: unknown tags {sorted(unknown)}")
        self._ensure_loop()
        async with self._lock:
            if not self._idle():  # SGLang asserts (and its server dies) when not idle
                raise EngineError(f"release_memory_occupation: the engine must be idle, {self._not_idle_reason()}; "
                                  f"pause_generation(abort or retract) first")
            if "kv_cache" in tags:
                self.prefix.clear()
                self._retract()  # frees the running batch's tensors

            def run():
                if "weights" in tags and "weights" not in self._released:
                    self._flat_buffers = [None, None]
                    for name, p in self.runner.model.named_parameters():
                        self._weight_shapes[name] = (p.shape, p.dtype)
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                if self.device.type == "cuda":  # hand the freed blocks back to the driver, for the colocated trainer
                    torch.cuda.empty_cache()
            await asyncio.get_running_loop().run_in_executor(self._worker, run)
            self._released |= tags

    async def resume_memory_occupation(self, tags: Optional[Sequence[MemoryTag]] = None) -> None:
        tags = set(tags or ("weights", "kv_cache"))
        never = tags - self._released
        if never:  # SGLang raises KeyError for these (and its server dies)
            raise EngineError(f"resume_memory_occupation: {sorted(never)} were never released")
        self._ensure_loop()
        async with self._lock:
            def run():
                if "weights" in tags and "weights" in self._released:
                    # Like SGLang without a CPU backup: memory comes back, contents must be pushed again.
                    for name, p in self.runner.model.named_parameters():
                        shape, dtype = self._weight_shapes[name]
                        p.data = torch.zeros(shape, dtype=dtype, device=self.device)
            await asyncio.get_running_loop().run_in_executor(self._worker, run)
            self._released -= tags
        self._wake.set()

    def memory_bytes(self) -> dict[str, int]:
        """What the engine holds now: parameter storages, and the running batch's cache plus the prefix cache
        (for colocated-cycle checks)."""
        weights = sum(p.untyped_storage().nbytes() for p in self.runner.model.parameters())
        return {"weights": int(weights), "kv_cache": int(self.prefix.nbytes() + self.batch.nbytes())}

    async def health(self) -> bool:
        """SGLang's /ready: up and not paused (it reads no memory, so it is safe while memory is released)."""
        return not self._paused

    async def get_model_info(self) -> ModelInfo:
        return ModelInfo(self.model_path, self.weight_version, True, self.runner.num_moe_layers, self.runner.top_k)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        for a in self._running + self._waiting:
            if not a.future.done():
                a.future.set_exception(EngineError("local engine closed"))
        self._running, self._waiting = [], []
        self.batch.clear()
