"""Evaluation with the reward model: held-out pair metrics and the side-by-side (sbs) metric.

- `pair_metrics`: from (Delta(x, a, b), Delta(x, b, a)) and labels: accuracy (Delta_bar on the
  labelled side; a tie Delta_bar == 0 counts as wrong), margin (mean Delta_bar towards the
  labelled answer) and the symmetric BT loss (RECIPE 5.1).
- `sbs`: mean P_bar(x, candidate, baseline) over prompts, i.e. how often a candidate model's
  answer beats a baseline model's answer for the same prompt (0.5 = on par).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from megatron_search.rewards.bradley_terry import debiased_delta, symmetric_bt_loss


def pair_metrics(delta_ab: Tensor, delta_ba: Tensor, labels: Tensor) -> dict[str, float]:
    labels = torch.as_tensor(labels, dtype=torch.float32)
    if labels.numel() == 0:
        raise ValueError("pair_metrics: no pairs")
    dbar = debiased_delta(delta_ab.float(), delta_ba.float())
    sign = 2.0 * labels - 1.0
    return {
        "accuracy": float(((dbar * sign) > 0).float().mean()),
        "margin": float((dbar * sign).mean()),
        "loss": float(symmetric_bt_loss(delta_ab.float(), delta_ba.float(), labels).mean()),
        "pairs": int(labels.numel()),
    }


def evaluate_pairs(scorer, pairs: Sequence) -> dict[str, float]:
    """pair_metrics of a scorer (rm.scorer.RMScorer) on PreferencePairs."""
    d_ab, d_ba = scorer.deltas([p.messages for p in pairs], [p.answer_a for p in pairs],
                               [p.answer_b for p in pairs])
    return pair_metrics(d_ab, d_ba, torch.tensor([p.label for p in pairs], dtype=torch.float32))


def sbs(scorer, contexts: Sequence, candidate: Sequence[str], baseline: Sequence[str]) -> dict[str, float]:
    """Mean P_bar(x, candidate, baseline) (the sbs score), and the win / tie / loss fractions."""
    if not (len(contexts) == len(candidate) == len(baseline)):
        raise ValueError(f"sbs: {len(contexts)} prompts, {len(candidate)} candidate and {len(baseline)} baseline answers")
    if not contexts:
        raise ValueError("sbs: no prompts")
    p = scorer.p_bar(list(contexts), list(candidate), list(baseline))
    return {"sbs": float(p.mean()), "win": float((p > 0.5).float().mean()), "tie": float((p == 0.5).float().mean()),
            "loss": float((p < 0.5).float().mean()), "prompts": len(contexts)}

