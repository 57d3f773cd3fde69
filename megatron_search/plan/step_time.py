"""How long one training update takes at a layout, and the preemption notice it and a checkpoint need
(docs/PLANNER.md, "Step time and the signal margin").

A stop signal (slurm/*.sh: `--signal=B:USR1@N`) is honoured at a step boundary: in SFT and in GRPO's update the
step in flight finishes, then the checkpoint is written (GRPO during its rollouts saves the step's start at once,
after releasing the engines). The worst case the notice must cover is therefore one whole update plus one save.

The update's FLOPs are counted from the architecture, at the worst case of every sequence at its length cap
(GRPO: rollout.max_total_tokens; SFT: sft.seq_length, packed): 6 x active parameters per token for the forward
and backward, 2 more under full recompute, and the full-attention layers' score and value products over a
causal context (GDN layers are linear in the context and counted in their parameters). The time divides them
by cluster.train_tflops_per_gpu, an assumption of the config (the throughput Megatron reaches on this model and
GPU), not a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_search.config.hf import Architecture
from megatron_search.config.schema import Config

from .params import ParamCounts, active_params


@dataclass
class StepTimeEstimate:
    tokens: float  # trained per step, every sequence at its length cap
    flops: float  # per step, all GPUs
    step_s: float  # one update at cluster.train_tflops_per_gpu
    save_s: float  # one checkpoint save (plan/checkpoint.py)
    notice_s: float  # cluster.preemption_notice_s
    tflops_per_gpu: float  # cluster.train_tflops_per_gpu

    @property
    def margin_s(self) -> float:
        """The notice a stop needs in the worst case: the update in flight, then a save."""
        return self.step_s + self.save_s


def attention_flops_per_token(a: Architecture, context: float) -> float:
    """Forward FLOPs of the full-attention layers' QK^T and AV per token, at a mean causal context of context/2."""
    full = sum(a.is_full_attention(i) for i in range(a.num_layers))
    return full * 2 * 2 * (context / 2) * a.num_attention_heads * a.head_dim


def step_time(cfg: Config, stage_kind: str, counts: ParamCounts, train_gpus: int, save_s: float) -> StepTimeEstimate:
    a = cfg.model.architecture
    if stage_kind == "sft":
        sequences, length = cfg.sft.global_batch_size, cfg.sft.seq_length
    else:
        sequences, length = cfg.grpo.prompts_per_step * cfg.grpo.group_size, cfg.rollout.max_total_tokens
    tokens = float(sequences * length)
    passes = 4 if cfg.model.recompute == "full" else 3  # forward, backward (2x), the recomputed forward
    # the embedding is a lookup, no matmul
    matmul_params = active_params(a) - counts.embedding
    per_token = 2 * passes * matmul_params + passes * attention_flops_per_token(a, length)
    flops = per_token * tokens
    seconds = flops / (train_gpus * cfg.cluster.train_tflops_per_gpu * 1e12)
    return StepTimeEstimate(tokens, flops, seconds, save_s, cfg.cluster.preemption_notice_s,
                            cfg.cluster.train_tflops_per_gpu)


def format_step_time(est: StepTimeEstimate) -> str:
    return (f"signal margin: a stop needs {est.margin_s:.0f} s (the update in flight {est.step_s:.0f} s: "
            f"{est.tokens / 1e6:.1f}M tokens, {est.flops / 1e18:.2f} EFLOP at {est.tflops_per_gpu:.0f} TFLOP/s per GPU; then the "
            f"save {est.save_s:.0f} s) of the {est.notice_s:.0f} s notice (cluster.preemption_notice_s)")


@dataclass
class ReferenceEstimate:
    """grpo.reference_source=rollout_engines: every reference answer of the run is generated at step 0, while the
    engines still hold the initial policy; every other rank waits for it on the host group."""
    answers: int  # grpo.steps x prompts_per_step x group_size
    tokens_each: int  # at most: max_new_tokens per turn x max_turns, capped by max_total_tokens
    engines: int
    seconds: float  # at cluster.engine_tokens_per_s per engine, every answer at its cap
    timeout_s: float  # parallel.phase_timeout_s: the host group's wait


def reference_time(cfg: Config, engines: int) -> ReferenceEstimate | None:
    """Step 0's reference generation (None unless the rollout engines answer the references)."""
    if cfg.reference_source() != "rollout_engines" or engines <= 0:
        return None
    g, r = cfg.grpo, cfg.rollout
    answers = g.steps * g.prompts_per_step * g.group_size
    tokens = min(r.max_new_tokens * r.max_turns, r.max_total_tokens)
    seconds = answers * tokens / (engines * cfg.cluster.engine_tokens_per_s)
    return ReferenceEstimate(answers, tokens, engines, seconds, cfg.parallel.phase_timeout_s)


def format_reference_time(est: ReferenceEstimate) -> str:
    return (f"step-0 references (grpo.reference_source=rollout_engines): {est.answers:,} answers of up to "
            f"{est.tokens_each:,} tokens on {est.engines} engine(s): up to {est.seconds / 3600:.1f} h before the first "
            f"update (parallel.phase_timeout_s {est.timeout_s / 3600:.1f} h)")
