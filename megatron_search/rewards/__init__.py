"""Rewards (RECIPE section 5): answer and rubric checks, Bradley-Terry preference pieces,
anchored tool and length penalties, gated aggregation. Pure functions of tensors and plain data."""
from .answer import exact_match, normalize_answer, qa_reward, rubric_reward, substring_match, token_f1
from .batch import RewardBreakdown, RolloutScores, compute_rewards, compute_rewards_from_config, reward_generator
from .bradley_terry import (
    bt_loss,
    debiased_delta,
    preference_probability,
    preference_score,
    scorer_deltas,
    scorer_symmetric_loss,
    symmetric_bt_loss,
)
from .gated import effective_penalty, gated_reward
from .groups import check_group_ids
from .length_penalty import LengthPenalty, anchored_length_penalty
from .tool_penalty import ToolPenalty, anchored_tool_penalty, sample_tool_baseline, tool_baseline_bounds

__all__ = [
    "LengthPenalty",
    "RewardBreakdown",
    "RolloutScores",
    "ToolPenalty",
    "anchored_length_penalty",
    "anchored_tool_penalty",
    "bt_loss",
    "check_group_ids",
    "compute_rewards",
    "compute_rewards_from_config",
    "debiased_delta",
    "effective_penalty",
    "exact_match",
    "gated_reward",
    "normalize_answer",
    "preference_probability",
    "preference_score",
    "qa_reward",
    "reward_generator",
    "rubric_reward",
    "sample_tool_baseline",
    "scorer_deltas",
    "scorer_symmetric_loss",
    "substring_match",
    "symmetric_bt_loss",
    "token_f1",
    "tool_baseline_bounds",
]
