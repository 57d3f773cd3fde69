"""Anchored tool-call penalty (RECIPE section 5.2), vectorised over a flat batch of groups.

For group g with winners W_g = {i : r_base_i = 1} and effective calls c~_i = c_i - e_i
(tool calls minus failed executions):

    b_g     ~ Uniform over the integers {lo_g, ..., hi_g},  lo_g = min_{W_g} c~,  hi_g = ceil(mean_{W_g} c~)
    Delta_i = max(0, c~_i - b_g),      p_i = 1 - exp(-Delta_i)
    pen_i   = alpha_win * p_i               if i in W_g
              alpha_lose * p_i + beta_lose  otherwise

Choices the write-up leaves open (documented in docs/REWARDS.md):
- Sampling: inclusive integer range (lo_g <= hi_g always, since the minimum never exceeds the
  mean). One uniform draw per group from the caller's seeded torch.Generator, group g uses the
  g-th draw, b_g = lo_g + floor(u_g * (hi_g - lo_g + 1)); every group consumes a draw, also
  one without winners, so a group's baseline does not depend on the other groups' outcomes.
  ceil is computed in integer arithmetic (no float rounding).
- Empty W_g (no rollout of the group is correct): there is no anchor, so p_i = 0 and every
  rollout of the group gets pen = beta_lose (the constant loser offset still applies).
Ranges: winners pen in [0, alpha_win], losers pen in [beta_lose, beta_lose + alpha_lose]; the
upper ends are approached as Delta grows (reached only through float rounding of exp(-Delta)).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .gated import check_binary
from .groups import check_flat, check_group_ids, group_count, group_min_where, group_sum


class ToolPenalty(NamedTuple):
    penalty: Tensor  # [N] pen_tool
    p: Tensor  # [N] 1 - exp(-Delta), 0 in groups without winners
    baseline: Tensor  # [K] int64 b_g, -1 in groups without winners
    effective_calls: Tensor  # [N] int64 c - e


def _check_counts(calls: Tensor, failed: Tensor, n: int) -> None:
    for name, x in (("tool_calls", calls), ("failed_calls", failed)):
        check_flat(name, x, n)
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor of counts, got {x.dtype}")
        if (x < 0).any():
            i = int((x < 0).nonzero()[0, 0])
            raise ValueError(f"{name}: counts must be >= 0, got {int(x[i])} at position {i}")
    over = (failed > calls).nonzero()
    if over.numel():
        i = int(over[0, 0])
        raise ValueError(
            f"failed_calls: {int(failed[i])} failed executions exceed the {int(calls[i])} tool calls at position {i}"
        )


def tool_baseline_bounds(eff_calls: Tensor, winners: Tensor, group_ids: Tensor, num_groups: int):
    """(lo [K], hi [K], has_winner [K]): min and integer ceil of the mean of winners' c~; -1 without winners."""
    n_win = group_count(winners, group_ids, num_groups)
    has = n_win > 0
    lo = group_min_where(eff_calls, winners, group_ids, num_groups, empty=-1)
    total = group_sum(torch.where(winners, eff_calls, torch.zeros_like(eff_calls)), group_ids, num_groups)
    hi = torch.where(has, (total + n_win - 1) // n_win.clamp(min=1), torch.full_like(total, -1))
    return lo, hi, has


def sample_tool_baseline(lo: Tensor, hi: Tensor, generator: Optional[torch.Generator]) -> Tensor:
    """b_g uniform over the integers lo_g..hi_g inclusive, one draw per group in group order."""
    if (hi < lo).any():
        raise ValueError("tool baseline: upper bound below lower bound")
    u = torch.rand(lo.numel(), generator=generator, dtype=torch.float64).to(lo.device)
    width = (hi - lo + 1).to(torch.float64)
    return torch.minimum(lo + torch.floor(u * width).to(lo.dtype), hi)


def anchored_tool_penalty(
    tool_calls: Tensor,
    failed_calls: Tensor,
    r_base: Tensor,
    group_ids: Tensor,
    *,
    alpha_win: float,
    alpha_lose: float,
    beta_lose: float,
    generator: Optional[torch.Generator],
    dtype: torch.dtype = torch.float32,
) -> ToolPenalty:
    """pen_tool [N] for every rollout of the batch (see module docstring)."""
    n = r_base.numel()
    check_binary("r_base", r_base, n)
    k = check_group_ids(group_ids, n)
    _check_counts(tool_calls, failed_calls, n)
    if min(alpha_win, alpha_lose, beta_lose) < 0:
        raise ValueError(f"alpha_win/alpha_lose/beta_lose: must be >= 0, got {alpha_win}, {alpha_lose}, {beta_lose}")
    eff = (tool_calls - failed_calls).to(torch.int64)
    winners = r_base == 1
    lo, hi, has = tool_baseline_bounds(eff, winners, group_ids, k)
    sampled = sample_tool_baseline(torch.where(has, lo, 0), torch.where(has, hi, 0), generator)
    baseline = torch.where(has, sampled, torch.full_like(sampled, -1))
    delta = (eff - baseline[group_ids]).clamp(min=0).to(dtype)
    p = torch.where(has[group_ids], 1.0 - torch.exp(-delta), torch.zeros_like(delta))
    pen = torch.where(winners, alpha_win * p, alpha_lose * p + beta_lose)
    return ToolPenalty(pen, p, baseline, eff)
