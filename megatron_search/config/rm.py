"""Preference reward model section (RECIPE 5.1; section 1: same backbone as the policy, scalar
value head instead of the LM head). The scorer kind (pointwise / pairwise) is `reward.scorer`.
Batch sizes and step counts are this project's defaults, sized for the tiny CPU model."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, NonNegativeInt, PositiveInt

from .base import Section


class RMConfig(Section):
    train_data: Optional[str] = Field(None, description="preference pairs JSONL for `rm train` (RECIPE 5.1)")
    eval_data: Optional[str] = Field(None, description="held-out preference pairs JSONL (accuracy, margin)")
    init_from: Optional[str] = Field(
        None,
        description="policy checkpoint the backbone starts from (RECIPE 1): a Megatron training checkpoint "
        "(or its root with `latest`) or an HF safetensors directory; None = random init (tests only)",
    )
    load: Optional[str] = Field(
        None, description="trained RM checkpoint (or its root) used by `rm score|eval` and the GRPO service"
    )
    steps: PositiveInt = Field(100, description="optimizer steps of `rm train` (ours)")
    global_batch_pairs: PositiveInt = Field(16, description="preference pairs per optimizer step (ours)")
    micro_batch_pairs: PositiveInt = Field(8, description="pairs per microbatch; each pair is 2 sequences (ours)")
    score_batch_pairs: PositiveInt = Field(32, description="pairs per forward pass when scoring (ours)")
    max_length: PositiveInt = Field(
        512, description="tokens per scored sequence; longer ones keep their end (the value is read at the last token)"
    )
    eval_interval: NonNegativeInt = Field(0, description="held-out evaluation every N steps (0: only at the end)")
    on_bad_pair: Literal["error", "skip"] = Field(
        "error",
        description="pairs with identical answers, missing fields or labels outside {0,1}: fail naming the "
        "line, or skip them and report the count",
    )
    noise_filter: bool = Field(
        False, description="apply the label-noise filter to training pairs (needs their `votes`, RECIPE 5.1)"
    )
    agreement_threshold: float = Field(
        1.0, ge=0.0, le=1.0,
        description="label-noise filter (RECIPE 5.1, Datbench-inspired): keep a pair when at least this fraction "
        "of the scoring models agree with its label (ours: 1.0 = all agree)",
    )
    min_scoring_models: PositiveInt = Field(
        2, description="label-noise filter: how many scoring models must have judged a pair (RECIPE 5.1: several)"
    )
    seed: int = Field(0, description="shuffling of training pairs")
