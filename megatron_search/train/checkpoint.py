"""What goes inside a training checkpoint, and how it is written and read back.

One checkpoint directory (published atomically by checkpoint_dir.save_checkpoint) holds:
    model_optim/          Megatron distributed checkpoint (megatron.core.dist_checkpointing, torch_dist
                          format) of every model chunk ("model0", "model1", ...) and the optimizer
                          (Adam moments, step, fp32 master weights when training in bf16); sharded
                          by Megatron, so another TP/PP/EP layout can load it
    rng/rank_NNNNN.pt     this rank's RNG states: python, numpy, torch CPU (+ CUDA), Megatron's
                          model-parallel RNG tracker (per-rank: TP ranks seed dropout differently)
    trainer.json          iteration, consumed tokens, LR schedule parameters, world layout and
                          the caller's `extra` (the data sampler's position, ...)
    config.yaml           the run's resolved config
Resuming with the same layout restores every bit of this state, so step k+1 after a resume equals
step k+1 of the uninterrupted run. With another layout the weights and optimizer reshard; RNG
states then restart from the seed and the iteration (logged), which changes only random choices.
"""
from __future__ import annotations

import json
import logging
import random
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .checkpoint_dir import save_checkpoint

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
MODEL_OPTIM, RNG_DIR, TRAINER_JSON, CONFIG_YAML = "model_optim", "rng", "trainer.json", "config.yaml"


_DIST_CKPT_MODULES = (
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.exchange_utils",
)


# Optimizer state in a layout-independent form: the distributed optimizer saves per-parameter
# tensors instead of its DP-specific flat buffers, so any TP/PP/EP/DP layout can load it; chained
# optimizers (dense + expert groups) keep their keys unprefixed, as Megatron's own newer checkpoints.
# On CPU the gather behind that format must run over the gloo DP group (the default path moves
# tensors with .cuda()), which Megatron calls the memory-efficient variant.
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _optim_metadata() -> dict:
    return {**OPTIM_METADATA, "distrib_optim_fully_reshardable_mem_efficient": not torch.cuda.is_available()}


class CheckpointError(RuntimeError):
    """A checkpoint is missing a part or does not match the run loading it."""


# ---------------------------------------------------------------------------------- RNG
def capture_rng() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "megatron_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def reseed_rng(seed: int, iteration: int, rank: int) -> None:
    """Fresh, deterministic RNG states when a checkpoint's per-rank states do not fit this layout."""
    from megatron.core import tensor_parallel

    s = seed + 1_000_003 * iteration + rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    tensor_parallel.model_parallel_cuda_manual_seed(s)


# ---------------------------------------------------------------------------------- sharded state
def _prime_fresh_distributed_optimizer(optimizer) -> None:
    """Give a never-stepped DistributedOptimizer placeholder Adam state before a load.

    Without Transformer Engine / Apex its state_dict() reads every parameter's torch-Adam "step",
    which does not exist before the first step; the load then overwrites these placeholders.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer) or not isinstance(opt.optimizer, torch.optim.Optimizer):
            continue
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if len(inner.state[p]) == 0:
                    inner.state[p].update(exp_avg=torch.zeros_like(p.data), exp_avg_sq=torch.zeros_like(p.data),
                                          step=torch.zeros((), dtype=torch.float32))


def _load_keeping_torch_adam_step(optimizer) -> None:
    """Let DistributedOptimizer.load_state_dict run with torch's Adam (no TE / Apex).

    Its parameter-state loaders copy every key of the inner Adam state from the checkpoint but
    deliberately leave out "step" (restored from the param groups just before), then fail on that
    missing key. Per instance, "step" is set aside while each parameter's tensors are copied.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer) or "_set_main_param_and_optimizer_states" in vars(opt):
            continue
        original = DistributedOptimizer._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
            step = state.pop("step", None) if "step" not in tensors else None
            try:
                original(opt, model_param, tensors)
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


def _sharded_state(trainer, is_loading: bool) -> dict:
    """{"model<i>": chunk sharded state, "optimizer": optimizer sharded state} (Megatron's layout)."""
    model_sd = {}
    for i, chunk in enumerate(trainer.model):
        model_sd[f"model{i}"] = chunk.sharded_state_dict()
    if is_loading:
        _prime_fresh_distributed_optimizer(trainer.optimizer)
    merged = {}
    for sd in model_sd.values():
        merged.update(sd)
    out = dict(model_sd)
    out["optimizer"] = trainer.optimizer.sharded_state_dict(merged, is_loading=is_loading, metadata=_optim_metadata())
    return out


def _dist_ckpt():
    import importlib

    from megatron.core import dist_checkpointing

    from megatron_search.distributed import cpu_compat

    # The save/load strategies are imported lazily by Megatron; load them now so the CPU compat
    # layer (a no-op on GPU) also redirects their torch.cuda calls.
    for name in _DIST_CKPT_MODULES:
        importlib.import_module(name)
    cpu_compat.rebind_new_modules()
    return dist_checkpointing


