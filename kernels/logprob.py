"""Fused token log-probabilities from logits, with IS ratio and entropy in the same pass.

    out = token_logprobs(logits [..., V], targets [...], logp_infer=..., mask=..., with_entropy=True)
    out.logp     log pi(target) in fp32, differentiable, always <= 0
    out.ratio    exp(logp - logp_infer) (1 on masked-out tokens), differentiable through logp only
    out.entropy  entropy of each row's softmax, differentiable
    out.stats    train/inference mismatch metrics (is_ratio.mismatch_stats), no gradient

Forward: one streaming pass over the vocabulary (softmax_stats.py); no [T, V] fp32 tensor.
Backward: the gradient is written tile by tile, into a fresh buffer of the logits' dtype, or with
`inplace_backward=True` into the logits' own storage (the logits are then destroyed; any other use
of them after backward sees the gradient; autograd raises if another op saved them).
Vocab-parallel: pass the tensor-parallel `group` and each rank's logits slice [..., V/TP]; the
result equals the single-process one on the full vocabulary (Megatron's vocab-parallel contract).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .impl import primitives
from .inputs import check_per_token, check_targets, flatten_rows
from .is_ratio import mismatch_stats
from .softmax_stats import SoftmaxStats
from .vocab_parallel import combine_stats, vocab_range


class TokenLogprobs(NamedTuple):
    logp: torch.Tensor
    entropy: Optional[torch.Tensor]
    ratio: Optional[torch.Tensor]
    stats: Optional[dict]


class _FusedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, logp_infer, mask, with_entropy, group, vocab_start, inplace, impl):
        stats = SoftmaxStats.empty(logits.shape[0], logits.device, with_entropy)
        impl.online_stats(logits, targets, vocab_start, stats)
        stats = combine_stats(stats, group)
        lse, logp, entropy, ratio, dratio = impl.finalize(stats, logp_infer, mask)
        ctx.save_for_backward(logits, targets, lse, entropy, dratio)
        ctx.vocab_start, ctx.inplace, ctx.impl = vocab_start, inplace, impl
        return logp, entropy, ratio

    @staticmethod
    def backward(ctx, g_logp, g_entropy, g_ratio):
        logits, targets, lse, entropy, dratio = ctx.saved_tensors
        g = torch.zeros_like(lse) if g_logp is None else g_logp.float().contiguous()
        if g_ratio is not None and dratio is not None:
            g = g + g_ratio.float() * dratio  # d ratio / d logp = ratio (0 where masked out)
        g_ent = None if (entropy is None or g_entropy is None) else g_entropy.float().contiguous()
        with torch.no_grad():
            out = logits if ctx.inplace else torch.empty_like(logits)
            ctx.impl.write_grad(logits, out, targets, ctx.vocab_start, lse, entropy if g_ent is not None else None, g, g_ent)
        return out, None, None, None, None, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    logp_infer: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    with_entropy: bool = False,
    group: Optional[dist.ProcessGroup] = None,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    inplace_backward: bool = False,
    backend: str = "auto",
    check_values: bool = True,
) -> TokenLogprobs:
    """Log-probabilities of `targets` under softmax(logits), fused with the IS ratio and entropy.

    logits: [..., V_local] fp32/bf16/fp16 (the local vocabulary slice when `group` is given);
    targets: [...] integer ids in [0, vocab_size); logp_infer: [...] inference-engine logprobs;
    mask: [...] loss mask (bool or 0/1), used for the ratio and the mismatch stats.
    vocab_start / vocab_size default to Megatron's equal split: rank * V_local and V_local * TP.
    backend: 'auto' (Triton on CUDA, torch otherwise), 'torch' or 'triton'.
    check_values: check the targets' range (and a float mask's 0/1 values): host syncs, for debugging.
    """
    flat = flatten_rows(logits, "logits")
    start, total = vocab_range(flat.shape[1], group, vocab_start, vocab_size)
    rows_shape = logits.shape[:-1]
    tgt = check_targets(targets, rows_shape, total, logits.device, check_values)
    infer = check_per_token(logp_infer, "logp_infer", rows_shape, logits.device, as_bool=False)
    keep = check_per_token(mask, "mask", rows_shape, logits.device, as_bool=True,
                           check_values=check_values)
    if mask is not None and logp_infer is None:
        raise ValueError("mask only applies to the IS ratio and mismatch stats: pass logp_infer as well")
    impl = primitives(backend, logits.device)
    logp, entropy, ratio = _FusedLogprob.apply(flat, tgt, infer, keep, with_entropy, group, start, inplace_backward, impl)
    stats = mismatch_stats(logp, infer, keep) if infer is not None else None
    shape = tuple(rows_shape)
    return TokenLogprobs(
        logp.view(shape),
        None if entropy is None else entropy.view(shape),
        None if ratio is None else ratio.view(shape),
        stats,
    )
