"""Anchored length penalty (RECIPE section 5.2), vectorised over a flat batch of groups.

L_i is the token length of rollout i's answer, L_i^ref that of the reference model's answer it
was compared with. Preferred winners W^_g = {i : r_base_i = 1 and s_i >= threshold (0.5)}.

    b_win_g  = mean_{j in W^_g} L_j^ref            b_lose_g = mean_{j in g, j not in W^_g} L_j^ref
    pen_i    = 1                                        if L_i > max_{j in g} L_j^cmp   (hard cap)
               1 - exp(-max(0, L_i / b_win - 1))        if i in W^_g                    (verbose winners)
               1 - exp(-max(0, b_lose / L_i - 1))       otherwise                       (terse losers)

L^cmp defaults to the group's reference lengths (the write-up does not define it); pass
`cmp_lengths` to use another cap (e.g. the generation limit). A group whose L^cmp are all 0
(every reference answer empty) has no hard cap: a zero cap would penalise every answer.

Edge cases (decided here, documented in docs/REWARDS.md):
- Empty W^_g: b_win is undefined but also unused (nobody is a preferred winner); everyone in
  the group is scored against b_lose (mean over the whole group). Likewise a group of only
  preferred winners never needs b_lose. Undefined baselines are reported as NaN, never used.
- Zero lengths. A zero anchor (b_win or b_lose = 0: every reference answer on that side was
  empty, e.g. the reference model failed) says nothing about a good length, so it disables its
  term (pen 0). A zero candidate length against a positive b_lose is maximally terse: the
  ratio b_lose / 0 is taken as +inf, pen 1.
Range: pen in [0, 1].
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .gated import check_binary, check_unit
from .groups import check_finite, check_flat, check_group_ids, group_count, group_max, group_sum


class LengthPenalty(NamedTuple):
    penalty: Tensor  # [N] pen_len
    preferred: Tensor  # [N] bool, membership of W^_g
    capped: Tensor  # [N] bool, L_i above the group's hard cap
    b_win: Tensor  # [K], NaN where W^_g is empty
    b_lose: Tensor  # [K], NaN where every rollout of the group is a preferred winner


def _check_lengths(name: str, x: Tensor, n: int) -> Tensor:
    check_flat(name, x, n)
    check_finite(name, x)
    if (x < 0).any():
        i = int((x < 0).nonzero()[0, 0])
        raise ValueError(f"{name}: lengths must be >= 0, got {float(x[i])} at position {i}")
    return x.to(torch.float64)


def _excess(num: Tensor, den: Tensor) -> Tensor:
    """1 - exp(-max(0, num / den - 1)) for a positive anchor; num / 0 = +inf for num > 0."""
    safe = torch.where(den > 0, den, torch.ones_like(den))
    ratio = torch.where(den > 0, num / safe, torch.full_like(num, float("inf")))
    return 1.0 - torch.exp(-(ratio - 1.0).clamp(min=0.0))


def anchored_length_penalty(
    lengths: Tensor,
    ref_lengths: Tensor,
    r_base: Tensor,
    s: Tensor,
    group_ids: Tensor,
    *,
    preference_threshold: float = 0.5,
    cmp_lengths: Optional[Tensor] = None,
    dtype: torch.dtype = torch.float32,
) -> LengthPenalty:
    """pen_len [N] for every rollout of the batch (see module docstring)."""
    n = r_base.numel()
    check_binary("r_base", r_base, n)
    check_unit("s", s, n)
    k = check_group_ids(group_ids, n)
    if not 0.0 <= preference_threshold <= 1.0:
        raise ValueError(f"preference_threshold: must lie in [0, 1], got {preference_threshold}")
    L = _check_lengths("lengths", lengths, n)
    L_ref = _check_lengths("ref_lengths", ref_lengths, n)
    L_cmp = L_ref if cmp_lengths is None else _check_lengths("cmp_lengths", cmp_lengths, n)

    preferred = (r_base == 1) & (s >= preference_threshold)
    n_pref = group_count(preferred, group_ids, k)
    n_all = group_count(torch.ones_like(preferred), group_ids, k)
    sum_pref = group_sum(torch.where(preferred, L_ref, 0.0), group_ids, k)
    sum_rest = group_sum(torch.where(preferred, 0.0, L_ref), group_ids, k)
    nan = torch.full_like(sum_pref, float("nan"))
    b_win = torch.where(n_pref > 0, sum_pref / n_pref.clamp(min=1), nan)
    b_lose = torch.where(n_all - n_pref > 0, sum_rest / (n_all - n_pref).clamp(min=1), nan)

    # Each rollout only reads the baseline of its own side, which is defined (non-empty side).
    anchor_win = torch.nan_to_num(b_win)[group_ids]
    anchor_lose = torch.nan_to_num(b_lose)[group_ids]
    zero = torch.zeros_like(L)
    verbose = torch.where(anchor_win > 0, _excess(L, anchor_win), zero)
    terse = torch.where(anchor_lose > 0, _excess(anchor_lose, L), zero)
    cap = group_max(L_cmp, group_ids, k)[group_ids]
    capped = (cap > 0) & (L > cap)
    pen = torch.where(capped, torch.ones_like(L), torch.where(preferred, verbose, terse))
    return LengthPenalty(pen.to(dtype), preferred, capped, b_win, b_lose)
