"""Data section (RECIPE sections 2 and 4): the embedded world, synthetic QA, the mix, SFT data,
public converters, the LLM client and the rubric pipeline."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import (Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, field_validator,
                      model_validator)

from .base import Section


class WorldConfig(Section):
    """The embedded synthetic world (data/world.py); demo-sized by default so it runs on a 2-core CPU."""

    seed: int = 0
    num_entities: PositiveInt = Field(300, description="invented entities (people, books, companies, ...)")
    min_sources: PositiveInt = Field(2, description="distinct sites stating each fact (RECIPE 4.1: confirmed by several sources)")
    single_source_fraction: float = Field(0.1, ge=0.0, le=1.0, description="facts stated only once (must not be trusted)")
    rumor_fraction: float = Field(0.05, ge=0.0, le=1.0, description="wrong single-source claims, as a fraction of facts")
    filler_docs: NonNegativeInt = Field(100, description="distractor documents that state no fact")


class SynthConfig(Section):
    """Synthetic QA by sequential expansion (RECIPE 4.1)."""

    seed: int = 0
    backend: Literal["offline", "llm"] = Field(
        "offline", description="offline: template extractor + scripted solvers (embedded world); llm: data.llm does "
        "claim extraction, question writing and solving (open corpora)")
    llm_solvers: PositiveInt = Field(3, description="llm backend: independent LLM search solvers")
    llm_solver_max_calls: PositiveInt = Field(5, description="llm backend: searches per solver (RECIPE 6: 5)")
    llm_solver_temperature: NonNegativeFloat = Field(0.6, description="llm backend: solver sampling temperature")
    prompt_version: str = Field("v1", description="llm backend: suffix of the versioned prompt files")
    num_seed_queries: PositiveInt = Field(40, description="seed queries; each retrieves candidate entities")
    search_k: PositiveInt = Field(10, description="results read per query (RECIPE 6: at most 10)")
    snippet_chars: PositiveInt = Field(2000, description="snippet length the pipeline reads from the local index")
    min_support: PositiveInt = Field(2, description="distinct sites that must state a claim for it to count")
    min_hops: int = Field(2, ge=2, le=4, description="RECIPE 4.1: chains of 2 to 4 hops")
    max_hops: int = Field(4, ge=2, le=4)
    chains_per_entity: PositiveInt = Field(3, description="expansion attempts per confirmed seed entity (distinct chains)")
    quorum: PositiveInt = Field(3, description="solvers that must agree on the unique answer")
    solvers: list[str] = Field(default_factory=lambda: ["phrase-k10", "keywords-k8", "entity-k6"],
                               description="verification solvers (data/synth/solver.py DEFAULT_SOLVERS names)")
    world_truth_check: bool = Field(True, description="embedded world only: also require a unique answer under the ground truth")
    augment_fraction: float = Field(0.3, ge=0.0, le=1.0, description="questions that also get a format-instruction copy")
    format_prompts: str = Field("format_instructions_v1", description="versioned prompt file of format instructions")
    validation_fraction: float = Field(0.1, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _check(self) -> "SynthConfig":
        if self.min_hops > self.max_hops:
            raise ValueError(f"data.synth.min_hops={self.min_hops} exceeds max_hops={self.max_hops}")
        if self.quorum > (self.llm_solvers if self.backend == "llm" else len(self.solvers)):
            raise ValueError(f"data.synth.quorum={self.quorum} exceeds the number of configured solvers")
        return self


class SFTDataConfig(Section):
    """SFT data (RECIPE 2): tool-use trajectories plus preference-oriented examples."""

    seed: int = 0
    instruction_examples: NonNegativeInt = Field(50, description="instruction-following examples (no search)")
    abstention_examples: NonNegativeInt = Field(50, description="abstention examples (search finds no evidence)")


class ConvertConfig(Section):
    """Public QA converters and quality filters (RECIPE 4.1 public baseline)."""

    on_error: Literal["raise", "skip"] = Field("raise", description="bad rows: error naming file and line, or skip and count")
    max_answer_chars: PositiveInt = Field(200, description="longer gold answers are dropped (not short-answer QA)")
    seed: int = Field(0, description="seed of the synthetic scale-matching sample and of format augmentation")
    augment_fraction: float = Field(0.3, ge=0.0, le=1.0, description="public questions that also get a format-instruction copy")
    format_prompts: str = Field("format_instructions_v1", description="versioned prompt file of format instructions")


class LLMConfig(Section):
    """OpenAI-compatible endpoint for data work (data/llm_client.py): SGLang, the local engine, any API."""

    base_url: str = Field("http://127.0.0.1:30000", description="server root; /v1/chat/completions is appended")
    model: str = Field("default", description="model name sent in each request")
    api_key_env: Optional[str] = Field(None, description="environment variable holding the API key (never logged)")
    concurrency: PositiveInt = Field(8, description="requests in flight at once")
    timeout_s: PositiveFloat = Field(120.0, description="per request")
    retries: NonNegativeInt = Field(3, description="retries on connection errors, timeouts, 429 and 5xx")
    backoff_s: NonNegativeFloat = Field(1.0, description="first retry delay; doubles each retry")
    cache_dir: Optional[str] = Field(None, description="on-disk response cache (None: no cache)")


class RubricConfig(Section):
    """Rubric chat data (RECIPE 4.2)."""

    samples: PositiveInt = Field(4, description="independent policy samples for the pass@k calibration (RECIPE: 4)")
    sample_temperature: NonNegativeFloat = Field(0.6, description="policy sampling temperature (RECIPE 8 default)")
    max_tokens: PositiveInt = Field(1024, description="per generated reply")
    prompt_version: str = Field("v1", description="suffix of the versioned prompt files in data/prompts/")
    max_rubric_chars: PositiveInt = Field(300, description="longer rubrics are rejected as non-atomic")
    policy_base_url: Optional[str] = Field(None, description="endpoint serving the policy to calibrate (default: data.llm)")
    policy_model: Optional[str] = None


MIX_DATASETS = ("qa", "rubric")  # the sources of GRPO prompts (train/grpo_data.py)


class DataConfig(Section):
    qa_path: Optional[str] = Field(None, description="verifiable QA records (data/records.py): JSONL / parquet / "
                                   "Arrow file, or a local folder in the Hub's layout or saved with save_to_disk")
    rubric_path: Optional[str] = Field(None, description="rubric chat rows (messages, rubrics): a file or folder as qa_path")
    mix: dict[str, float] = Field(
        default_factory=lambda: {"qa": 0.9, "rubric": 0.1},
        description="dataset-level sampling weights (RECIPE 4.3: 90% verifiable QA, 10% rubric chat)",
    )
    seed: int = 0
    world: WorldConfig = Field(default_factory=WorldConfig)
    synth: SynthConfig = Field(default_factory=SynthConfig)
    sft: SFTDataConfig = Field(default_factory=SFTDataConfig)
    convert: ConvertConfig = Field(default_factory=ConvertConfig)
    llm: LLMConfig = Field(default_factory=LLMConfig)
    rubric: RubricConfig = Field(default_factory=RubricConfig)

    @field_validator("mix")
    @classmethod
    def _known_datasets(cls, mix: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(mix) - set(MIX_DATASETS))
        if unknown:
            raise ValueError(f"unknown dataset(s) {unknown} (known: {', '.join(MIX_DATASETS)})")
        negative = {k: v for k, v in mix.items() if v < 0}
        if negative:
            raise ValueError(f"negative weight(s) {negative}")
        return mix
