"""Triton versions of the fused-logprob primitives; signatures match `logprob_torch.py`.

One program per row walks the vocabulary in BLOCK_COLS-wide tiles held in registers, so the only
memory traffic is one read of the logits (forward) and one read + one write (backward, which may
write into the logits' own storage). Strides are passed explicitly: any 2-D layout with a
positive column stride works. Row offsets are computed in int64 (T * V exceeds 2**31 at 16k
tokens x 248k vocab). On CPU these run only under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .softmax_stats import SoftmaxStats

# Columns per tile: 4096 fp32 values per program keep registers busy without spilling on
# current GPUs (blocks narrower than that use the next power of two of their width);
# `block_rows` is accepted for signature parity (one program per row here).
TRITON_BLOCK_COLS = 4096
FINALIZE_BLOCK = 1024


@triton.jit
def _online_stats_kernel(
    x_ptr, stride_xr, stride_xc, n_cols, tgt_ptr, vocab_offset,
    m_ptr, s_ptr, w_ptr, xt_ptr,
    HAS_W: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    m = tl.load(m_ptr + row)
    s = tl.load(s_ptr + row)
    w = tl.load(w_ptr + row) if HAS_W else 0.0
    xt = tl.load(xt_ptr + row)
    tgt = tl.load(tgt_ptr + row).to(tl.int64) - vocab_offset
    row_ptr = x_ptr + row.to(tl.int64) * stride_xr
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        valid = cols < n_cols
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_xc, mask=valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        empty = m == float("-inf")
        scale = tl.where(empty, 0.0, tl.exp(m - m_safe))
        d = x - m_safe
        e = tl.exp(d)
        if HAS_W:
            # -inf logits give e = 0 and d = -inf: select before multiplying so no NaN is formed
            shift = tl.where(empty, 0.0, m - m_safe) * s
            w = scale * (w + shift) + tl.sum(e * tl.where(e > 0, d, 0.0), axis=0)
        s = s * scale + tl.sum(e, axis=0)
        xt += tl.sum(tl.where(valid & (cols == tgt), x, 0.0), axis=0)  # padding lanes may equal tgt
        m = m_new
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    if HAS_W:
        tl.store(w_ptr + row, w)
    tl.store(xt_ptr + row, xt)


@triton.jit
def _write_grad_kernel(
    x_ptr, stride_xr, stride_xc, out_ptr, stride_or, stride_oc, n_cols, tgt_ptr, vocab_offset,
    lse_ptr, ent_ptr, glogp_ptr, gent_ptr,
    HAS_ENT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    lse = tl.load(lse_ptr + row)
    g = tl.load(glogp_ptr + row)
    tgt = tl.load(tgt_ptr + row).to(tl.int64) - vocab_offset
    if HAS_ENT:
        ent = tl.load(ent_ptr + row)
        g_ent = tl.load(gent_ptr + row)
    x_row = x_ptr + row.to(tl.int64) * stride_xr
    o_row = out_ptr + row.to(tl.int64) * stride_or
    for c0 in range(0, n_cols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        valid = cols < n_cols
        x = tl.load(x_row + cols.to(tl.int64) * stride_xc, mask=valid, other=float("-inf")).to(tl.float32)
        logq = x - lse
        p = tl.exp(logq)
        logq = tl.where(p > 0, logq, 0.0)  # -inf logits: p = 0, keep the product below finite
        coef = g
        if HAS_ENT:
            coef = g + g_ent * (logq + ent)
        grad = -p * coef + tl.where(valid & (cols == tgt), g, 0.0)
        tl.store(o_row + cols.to(tl.int64) * stride_oc, grad.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _finalize_kernel(
    m_ptr, s_ptr, w_ptr, xt_ptr, li_ptr, mask_ptr,
    lse_ptr, logp_ptr, ent_ptr, ratio_ptr, dratio_ptr, n,
    HAS_W: tl.constexpr, HAS_INFER: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    m = tl.load(m_ptr + offs, mask=ok, other=0.0)
    s = tl.load(s_ptr + offs, mask=ok, other=1.0)
    xt = tl.load(xt_ptr + offs, mask=ok, other=0.0)
    log_s = tl.maximum(tl.log(s), 0.0)
    lse = m + log_s
    logp = xt - lse
    tl.store(lse_ptr + offs, lse, mask=ok)
    tl.store(logp_ptr + offs, logp, mask=ok)
    if HAS_W:
        w = tl.load(w_ptr + offs, mask=ok, other=0.0)
        tl.store(ent_ptr + offs, log_s - w / s, mask=ok)
    if HAS_INFER:
        li = tl.load(li_ptr + offs, mask=ok, other=0.0)
        ratio = tl.exp(logp - li)
        dratio = ratio
        if HAS_MASK:
            keep = tl.load(mask_ptr + offs, mask=ok, other=0) != 0
            ratio = tl.where(keep, ratio, 1.0)
            dratio = tl.where(keep, dratio, 0.0)
        tl.store(ratio_ptr + offs, ratio, mask=ok)
        tl.store(dratio_ptr + offs, dratio, mask=ok)


def online_stats_triton(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_offset: int,
    stats: SoftmaxStats,
    *,
    block_rows: int = 1,
    block_cols: int = TRITON_BLOCK_COLS,
) -> None:
    """Triton twin of `online_stats_torch`."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    w = stats.w if stats.w is not None else stats.s  # dummy pointer, never read without HAS_W
    _online_stats_kernel[(n_rows,)](
        logits, logits.stride(0), logits.stride(1), n_cols, targets, vocab_offset,
        stats.m, stats.s, w, stats.xt,
        HAS_W=stats.w is not None, BLOCK=min(block_cols, triton.next_power_of_2(n_cols)),
    )


