"""Reward section (RECIPE section 5). The write-up gives the formulas but not the coefficients;
the defaults below are this project's choice and are documented as such."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, NonNegativeFloat

from .base import Section
from .data import LLMConfig


class RewardConfig(Section):
    answer_match: Literal["exact", "substring"] = Field(
        "substring", description="QA r_base: normalised exact match, or gold answer contained in the prediction"
    )
    # RECIPE 5.2: pen_eff = lambda_tool * pen_tool + lambda_len * pen_len. Ours: 0.1 each, so the
    # largest penalty (0.1 + 0.1) stays below the preference credit a correct answer can earn.
    lambda_tool: NonNegativeFloat = Field(0.1, description="weight of the anchored tool penalty (RECIPE 5.2; ours)")
    lambda_len: NonNegativeFloat = Field(0.1, description="weight of the anchored length penalty (RECIPE 5.2; ours)")
    alpha_win: NonNegativeFloat = Field(1.0, description="tool penalty scale for winners (RECIPE 5.2; ours)")
    alpha_lose: NonNegativeFloat = Field(1.0, description="tool penalty scale for losers (RECIPE 5.2; ours)")
    beta_lose: NonNegativeFloat = Field(
        0.0, description="constant tool penalty offset for losers (RECIPE 5.2; ours: off, losers already earn 0)"
    )
    preference_threshold: float = Field(
        0.5, ge=0.0, le=1.0, description="s >= this marks a preferred winner (RECIPE 5.2: 0.5)"
    )
    scorer: Literal["pointwise", "pairwise"] = Field(
        "pointwise", description="RECIPE 5.1: scalar score per answer, or Delta with both answers in context"
    )
    seed: int = Field(0, description="seed of the generator that samples the tool baseline b_g (RECIPE 5.2)")
    rubric_judge: Optional[LLMConfig] = Field(
        None, description="OpenAI-compatible endpoint of the instruction-following judge that grades rubric chat "
        "(RECIPE 4.2, 5: r_base = every rubric passes) for the rubrics the mechanical checks cannot decide: an "
        "SGLang-served judge at scale, the local engine server on CPU; prompt data/prompts/rubric_judge_<data.rubric."
        "prompt_version>, the same judge as the pass@4 calibration (`data rubrics` uses it when set). None: a rubric "
        "item the mechanical checks cannot decide is an error")
