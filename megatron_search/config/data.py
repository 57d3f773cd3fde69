"""Data section (RECIPE section 4)."""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from .base import Section


class DataConfig(Section):
    qa_path: Optional[str] = Field(None, description="verifiable QA JSONL (question, answer, ...)")
    rubric_path: Optional[str] = Field(None, description="rubric chat JSONL (messages, rubrics)")
    mix: dict[str, float] = Field(
        default_factory=lambda: {"qa": 0.9, "rubric": 0.1},
        description="dataset-level sampling weights (RECIPE 4.3: 90% verifiable QA, 10% rubric chat)",
    )
    seed: int = 0
