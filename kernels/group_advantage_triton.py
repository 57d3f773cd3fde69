"""Triton twin of `group_advantage.group_advantages_torch`: one program per group.

Each program reads its group's rewards (three short passes over at most a few dozen values: sum and
max/min, centred sum of squares, write) and then writes every token of every rollout of the group,
so a whole batch takes one launch.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .group_advantage import GroupAdvantages

ROLLOUT_BLOCK = 32
TOKEN_BLOCK = 1024


@triton.jit
def _group_adv_kernel(
    r_ptr, goff_ptr, toff_ptr, adv_ptr, tok_ptr, eps,
    STD: tl.constexpr, UNBIASED: tl.constexpr, HAS_TOK: tl.constexpr, BLOCK: tl.constexpr, TOK_BLOCK: tl.constexpr,
):
    g = tl.program_id(0)
    start = tl.load(goff_ptr + g)
    end = tl.load(goff_ptr + g + 1)
    n = (end - start).to(tl.float32)
    # typed scalars: loop-carried values must keep one type in compiled Triton
    total = tl.full([], 0.0, tl.float32)
    hi = tl.full([], float("-inf"), tl.float32)
    lo = tl.full([], float("inf"), tl.float32)
    for i0 in range(start, end, BLOCK):
        idx = i0 + tl.arange(0, BLOCK)
        ok = idx < end
        r = tl.load(r_ptr + idx, mask=ok, other=0.0).to(tl.float32)
        total += tl.sum(r, axis=0)
        hi = tl.maximum(hi, tl.max(tl.where(ok, r, float("-inf")), axis=0))
        lo = tl.minimum(lo, tl.min(tl.where(ok, r, float("inf")), axis=0))
    mean = total / tl.maximum(n, 1.0)
    constant = hi == lo
    denom = 1.0
    if STD:
        ss = tl.full([], 0.0, tl.float32)
        for i0 in range(start, end, BLOCK):
            idx = i0 + tl.arange(0, BLOCK)
            ok = idx < end
            c = tl.where(ok, tl.load(r_ptr + idx, mask=ok, other=0.0).to(tl.float32) - mean, 0.0)
            ss += tl.sum(c * c, axis=0)
        if UNBIASED:
            dof = tl.maximum(n - 1.0, 1.0)
        else:
            dof = tl.maximum(n, 1.0)
        denom = tl.sqrt(ss / dof) + eps
    denom = tl.where(constant, 1.0, denom)  # constant group (std 0, eps may be 0): advantages are 0 anyway
    for i0 in range(start, end, BLOCK):
        idx = i0 + tl.arange(0, BLOCK)
        ok = idx < end
        c = tl.load(r_ptr + idx, mask=ok, other=0.0).to(tl.float32) - mean
        tl.store(adv_ptr + idx, tl.where(constant, 0.0, c / denom), mask=ok)
    if HAS_TOK:
        for i in range(start, end):
            # recomputed, not re-read: other lanes' stores above are not guaranteed visible yet
            a = (tl.load(r_ptr + i).to(tl.float32) - mean) / denom
            a = tl.where(constant, 0.0, a)
            t_start = tl.load(toff_ptr + i)
            t_end = tl.load(toff_ptr + i + 1)
            for t0 in range(t_start, t_end, TOK_BLOCK):
                offs = t0 + tl.arange(0, TOK_BLOCK)
                tl.store(tok_ptr + offs, tl.zeros([TOK_BLOCK], dtype=tl.float32) + a, mask=offs < t_end)


def group_advantages_triton(
    rewards: torch.Tensor, group_offsets: torch.Tensor, token_offsets: Optional[torch.Tensor],
    std_normalize: bool, eps: float, unbiased: bool,
) -> GroupAdvantages:
    """Triton twin of `group_advantages_torch` (same signature and results)."""
    adv = torch.empty(rewards.shape, dtype=torch.float32, device=rewards.device)
    tok = None
    if token_offsets is not None:
        tok = torch.empty(int(token_offsets[-1]), dtype=torch.float32, device=rewards.device)
    k = group_offsets.numel() - 1
    if k > 0:
        _group_adv_kernel[(k,)](
            rewards, group_offsets, token_offsets if token_offsets is not None else group_offsets,
            adv, tok if tok is not None else adv, float(eps),
            STD=std_normalize, UNBIASED=unbiased, HAS_TOK=tok is not None, BLOCK=ROLLOUT_BLOCK, TOK_BLOCK=TOKEN_BLOCK,
        )
    return GroupAdvantages(adv, tok)
