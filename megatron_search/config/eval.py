"""Evaluation section (RECIPE section 8 defaults)."""
from __future__ import annotations

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt

from .base import Section


class EvalConfig(Section):
    budgets: list[NonNegativeInt] = Field(default_factory=lambda: list(range(11)), description="tool budgets b swept")
    max_calls: NonNegativeInt = 5
    max_results: PositiveInt = 10
    max_new_tokens: PositiveInt = 8192
    temperature: NonNegativeFloat = 0.6
    limit: NonNegativeInt = Field(0, description="examples per benchmark; 0 = all")
    seed: int = 0
