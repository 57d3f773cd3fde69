"""TransformerConfig fields shared by every architecture: parallel layout, precision, fusions, MoE dispatch.

Fusions (model.fusions=auto) are switched on one by one where Megatron-Core 0.16.1 can run them, each
prerequisite read from its source: gradient_accumulation_fusion needs the fused_weight_gradient_mlp_cuda
extension (apex; tensor_parallel/layers.py raises in ColumnParallelLinear without it, even beside TE, whose
linears use their own kernel) and main_grad buffers (Megatron DDP, fp32 here: trainer/step.py);
apply_rope_fusion needs TE's fused RoPE (rope_utils.fused_apply_rotary_pos_emb, TE >= 1.4);
bias_activation_fusion (SwiGLU) and bias_dropout_fusion are Megatron's own jit fusions. masked_softmax_fusion
and persist_layer_norm stay off: only DotProductAttention (whose core attention our local specs route through
SDPA, and the TE specs replace) and apex's FusedLayerNorm (LayerNorm; ours are RMSNorm) read them.
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Any, Callable

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.transformer.moe import fused_a2a

log = logging.getLogger(__name__)


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


def variable_seq_lengths(asked: bool, pp: int, dispatcher) -> bool:
    """Megatron's variable_seq_lengths: only where shapes vary (`asked`), matter (PP > 1: stages exchange
    activations) and Megatron allows it (not with the allgather dispatcher, transformer_config.py)."""
    return bool(asked and pp > 1 and dispatcher != "allgather")


def _flex_backend_present(backend: str) -> bool:
    """Megatron's own probe: fused_a2a imports deep_ep's Buffer (deepep) or HybridEPBuffer (hybridep)."""
    return bool(fused_a2a.HAVE_DEEP_EP if backend == "deepep" else fused_a2a.HAVE_HYBRIDEP)


def flex_problems(m, p, backend_present: Callable[[str], bool] = _flex_backend_present) -> list[str]:
    """Why the flex dispatcher cannot run for this model/layout (empty: it can). Megatron-Core 0.16.1 would fail
    later and less clearly: ImportError in _DeepepManager, an assert on TP x EP > 1 in MoEFlexTokenDispatcher."""
    out = []
    if p.etp * p.ep == 1:  # the dispatcher's tp is the expert tensor-parallel group (token_dispatcher.py)
        out.append(f"model.moe_token_dispatcher: flex needs ETP x EP > 1 (Megatron's MoEFlexTokenDispatcher), got "
                   f"ETP={p.etp} EP={p.ep}; use alltoall")
    if not backend_present(m.moe_flex_dispatcher_backend):
        what = "deep_ep (DeepEP, github.com/deepseek-ai/DeepEP)" if m.moe_flex_dispatcher_backend == "deepep" \
            else "deep_ep with HybridEPBuffer (DeepEP's hybrid-ep branch)"
        out.append(f"model.moe_token_dispatcher: flex with moe_flex_dispatcher_backend="
                   f"{m.moe_flex_dispatcher_backend!r} needs {what}, which is not importable; install it or use "
                   f"alltoall")
    return out


def _te_permute_present() -> bool:
    """Megatron's own probe (transformer_config.py, moe_permute_fusion): TE's five moe_permute/unpermute ops."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    # optional: transformer_engine (the probe runs only where TE is installed)
    from megatron.core.extensions import transformer_engine as te_ext

    return all(getattr(te_ext, n, None) is not None for n in (
        "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs", "fused_unpermute"))


def permute_fusion_problems(m, permute_present: Callable[[], bool] = _te_permute_present) -> list[str]:
    if m.moe_permute_fusion and not permute_present():
        return ["model.moe_permute_fusion: needs Transformer Engine >= 2.1 (its moe_permute ops, "
                "transformer_engine.pytorch.permutation), which is not importable; install the gpu extra or set "
                "model.moe_permute_fusion=false"]
    return []


FUSIONS = ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
           "apply_rope_fusion", "persist_layer_norm")
