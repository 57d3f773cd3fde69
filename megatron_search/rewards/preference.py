"""What the reward side needs from a preference service and a reference model (RECIPE 5.1): the protocol
GRPO scores through (rm/service.PreferenceService implements it) and the reference rollout's summary."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


class PreferenceScorer(Protocol):
    def score(self, prompts: Sequence[list[dict]], answers: Sequence[str], ref_answers: Sequence[str]) -> torch.Tensor:
        """P_bar(x, y, y_ref) in [0, 1] for each triple."""


@dataclass(frozen=True)
class ReferenceAnswer:
    """The frozen reference model's rollout summary for one prompt (cached once per prompt)."""

    answer: str
    generated_tokens: int
