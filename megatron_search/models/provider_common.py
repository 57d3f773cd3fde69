"""TransformerConfig fields shared by every architecture: parallel layout, precision, CPU choices."""
from __future__ import annotations

from typing import Any

import torch


class ProviderError(ValueError):
    """A config.json / config combination the Megatron provider cannot build."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rope_theta(hf: dict[str, Any], where: str) -> float:
    """RoPE base from `rope_parameters` (transformers >= 5) or the older `rope_theta`/`rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    rope_type = params.get("rope_type", (hf.get("rope_scaling") or {}).get("rope_type", "default"))
    if rope_type not in ("default", None):
        raise ProviderError(f"{where}: rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ProviderError(f"{where}: no rope_theta in rope_parameters or at top level")
    return float(theta)


def moe_dispatcher(choice: str, on_gpu: bool) -> str:
    if choice == "auto":
        return "alltoall" if on_gpu else "allgather"
    if choice in ("alltoall", "flex") and not on_gpu:
        raise ProviderError(f"model.moe_token_dispatcher: {choice!r} needs CUDA; use allgather on CPU")
    return choice


def base_config_kwargs(cfg, hf: dict[str, Any], use_te: bool) -> dict[str, Any]:
    """Parallel layout + precision + fusions off on CPU; architecture modules add their fields."""
    p, m = cfg.parallel, cfg.model
    on_gpu = torch.cuda.is_available()
    dtype = _DTYPES[m.params_dtype]
    recompute = {}
    if m.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif m.recompute == "selective":
        recompute = dict(recompute_granularity="selective")
        if m.recompute_modules is not None:
            recompute["recompute_modules"] = list(m.recompute_modules)
    return dict(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=p.etp,
        sequence_parallel=p.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        normalization="RMSNorm",
        init_method_std=hf.get("initializer_range", 0.02),
        # Router losses come from our config only, never from the HF config (config/model.py).
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if m.moe_aux_loss_coeff > 0 else "none",
        # None is Megatron's "off"; 0.0 would still run the z-loss (and log z_loss / 0).
        moe_z_loss_coeff=m.moe_z_loss_coeff if m.moe_z_loss_coeff > 0 else None,
        mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
        moe_token_dispatcher_type=moe_dispatcher(m.moe_token_dispatcher, on_gpu),
        # Grouped GEMM needs TE kernels; otherwise experts run as a loop of plain MLPs (SequentialMLP).
        moe_grouped_gemm=use_te,
        # Fused kernels are CUDA-only; TE's apply them anyway where available.
        use_cpu_initialization=not on_gpu,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # Batched p2p posts send/recv to prev and to next in one batch; with VPP and PP=2 prev and
        # next are the same peer, messages match by order rather than meaning and activations and
        # gradients get swapped (seen on gloo: wrong loss). Megatron's unbatched path orders them.
        batch_p2p_comm=not (p.vpp is not None and p.pp == 2),
        **recompute,
    )
