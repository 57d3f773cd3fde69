"""Torch reference of the fused-logprob primitives (the CPU fast path).

Two primitives, mirrored with identical signatures by `logprob_triton.py`:
  online_stats_torch  fold a block of logits [R, C] into the streaming state (softmax_stats.py)
  write_grad_torch    write d(loss)/d(logits) for a block, given the final lse (and entropy)
Both walk the block in tiles of `block_rows` x `block_cols`, so the largest fp32 temporary is one
tile, never [T, V]. `out` in write_grad may be `logits` itself: each tile is read into an fp32
temporary before the tile is overwritten, which is what makes the in-place backward safe.
Column c of a block holds vocabulary id `vocab_offset + c`.
"""
from __future__ import annotations

from typing import Optional

import torch

from .softmax_stats import NEG_INF, SoftmaxStats, rescale

# Tile of the torch path: 64 x 8192 fp32 = 2 MiB per temporary (fits in L2, few Python steps).
TORCH_BLOCK_ROWS = 64
TORCH_BLOCK_COLS = 8192
# log-probabilities below this are clamped where they multiply an exp(): exp underflows to exactly 0
# in fp32 already near -104, so the clamp changes no result and turns 0 * -inf (NaN) into 0 * -1000.
LOG_FLOOR = -1000.0


def _target_in_tile(targets: torch.Tensor, first_id: int, width: int):
    local = targets - first_id
    hit = (local >= 0) & (local < width)
    return hit, local.clamp(0, width - 1)


def online_stats_torch(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_offset: int,
    stats: SoftmaxStats,
    *,
    block_rows: int = TORCH_BLOCK_ROWS,
    block_cols: int = TORCH_BLOCK_COLS,
) -> None:
    """Update `stats` (rows of `logits`) in place with the columns of `logits`."""
    n_rows, n_cols = logits.shape
    for r0 in range(0, n_rows, block_rows):
        r1 = min(r0 + block_rows, n_rows)
        st = stats.rows(r0, r1)
        tgt = targets[r0:r1]
        for c0 in range(0, n_cols, block_cols):
            c1 = min(c0 + block_cols, n_cols)
            x = logits[r0:r1, c0:c1].to(torch.float32, copy=True)  # own buffer: modified below
            m_new = torch.maximum(st.m, x.amax(dim=1))
            s_old, w_old = rescale(st.m, st.s, st.w, m_new)
            m_safe = torch.where(m_new == NEG_INF, torch.zeros_like(m_new), m_new)
            hit, col = _target_in_tile(tgt, vocab_offset + c0, c1 - c0)
            st.xt.add_(torch.where(hit, x.gather(1, col[:, None]).squeeze(1), torch.zeros_like(m_new)))
            if st.w is None:
                e = x.sub_(m_safe[:, None]).exp_()  # exp(x - m), reusing the tile's buffer
            else:
                d = x.sub_(m_safe[:, None]).clamp_min_(LOG_FLOOR)
                e = torch.exp(d)
                st.w.copy_(w_old + (e * d).sum(dim=1))
            st.s.copy_(s_old + e.sum(dim=1))
            st.m.copy_(m_new)


def write_grad_torch(
    logits: torch.Tensor,
    out: torch.Tensor,
    targets: torch.Tensor,
    vocab_offset: int,
    lse: torch.Tensor,
    entropy: Optional[torch.Tensor],
    g_logp: torch.Tensor,
    g_entropy: Optional[torch.Tensor],
    *,
    block_rows: int = TORCH_BLOCK_ROWS,
    block_cols: int = TORCH_BLOCK_COLS,
) -> None:
    """out[i, j] = g_logp_i * (1[j = t_i] - p_ij) - g_entropy_i * p_ij * (log p_ij + H_i).

    p_ij = exp(x_ij - lse_i). Terms with p = 0 (logit -inf) are 0. `out` may alias `logits`.
    Computed as p * c with c = -(g_logp + g_entropy * (H + max(log p, LOG_FLOOR))): one addcmul.
    """
    n_rows, n_cols = logits.shape
    for r0 in range(0, n_rows, block_rows):
        r1 = min(r0 + block_rows, n_rows)
        tgt, g = targets[r0:r1], g_logp[r0:r1, None]
        for c0 in range(0, n_cols, block_cols):
            c1 = min(c0 + block_cols, n_cols)
            logq = logits[r0:r1, c0:c1].to(torch.float32, copy=True).sub_(lse[r0:r1, None])
            if g_entropy is None:
                grad = logq.exp_().mul_(-g)
            else:
                g_ent = g_entropy[r0:r1, None]
                logq.clamp_min_(LOG_FLOOR)
                coef = torch.addcmul(-(g + g_ent * entropy[r0:r1, None]), logq, g_ent, value=-1.0)
                grad = logq.exp_().mul_(coef)
            hit, col = _target_in_tile(tgt, vocab_offset + c0, c1 - c0)
            grad.scatter_add_(1, col[:, None], torch.where(hit, g_logp[r0:r1], torch.zeros_like(lse[r0:r1]))[:, None])
            out[r0:r1, c0:c1].copy_(grad)
