"""Spawned worker for tests/test_train_policy_step.py (Megatron needs its own process)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

B, S = 4, 16


def _setup(overrides, world, port, rank):
    from megatron_search.config import load_config
    from megatron_search.distributed import DistEnv, init_distributed

    cfg = load_config(None, [f"parallel.world_size={world}", "optim.lr=1e-4", *overrides])
    source = "single" if world == 1 else "torchrun"
    ctx = init_distributed(cfg, env=DistEnv(rank, world, rank, "127.0.0.1", port, source))
    return cfg, ctx


def _data(vocab):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (B, S + 1), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    delta = 0.2 * torch.randn(B, S, generator=g)  # log pi - log mu, known exactly
    adv = torch.randn(B, generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask, delta, adv


def worker(rank: int, world: int, port: int, overrides: list, out: str) -> None:
    from megatron_search.trainer.step import make_optimizer, wrap_ddp
    from megatron_search.models import reshard
    from megatron_search.models.provider import build_model_chunks
    from megatron_search.rl.registry import build_policy_loss
    from megatron_search.train.grpo import training_temperature
    from megatron_search.train.policy_step import policy_update
    from megatron_search.train.rollout_batch import RolloutBatch

    cfg, ctx = _setup(overrides, world, port, rank)
    chunks = build_model_chunks(cfg, ctx.groups)
    full = reshard.full_state(chunks[0])
    vocab = cfg.model.architecture.vocab_size
    inputs, targets, mask, delta, adv = _data(vocab)
    temperature = training_temperature(cfg.rollout)
    with torch.no_grad():  # reference log pi of the targets (at the sampling temperature), float64
        pos = torch.arange(S).unsqueeze(0).expand(B, S)
        logits = chunks[0](inputs, pos, None).double() / cfg.rollout.temperature
        logp_ref = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    batch = RolloutBatch(inputs, targets, (logp_ref - delta).float(), mask, adv)
    results = {}
    # (micro-batch size, padding rows): two padding rows make the 4 rollouts fill two micro-batches of 3;
    # with micro-batches of 2 the third holds only padding (no trained token: it adds nothing, and must not raise).
    for mbs, pad in ((B, 0), (1, 0), (3, 2), (2, 2)):
        for chunk in chunks:
            reshard.load_full_state(chunk, full, chunk.config, ctx.groups)
        ddp = wrap_ddp(cfg, chunks, chunks[0].config)
        opt = make_optimizer(cfg, ddp)
        (m,) = policy_update(ddp, opt, batch.pad_rows(pad, pad_id=0), groups=ctx.groups,
                             policy_loss=build_policy_loss(cfg.grpo),
                             aggregation=cfg.grpo.loss_aggregation, micro_batch_size=mbs, temperature=temperature)
        results[f"{mbs}+{pad}"] = {"loss": m["loss"], "grad_norm": m["grad_norm"]}
    # Independent float64 value of the recipe's objective: r = pi/mu = exp(delta).
    r = torch.exp(delta.double())
    per_seq = (r * adv.double()[:, None] * mask).sum(-1) / mask.sum(-1)
    results["expected_loss"] = float(-per_seq.mean())
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    ctx.teardown()
