"""The GRPO batch reaches each rank as its data-parallel slice, with the routed experts of its own
layers only (4 gloo processes: TP2 x PP2 and EP2 x PP2, the layers found from the built model chunks).

Every rank checks what it got against the driver's batch sliced independently here: rows of its
replica, expert columns of its stage's layers; and the bytes it received against the whole batch.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _mp import run_spawned

pytestmark = pytest.mark.multiprocess

B, S, L, K = 8, 6, 4, 2
LAYOUTS = {"tp2_pp2": ["parallel.tp=2", "parallel.etp=2", "parallel.pp=2", "parallel.sequence_parallel=true"],
           "ep2_pp2": ["parallel.ep=2", "parallel.pp=2"]}


def _batch():
    from megatron_search.train.rollout_batch import RolloutBatch

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 100, (B, S), generator=g)
    experts = torch.randint(0, 8, (B, S, L, K), generator=g, dtype=torch.int64).to(torch.int32)
    return RolloutBatch(tokens, tokens.roll(-1, 1), torch.randn(B, S, generator=g), torch.ones(B, S),
                        torch.randn(B, generator=g), experts)


def worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_search.config import load_config
    from megatron_search.distributed import DistEnv, init_distributed
    from megatron_search.models.provider import build_model_chunks
    from megatron_search.models.routing_replay import moe_routers
    from megatron_search.train.batch_scatter import BatchScatter, batch_nbytes

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    env = DistEnv(rank, world, rank, "127.0.0.1", port, "torchrun")
    results = {}
    for name, overrides in LAYOUTS.items():
        cfg = load_config(None, [f"parallel.world_size={world}", *overrides])
        ctx = init_distributed(cfg, env=env)
        layers = [layer for layer, _ in moe_routers(build_model_chunks(cfg, ctx.groups))]
        scatter = BatchScatter(ctx.groups, moe_layers=layers)
        full = _batch()
        got, stats = scatter.scatter(full if rank == 0 else None)
        dp, d = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        n = B // dp
        want = full.slice(d * n, (d + 1) * n)
        results[name] = {
            "layers": layers, "expert_layers": list(got.expert_layers), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "rows_equal": all(torch.equal(a, b) for a, b in [(got.tokens_BS, want.tokens_BS),
                                                            (got.logp_infer_BS, want.logp_infer_BS),
                                                            (got.advantages_B, want.advantages_B)]),
            "experts_equal": torch.equal(got.routed_experts_BSLK, want.routed_experts_BSLK[:, :, layers]),
            "received": batch_nbytes(got), "total": batch_nbytes(full), "stats": stats,
        }
        ctx.teardown()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_each_rank_gets_its_rows_and_its_stages_experts(tmp_path):
    run_spawned(worker, 4, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for name in LAYOUTS:
        for r in ranks:
            got = r[name]
            assert got["rows_equal"] and got["experts_equal"], (name, got)
            assert got["expert_layers"] == got["layers"] == [2 * got["pp_rank"], 2 * got["pp_rank"] + 1], (name, got)
        total = ranks[0][name]["total"]
        dp = 1 if name == "tp2_pp2" else 2
        rows = total - B * S * L * K * 4  # the batch without its int32 experts
        for r in ranks:
            # its replica's rows and half of their expert columns (2 of 4 layers)
            assert r[name]["received"] == (rows + B * S * L * K * 4 // 2) // dp, (name, r[name])
        stats = ranks[0][name]["stats"]
        print(f"{name}: batch {total} B, each rank received {[r[name]['received'] for r in ranks]} B")
        assert stats["batch/max_rank_received_MB"] * 2**20 == max(r[name]["received"] for r in ranks[1:])
