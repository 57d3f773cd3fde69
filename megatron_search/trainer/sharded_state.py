"""Model + optimizer state as one Megatron distributed checkpoint (torch_dist format).

    save_sharded(model_chunks, optimizer, directory)   # collective: every rank calls it
    load_sharded(model_chunks, optimizer, directory)   # restores weights and optimizer in place
    load_model(model_chunks, directory)                # weights only (start a new run from them)
    optimizer_parts(optimizer)                         # 2 when Megatron split dense / expert groups

Chunks are stored as "model0", "model1", ... and the optimizer under "optimizer", each from its
Megatron `sharded_state_dict`, so another TP/PP/EP/DP layout can load the result. Also holds the
few workarounds Megatron-Core 0.16 needs here (each documented where it is applied): a
synchronous in-process writer, the gloo gather of the distributed optimizer on CPU, and torch
Adam's "step" around DistributedOptimizer loads without Transformer Engine / Apex.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch.distributed import checkpoint as dcp

from megatron_search.distributed import cpu_compat

_DIST_CKPT_MODULES = (
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.exchange_utils",
)


# The distributed optimizer's state: "dp_reshardable" (each rank's shard as it lies, the default) or
# "fully_reshardable" (per-parameter tensors, any layout loads them; checkpoint.optimizer_format). Chained
# optimizers (dense + expert groups) keep their keys unprefixed, as Megatron's own newer checkpoints. On CPU
# the gather behind fully_reshardable must run over the gloo DP group (the default path moves tensors with
# .cuda()), which Megatron calls the memory-efficient variant.
OPTIMIZER_FORMATS = ("dp_reshardable", "fully_reshardable")


def _optim_metadata(optimizer_format: str) -> dict:
    if optimizer_format not in OPTIMIZER_FORMATS:
        raise ValueError(f"optimizer format {optimizer_format!r}: not one of {OPTIMIZER_FORMATS}")
    return {"distrib_optim_sharding_type": optimizer_format, "chained_optim_avoid_prefix": True,
            "distrib_optim_fully_reshardable_mem_efficient": not torch.cuda.is_available()}


def _prime_fresh_distributed_optimizer(optimizer) -> None:
    """Give a never-stepped DistributedOptimizer the Adam state its first step would create, before a load or
    a save, so a checkpoint written before any step has the same keys as any other (GRPO: a run whose every
    step was skipped, no group with signal, saves and resumes as if fresh; a load overwrites the values).

    Each inner optimizer gets its own kind of state. Transformer Engine's FusedAdam: its `initialize_state`
    (zero moments, plus the master copy when it keeps one); it keeps "step" in the param group, and its
    `state_dict()` maps every state key through `name_to_dtype_map` (exp_avg, exp_avg_sq, master_param), so
    a "step" entry would raise KeyError. torch's Adam / AdamW: zero moments and a per-parameter "step" tensor,
    which Megatron's state_dict reads without TE / Apex (it asserts on the empty set otherwise). Megatron's
    CPU-offload optimizer builds its own state on load (`dummy_step`) and is left alone.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer) or isinstance(opt.optimizer, HybridDeviceOptimizer):
            continue
        inner = opt.optimizer
        te_style = callable(getattr(inner, "initialize_state", None)) and hasattr(inner, "name_to_dtype_map")
        torch_adam = isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))
        if not (te_style or torch_adam):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if len(inner.state[p]):
                    continue
                if te_style:
                    inner.initialize_state(p, bool(getattr(inner, "store_param_remainders", False))
                                           and p.dtype == torch.bfloat16)
                else:
                    inner.state[p].update(exp_avg=torch.zeros_like(p.data), exp_avg_sq=torch.zeros_like(p.data),
                                          step=torch.zeros((), dtype=torch.float32))


def _load_keeping_torch_adam_step(optimizer) -> None:
    """Let DistributedOptimizer.load_state_dict run with torch's Adam (no TE / Apex).

    Its load_state_dict first restores torch Adam's per-parameter "step" from the saved param groups (the right
    value), then its parameter-state loaders copy every key of the inner state: fully_reshardable leaves "step"
    out of the tensors and fails on the missing key; dp_reshardable hands over a "step" that is not read from
    the checkpoint (the never-stepped value of the freshly built optimizer). Per instance, "step" is set aside
    while each parameter's tensors are copied, so the param groups' value stays.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer) or "_set_main_param_and_optimizer_states" in vars(opt):
            continue
        original = DistributedOptimizer._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
            step = state.pop("step", None)
            try:
                original(opt, model_param, {k: v for k, v in tensors.items() if k != "step"})
            finally:
                if step is not None:
                    state["step"] = step

        opt._set_main_param_and_optimizer_states = set_states


def _unshare_torch_adam_steps(optimizer) -> None:
    """DistributedOptimizer.load_state_dict hands every parameter the SAME "step" tensor; torch's Adam
    increments each parameter's step in place, so a shared tensor would advance once per parameter
    and corrupt the bias correction. Give each parameter its own copy."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            for st in inner.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].clone()


