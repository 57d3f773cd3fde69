"""Flat-batch GRPO groups: validation of group ids and vectorised per-group reductions.

A batch of rollouts is a set of flat tensors of length N plus `group_ids` [N]. Ids are
contiguous: rollouts of one group are adjacent and ids count 0, 1, ..., K-1 in order
(e.g. [0, 0, 0, 1, 1, 2, 2, 2]). Groups may be ragged (a group can lose rollouts to
failures). Contiguity lets every per-group statistic be one `index_add_` over the batch,
so 16k rollouts cost a handful of tensor ops instead of a Python loop over groups.
"""
from __future__ import annotations

import torch
from torch import Tensor


def check_group_ids(group_ids: Tensor, n: int | None = None, name: str = "group_ids") -> int:
    """Validate `group_ids` and return the number of groups K.

    Raises ValueError naming the first offending position when the ids are not a 1-D integer
    tensor of contiguous ids 0..K-1 in order, or when its length differs from `n`.
    """
    if not isinstance(group_ids, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(group_ids).__name__}")
    if group_ids.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool or group_ids.is_complex():
        raise ValueError(f"{name}: expected an integer tensor, got {group_ids.dtype}")
    if n is not None and group_ids.numel() != n:
        raise ValueError(f"{name}: length {group_ids.numel()} does not match the {n} rollouts of the batch")
    if group_ids.numel() == 0:
        raise ValueError(f"{name}: empty batch (no rollouts)")
    if int(group_ids[0]) != 0:
        raise ValueError(f"{name}: ids must start at 0, got {int(group_ids[0])} at position 0")
    steps = group_ids[1:] - group_ids[:-1]
    bad = ((steps != 0) & (steps != 1)).nonzero()
    if bad.numel():
        i = int(bad[0, 0]) + 1
        raise ValueError(
            f"{name}: not contiguous at position {i} (id {int(group_ids[i])} follows {int(group_ids[i - 1])}); "
            "rollouts of one group must be adjacent and ids numbered 0..K-1 in order"
        )
    return int(group_ids[-1]) + 1


def group_sum(values: Tensor, group_ids: Tensor, num_groups: int) -> Tensor:
    """Per-group sum [K] of a flat tensor [N]."""
    out = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return out.index_add_(0, group_ids, values)


def group_count(mask: Tensor, group_ids: Tensor, num_groups: int) -> Tensor:
    """Per-group number [K] (int64) of rollouts where `mask` is true."""
    return group_sum(mask.to(torch.int64), group_ids, num_groups)


def group_max(values: Tensor, group_ids: Tensor, num_groups: int) -> Tensor:
    """Per-group maximum [K] of a flat tensor [N] (every group is non-empty by contiguity)."""
    out = torch.empty(num_groups, dtype=values.dtype, device=values.device)
    return out.scatter_reduce_(0, group_ids, values, reduce="amax", include_self=False)


def group_min_where(values: Tensor, mask: Tensor, group_ids: Tensor, num_groups: int, empty: float) -> Tensor:
    """Per-group minimum [K] over the rollouts where `mask` holds; `empty` where none does."""
    big = torch.full_like(values, torch.iinfo(values.dtype).max if not values.dtype.is_floating_point else float("inf"))
    masked = torch.where(mask, values, big)
    out = torch.empty(num_groups, dtype=values.dtype, device=values.device)
    out.scatter_reduce_(0, group_ids, masked, reduce="amin", include_self=False)
    has = group_count(mask, group_ids, num_groups) > 0
    return torch.where(has, out, torch.full_like(out, empty))


def check_flat(name: str, x: Tensor, n: int | None = None) -> Tensor:
    """A 1-D per-rollout tensor of length n (when given), else a ValueError naming `name`."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D per-rollout tensor, got shape {tuple(x.shape)}")
    if n is not None and x.numel() != n:
        raise ValueError(f"{name}: length {x.numel()} does not match the {n} rollouts of the batch")
    return x


def check_finite(name: str, x: Tensor) -> None:
    """ValueError listing the first positions of NaN/inf entries of a floating tensor."""
    if x.dtype.is_floating_point:
        bad = (~torch.isfinite(x)).nonzero()
        if bad.numel():
            pos = [tuple(int(v) for v in row) if row.numel() > 1 else int(row) for row in bad[:5]]
            raise ValueError(f"{name}: {bad.shape[0]} NaN/inf value(s), first at position(s) {pos}")
