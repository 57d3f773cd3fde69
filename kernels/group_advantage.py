"""Fused GRPO group advantages: per-group mean/std and per-token broadcast in one call.

    adv = fused_group_advantages(rewards [N], group_offsets [K+1], token_offsets [N+1])
    adv.per_rollout  [N]   A_i = (R_i - mean_g R) / (std_g R + eps)   (or R_i - mean_g R)
    adv.per_token    [token_offsets[-1]]  A_i repeated over rollout i's tokens (packed layout)

Rollouts of group g are rewards[group_offsets[g]:group_offsets[g+1]] (ragged groups; offsets
start at 0, end at N, never decrease). Rollout i's tokens are
[token_offsets[i], token_offsets[i+1]) of the packed token stream.
Semantics match megatron_search.rl.advantages.group_advantages (RECIPE section 3): sample std
(ddof=1, clamped to >= 1 for groups of one) unless unbiased=False; eps added to the std; a group
whose rewards are all equal (including a group of one) gets advantages exactly 0. Computed in fp32
(float64 rewards stay float64 on the torch path, which rl.advantages.group_advantages relies on).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .backend import resolve_backend


class GroupAdvantages(NamedTuple):
    per_rollout: torch.Tensor
    per_token: Optional[torch.Tensor]


def offsets_from_group_ids(group_ids: torch.Tensor) -> torch.Tensor:
    """[K+1] offsets from contiguous ids 0..K-1 (the flat-batch layout of rewards.groups)."""
    if group_ids.dim() != 1 or group_ids.numel() == 0:
        raise ValueError(f"group_ids must be a non-empty 1-D tensor, got shape {tuple(group_ids.shape)}")
    steps = group_ids[1:] - group_ids[:-1]
    if int(group_ids[0]) != 0 or bool(((steps != 0) & (steps != 1)).any()):
        raise ValueError("group_ids must be contiguous ids 0..K-1 in order (rollouts of a group adjacent)")
    counts = torch.bincount(group_ids)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def _check_offsets(offsets: torch.Tensor, name: str, total: int, device: torch.device) -> torch.Tensor:
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} must be a 1-D tensor with at least one entry, got shape {tuple(offsets.shape)}")
    if offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {offsets.dtype}")
    if offsets.device != device:
        raise ValueError(f"{name} is on {offsets.device} but the rewards are on {device}")
    flat = offsets.to(torch.int64).contiguous()
    if int(flat[0]) != 0 or int(flat[-1]) != total:
        raise ValueError(f"{name} must start at 0 and end at {total}, got {int(flat[0])} ... {int(flat[-1])}")
    down = ((flat[1:] - flat[:-1]) < 0).nonzero()
    if down.numel():
        i = int(down[0, 0])
        raise ValueError(f"{name} must not decrease: {int(flat[i])} at {i} is followed by {int(flat[i + 1])}")
    return flat


def group_advantages_torch(
    rewards: torch.Tensor, group_offsets: torch.Tensor, token_offsets: Optional[torch.Tensor],
    std_normalize: bool, eps: float, unbiased: bool,
) -> GroupAdvantages:
    """Torch reference (segment reductions via index_add / scatter_reduce); fp32, or float64 for float64 rewards."""
    r = rewards if rewards.dtype == torch.float64 else rewards.float()
    counts = group_offsets[1:] - group_offsets[:-1]
    k = counts.numel()
    gid = torch.repeat_interleave(torch.arange(k, device=r.device), counts)
    n_g = counts.to(r.dtype)
    mean = torch.zeros(k, dtype=r.dtype, device=r.device).index_add_(0, gid, r) / n_g.clamp_min(1)
    hi = torch.full((k,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, gid, r, reduce="amax")
    lo = torch.full((k,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, gid, r, reduce="amin")
    constant = (hi == lo)[gid]
    adv = torch.where(constant, torch.zeros_like(r), r - mean[gid])
    if std_normalize:
        dof = (n_g - 1).clamp_min(1) if unbiased else n_g.clamp_min(1)
        std = (torch.zeros(k, dtype=r.dtype, device=r.device).index_add_(0, gid, adv * adv) / dof).sqrt()
        adv = torch.where(constant, adv, adv / (std[gid] + eps))
    per_token = None
    if token_offsets is not None:
        per_token = torch.repeat_interleave(adv, token_offsets[1:] - token_offsets[:-1])
    return GroupAdvantages(adv, per_token)


def fused_group_advantages(
    rewards: torch.Tensor,
    group_offsets: torch.Tensor,
    token_offsets: Optional[torch.Tensor] = None,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
    unbiased: bool = True,
    backend: str = "auto",
) -> GroupAdvantages:
    """Group-relative advantages per rollout and, with token_offsets, per packed token (see module doc)."""
    if rewards.dim() != 1 or not rewards.dtype.is_floating_point:
        raise ValueError(f"rewards must be a 1-D floating tensor, got {rewards.dtype} of shape {tuple(rewards.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        i = int((~torch.isfinite(rewards)).nonzero()[0, 0])
        raise ValueError(f"rewards must be finite; rewards[{i}] = {float(rewards[i])}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    goff = _check_offsets(group_offsets, "group_offsets", rewards.numel(), rewards.device)
    toff = None
    if token_offsets is not None:
        if token_offsets.numel() != rewards.numel() + 1:
            raise ValueError(f"token_offsets needs N+1 = {rewards.numel() + 1} entries, got {token_offsets.numel()}")
        toff = _check_offsets(token_offsets, "token_offsets", int(token_offsets[-1]), rewards.device)
    rewards = rewards.contiguous()
    if resolve_backend(backend, rewards.device) == "triton":
        from .group_advantage_triton import group_advantages_triton  # optional: triton (the GPU backend)

        return group_advantages_triton(rewards, goff, toff, std_normalize, eps, unbiased)
    return group_advantages_torch(rewards, goff, toff, std_normalize, eps, unbiased)
