"""Fused kernels (Triton on GPU, torch references on CPU), installed as `megatron_search.kernels`."""

from .backend import resolve_backend  # noqa: E402
from .group_advantage import GroupAdvantages, fused_group_advantages, offsets_from_group_ids  # noqa: E402
from .is_ratio import mismatch_stats  # noqa: E402
from .linear_logprob import linear_token_logprobs  # noqa: E402
from .logprob import TokenLogprobs, token_logprobs  # noqa: E402

__all__ = [
    "GroupAdvantages",
    "TokenLogprobs",
    "fused_group_advantages",
    "linear_token_logprobs",
    "mismatch_stats",
    "offsets_from_group_ids",
    "resolve_backend",
    "token_logprobs",
]
