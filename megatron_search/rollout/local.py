"""The local engine: SGLang's engine semantics over an HF transformers model, in process.

A scheduler task steps all in-flight requests together: new requests are prefilled one by one
(reusing cached state: an earlier turn's sequence that prefixes the input, or for attention-only
models any shared head of it, cut at a block boundary), then every
running request advances one token in a single batched forward (local_runner.py). Control
operations (weight updates, flush, pause) take the same lock as a step, so they happen between
steps, never inside one. Torch work runs in a worker thread so an HTTP server on the same event
loop keeps answering. The model runs on `device` (CPU by default, or one CUDA device); sampling
stays on the host (local_runner.py), so seeded requests give the same tokens on either.

Logprobs are fp32 log-softmax of logits / temperature (the sampling distribution, before top-p
truncation), or of the raw logits with `return_original_logprob` (SGLang's env switch of the
same name). temperature 0 samples greedily and reports raw-logit logprobs.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from .engine import Engine, EngineError, MemoryTag, ModelInfo, PauseMode
from .local_runner import ModelRunner, PrefixStore, SeqState, load_hf_model
from .local_weights import check_dtypes, load_named_tensors, read_safetensors_dir
from .types import FinishReason, GenerateRequest, GenerateResult
from .weight_group import FLAT, close_weight_group, open_weight_group, receive_flat_bucket, receive_named_tensors

log = logging.getLogger(__name__)


@dataclass
class _Active:
    """One in-flight request and everything sampled for it so far."""

    req: GenerateRequest
    future: asyncio.Future
    generator: torch.Generator
    stop_ids: frozenset
    state: Optional[SeqState] = None
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
    """Sample one token per row with that request's params and seeded generator; fp32 logprobs."""
    out = []
    raw_logp = torch.log_softmax(logits_BV, dim=-1)
    for row, a in enumerate(actives):
        sp = a.req.sampling
        if sp.temperature == 0:
            tok = int(torch.argmax(logits_BV[row]))
            out.append((tok, float(raw_logp[row, tok])))
            continue
        logp = torch.log_softmax(logits_BV[row] / sp.temperature, dim=-1)
        probs = logp.exp()
        if sp.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            # keep the smallest head whose mass reaches top_p (the first token always stays)
            drop = (torch.cumsum(sorted_p, 0) - sorted_p) > sp.top_p  # as SGLang's torch sampler
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            tok = int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=a.generator)])
        else:
            tok = int(torch.multinomial(probs, 1, generator=a.generator))
        out.append((tok, float(raw_logp[row, tok] if original_logprob else logp[tok])))
    return out


