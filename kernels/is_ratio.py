"""Train/inference mismatch statistics for token-level importance sampling (RECIPE section 3).

The tokens were sampled by the inference engine (mu_infer), so with d = logp_train - logp_infer
and ratio = exp(d) = pi_train / mu_infer, two estimators of KL(mu_infer || pi_train) are
    k1 = mean(-d) = mean(logp_infer - logp_train)      (unbiased, can be negative)
    k3 = mean(exp(d) - 1 - d)                          (unbiased, always >= 0, lower variance)
taken over the loss-mask tokens. These are metrics: computed without gradient.
"""
from __future__ import annotations

from typing import Optional

import torch


@torch.no_grad()
def mismatch_stats(logp: torch.Tensor, logp_infer: torch.Tensor, mask: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """k1, k3, ratio mean/min/max and token count over `mask` (all tokens when None); 0-dim fp32 tensors.

    With no masked-in token every statistic is 0 (and n_tokens 0), not NaN.
    """
    d = (logp.float() - logp_infer.float()).flatten()
    if d.numel() == 0:
        zero = d.new_zeros(())
        return {k: zero.clone() for k in ("k1", "k3", "ratio_mean", "ratio_max", "ratio_min", "n_tokens")}
    keep = torch.ones_like(d, dtype=torch.bool) if mask is None else mask.flatten().bool()
    n = keep.sum()
    denom = n.clamp_min(1).float()
    zero = torch.zeros_like(d)
    d_kept = torch.where(keep, d, zero)  # masked-out d may be +-inf/NaN (padding); never let it in
    ratio = torch.exp(d_kept)
    any_kept = n > 0
    return {
        "k1": torch.where(keep, -d_kept, zero).sum() / denom,
        "k3": torch.where(keep, torch.expm1(d_kept) - d_kept, zero).sum() / denom,
        "ratio_mean": torch.where(keep, ratio, zero).sum() / denom,
        "ratio_max": torch.where(any_kept, torch.where(keep, ratio, torch.full_like(d, -torch.inf)).max(), 0.0),
        "ratio_min": torch.where(any_kept, torch.where(keep, ratio, torch.full_like(d, torch.inf)).min(), 0.0),
        "n_tokens": n.float(),
    }
