"""Spawned workers for tests/test_rm_parallel.py: the reward model gives the same last-token values,
symmetric-BT loss and global grad norm at 1 process and on 2 gloo processes with TP=2 (sequence
parallel), EP=2 and PP=2, from the same full weights (models/reshard.py slicing) and pairs."""
from __future__ import annotations

import json
from pathlib import Path

import torch

LAYOUTS = {
    "tp2_sp": ["parallel.tp=2", "parallel.etp=2", "parallel.sequence_parallel=true"],
    "ep2": ["parallel.ep=2"],
    "pp2": ["parallel.pp=2"],
}
PAIRS, SEQ = 4, 16
MICRO_ROWS = {"reference": 8, "tp2_sp": 4, "ep2": 2, "pp2": 2}  # ep2: DP=2, so 4 rows per rank


def _config(overrides: list[str], world: int):
    from megatron_search.config import load_config

    return load_config(None, [f"parallel.world_size={world}", "optim.lr=1e-3", "reward.scorer=pointwise", *overrides])


def _batch():
    from megatron_search.rm.scorer import make_batch

    g = torch.Generator().manual_seed(99)
    lengths = torch.randint(9, SEQ + 1, (2 * PAIRS,), generator=g).tolist()
    rows = [torch.randint(10, 2048, (n,), generator=g).tolist() for n in lengths]
    labels = torch.randint(0, 2, (PAIRS,), generator=g).repeat_interleave(2).tolist()
    return make_batch(rows, pad_id=0, labels=labels, min_length=SEQ)


def _run(cfg, ctx, full: dict | None, micro_rows: int):
    from megatron_search.models import reshard
    from megatron_search.rm.scorer import forward_values
    from megatron_search.rm.train import RMTrainer, _global_sums, _loss_fn

    trainer = RMTrainer(cfg, ctx, total_steps=1)
    saved = None
    if full is None:
        saved = reshard.full_state(trainer.model[0])
    else:
        for chunk in trainer.model:
            reshard.load_full_state(chunk, full, chunk.config, ctx.groups)
    batch = _batch()
    values = forward_values(trainer.model, batch, micro_rows, ctx.groups)
    sink: list = []
    m = trainer.step(trainer.dp_slice(batch), _loss_fn("pointwise", sink), micro_rows)
    correct, margin, pairs = _global_sums(sink, ctx.groups).tolist()  # the logged accuracy / margin, reduced over DP and PP
    return {"values": values.tolist(), "loss": m["loss"], "grad_norm": m["grad_norm"], "correct": correct,
            "margin_sum": margin, "pairs": pairs}, saved


def reference_worker(rank: int, world: int, port: int, out: str) -> None:
    from megatron_search.distributed import DistEnv, init_distributed

    cfg = _config([], 1)
    ctx = init_distributed(cfg, env=DistEnv(0, 1, 0, "127.0.0.1", port, "single"))
    result, saved = _run(cfg, ctx, None, MICRO_ROWS["reference"])
    torch.save(saved, Path(out) / "full.pt")
    (Path(out) / "reference.json").write_text(json.dumps(result))
    ctx.teardown()


def layouts_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from megatron_search.distributed import DistEnv, init_distributed

    env = DistEnv(rank, world, rank, "127.0.0.1", port, "torchrun")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    full = torch.load(Path(out) / "full.pt")
    results = {}
    for name, overrides in LAYOUTS.items():
        cfg = _config(overrides, world)
        ctx = init_distributed(cfg, env=env)
        results[name], _ = _run(cfg, ctx, full, MICRO_ROWS[name])
        ctx.teardown()
    (Path(out) / f"layouts_rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