def write_grad_triton(
    logits: torch.Tensor,
    out: torch.Tensor,
    targets: torch.Tensor,
    vocab_offset: int,
    lse: torch.Tensor,
    entropy: Optional[torch.Tensor],
    g_logp: torch.Tensor,
    g_entropy: Optional[torch.Tensor],
    *,
    block_rows: int = 1,
    block_cols: int = TRITON_BLOCK_COLS,
) -> None:
    """Triton twin of `write_grad_torch`; `out` may alias `logits` (each element is read, then written)."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    has_ent = g_entropy is not None
    _write_grad_kernel[(n_rows,)](
        logits, logits.stride(0), logits.stride(1), out, out.stride(0), out.stride(1), n_cols,
        targets, vocab_offset, lse,
        entropy if has_ent else lse, g_logp, g_entropy if has_ent else g_logp,
        HAS_ENT=has_ent, BLOCK=min(block_cols, triton.next_power_of_2(n_cols)),
    )


def finalize_triton(stats: SoftmaxStats, logp_infer: Optional[torch.Tensor], mask: Optional[torch.Tensor]):
    """Triton twin of `softmax_stats.finalize_torch`."""
    n = stats.m.numel()
    lse, logp = torch.empty_like(stats.m), torch.empty_like(stats.m)
    entropy = torch.empty_like(stats.m) if stats.w is not None else None
    ratio = torch.empty_like(stats.m) if logp_infer is not None else None
    dratio = torch.empty_like(stats.m) if logp_infer is not None else None
    if n:
        _finalize_kernel[(triton.cdiv(n, FINALIZE_BLOCK),)](
            stats.m, stats.s, stats.w if stats.w is not None else stats.s, stats.xt,
            logp_infer if logp_infer is not None else stats.m,
            mask if mask is not None else stats.m,
            lse, logp, entropy if entropy is not None else lse,
            ratio if ratio is not None else lse, dratio if dratio is not None else lse, n,
            HAS_W=stats.w is not None, HAS_INFER=logp_infer is not None, HAS_MASK=mask is not None,
            BLOCK=FINALIZE_BLOCK,
        )
    return lse, logp, entropy, ratio, dratio