def _save_strategy():
    """Megatron's torch_dist format written synchronously in this process.

    Megatron's default torch_dist saver hands the write to forked worker processes and a spawned
    multiprocessing Manager; on CPU under gloo those workers hung our saves, and extra processes
    are a poor fit for a 2-core machine anyway. This strategy translates the sharded state dict
    with Megatron's own helpers and planner and writes it with torch.distributed.checkpoint's
    plain FileSystemWriter, so the result is the same torch_dist checkpoint Megatron loads.
    """
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed import checkpoint as dcp

    class SyncTorchDistSave(SaveShardedStrategy):
        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
            dcp.save(pyt_state_dict, storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))

    return SyncTorchDistSave("torch_dist", 1)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _agreed_nonce() -> str:
    """One staging-directory nonce for all ranks (rank 0 draws it, everyone receives it)."""
    box = [uuid.uuid4().hex[:12]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _optimizer_parts(optimizer) -> int:
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


def _layout(trainer) -> dict:
    p = trainer.cfg.parallel
    return {"world_size": trainer.ctx.world_size, "tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp, "ep": p.ep,
            "etp": p.etp}


# ---------------------------------------------------------------------------------- save / load
def write_run_state(trainer, directory: Path, extra: dict) -> None:
    """Every rank: write this rank's part of the checkpoint into `directory` (a staging dir)."""
    from megatron_search.config import dump_config

    rank = trainer.ctx.rank
    if rank == 0:
        (directory / MODEL_OPTIM).mkdir(parents=True, exist_ok=True)
        (directory / RNG_DIR).mkdir(parents=True, exist_ok=True)
    _barrier()
    _dist_ckpt().save(_sharded_state(trainer, is_loading=False), str(directory / MODEL_OPTIM),
                      sharded_strategy=_save_strategy())
    torch.save(capture_rng(), directory / RNG_DIR / f"rank_{rank:05d}.pt")
    if rank == 0:
        o = trainer.cfg.optim
        meta = {
            "format_version": FORMAT_VERSION,
            "iteration": trainer.iteration,
            "consumed_tokens": trainer.consumed_tokens,
            "total_steps": trainer.total_steps,
            "lr_schedule": {"lr": o.lr, "min_lr": o.min_lr, "schedule": o.lr_schedule,
                            "warmup_steps": o.warmup_steps, "total_steps": trainer.total_steps},
            "layout": _layout(trainer),
            "num_chunks": len(trainer.model),
            "optimizer_parts": _optimizer_parts(trainer.optimizer),
            "extra": extra,
        }
        (directory / TRAINER_JSON).write_text(json.dumps(meta, indent=1))
        (directory / CONFIG_YAML).write_text(dump_config(trainer.cfg))


def save_run(trainer, root: Path, extra: dict, write=write_run_state) -> Path:
    """Write and atomically publish checkpoint step_<iteration> under `root`; keeps the last N."""
    json.dumps(extra)  # fail before writing anything when extra is not JSON-serialisable
    return save_checkpoint(
        root,
        trainer.iteration,
        lambda staged: write(trainer, staged, extra),
        keep_last=trainer.cfg.checkpoint.keep_last,
        nonce=_agreed_nonce(),
        barrier=_barrier,
        is_rank0=trainer.ctx.rank == 0,
    )


def read_trainer_meta(path: Path) -> dict:
    f = Path(path) / TRAINER_JSON
    if not f.is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no {TRAINER_JSON})")
    meta = json.loads(f.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{f}: format_version {meta.get('format_version')} (this code reads {FORMAT_VERSION})")
    return meta


def load_run(trainer, path: Path) -> dict:
    """Every rank: restore model, optimizer, RNG, iteration and tokens from `path`; returns `extra`."""
    meta = read_trainer_meta(path)
    if meta["num_chunks"] != len(trainer.model):
        raise CheckpointError(f"{path}: {meta['num_chunks']} model chunk(s) saved, this run has {len(trainer.model)} "
                              "(virtual pipeline stages differ; convert the checkpoint)")
    saved_parts, parts = meta["optimizer_parts"], _optimizer_parts(trainer.optimizer)
    if saved_parts != parts:
        raise CheckpointError(
            f"{path}: the optimizer was saved in {saved_parts} part(s) (dense / expert-parallel groups), this run "
            f"has {parts}: Megatron splits expert parameters into their own optimizer only when EP > 1, so resume "
            f"with EP > 1 on both sides or EP = 1 on both (saved layout {meta['layout']})")
    state = _dist_ckpt().load(_sharded_state(trainer, is_loading=True), str(Path(path) / MODEL_OPTIM))
    for i, chunk in enumerate(trainer.model):
        chunk.load_state_dict(state[f"model{i}"])
    _load_keeping_torch_adam_step(trainer.optimizer)
    trainer.optimizer.load_state_dict(state["optimizer"])
    _unshare_torch_adam_steps(trainer.optimizer)
    trainer.iteration = int(meta["iteration"])
    trainer.consumed_tokens = int(meta["consumed_tokens"])
    rng_file = Path(path) / RNG_DIR / f"rank_{trainer.ctx.rank:05d}.pt"
    if meta["layout"] == _layout(trainer) and rng_file.is_file():
        restore_rng(torch.load(rng_file, weights_only=False))
    else:
        if trainer.ctx.rank == 0:
            log.warning("checkpoint %s was saved with layout %s, this run is %s: RNG states reseeded",
                        path, meta["layout"], _layout(trainer))
        reseed_rng(trainer.cfg.run.seed, trainer.iteration, trainer.ctx.rank)
    _barrier()
    return meta["extra"]
