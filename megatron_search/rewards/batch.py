"""The whole reward of a flat batch of GRPO groups in one vectorised call (RECIPE section 5).

    R_i = r_base_i * s_i - (lambda_tool * pen_tool_i + lambda_len * pen_len_i)

with the anchored penalties of tool_penalty.py and length_penalty.py. Inputs are flat
per-rollout tensors plus contiguous group ids, so 16,384 rollouts in groups of 16 are a few
dozen tensor ops. The seeded generator makes the tool baselines reproducible: derive it from
(reward.seed, step) with `reward_generator`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .gated import effective_penalty, gated_reward
from .length_penalty import anchored_length_penalty
from .tool_penalty import anchored_tool_penalty


@dataclass(frozen=True)
class RolloutScores:
    """Per-rollout inputs [N] of the reward, rollouts of one group adjacent (group_ids 0..K-1)."""

    group_ids: Tensor  # int64
    r_base: Tensor  # {0, 1}: QA answer matches / every rubric passes
    s: Tensor  # float in [0, 1]: preference P_bar(x, y_i, y_ref)
    tool_calls: Tensor  # int64 c_i
    failed_calls: Tensor  # int64 e_i
    lengths: Tensor  # L_i, answer tokens
    ref_lengths: Tensor  # L_i^ref, tokens of the reference answer compared with
    cmp_lengths: Optional[Tensor] = None  # L^cmp for the hard cap; None = ref_lengths


@dataclass(frozen=True)
class RewardBreakdown:
    reward: Tensor  # [N] R
    pen_tool: Tensor  # [N]
    pen_len: Tensor  # [N]
    pen_eff: Tensor  # [N]
    tool_baseline: Tensor  # [K] b_g, -1 without winners
    preferred: Tensor  # [N] bool, W^_g membership

    def metrics(self, scores: RolloutScores) -> dict[str, float]:
        """Batch means for logging (the curves of RECIPE section 7)."""
        return {
            "reward/mean": float(self.reward.mean()),
            "reward/r_base": float(scores.r_base.float().mean()),
            "reward/preference": float(scores.s.float().mean()),
            "reward/pen_tool": float(self.pen_tool.mean()),
            "reward/pen_len": float(self.pen_len.mean()),
            "reward/tool_calls": float(scores.tool_calls.float().mean()),
            "reward/length": float(scores.lengths.float().mean()),
        }


def reward_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator seeded from (seed, step), so a resumed run redraws the same baselines."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))


def compute_rewards(
    scores: RolloutScores,
    *,
    lambda_tool: float,
    lambda_len: float,
    alpha_win: float,
    alpha_lose: float,
    beta_lose: float,
    preference_threshold: float,
    generator: Optional[torch.Generator],
) -> RewardBreakdown:
    """R and its parts for every rollout of the batch."""
    dtype = scores.s.dtype if scores.s.dtype.is_floating_point else torch.float32
    tool = anchored_tool_penalty(
        scores.tool_calls,
        scores.failed_calls,
        scores.r_base,
        scores.group_ids,
        alpha_win=alpha_win,
        alpha_lose=alpha_lose,
        beta_lose=beta_lose,
        generator=generator,
        dtype=dtype,
    )
    length = anchored_length_penalty(
        scores.lengths,
        scores.ref_lengths,
        scores.r_base,
        scores.s,
        scores.group_ids,
        preference_threshold=preference_threshold,
        cmp_lengths=scores.cmp_lengths,
        dtype=dtype,
    )
    pen_eff = effective_penalty(tool.penalty, length.penalty, lambda_tool, lambda_len)
    reward = gated_reward(scores.r_base, scores.s, pen_eff)
    return RewardBreakdown(reward, tool.penalty, length.penalty, pen_eff, tool.baseline, length.preferred)


def compute_rewards_from_config(scores: RolloutScores, cfg, generator: Optional[torch.Generator]) -> RewardBreakdown:
    """compute_rewards with the coefficients of a RewardConfig."""
    return compute_rewards(
        scores,
        lambda_tool=cfg.lambda_tool,
        lambda_len=cfg.lambda_len,
        alpha_win=cfg.alpha_win,
        alpha_lose=cfg.alpha_lose,
        beta_lose=cfg.beta_lose,
        preference_threshold=cfg.preference_threshold,
        generator=generator,
    )
