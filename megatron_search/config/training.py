"""Optimiser, SFT, checkpoint and logging sections (RECIPE section 2 for SFT)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from .base import Section


class OptimConfig(Section):
    lr: NonNegativeFloat = Field(1e-6, description="peak learning rate; 0 = a control run (every step taken, no update)")
    min_lr: NonNegativeFloat = 0.0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: NonNegativeInt = 0
    weight_decay: NonNegativeFloat = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: PositiveFloat = 1e-8
    clip_grad: NonNegativeFloat = Field(1.0, description="global gradient-norm clip; 0 disables")
    main_grads_fp32: bool = Field(True, description="accumulate and all-reduce gradients in fp32")

    @model_validator(mode="before")
    @classmethod
    def _no_cpu_offload(cls, data):
        if not isinstance(data, dict) or "cpu_offload" not in data:
            return data
        data = dict(data)
        if data.pop("cpu_offload"):  # `false` (what configs saved before the field went say) is dropped
            raise ValueError("optim.cpu_offload is gone: it only changed the planner (the optimizer state stayed on "
                             "the GPU, so a plan that fit with it ran out of memory); fit the optimizer with more "
                             "EP / PP, the distributed optimizer, or recompute")
        return data


class SkillCheckConfig(Section):
    """Stop an SFT run once the model does what it is trained for: every `every` steps the model answers the
    held-out examples of `path` greedily, and the run ends (checkpoint saved) when the share answered exactly
    reaches `threshold`; `sft.steps` is then the cap (ours: the demo's warm-ups, issue 21.4)."""

    path: Optional[str] = Field(None, description="JSONL of chat examples; the last assistant message is the expected "
                                "answer, the messages before it the prompt (unset: no check)")
    every: PositiveInt = Field(100, description="steps between checks")
    threshold: float = Field(0.9, gt=0, le=1, description="share of exact answers that ends the run")
    min_steps: NonNegativeInt = Field(0, description="no check before this step")
    max_examples: PositiveInt = Field(64, description="examples of `path` checked (the first ones)")
    max_new_tokens: PositiveInt = Field(40, description="greedy tokens per answer")


class SFTConfig(Section):
    """SFT warm-up: loss on assistant tokens only (RECIPE section 2)."""

    steps: PositiveInt = 100
    global_batch_size: PositiveInt = 8
    micro_batch_size: PositiveInt = 1
    seq_length: PositiveInt = 1024
    packing: bool = Field(True, description="pack several examples per row (else one example per row, padded)")
    trim_padding: bool = Field(
        True, description="cut each batch to its longest row (rounded up to what sequence parallelism needs) "
        "instead of seq_length: same cross-entropy for less compute when rows are short (ours)")
    datasets: dict[str, float] = Field(
        default_factory=dict, description="dataset path (JSONL / parquet / Arrow file, or a local Hub-layout / save_to_disk "
        "folder) -> sampling weight of the SFT mix"
    )
    skill_check: SkillCheckConfig = Field(default_factory=SkillCheckConfig)


class CheckpointConfig(Section):
    dir: Optional[str] = Field(None, description="defaults to <run.output_dir>/checkpoints")
    save_interval: PositiveInt = 50
    keep_last: PositiveInt = 3
    resume: bool = False
    load: Optional[str] = Field(None, description="checkpoint to start from (weights only unless resume; with resume, "
                                "used only when the run has no checkpoint of its own yet)")
    optimizer_format: Literal["dp_reshardable", "fully_reshardable"] = Field(
        "dp_reshardable", description="how the distributed optimizer's state is written (Megatron's sharding types). "
        "dp_reshardable: each rank writes its own shard as it lies, no gather, no extra host memory (Megatron-LM's "
        "choice at scale); it resumes at the same TP/PP/VPP/EP/ETP layout (DP may change). fully_reshardable: "
        "gathered per parameter over each DP group (host memory for the DP group's state on every rank), resumes at "
        "any layout: the conversion step before a layout change (resume once at the old layout with it and save)")
    fully_parallel: bool = Field(
        True, description="spread the writing of replicated tensors over the data-parallel ranks (Megatron's "
        "FullyParallelSaveStrategyWrapper) instead of the first replica writing all of them; each rank reads its "
        "own shards (a fully parallel load would exchange every shard with two holders over the DP group)")
    write_threads: int = Field(2, ge=1, description="writer threads per rank (torch.distributed.checkpoint's "
                               "FileSystemWriter thread_count; Megatron-LM's default is 2)")


class LoggingConfig(Section):
    tensorboard: bool = Field(True, description="scalars under <run.output_dir>/tensorboard")
    wandb: bool = Field(False, description="the same scalars to Weights & Biases (the `wandb` extra: pip install "
                        "'.[wandb]'); the run's resolved config goes along. The API key is wandb's own $WANDB_API_KEY")
    wandb_project: str = Field("megatron-search", description="W&B project (the run's name is run.name)")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: the run is written under <run.output_dir>/wandb and nothing leaves the "
        "machine (`wandb sync` uploads it later); online: streamed to the W&B server")
    log_interval: PositiveInt = 1
    progress_bars: bool = True


class RunConfig(Section):
    name: str = "run"
    output_dir: str = "runs/default"
    seed: NonNegativeInt = 1234
