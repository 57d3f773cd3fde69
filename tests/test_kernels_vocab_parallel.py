"""Vocab-parallel fused logprob across 2 gloo processes equals the single-process result on the full vocabulary."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_search.kernels import linear_token_logprobs, token_logprobs

from _tolerance import entropy_tol, linear_logprob_tols, logprob_tol, softmax_grad_tol

pytestmark = pytest.mark.multiprocess

T, H, V = 11, 8, 301  # odd V: rank 0 holds 150 ids, rank 1 holds 151 (explicit vocab_start/vocab_size)
SPLIT = 150


def _data():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(T, V, generator=g) * 4
    logits[3, 200] = 40.0  # row 3: the max and the target live on rank 1
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, (T,), generator=g)
    targets[3] = 200
    targets[4] = 0
    logp_infer = -torch.rand(T, generator=g) * 5
    mask = torch.rand(T, generator=g) > 0.3
    w = torch.randn(3, T, generator=g)
    return logits, hidden, weight, targets, logp_infer, mask, w


def _run(logits, hidden, weight, targets, logp_infer, mask, w, group=None, lo=0, hi=V):
    kw = dict(logp_infer=logp_infer, mask=mask, with_entropy=True, group=group,
              vocab_start=lo if group is not None else None, vocab_size=V if group is not None else None)
    x = logits[:, lo:hi].clone().requires_grad_()
    a = token_logprobs(x, targets, **kw)
    (a.logp * w[0] + a.entropy * w[1] + a.ratio * w[2]).sum().backward()
    h = hidden.clone().requires_grad_()
    wt = weight[lo:hi].clone().requires_grad_()
    b = linear_token_logprobs(h, wt, targets, token_chunk=4, vocab_chunk=64, **kw)
    (b.logp * w[0] + b.entropy * w[1] + b.ratio * w[2]).sum().backward()
    return {
        "logp": a.logp.detach(), "entropy": a.entropy.detach(), "ratio": a.ratio.detach(), "k3": a.stats["k3"],
        "grad_logits": x.grad, "lin_logp": b.logp.detach(), "lin_entropy": b.entropy.detach(),
        "grad_hidden": h.grad, "grad_weight": wt.grad,
    }


def _worker(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        lo, hi = (0, SPLIT) if rank == 0 else (SPLIT, V)
        torch.save(_run(*_data(), group=dist.group.WORLD, lo=lo, hi=hi), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_equal_single_process(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    data = _data()
    full = _run(*data)
    logits, hidden, weight, _, _, _, w = data
    # Both sides are fp32 with other reduction orders (two vocab halves merged over the group, 64-wide vocab
    # chunks): each is within the worst-case bound of the exact value, so they differ by at most twice it.
    M = float(logits.abs().max())
    up, up_ent = float(w[0].abs().max() + (w[2] * full["ratio"]).abs().max()), float(w[1].abs().max())
    lin = linear_logprob_tols(hidden, weight, up, merges=4, entropy_upstream=up_ent)
    tol = {"logp": logprob_tol(M, V, merges=2), "entropy": entropy_tol(M, V, merges=2), "lin_logp": lin["logp"],
           "lin_entropy": lin["entropy"]}
    tol["ratio"] = tol["logp"] * float(full["ratio"].abs().max())
    tol["k3"] = tol["logp"] * (float(full["ratio"].abs().max()) + 1)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r, (lo, hi) in enumerate([(0, SPLIT), (SPLIT, V)]):
        got = ranks[r]
        for key in ("logp", "entropy", "ratio", "lin_logp", "lin_entropy", "k3"):
            assert (got[key] - full[key]).abs().max() <= 2 * tol[key], (r, key)
        assert (got["logp"] <= 0).all()
        assert (got["grad_logits"] - full["grad_logits"][:, lo:hi]).abs().max() <= 2 * softmax_grad_tol(up, M, V, merges=2, entropy_upstream=up_ent)
        assert (got["grad_weight"] - full["grad_weight"][lo:hi]).abs().max() <= 2 * lin["grad_weight"]
        # grad_hidden is all-reduced over the group, so every rank holds the full-vocabulary gradient
        assert (got["grad_hidden"] - full["grad_hidden"]).abs().max() <= 2 * lin["grad_hidden"]
