"""Qwen3-MoE (Qwen3-30B-A3B family) on Megatron-Core: TransformerConfig fields and layer spec.

Every layer: RMSNorm -> GQA attention with per-head RMSNorm on q and k (QK-norm) and full RoPE
-> RMSNorm -> MoE (softmax router, top-k, renormalised when `norm_topk_prob`, SwiGLU experts,
no shared expert). No biases, untied embeddings. Matches transformers' Qwen3MoeForCausalLM.
"""
from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

from .norm import RMSNorm
from .provider_common import ProviderError, base_config_kwargs, rope_theta
from .specs import block_from_layer_spec, local_spec_fixups


def transformer_config_kwargs(cfg, hf: dict[str, Any], where: str, use_te: bool) -> dict[str, Any]:
    """Architecture fields of the Megatron TransformerConfig for a qwen3_moe config.json."""
    if hf.get("mlp_only_layers"):
        raise ProviderError(f"{where}: mlp_only_layers={hf['mlp_only_layers']} (dense layers) is not supported")
    if int(hf.get("decoder_sparse_step", 1)) != 1:
        raise ProviderError(f"{where}: decoder_sparse_step={hf['decoder_sparse_step']} is not supported (need 1)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ProviderError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported (need 'silu')")
    if hf.get("use_sliding_window"):
        raise ProviderError(f"{where}: use_sliding_window=true is not supported")
    heads = hf["num_attention_heads"]
    kw = base_config_kwargs(cfg, hf, use_te)
    kw.update(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads", heads),
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf.get("intermediate_size", hf["moe_intermediate_size"]),
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        add_qkv_bias=bool(hf.get("attention_bias", False)),
        qk_layernorm=True,
        # transformers 5 writes Qwen3-MoE configs with num_local_experts (the Hub's have num_experts)
        num_moe_experts=cfg.model.architecture.num_experts,
        moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        # Megatron: pre_softmax=False takes the top-k logits then softmaxes them, which equals
        # HF's softmax -> top-k -> renormalise; pre_softmax=True is HF's norm_topk_prob=False.
        moe_router_pre_softmax=not bool(hf.get("norm_topk_prob", True)),
        moe_router_score_function="softmax",
        activation_func=F.silu,
        gated_linear_unit=True,
    )
    return kw


def gpt_model_kwargs(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """GPTModel constructor arguments (embedding / RoPE / output layer)."""
    return dict(
        vocab_size=hf["vocab_size"],
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=rope_theta(hf, where),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
    )


def layer_spec(config, use_te: bool, vp_stage: int | None, pp_rank: int | None):
    """Block spec for this pipeline stage (TE when `use_te`, else local with our SP-capable RMSNorm)."""
    if use_te:
        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage, pp_rank=pp_rank
        )
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=True,
        normalization="RMSNorm",
    )
    return block_from_layer_spec(local_spec_fixups(spec, RMSNorm), config, vp_stage, pp_rank, RMSNorm)
