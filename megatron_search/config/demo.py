"""The embedded CPU demo's curriculum (`megatron-search demo`, train/demo.py).

The stages themselves are configured by the usual sections (`sft`, `optim`, `rm`, `grpo`, ...);
this section holds what only the demo decides: how many drills it writes, the copy warm-up stage
that runs before the agent SFT, the SFT mix and GRPO's learning rate. Ours, sized by measurement
for a model trained from scratch on 2 CPU cores (README, "The embedded demo").
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, field_validator

from .base import Section

SFT_PARTS = ("tool", "copy", "read")
WARMUP_PARTS = ("copy", "read")


class DemoConfig(Section):
    copy_drills: PositiveInt = Field(20000, description="'Repeat exactly: <invented name>' examples written")
    copy_layout: Literal["end", "varied"] = Field(
        "end", description="'end': the name ends the prompt (learnt as a copy from a fixed offset: 0% once anything "
        "follows it, measured); 'varied': among filler words and a distractor name (data/demo_tasks.copy_drills)")
    reading_drills: PositiveInt = Field(5000, description="passage + question -> name examples written")
    reading_answer: Literal["name", "sentence"] = Field(
        "name", description="reading drills answer with the bare name or restate the fact ('X was written by Y.')")
    reading_phrasing: Literal["any", "first"] = Field(
        "any", description="reading drill passages state facts with any template of the relation or the first only")
    warmup_steps: NonNegativeInt = Field(
        500, description="copy warm-up SFT steps on the copy drills before the agent SFT (0: no warm-up); "
        "copying fresh names: 17% after 300 steps, 77% after 400, 97% after 500 (measured)")
    warmup_mix: dict[str, float] = Field(
        default_factory=lambda: {"copy": 1.0},
        description="warm-up sampling weights of the drill kinds (copy, read); reading drills need "
        "warmup_seq_length ~128")
    warmup_lr: PositiveFloat = Field(2e-3, description="constant LR of the warm-up (after optim.warmup_steps)")
    warmup_batch: PositiveInt = Field(128, description="drills per warm-up step (one per row, unpacked)")
    warmup_seq_length: PositiveInt = Field(
        40, description="row length of the warm-up (a copy drill is 19-33 tokens with the demo tokenizer)")
    sft_lr: PositiveFloat = Field(
        5e-4, description="peak LR of the agent SFT after the warm-up; a higher one erases the copying the "
        "warm-up taught (measured: 2e-3 -> 0% on fresh names)")
    sft_min_lr: PositiveFloat = Field(5e-5, description="final LR of the agent SFT's cosine schedule")
    sft_mix: dict[str, float] = Field(
        default_factory=lambda: {"tool": 0.5, "copy": 0.3, "read": 0.2},
        description="agent SFT sampling weights of the tool trajectories and the two drill kinds")
    grpo_lr: PositiveFloat = Field(1e-4, description="constant GRPO learning rate (no warm-up)")

    @field_validator("sft_mix")
    @classmethod
    def _known_parts(cls, mix: dict[str, float]) -> dict[str, float]:
        return _check_mix(mix, SFT_PARTS, "tool")

    @field_validator("warmup_mix")
    @classmethod
    def _known_drills(cls, mix: dict[str, float]) -> dict[str, float]:
        return _check_mix(mix, WARMUP_PARTS, None)


def _check_mix(mix: dict[str, float], parts: tuple[str, ...], required: str | None) -> dict[str, float]:
    unknown = sorted(set(mix) - set(parts))
    if unknown or (required and not mix.get(required)) or not any(w > 0 for w in mix.values()):
        need = f" with a positive '{required}' weight" if required else " with a positive weight"
        raise ValueError(f"keys are {', '.join(parts)}{need}")
    if any(w < 0 for w in mix.values()):
        raise ValueError(f"weights must be >= 0 (got {mix})")
    return mix
