"""Spawned ranks of tests/test_routing_replay_recompute.py: one GRPO policy update per setting, same weights,
same rollouts, same forced experts; saves every parameter's reduced gradient (main_grad) per setting."""
from __future__ import annotations

from pathlib import Path

import torch

B, S = 4, 16
# name: (routing replay, recompute overrides, updates per batch)
SETTINGS = {
    "replay": (True, [], 1),
    "replay_full": (True, ["model.recompute=full"], 1),
    "replay_selective_moe": (True, ["model.recompute=selective", "model.recompute_modules=[moe]"], 1),
    "replay_updates2": (True, [], 2),
    "replay_full_updates2": (True, ["model.recompute=full"], 2),
    "natural_full": (False, ["model.recompute=full"], 1),  # control: the router's own choices
}


def _forced_experts(num_layers: int, num_experts: int, k: int) -> torch.Tensor:
    """[B, S, L, K] distinct random experts per token and layer (not what the router would pick)."""
    g = torch.Generator().manual_seed(11)
    return torch.rand(B, S, num_layers, num_experts, generator=g).argsort(-1)[..., :k].contiguous()


def worker(rank: int, world: int, port: int, arch_dir: str, layout: list, out: str, shared: str) -> None:
    """`out`: this world size's results; `shared`: the full weights (written by the 1-process run)."""
    from megatron_search.config import load_config
    from megatron_search.distributed import DistEnv, init_distributed
    from megatron_search.trainer.step import make_optimizer, wrap_ddp
    from megatron_search.models import reshard
    from megatron_search.models.provider import architecture_module, build_model_chunks
    from megatron_search.rl.registry import build_policy_loss
    from megatron_search.train.microbatches import Batching
    from megatron_search.train.policy_step import policy_update
    from megatron_search.train.rollout_batch import RolloutBatch

    import torch.distributed as dist

    env = DistEnv(rank, world, rank, "127.0.0.1", port, "torchrun")
    # One process group for every setting (init_distributed reuses it and re-creates Megatron's groups):
    # re-creating the default group on the same port races its own teardown.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    full = None
    results = {}
    for name, (replay, recompute, updates) in SETTINGS.items():
        cfg = load_config(None, [f"model.hf_config={arch_dir}", f"parallel.world_size={world}", "optim.lr=1e-3",
                                 "grpo.routing_replay=true", f"grpo.updates_per_batch={updates}", *layout, *recompute])
        ctx = init_distributed(cfg, env=env)
        chunks = build_model_chunks(cfg, ctx.groups, routing_replay=cfg.grpo.routing_replay)
        if full is None:  # every setting starts from the first build's weights (world 1: the whole model)
            full = torch.load(Path(shared) / "full.pt") if world > 1 else reshard.full_state(chunks[0])
            if world == 1:
                torch.save(full, Path(shared) / "full.pt")
        tp_slice = getattr(architecture_module(cfg)[0], "tp_slice", None)
        for chunk in chunks:
            reshard.load_full_state(chunk, full, chunk.config, ctx.groups, tp_slice=tp_slice)
        a = cfg.model.architecture
        g = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, a.vocab_size, (B, S + 1), generator=g)
        mask = torch.ones(B, S)
        logp_infer = -3.0 + 0.1 * torch.randn(B, S, generator=g)
        adv = torch.randn(B, generator=g)
        batch = RolloutBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), logp_infer, mask, adv,
                             _forced_experts(a.num_layers, a.num_experts, a.moe_top_k))
        ddp = wrap_ddp(cfg, chunks, chunks[0].config)
        opt = make_optimizer(cfg, ddp)
        history = policy_update(ddp, opt, batch, groups=ctx.groups, policy_loss=build_policy_loss(cfg.grpo),
                                aggregation=cfg.grpo.loss_aggregation, batching=Batching(rows=1), updates=updates,
                                replay=replay)
        grads = {n.removeprefix("module."): p.main_grad.detach().clone() for m in ddp for n, p in m.named_parameters()}
        torch.save(grads, Path(out) / f"{name}_rank{rank}.pt")
        results[name] = history[-1]
        ctx.teardown()
    torch.save(results, Path(out) / f"metrics_rank{rank}.pt")
    dist.destroy_process_group()
