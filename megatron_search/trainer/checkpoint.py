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
from megatron.core import tensor_parallel

from megatron_search.config import dump_config
from megatron_search.distributed import collectives as coll

from .checkpoint_dir import save_checkpoint
from .sharded_state import load_sharded, optimizer_parts, save_sharded

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
MODEL_OPTIM, RNG_DIR, TRAINER_JSON, CONFIG_YAML = "model_optim", "rng", "trainer.json", "config.yaml"


class CheckpointError(RuntimeError):
    """A checkpoint is missing a part or does not match the run loading it."""


# ---------------------------------------------------------------------------------- RNG
def capture_rng() -> dict:
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
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def reseed_rng(seed: int, iteration: int, rank: int) -> None:
    """Fresh, deterministic RNG states when a checkpoint's per-rank states do not fit this layout."""
    s = seed + 1_000_003 * iteration + rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    tensor_parallel.model_parallel_cuda_manual_seed(s)


# ---------------------------------------------------------------------------------- collectives, layout
def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        coll.barrier()


def _agreed_nonce() -> str:
    """One staging-directory nonce for all ranks (rank 0 draws it, everyone receives it)."""
    box = [uuid.uuid4().hex[:12]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _optimizer_buffers(trainer) -> dict:
    """What the distributed optimizer's flat buffers depend on besides the layout: which parameters train."""
    return {"distributed_optimizer": bool(trainer.cfg.parallel.distributed_optimizer), "mtp": bool(trainer.cfg.model.mtp),
            "mtp_trained": bool(trainer.cfg.model.mtp and getattr(trainer, "train_mtp", True))}


def _parallel_group(trainer):
    """With checkpoint.fully_parallel, the DP x CP group that shares the replicated tensors' writes."""
    group = getattr(trainer.ctx.groups, "dp_cp", None) if trainer.cfg.checkpoint.fully_parallel else None
    return group if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1 else None


def _layout(trainer) -> dict:
    p = trainer.cfg.parallel
    return {"world_size": trainer.ctx.world_size, "tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp, "ep": p.ep,
            "etp": p.etp}


# ---------------------------------------------------------------------------------- save / load
def write_run_state(trainer, directory: Path, extra: dict) -> None:
    """Every rank: write this rank's part of the checkpoint into `directory` (a staging dir)."""
    rank = trainer.ctx.rank
    if rank == 0:
        (directory / MODEL_OPTIM).mkdir(parents=True, exist_ok=True)
        (directory / RNG_DIR).mkdir(parents=True, exist_ok=True)
    _barrier()
    ck = trainer.cfg.checkpoint
    save_sharded(trainer.model, trainer.optimizer, directory / MODEL_OPTIM, optimizer_format=ck.optimizer_format,
                 threads=ck.write_threads, parallel_group=_parallel_group(trainer))
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
            "optimizer_parts": optimizer_parts(trainer.optimizer),
            "optimizer_format": ck.optimizer_format,
            "optimizer_buffers": _optimizer_buffers(trainer),
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
    saved_parts, parts = meta["optimizer_parts"], optimizer_parts(trainer.optimizer)
    if saved_parts != parts:
        raise CheckpointError(
            f"{path}: the optimizer was saved in {saved_parts} part(s) (dense / expert-parallel groups), this run "
            f"has {parts}: Megatron splits expert parameters into their own optimizer only when EP > 1, so resume "
            f"with EP > 1 on both sides or EP = 1 on both (saved layout {meta['layout']})")
    saved_format = meta.get("optimizer_format", "fully_reshardable")  # what checkpoints before the field were
    moved = {k: (v, _layout(trainer)[k]) for k, v in meta["layout"].items()
             if k != "world_size" and v != _layout(trainer)[k]}
    saved_buffers = meta.get("optimizer_buffers")
    if saved_format == "dp_reshardable" and saved_buffers is not None and saved_buffers != _optimizer_buffers(trainer):
        raise CheckpointError(
            f"{path}: the optimizer state was saved dp_reshardable with buffers of {saved_buffers}, this run has "
            f"{_optimizer_buffers(trainer)} (another set of trained parameters: e.g. GRPO freezes the MTP layer; or "
            "the distributed optimizer switched): its flat shards do not fit. Start from its weights only "
            "(checkpoint.load without checkpoint.resume), or save it fully_reshardable at its own settings first")
    if saved_format == "dp_reshardable" and moved:
        raise CheckpointError(
            f"{path}: the optimizer state was saved dp_reshardable, which loads only at the layout it was saved at "
            f"(but for DP); this run changes {', '.join(f'{k} {a} -> {b}' for k, (a, b) in moved.items())}. Convert "
            "first: resume it at its own layout with checkpoint.optimizer_format=fully_reshardable and save "
            "(e.g. sft.steps / grpo.steps = its iteration + 1, checkpoint.save_interval=1), then resume here")
    load_sharded(trainer.model, trainer.optimizer, Path(path) / MODEL_OPTIM, optimizer_format=saved_format)
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
