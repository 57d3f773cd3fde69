"""Group-relative advantages (GRPO, RECIPE section 3).

    A_i = (R_i - mean_g R) / (std_g R + eps)      or, without std division,   A_i = R_i - mean_g R

over the rollouts of each group g; every token of rollout i shares A_i. Vectorised over a flat
batch with contiguous group ids (see rewards.groups), ragged groups allowed. The one implementation
is the fused kernel (megatron_search.kernels.fused_group_advantages: Triton on CUDA, its torch
reference elsewhere, float64 kept); this is its group-id front end with the batch checks.

std_g is the sample standard deviation (ddof=1, what torch.std and most GRPO code use) unless
`unbiased=False` (population std). A group whose rewards are all equal (including a group of
one rollout) carries no signal: its advantages are exactly 0, also when float rounding of the
mean would leave a residue of ~1e-17 that a tiny eps would blow up.

`filtered_groups` names the groups a correctness filter (grpo.group_filter) leaves out of training.
"""
from __future__ import annotations

import torch
from torch import Tensor

from megatron_search.kernels import fused_group_advantages, offsets_from_group_ids

from ..rewards.gated import check_binary
from ..rewards.groups import check_finite, check_flat, check_group_ids, group_sum


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
    unbiased: bool = True,
) -> Tensor:
    """Advantages [N] of rewards [N] relative to their group (see module docstring)."""
    check_flat("rewards", rewards)
    if not rewards.dtype.is_floating_point:
        raise ValueError(f"rewards: expected a floating tensor, got {rewards.dtype}")
    check_finite("rewards", rewards)
    k = check_group_ids(group_ids, rewards.numel())
    if eps < 0:
        raise ValueError(f"eps: must be >= 0, got {eps}")
    del k  # checked: contiguous ids 0..K-1, which is what the offsets need
    offsets = offsets_from_group_ids(group_ids.to(torch.int64)).to(rewards.device)
    out = fused_group_advantages(rewards, offsets, std_normalize=std_normalize, eps=eps, unbiased=unbiased)
    return out.per_rollout.to(rewards.dtype)


GROUP_FILTERS = ("none", "no_winner", "uniform_correctness")


def filtered_groups(r_base: Tensor, group_ids: Tensor, mode: str) -> Tensor:
    """Groups [K] (bool) that `mode` leaves out of training, by their correctness r_base in {0, 1}:
    'no_winner' = no rollout correct, 'uniform_correctness' = all correct or all wrong (DAPO's
    dynamic-sampling criterion), 'none' = no group."""
    if mode not in GROUP_FILTERS:
        raise ValueError(f"group filter: expected one of {', '.join(GROUP_FILTERS)}, got {mode!r}")
    check_binary("r_base", r_base)
    k = check_group_ids(group_ids, r_base.numel())
    if mode == "none":
        return torch.zeros(k, dtype=torch.bool)
    correct = r_base.to(torch.int64)
    wins = group_sum(correct, group_ids, k)
    if mode == "no_winner":
        return wins == 0
    size = group_sum(torch.ones_like(correct), group_ids, k)
    return (wins == 0) | (wins == size)
