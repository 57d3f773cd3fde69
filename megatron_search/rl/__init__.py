"""RL core: group-relative advantages and GRPO policy losses (pure tensor functions)."""
from .advantages import group_advantages
from .losses import aggregate, sequence_is_loss, token_is_loss
from .registry import build_policy_loss, get_policy_loss, policy_loss_names, register_policy_loss

__all__ = [
    "aggregate",
    "build_policy_loss",
    "get_policy_loss",
    "group_advantages",
    "policy_loss_names",
    "register_policy_loss",
    "sequence_is_loss",
    "token_is_loss",
]
