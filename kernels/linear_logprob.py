"""Fused output layer + token logprob: logp from hidden states without the [T, V] logits.

    out = linear_token_logprobs(hidden [..., H], weight [V_local, H], targets [...], ...)

Equals token_logprobs(hidden @ weight.T, targets, ...) (same outputs, same options), but the
logits only ever exist as one [token_chunk, vocab_chunk] tile in the input dtype: the forward folds
each tile into the streaming softmax state, the backward recomputes each tile, turns it into its
gradient in place and multiplies it straight into grad_hidden and grad_weight. Cost: one extra
forward matmul (3 -> 4 matmul passes); gain: memory independent of V (what lets long sequences fit).

Vocab-parallel: `weight` is this rank's row slice of the output layer; stats are combined over
`group`. grad_hidden is then a partial sum over the vocabulary slice: with `reduce_grad_hidden`
(default) it is all-reduced over `group`, as Megatron's ColumnParallelLinear does for its input.
Pass False when the caller reduces it itself (e.g. sequence parallel, where the gather of the
hidden states already reduce-scatters its gradient).
Accumulation: grad_hidden in fp32 over vocabulary chunks, each grad_weight chunk in fp32 over
token chunks; both returned in the parameters' dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .impl import primitives
from .inputs import check_per_token, check_targets, flatten_rows
from .is_ratio import mismatch_stats
from .logprob import TokenLogprobs
from .softmax_stats import SoftmaxStats
from .vocab_parallel import combine_stats, vocab_range

# Tile sizes: 4096 x 16384 bf16 logits = 128 MiB per tile, large enough for efficient matmuls.
TOKEN_CHUNK = 4096
VOCAB_CHUNK = 16384


def _spans(n: int, step: int):
    return [(a, min(a + step, n)) for a in range(0, n, step)]


class _FusedLinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, logp_infer, mask, with_entropy, group, vocab_start, reduce_grad_hidden, impl, chunks):
        token_chunk, vocab_chunk = chunks
        stats = SoftmaxStats.empty(hidden.shape[0], hidden.device, with_entropy)
        for t0, t1 in _spans(hidden.shape[0], token_chunk):
            rows = stats.rows(t0, t1)
            for v0, v1 in _spans(weight.shape[0], vocab_chunk):
                tile = hidden[t0:t1] @ weight[v0:v1].T
                impl.online_stats(tile, targets[t0:t1], vocab_start + v0, rows)
        stats = combine_stats(stats, group)
        lse, logp, entropy, ratio, dratio = impl.finalize(stats, logp_infer, mask)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy, dratio)
        ctx.group, ctx.vocab_start, ctx.reduce, ctx.impl, ctx.chunks = group, vocab_start, reduce_grad_hidden, impl, chunks
        return logp, entropy, ratio

    @staticmethod
    def backward(ctx, g_logp, g_entropy, g_ratio):
        hidden, weight, targets, lse, entropy, dratio = ctx.saved_tensors
        token_chunk, vocab_chunk = ctx.chunks
        g = torch.zeros_like(lse) if g_logp is None else g_logp.float().contiguous()
        if g_ratio is not None and dratio is not None:
            g = g + g_ratio.float() * dratio
        g_ent = None if (entropy is None or g_entropy is None) else g_entropy.float().contiguous()
        ent = entropy if g_ent is not None else None
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
        grad_w = torch.empty_like(weight) if want_w else None
        with torch.no_grad():
            for v0, v1 in _spans(weight.shape[0], vocab_chunk):
                w_tile = weight[v0:v1]
                gw = torch.zeros(w_tile.shape, dtype=torch.float32, device=weight.device) if want_w else None
                for t0, t1 in _spans(hidden.shape[0], token_chunk):
                    h = hidden[t0:t1]
                    tile = h @ w_tile.T
                    ctx.impl.write_grad(
                        tile, tile, targets[t0:t1], ctx.vocab_start + v0, lse[t0:t1],
                        None if ent is None else ent[t0:t1], g[t0:t1], None if g_ent is None else g_ent[t0:t1],
                    )
                    if want_h:
                        grad_h[t0:t1] += tile @ w_tile
                    if want_w:
                        gw += tile.T @ h
                if want_w:
                    grad_w[v0:v1] = gw
            if want_h and ctx.group is not None and ctx.reduce:
                dist.all_reduce(grad_h, group=ctx.group)
        grad_h = grad_h.to(hidden.dtype) if want_h else None
        return grad_h, grad_w, None, None, None, None, None, None, None, None, None


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    logp_infer: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    with_entropy: bool = False,
    group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    reduce_grad_hidden: bool = True,
    token_chunk: int = TOKEN_CHUNK,
    vocab_chunk: int = VOCAB_CHUNK,
    backend: str = "auto",
    check_values: bool = True,
) -> TokenLogprobs:
    """token_logprobs(hidden @ weight.T, targets, ...) without materialising the logits.

    hidden: [..., H]; weight: [V_local, H] (same dtype and device); other arguments as in
    `logprob.token_logprobs`. token_chunk / vocab_chunk bound the one logits tile alive at a time.
    """
    flat = flatten_rows(hidden, "hidden")
    if weight.dim() != 2 or weight.shape[1] != flat.shape[1]:
        raise ValueError(f"weight must be [V_local, H={flat.shape[1]}], got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"weight ({weight.dtype}, {weight.device}) must match hidden ({hidden.dtype}, {hidden.device})")
    if token_chunk < 1 or vocab_chunk < 1:
        raise ValueError(f"token_chunk and vocab_chunk must be >= 1, got {token_chunk}, {vocab_chunk}")
    start, total = vocab_range(weight.shape[0], group, vocab_start, vocab_size)
    rows_shape = hidden.shape[:-1]
    tgt = check_targets(targets, rows_shape, total, hidden.device, check_values)
    infer = check_per_token(logp_infer, "logp_infer", rows_shape, hidden.device, as_bool=False)
    keep = check_per_token(mask, "mask", rows_shape, hidden.device, as_bool=True,
                           check_values=check_values)
    if mask is not None and logp_infer is None:
        raise ValueError("mask only applies to the IS ratio and mismatch stats: pass logp_infer as well")
    impl = primitives(backend, hidden.device)
    logp, entropy, ratio = _FusedLinearLogprob.apply(
        flat, weight, tgt, infer, keep, with_entropy, group, start, reduce_grad_hidden, impl, (token_chunk, vocab_chunk)
    )
    stats = mismatch_stats(logp, infer, keep) if infer is not None else None
    shape = tuple(rows_shape)
    return TokenLogprobs(
        logp.view(shape),
        None if entropy is None else entropy.view(shape),
        None if ratio is None else ratio.view(shape),
        stats,
    )
