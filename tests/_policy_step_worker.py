"""Spawned worker for tests/test_train_policy_step.py (Megatron needs its own process)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

B, S = 4, 16
LENGTHS = (16, 5, 9, 2)  # each row's last trained position: the rest of the row is padding for the loss


def _setup(overrides, world, port, rank):
    from megatron_search.config import load_config
    from megatron_search.distributed import DistEnv, init_distributed

    cfg = load_config(None, [f"parallel.world_size={world}", "optim.lr=1e-4", *overrides])
    source = "single" if world == 1 else "torchrun"
    ctx = init_distributed(cfg, env=DistEnv(rank, world, rank, "127.0.0.1", port, source))
    return cfg, ctx


def _data(vocab, seed=7, rows=B, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, S + 1), generator=g)
    mask = (torch.rand(rows, S, generator=g) > 0.3).float()
    for i, n in enumerate(lengths):
        mask[i, 0] = mask[i, n - 1] = 1.0
        mask[i, n:] = 0.0
    delta = 0.2 * torch.randn(rows, S, generator=g)  # log pi - log mu, known exactly
    adv = torch.randn(rows, generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask, delta, adv


def expected_loss(delta, adv, mask, aggregation: str, norm: int) -> float:
    """The recipe's objective in float64, independently of rl/losses.py: r = pi/mu = exp(delta)."""
    per_token = torch.exp(delta.double()) * adv.double()[:, None] * mask.double()
    if aggregation == "token_mean":
        return float(-per_token.sum() / mask.sum())
    n_tok = mask.double().sum(-1)
    per_seq = per_token.sum(-1) / (norm if aggregation == "seq_mean_token_sum_norm" else n_tok.clamp(min=1))
    return float(-per_seq.sum() / (n_tok > 0).sum())


# (name, micro-batch rows, padding rows, token budget, trim): two padding rows make the 4 rollouts fill two
# micro-batches of 3; with micro-batches of 2 the third holds only padding (no trained token: it adds nothing,
# and must not raise). Budget 20 groups the rows longest first as [16], [9, 5] (2 x 9 = 18), [2].
RUNS = (("4+0", B, 0, None, True), ("1+0", 1, 0, None, True), ("3+2", 3, 2, None, True), ("2+2", 2, 2, None, True),
        ("2+0 untrimmed", 2, 0, None, False), ("budget20", 1, 0, 20, True), ("budget20+2", 1, 2, 20, True))


def worker(rank: int, world: int, port: int, overrides: list, out: str) -> None:
    from megatron_search.trainer.step import make_optimizer, wrap_ddp
    from megatron_search.models import reshard
    from megatron_search.models.provider import build_model_chunks
    from megatron_search.rl.registry import build_policy_loss
    from megatron_search.train.grpo import training_temperature
    from megatron_search.train.microbatches import Batching
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
        logp_all = torch.log_softmax(logits, -1)
        logp_ref = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # of the sampling distribution, float64
    batch = RolloutBatch(inputs, targets, (logp_ref - delta).float(), mask, adv)
    results = {"expected_entropy": float((entropy * mask.double()).sum() / mask.sum())}
    for name, rows, pad, budget, trim in RUNS:
        for chunk in chunks:
            reshard.load_full_state(chunk, full, chunk.config, ctx.groups)
        ddp = wrap_ddp(cfg, chunks, chunks[0].config)
        opt = make_optimizer(cfg, ddp)
        (m,) = policy_update(ddp, opt, batch.pad_rows(pad, pad_id=0), groups=ctx.groups,
                             policy_loss=build_policy_loss(cfg.grpo), aggregation=cfg.grpo.loss_aggregation,
                             batching=Batching(rows=rows, max_tokens=budget, trim=trim), temperature=temperature)
        results[name] = {k: m[k] for k in ("loss", "grad_norm", "positions_vs_longest", "positions_per_micro_batch",
                                           "micro_batches", "entropy")}
    results["expected_loss"] = expected_loss(delta, adv, mask, cfg.grpo.loss_aggregation, S)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    ctx.teardown()


RANK_LENGTHS = ((16, 5, 9, 2), (3, 4, 2, 16))  # budget 20: rank 0 makes 3 micro-batches, rank 1 2 (then split to 3)


def worker_dp(rank: int, world: int, port: int, overrides: list, out: str) -> None:
    """Two data-parallel ranks with rows of different lengths: the loss over both equals the float64 objective
    of all 8 rows with every batching; under the allgather dispatcher with EP=2 a token budget is refused."""
    from megatron_search.trainer.step import make_optimizer, wrap_ddp
    from megatron_search.models.provider import build_model_chunks
    from megatron_search.rl.registry import build_policy_loss
    from megatron_search.train.microbatches import Batching
    from megatron_search.train.policy_step import policy_update
    from megatron_search.train.rollout_batch import RolloutBatch

    cfg, ctx = _setup(overrides, world, port, rank)
    chunks = build_model_chunks(cfg, ctx.groups)
    initial = [{n: q.detach().clone() for n, q in c.named_parameters()} for c in chunks]  # this rank's experts only
    vocab = cfg.model.architecture.vocab_size
    data = [_data(vocab, seed=11 + r, lengths=RANK_LENGTHS[r]) for r in range(world)]
    inputs, targets, mask, delta, adv = data[rank]
    with torch.no_grad():
        pos = torch.arange(S).unsqueeze(0).expand(B, S)
        logp_ref = torch.log_softmax(chunks[0](inputs, pos, None).double(), -1).gather(
            -1, targets.unsqueeze(-1)).squeeze(-1)
    batch = RolloutBatch(inputs, targets, (logp_ref - delta).float(), mask, adv)
    results = {}
    for name, rows, budget, trim in (("4 untrimmed", B, None, False), ("1", 1, None, True), ("2", 2, None, True),
                                     ("budget20", 1, 20, True)):
        with torch.no_grad():
            for chunk, state in zip(chunks, initial):
                for n, q in chunk.named_parameters():
                    q.copy_(state[n])
        ddp = wrap_ddp(cfg, chunks, chunks[0].config)
        opt = make_optimizer(cfg, ddp)
        try:
            (m,) = policy_update(ddp, opt, batch, groups=ctx.groups, policy_loss=build_policy_loss(cfg.grpo),
                                 aggregation=cfg.grpo.loss_aggregation,
                                 batching=Batching(rows=rows, max_tokens=budget, trim=trim))
        except ValueError as e:
            results[name] = {"error": str(e)}
            continue
        results[name] = {k: m[k] for k in ("loss", "grad_norm", "positions_vs_longest", "micro_batches")}
    cat = lambda i: torch.cat([d[i] for d in data])  # noqa: E731
    results["expected_loss"] = expected_loss(cat(3), cat(4), cat(2), cfg.grpo.loss_aggregation, S)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    ctx.teardown()