# Off whatever is installed: no module of our specs reads them (module docstring).
_UNUSED = {
    "masked_softmax_fusion": "read only by Megatron's DotProductAttention: the TE specs use TEDotProductAttention, "
                             "the local specs torch SDPA",
    "persist_layer_norm": "read only by apex's FusedLayerNorm (LayerNorm); our norms are RMSNorm",
}


def _grad_accum_extension_present() -> bool:
    # Megatron's own verdict: tensor_parallel/layers.py imports the extension and keeps whether it loaded
    return bool(tp_layers._grad_accum_fusion_available)


def _te_rope_present() -> bool:
    # the name transformer_config.py checks for apply_rope_fusion (None without TE >= 1.4)
    return rope_utils.fused_apply_rotary_pos_emb is not None


def fusion_settings(choice: str, on_gpu: bool, grad_accum_present: Callable[[], bool] = _grad_accum_extension_present,
                    te_rope_present: Callable[[], bool] = _te_rope_present) -> tuple[dict[str, bool], dict[str, str]]:
    """({fusion: on} for the six TransformerConfig flags, {fusion: why it is off}) for model.fusions=`choice`."""
    if choice == "off":
        return dict.fromkeys(FUSIONS, False), dict.fromkeys(FUSIONS, "model.fusions=off")
    if not on_gpu:
        return dict.fromkeys(FUSIONS, False), dict.fromkeys(FUSIONS, "no GPU (the fused kernels are CUDA kernels)")
    why = dict(_UNUSED)
    if not grad_accum_present():
        why["gradient_accumulation_fusion"] = ("the fused_weight_gradient_mlp_cuda extension (apex --cuda_ext) is not "
                                               "importable; Megatron's ColumnParallelLinear refuses the fusion without it")
    if not te_rope_present():
        why["apply_rope_fusion"] = "Transformer Engine's fused RoPE (TE >= 1.4) is not importable"
    return {f: f not in why for f in FUSIONS}, why


def log_fusions(on: dict[str, bool], why: dict[str, str]) -> str:
    """One line naming the fusions on and, for each one off, why; logged where the model is built."""
    line = ("fusions on: " + (", ".join(f for f in FUSIONS if on[f]) or "none") + "; off: "
            + "; ".join(f"{f} ({why[f]})" for f in FUSIONS if not on[f]))
    log.info(line)
    return line


def base_config_kwargs(cfg, hf: dict[str, Any], use_te: bool) -> dict[str, Any]:
    """Parallel layout + precision + fusions off on CPU; architecture modules add their fields."""
    p, m = cfg.parallel, cfg.model
    on_gpu = torch.cuda.is_available()
    dtype = _DTYPES[m.params_dtype]
    dispatcher = moe_dispatcher(m.moe_token_dispatcher, on_gpu)
    problems = permute_fusion_problems(m) + (flex_problems(m, p) if dispatcher == "flex" else [])
    if problems:
        raise ProviderError("; ".join(problems))
    fusions, _ = fusion_settings(m.fusions, on_gpu)
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
        moe_token_dispatcher_type=dispatcher,
        # Grouped GEMM needs TE kernels; otherwise experts run as a loop of plain MLPs (SequentialMLP).
        moe_grouped_gemm=use_te,
        moe_router_dtype=m.moe_router_dtype,
        moe_permute_fusion=m.moe_permute_fusion,
        **({"moe_flex_dispatcher_backend": m.moe_flex_dispatcher_backend} if dispatcher == "flex" else {}),
        use_cpu_initialization=not on_gpu,
        **fusions,  # model.fusions: fusion_settings (module docstring); none on CPU
        # Batched p2p posts send/recv to prev and to next in one batch; with VPP and PP=2 prev and
        # next are the same peer, messages match by order rather than meaning and activations and
        # gradients get swapped (seen on gloo: wrong loss). Megatron's unbatched path orders them.
        batch_p2p_comm=not (p.vpp is not None and p.pp == 2),
        **recompute,
    )
