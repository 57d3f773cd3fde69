"""Per-step rollout metrics for TensorBoard (RECIPE section 7's curves)."""
from __future__ import annotations

import torch

from megatron_search.search.tool import SEARCH_FAILURE_KINDS


def rollout_metrics(col, scores, rewards, adv: torch.Tensor) -> dict[str, float]:
    kinds = [it.kind for it in col.items]
    out: dict[str, float] = {}
    for kind, tag in (("qa", "reward/qa_correct"), ("rubric", "reward/rubric_pass")):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        if idx:
            out[tag] = float(scores.r_base[idx].float().mean())
    calls = scores.tool_calls.float()
    out["rollout/tool_calls"] = float(calls.mean())
    out["rollout/effective_calls"] = float((scores.tool_calls - scores.failed_calls).float().mean())
    out["rollout/broken_calls"] = sum(sum(r.broken_calls.values()) for r in col.rollouts) / len(col.rollouts)
    for kind in SEARCH_FAILURE_KINDS:  # failed executions by class (rollout/search_timeouts, rollout/search_errors)
        out[f"rollout/{kind}s"] = sum(r.search_failures.get(kind, 0) for r in col.rollouts) / len(col.rollouts)
    out["rollout/response_tokens"] = float(scores.lengths.mean())
    out["rollout/no_answer"] = sum(r.final_answer is None for r in col.rollouts) / len(col.rollouts)
    out["reward/R"] = float(rewards.reward.mean())
    out["advantage/mean"] = float(adv.mean())
    out["advantage/std"] = float(adv.std()) if adv.numel() > 1 else 0.0
    out["advantage/abs_max"] = float(adv.abs().max())
    return out
