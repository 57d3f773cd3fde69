"""The preference scorer of the GRPO reward: the trained Bradley-Terry reward model (RECIPE 5.1)."""
from __future__ import annotations

from megatron_search.rm.build import preference_service


def build_preference(cfg, groups):
    """rm/'s PreferenceService on the reward model in rm.load. There is no fallback: without a trained
    reward model the gated reward R = r_base * s - pen_eff is undefined, so a GRPO config without rm.load is
    refused (config.stage_problems). The reward model is built in `groups`, the policy's layout."""
    return preference_service(cfg, groups)
