"""The preference scorer of the GRPO reward: the trained Bradley-Terry reward model (RECIPE 5.1)."""
from __future__ import annotations


def build_preference(cfg, groups):
    """rm/'s PreferenceService on the reward model in rm.load. There is no fallback: without a trained
    reward model the gated reward R = r_base * s - pen_eff is undefined, so this is an error. The reward model
    is built in `groups`, the policy's layout."""
    if not cfg.rm.load:
        raise ValueError("rm.load: GRPO needs a trained reward model for the preference score s "
                         "(train one with `megatron-search rm train`, then pass rm.load=<its checkpoint>)")
    from megatron_search.rm.build import preference_service

    return preference_service(cfg, groups)
