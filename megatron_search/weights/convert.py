"""Command-line conversion HF <-> Megatron distributed checkpoint (shared by tools/ and the CLI).

    python tools/convert_hf_to_mcore.py --hf DIR --out DIR [--tp 2 --pp 2 --ep 2]
    python tools/convert_mcore_to_hf.py --mcore DIR --out DIR [--tp 1 ...] [--dtype bfloat16]

The layout flags say how many ranks convert (TP x PP x EP processes, spawned locally unless
launched by torchrun/srun); the Megatron checkpoint itself is layout-free and loads at any layout.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

import torch

from megatron_search.config.loader import load_config
from megatron_search.distributed.init import init_distributed
from megatron_search.weights.checkpoint import hf_to_mcore, mcore_to_hf
from megatron_search.weights.launch import run_ranks
from megatron_search.weights.sources import EXTRA_DIR, run_checkpoint_step, source_problem


def world_size_for(tp: int, pp: int, ep: int, etp: int) -> int:
    """Smallest world for the layout: EP x ETP must divide the TP x DP ranks of a pipeline stage."""
    return pp * math.lcm(tp, ep * etp)


def _overrides(hf_config: str, tp: int, pp: int, ep: int, etp: int, extra: Sequence[str]) -> list[str]:
    # Every layout field is set: a training run's config.yaml (the source of a run checkpoint's conversion) has
    # its own, e.g. sequence parallel (Megatron refuses it at TP=1) or virtual stages (refused at PP=1).
    return [f"model.hf_config={hf_config}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}",
            f"parallel.etp={etp}", f"parallel.world_size={world_size_for(tp, pp, ep, etp)}", "parallel.cp=1",
            f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}",  # Megatron MoE with TP needs it
            "parallel.vpp=null", *extra]


def _rank_main(direction: str, config: Optional[str], overrides: list[str], src: str, dst: str, opts: dict):
    cfg = load_config(config, overrides)
    ctx = init_distributed(cfg)
    try:
        if direction == "hf_to_mcore":
            hf_to_mcore(cfg, src, dst, ctx.groups, progress=opts.get("progress", True))
            return None
        dtype = getattr(torch, opts["dtype"]) if opts.get("dtype") else None
        bucket = opts["bucket_mb"] << 20 if opts["bucket_mb"] else cfg.weight_bucket_bytes()
        return mcore_to_hf(cfg, src, dst, ctx.groups, bucket_bytes=bucket,
                           max_shard_bytes=opts["shard_mb"] << 20, out_dtype=dtype,
                           progress=opts.get("progress", True))
    finally:
        ctx.teardown()


def convert(direction: str, src: str | Path, dst: str | Path, *, config: Optional[str] = None,
            hf_config: Optional[str] = None, tp: int = 1, pp: int = 1, ep: int = 1, etp: Optional[int] = None,
            overrides: Sequence[str] = (), bucket_mb: Optional[int] = None, shard_mb: int = 4096,
            dtype: Optional[str] = None, progress: bool = True):
    """Run one conversion on tp*pp*ep ranks; returns rank 0's summary (mcore_to_hf) or None.

    mcore_to_hf also takes a training run's checkpoint (an SFT or GRPO run's step directory, or its checkpoint
    root): its model weights are read, and the run's own config (config.yaml) names the architecture and the
    HF directory whose tokenizer, chat template and processor files go beside the weights."""
    if direction not in ("hf_to_mcore", "mcore_to_hf"):
        raise ValueError(f"direction must be hf_to_mcore or mcore_to_hf, got {direction!r}")
    problem = source_problem(direction, src, hf_config)
    if problem:
        raise FileNotFoundError(problem)
    step = run_checkpoint_step(Path(src)) if direction == "mcore_to_hf" else None
    if step is not None:
        src, config = step / "model_optim", config or str(step / "config.yaml")
        if hf_config is None:
            hf_config = str(load_config(config).model.resolved_hf_config())
    src, dst = str(Path(src).resolve()), str(Path(dst).resolve())
    if etp is None:  # Megatron: without EP the experts are sharded like the dense layers
        etp = tp if ep == 1 else 1
    if hf_config is None:
        hf_config = src if direction == "hf_to_mcore" else str(Path(src) / EXTRA_DIR)
    if not (Path(hf_config) / "config.json").is_file() and not Path(hf_config).is_file():
        raise FileNotFoundError(f"{hf_config}: no config.json (pass --hf-config)")
    ov = _overrides(hf_config, tp, pp, ep, etp, overrides)
    opts = dict(bucket_mb=bucket_mb, shard_mb=shard_mb, dtype=dtype, progress=progress)
    world = world_size_for(tp, pp, ep, etp)
    results = run_ranks(_rank_main, world, direction, config, ov, src, dst, opts)
    return results[0]
