"""Model and parallelism sections."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, PositiveInt, model_validator

from .base import Section
from .hf import Architecture, architecture_from_hf, load_hf_config


class ModelConfig(Section):
    """Which model to build: a Hugging Face config.json plus Megatron build choices."""

    hf_config: str = Field(
        "configs/models/tiny_qwen3_moe",
        description="config.json (or a directory holding one) of the HF model; relative paths "
        "resolve against the repository root, then the current directory.",
    )
    checkpoint: Optional[str] = Field(None, description="HF safetensors directory to initialise from")
    tokenizer: str = Field(
        "qwen",
        description="'qwen' = the real Qwen2/3 BPE (shipped in qwen-agent); else a tokenizer.json path "
        "(the tiny demo trains its own with `megatron-search train-tokenizer`)",
    )
    chat_style: Literal["qwen3", "qwen3_5"] = Field("qwen3", description="tool-call syntax of the chat format")
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    transformer_impl: Literal["auto", "local", "transformer_engine"] = Field(
        "auto", description="auto: Transformer Engine specs when TE is importable, local otherwise"
    )
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_modules: Optional[list[Literal["core_attn", "moe_act", "layernorm", "mlp", "moe", "shared_experts"]]] = Field(
        None, description="with recompute=selective, the modules recomputed (Megatron's recompute_modules; None = its "
        "default, core_attn); 'moe' recomputes the router too, where routing replay replays the engine's experts"
    )
    mtp: bool = Field(
        False, description="build the model's multi-token-prediction layer (Qwen3.5, HF mtp.*; needs "
        "mtp_num_hidden_layers=1 in the config.json): loaded, exported and synced with the rest of the model; "
        "SFT trains it (cross entropy of token t+2 under the same loss mask, weighted by mtp_loss_scaling_factor); "
        "GRPO keeps it frozen and out of the RL loss (train/grpo.py). Off: HF mtp.* tensors are carried "
        "through conversion unchanged and never synced")
    mtp_loss_scaling_factor: float = Field(
        0.1, ge=0.0, description="weight of the MTP loss added to the SFT loss (Megatron's "
        "mtp_loss_scaling_factor, whose default 0.1 this is); used only with model.mtp")
    seed: int = 1234
    # MoE router losses: set here only. The HF config's router_aux_loss_coef (0.001 in the Qwen3 / Qwen3.5
    # configs) is a pre-training value and is never read: inherited into RL it multiplied the grad norm
    # 3.4x for a peer (Megatron-LM #5694). The RECIPE write-up names no router loss for RL.
    moe_aux_loss_coeff: float = Field(
        0.0, ge=0.0, description="Megatron aux load-balancing loss coefficient; 0 = no aux loss (RL default); "
        "never taken from the HF config's router_aux_loss_coef"
    )
    moe_z_loss_coeff: float = Field(
        0.0, ge=0.0, description="Megatron router z-loss coefficient; 0 = no z-loss (RL default; passed to "
        "Megatron as None, its 'off')"
    )
    moe_token_dispatcher: Literal["auto", "allgather", "alltoall", "flex"] = Field(
        "auto", description="auto: alltoall on GPU, allgather on CPU (alltoall needs CUDA streams)"
    )

    @model_validator(mode="after")
    def _recompute_modules_need_selective(self):
        if self.recompute_modules is not None and self.recompute != "selective":
            raise ValueError(f"model.recompute_modules: {self.recompute_modules} applies to recompute=selective only "
                             f"(recompute={self.recompute!r})")
        return self

    def resolved_hf_config(self) -> Path:
        p = Path(self.hf_config)
        if p.is_absolute() or p.exists():
            return p
        repo_root = Path(__file__).resolve().parents[2]
        return repo_root / p

    @cached_property
    def architecture(self) -> Architecture:
        path = self.resolved_hf_config()
        return architecture_from_hf(load_hf_config(path), where=str(path))


class ParallelConfig(Section):
    """Megatron parallel layout. DP is derived: world / (TP * PP * CP)."""

    tp: PositiveInt = 1
    pp: PositiveInt = 1
    vpp: Optional[PositiveInt] = Field(None, description="virtual pipeline stages per rank")
    cp: PositiveInt = 1
    ep: PositiveInt = 1
    etp: PositiveInt = Field(
        1, description="expert tensor parallel size; when not given it equals tp (Megatron-LM's default)"
    )
    sequence_parallel: bool = False
    world_size: Optional[PositiveInt] = Field(
        None, description="expected world size; checked against TP*PP*CP*DP when given and at launch"
    )
    distributed_optimizer: bool = True
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl on GPU, gloo on CPU")

    @property
    def sequence_multiple(self) -> int:
        """Training sequence lengths must be a multiple of this: sequence parallelism splits them over TP."""
        return self.tp if self.sequence_parallel else 1

    @model_validator(mode="before")
    @classmethod
    def _etp_defaults_to_tp(cls, data):
        # With EP=1, ETP must equal TP (see layout_problems), so an unset ETP follows TP.
        if isinstance(data, dict) and data.get("etp") is None and "tp" in data:
            data = {**data, "etp": data["tp"]}
        return data
