"""Streaming softmax statistics: the state the fused logprob kernels carry over vocabulary chunks.

Per row (token) the state is four fp32 numbers, updated chunk by chunk so no [T, V] fp32 tensor
ever exists:
    m   running max of the logits seen so far
    s   sum_j exp(x_j - m)
    w   sum_j exp(x_j - m) * (x_j - m)      (only when entropy is wanted)
    xt  the target's logit (0 until the chunk holding the target has been seen)
From it: lse = m + log s, logp = xt - lse, entropy = log s - w / s.
Keeping `w` relative to `m` (instead of sum p*x) keeps entropy exact for logits of magnitude 1e4.

Invariant that makes logp <= 0 exact in floating point: the element that attains the final max
contributed exp(0) = 1 to `s`, sums of non-negative terms never round below an addend, so s >= 1,
log s >= 0, lse >= m >= xt (xt is one of the same fp32 values the max was taken over).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

NEG_INF = float("-inf")


@dataclass
class SoftmaxStats:
    """Row-wise streaming state (all fp32, shape [T], contiguous)."""

    m: torch.Tensor
    s: torch.Tensor
    w: Optional[torch.Tensor]
    xt: torch.Tensor

    @classmethod
    def empty(cls, rows: int, device: torch.device, with_entropy: bool) -> "SoftmaxStats":
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            m=torch.full((rows,), NEG_INF, **f32),
            s=torch.zeros(rows, **f32),
            w=torch.zeros(rows, **f32) if with_entropy else None,
            xt=torch.zeros(rows, **f32),
        )

    def rows(self, start: int, stop: int) -> "SoftmaxStats":
        """A view of rows [start, stop): updates through it land in this state."""
        return SoftmaxStats(
            self.m[start:stop], self.s[start:stop], None if self.w is None else self.w[start:stop], self.xt[start:stop]
        )


def rescale(m_old: torch.Tensor, s: torch.Tensor, w: Optional[torch.Tensor], m_new: torch.Tensor):
    """Express (s, w) taken relative to m_old relative to m_new >= m_old; empty rows (m_old=-inf) give 0."""
    empty = m_old == NEG_INF
    m_new_safe = torch.where(m_new == NEG_INF, torch.zeros_like(m_new), m_new)
    scale = torch.where(empty, torch.zeros_like(m_old), torch.exp(m_old - m_new_safe))
    s_new = s * scale
    w_new = None
    if w is not None:
        shift = torch.where(empty, torch.zeros_like(m_old), (m_old - m_new_safe) * s)
        w_new = scale * (w + shift)
    return s_new, w_new


def finalize_torch(stats: SoftmaxStats, logp_infer: Optional[torch.Tensor], mask: Optional[torch.Tensor]):
    """(lse, logp, entropy or None, ratio or None, dratio_dlogp or None) from a complete state.

    ratio = exp(logp - logp_infer) on masked-in tokens and exactly 1 (constant, zero gradient) on
    masked-out ones, so padding with logp_infer = -inf cannot turn a loss into NaN.
    """
    log_s = torch.log(stats.s).clamp_min(0.0)  # s >= 1 by construction; the clamp guards log's rounding
    lse = stats.m + log_s
    logp = stats.xt - lse
    entropy = None if stats.w is None else log_s - stats.w / stats.s
    ratio = dratio = None
    if logp_infer is not None:
        ratio = torch.exp(logp - logp_infer)
        dratio = ratio
        if mask is not None:
            ratio = torch.where(mask, ratio, torch.ones_like(ratio))
            dratio = torch.where(mask, ratio, torch.zeros_like(ratio))
    return lse, logp, entropy, ratio, dratio
