"""Bradley-Terry preference pieces (RECIPE section 5.1), pure functions of tensors.

For context x and answers y_a, y_b a scorer gives Delta(x, y_a, y_b) (logit that y_a is
preferred); r = 1 when y_a is the preferred answer (soft labels in [0, 1] allowed).

    l_BT(Delta, r) = -[ r log sigma(Delta) + (1 - r) log(1 - sigma(Delta)) ]
    L_sym          = 1/2 l_BT(Delta(x, a, b), r) + 1/2 l_BT(Delta(x, b, a), 1 - r)
    Delta_bar      = 1/2 [ Delta(x, a, b) - Delta(x, b, a) ],     P_bar = sigma(Delta_bar)

Two kinds of scorer:
  pointwise  score(x, y) -> scalar per example;  Delta(x, a, b) = score(x, a) - score(x, b),
             so Delta(x, b, a) = -Delta(x, a, b) and the order averaging changes nothing;
  pairwise   delta(x, first, second) -> Delta with both answers in one context; the two
             orders differ (position bias) and the averaging removes the bias.

P_bar is computed so that P_bar(a, b) = 1 - P_bar(b, a) holds exactly in floating point:
sigma(|z|) for z >= 0 and 1 - sigma(|z|) for z < 0 (1 - sigma is exact for sigma in [1/2, 1]).
The policy's preference score is s_i = P_bar(x, y_i, y_ref).
"""
from __future__ import annotations

from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .groups import check_finite

PointwiseScorer = Callable[[Any, Any], Tensor]  # (context, answer) -> score [B]
PairwiseScorer = Callable[[Any, Any, Any], Tensor]  # (context, first, second) -> Delta [B]
ScorerKind = Literal["pointwise", "pairwise"]


def _check_pair(delta: Tensor, other: Tensor, other_name: str) -> None:
    if not isinstance(delta, Tensor) or not delta.dtype.is_floating_point:
        raise ValueError(f"delta: expected a floating tensor, got {getattr(delta, 'dtype', type(delta))}")
    if other.shape != delta.shape:
        raise ValueError(f"{other_name}: shape {tuple(other.shape)} does not match delta {tuple(delta.shape)}")
    check_finite("delta", delta)
    check_finite(other_name, other)


def bt_loss(delta: Tensor, r: Tensor) -> Tensor:
    """Elementwise l_BT(Delta, r), stable for large |Delta| (softplus form)."""
    r = torch.as_tensor(r, dtype=delta.dtype, device=delta.device).expand_as(delta)
    _check_pair(delta, r, "r")
    if ((r < 0) | (r > 1)).any():
        raise ValueError("r: preference labels must lie in [0, 1]")
    # -log sigma(D) = softplus(-D);  -log(1 - sigma(D)) = softplus(D)
    return r * F.softplus(-delta) + (1.0 - r) * F.softplus(delta)


def symmetric_bt_loss(delta_ab: Tensor, delta_ba: Tensor, r: Tensor) -> Tensor:
    """Elementwise L_sym: the BT loss averaged over both presentation orders."""
    _check_pair(delta_ab, delta_ba, "delta_ba")
    r = torch.as_tensor(r, dtype=delta_ab.dtype, device=delta_ab.device)
    return 0.5 * bt_loss(delta_ab, r) + 0.5 * bt_loss(delta_ba, 1.0 - r)


def debiased_delta(delta_ab: Tensor, delta_ba: Tensor) -> Tensor:
    """Delta_bar = (Delta(a, b) - Delta(b, a)) / 2; exactly antisymmetric under swapping."""
    _check_pair(delta_ab, delta_ba, "delta_ba")
    return 0.5 * (delta_ab - delta_ba)


def preference_probability(delta_bar: Tensor) -> Tensor:
    """sigma(Delta_bar), computed so that p(z) + p(-z) == 1 exactly (module docstring)."""
    check_finite("delta_bar", delta_bar)
    p_pos = torch.sigmoid(delta_bar.abs())
    return torch.where(delta_bar >= 0, p_pos, 1.0 - p_pos)


def scorer_deltas(kind: ScorerKind, scorer: Callable, x: Any, a: Any, b: Any) -> tuple[Tensor, Tensor]:
    """(Delta(x, a, b), Delta(x, b, a)) from a pointwise or a pairwise scorer."""
    if kind == "pointwise":
        sa, sb = scorer(x, a), scorer(x, b)
        if sa.shape != sb.shape:
            raise ValueError(f"pointwise scorer: score shapes differ, {tuple(sa.shape)} vs {tuple(sb.shape)}")
        return sa - sb, sb - sa
    if kind == "pairwise":
        return scorer(x, a, b), scorer(x, b, a)
    raise ValueError(f"scorer kind: {kind!r} is not 'pointwise' or 'pairwise'")


def preference_score(kind: ScorerKind, scorer: Callable, x: Any, y: Any, y_ref: Any) -> Tensor:
    """s = P_bar(x, y, y_ref): probability that y beats the reference answer, position-independent."""
    return preference_probability(debiased_delta(*scorer_deltas(kind, scorer, x, y, y_ref)))


def scorer_symmetric_loss(kind: ScorerKind, scorer: Callable, x: Any, a: Any, b: Any, r: Tensor) -> Tensor:
    """Mean L_sym over a batch of labelled pairs, through the scorer (the RM training loss)."""
    return symmetric_bt_loss(*scorer_deltas(kind, scorer, x, a, b), r).mean()