def _sharded_state(model: list, optimizer, is_loading: bool, optimizer_format: str) -> dict:
    """{"model<i>": chunk sharded state, "optimizer": optimizer sharded state} (Megatron's layout)."""
    model_sd = {}
    for i, chunk in enumerate(model):
        model_sd[f"model{i}"] = chunk.sharded_state_dict()
    _prime_fresh_distributed_optimizer(optimizer)
    merged = {}
    for sd in model_sd.values():
        merged.update(sd)
    out = dict(model_sd)
    out["optimizer"] = optimizer.sharded_state_dict(merged, is_loading=is_loading,
                                                    metadata=_optim_metadata(optimizer_format))
    return out


def _dist_ckpt():
    # The save/load strategies are imported lazily by Megatron; load them now so the CPU compat
    # layer (a no-op on GPU) also redirects their torch.cuda calls.
    for name in _DIST_CKPT_MODULES:
        importlib.import_module(name)
    cpu_compat.rebind_new_modules()
    return dist_checkpointing


def _save_strategy(threads: int, parallel_group=None):
    """Megatron's torch_dist format written synchronously in this process, `threads` writer threads per rank;
    with `parallel_group` (the DP group) the replicated tensors' writes are spread over its ranks.

    Megatron's default torch_dist saver hands the write to forked worker processes and a spawned
    multiprocessing Manager; on CPU under gloo those workers hung our saves, and extra processes
    are a poor fit for a 2-core machine anyway. This strategy translates the sharded state dict
    with Megatron's own helpers and planner and writes it with torch.distributed.checkpoint's
    plain FileSystemWriter, so the result is the same torch_dist checkpoint Megatron loads.
    """
    class SyncTorchDistSave(SaveShardedStrategy):
        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
            dcp.save(pyt_state_dict, storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=threads),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))

    base = SyncTorchDistSave("torch_dist", 1)
    if parallel_group is None:
        return base
    # one wrapper per group and thread count, caching its distribution of the writes: every save after the first
    # skips the world-wide gather of all shards' metadata (the state's structure does not change within a run)
    key = (id(parallel_group), threads)
    if key not in _PARALLEL_SAVES:
        _PARALLEL_SAVES[key] = FullyParallelSaveStrategyWrapper(base, parallel_group, do_cache_distribution=True)
    return _PARALLEL_SAVES[key]


_PARALLEL_SAVES: dict = {}


def optimizer_parts(optimizer) -> int:
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


def save_sharded(model: list, optimizer, directory: Path, *, optimizer_format: str = "dp_reshardable",
                 threads: int = 2, parallel_group=None) -> None:
    """Every rank: write the sharded model + optimizer state into `directory` (it must exist); with
    `parallel_group` (the DP x CP group) the replicated tensors' writes are spread over its ranks."""
    _dist_ckpt().save(_sharded_state(model, optimizer, False, optimizer_format), str(directory),
                      sharded_strategy=_save_strategy(threads, parallel_group))


def load_sharded(model: list, optimizer, directory: Path, *, optimizer_format: str = "dp_reshardable") -> None:
    """Every rank: load weights and optimizer state saved by `save_sharded` in place (`optimizer_format`: the one it
    was saved with; fully_reshardable loads at any layout, dp_reshardable at the saved one but for DP).

    Each rank reads its own shards: Megatron's fully parallel load would exchange every shard held by more than
    one rank of the group over it, each rank allocating (on CUDA) the shards it then drops, about 90 GB per rank
    at the 397B layout where each expert shard has two holders in a DP group of 32."""
    state = _dist_ckpt().load(_sharded_state(model, optimizer, True, optimizer_format), str(directory))
    for i, chunk in enumerate(model):
        chunk.load_state_dict(state[f"model{i}"])
    _load_keeping_torch_adam_step(optimizer)
    with torch.no_grad():  # dp_reshardable copies into the fp32 main parameters, leaves that require grad
        optimizer.load_state_dict(state["optimizer"])
    _unshare_torch_adam_steps(optimizer)


def load_model(model: list, directory: Path) -> None:
    """Every rank: load only the weights saved by `save_sharded` (any layout) into the chunks."""
    state = _dist_ckpt().load({f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(model)},
                              str(directory))
    for i, chunk in enumerate(model):
        chunk.load_state_dict(state[f"model{i}"])
