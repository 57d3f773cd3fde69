"""Reward section (RECIPE section 5). The write-up gives the formulas but not the coefficients;
the defaults below are this project's choice and are documented as such."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeFloat

from .base import Section


class RewardConfig(Section):
    answer_match: Literal["exact", "substring"] = Field(
        "substring", description="QA r_base: normalised exact match, or gold answer contained in the prediction"
    )
    lambda_tool: NonNegativeFloat = Field(0.1, description="weight of the anchored tool penalty")
    lambda_len: NonNegativeFloat = Field(0.1, description="weight of the anchored length penalty")
    alpha_win: NonNegativeFloat = Field(1.0, description="tool penalty scale for winners")
    alpha_lose: NonNegativeFloat = Field(1.0, description="tool penalty scale for losers")
    beta_lose: NonNegativeFloat = Field(0.0, description="constant tool penalty offset for losers")
    preference_threshold: float = Field(0.5, ge=0.0, le=1.0, description="s >= this marks a preferred winner")
    scorer: Literal["pointwise", "pairwise"] = "pointwise"
    seed: int = Field(0, description="seed of the generator that samples the tool baseline b_g")
