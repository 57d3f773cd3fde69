"""Evaluation section (RECIPE section 8 defaults; the rest is ours and says so)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt

from .base import Section

DEFAULT_LANGUAGES = ["ENGLISH", "CHINESE", "RUSSIAN", "FRENCH", "GERMAN", "SPANISH", "PORTUGUESE", "ITALIAN",
                     "JAPANESE", "KOREAN", "ARABIC", "TURKISH", "DUTCH", "POLISH", "UKRAINIAN", "VIETNAMESE",
                     "INDONESIAN", "HINDI"]


class EvalConfig(Section):
    budgets: list[NonNegativeInt] = Field(default_factory=lambda: list(range(11)),
                                          description="tool budgets b swept (RECIPE 8: 0..10)")
    max_calls: NonNegativeInt = Field(5, description="tool calls per example outside the sweep (RECIPE 8)")
    max_results: PositiveInt = Field(10, description="results per search_web call (RECIPE 8)")
    max_new_tokens: PositiveInt = Field(8192, description="output tokens per example (RECIPE 8)")
    temperature: NonNegativeFloat = Field(0.6, description="sampling temperature (RECIPE 8)")
    samples: PositiveInt = Field(
        1, description="episodes per example (and budget), each with its own sampling seed; accuracy and the other "
        "means average over them (avg@k, for small sets; ours)")
    limit: NonNegativeInt = Field(0, description="examples per benchmark; 0 = all")
    seed: int = Field(0, description="seed of the deterministic sub-sampling and of per-example sampling seeds")
    grader: Literal["substring", "exact", "llm"] = Field(
        "substring", description="answer grading: normalised gold-substring / exact match, or the benchmark's LLM "
        "judge (SimpleQA protocol, FRAMES TRUE/FALSE) over judge_base_url (ours)")
    judge_base_url: Optional[str] = Field(None, description="OpenAI-compatible endpoint of the LLM judge")
    judge_model: str = Field("default", description="model name sent to the judge endpoint")
    judge_api_key_env: Optional[str] = Field(None, description="environment variable holding the judge's API key")
    judge_max_tokens: PositiveInt = Field(512, description="judge reply length (ours)")
    judge_cache_dir: Optional[str] = Field(None, description="on-disk cache of judge replies (ours)")
    min_language_chars: PositiveInt = Field(
        20, description="shorter answers/questions are 'undetermined' for language mismatch (lingua is unreliable "
        "on a few characters; ours)")
    language_min_confidence: float = Field(
        0.5, ge=0.0, le=1.0, description="lingua confidence below which a text's language is undetermined (ours)")
    languages: list[str] = Field(default_factory=lambda: list(DEFAULT_LANGUAGES),
                                 description="lingua Language names considered by the language-mismatch metric")
    prices: Optional[str] = Field(None, description="price table YAML; None = megatron_search/eval/prices.yaml")