class LocalEngine(Engine):
    """In-process engine (CPU or one CUDA device); `local_server.py` puts SGLang's HTTP API in front of it."""

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
    ):
        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.runner = ModelRunner(load_hf_model(model_path, dtype=dtype, seed=seed, device=self.device))
        self.vocab_size = int(self.runner.config.vocab_size)
        self.seed = seed
        self.max_running = max_running_requests
        self.prefix = PrefixStore(prefix_cache_entries, prefix_cache_block if self.runner.can_crop else 0)
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
        self._session = False  # a weight-update session is open (begin/end_weight_update)
        self.steps = 0

    @classmethod
    def from_config(cls, cfg, device: Optional[str | torch.device] = None) -> "LocalEngine":
        """Build from the root Config (rollout.local + model sections) on `device` (default rollout.local.device)."""
        lc = cfg.rollout.local
        path = lc.model_path or cfg.model.checkpoint or str(cfg.model.resolved_hf_config())
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
                    await loop.run_in_executor(None, self._step, batch)
                except Exception as e:  # a bug in one step fails its requests, not the engine
                    log.exception("local engine step failed")
                    for a in batch:
                        if not a.future.done():
                            a.future.set_exception(EngineError(f"local engine step failed: {type(e).__name__}: {e}"))
                    self._running = []
                    continue
                self.steps += 1
                self._running = [a for a in batch if a.finish is None]
                for a in batch:
                    if a.finish is not None:
                        self._complete(a)

    def _step(self, batch: list[_Active]) -> None:
        """Worker thread: bring every request one sampled token further."""
        ongoing = [a for a in batch if a.state is not None]
        # Requests with identical inputs (a GRPO group) share one prefill: states are never mutated
        # (every forward builds new tensors), so they can start from the same state object.
        groups: dict[tuple, list[_Active]] = {}
        for a in batch:
            if a.state is None:
                groups.setdefault(tuple(a.fed_target), []).append(a)
        for key, members in groups.items():
            target = list(key)
            prefix, cached = self.prefix.longest_prefix(target)
            if prefix is not None and cached < len(prefix.tokens):
                prefix = self.runner.crop(prefix, cached)
            state, logits = self.runner.prefill(target[cached:], prefix)
            self.prefix.put(state)  # later arrivals sharing a head of this input reuse it
            for i, a in enumerate(members):
                a.state, a.cached_tokens = state, cached if i == 0 else len(target)
            self._accept(members, logits[None].expand(len(members), -1))
        if ongoing:
            states, logits = self.runner.decode([a.state for a in ongoing], [a.output_ids[-1] for a in ongoing])
            for a, s in zip(ongoing, states):
                a.state = s
            self._accept(ongoing, logits)

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

    def _complete(self, a: _Active) -> None:
        if a.future.done():
            return
        if a.state is not None and a.finish.type != "abort":
            self.prefix.put(a.state)
        experts = None
        if a.req.return_routed_experts and a.state is not None and self.runner.num_moe_layers:
            # rows for positions [start_len, seqlen - 1): the state holds exactly seqlen - 1 fed tokens
            experts = a.state.routed_experts(a.req.routed_experts_start_len)
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
            result = await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        self._wake.set()
        return result

    def _abort_all(self, message: str) -> None:
        for a in self._running + self._waiting:
            a.finish = FinishReason("abort", message=message)
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

        def run():
            receive = receive_flat_bucket if load_format == FLAT else receive_named_tensors
            named = receive(group, names, torch_dtypes, shapes, device=self._group_devices[group_name])
            load_named_tensors(self.runner.model, named)
            self._after_update(weight_version, flush_cache)
        await self._control(run, abort_all=abort_all_requests)

    async def destroy_weights_update_group(self, group_name="weight_update_group"):
        group = self._groups.pop(group_name, None)
        if group is None:
            raise EngineError(f"destroy_weights_update_group: no group {group_name!r}")
        self._group_devices.pop(group_name, None)
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
        """Drop running requests' states; they are recomputed (prefill of input + output) later."""
        for a in self._running:
            a.state = None
        self._waiting = self._running + self._waiting
        self._running = []

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
                self._retract()
            if "weights" in tags and "weights" not in self._released:
                for name, p in self.runner.model.named_parameters():
                    self._weight_shapes[name] = (p.shape, p.dtype)
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            if self.device.type == "cuda":  # hand the freed blocks back to the driver, for the colocated trainer
                torch.cuda.empty_cache()
            self._released |= tags

    async def resume_memory_occupation(self, tags: Optional[Sequence[MemoryTag]] = None) -> None:
        tags = set(tags or ("weights", "kv_cache"))
        never = tags - self._released
        if never:  # SGLang raises KeyError for these (and its server dies)
            raise EngineError(f"resume_memory_occupation: {sorted(never)} were never released")
        self._ensure_loop()
        async with self._lock:
            if "weights" in tags and "weights" in self._released:
                # Like SGLang without a CPU backup: memory comes back, contents must be pushed again.
                for name, p in self.runner.model.named_parameters():
                    shape, dtype = self._weight_shapes[name]
                    p.data = torch.zeros(shape, dtype=dtype, device=self.device)
            self._released -= tags
        self._wake.set()

    def memory_bytes(self) -> dict[str, int]:
        """What the engine holds now: parameter storages and the prefix cache (for colocated-cycle checks)."""
        weights = sum(p.untyped_storage().nbytes() for p in self.runner.model.parameters())
        return {"weights": int(weights), "kv_cache": int(self.prefix.nbytes())}

    async def health(self) -> bool:
        return "weights" not in self._released

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
