"""Qwen3.5-MoE hybrid (Qwen3.5-122B-A10B / 397B-A17B) language model on Megatron-Core.

Layer i is a Gated DeltaNet (GDN) layer, except every `full_attention_interval`-th layer
((i + 1) % interval == 0), which is gated full attention: q_proj twice as wide, the second half
of each head is a sigmoid output gate; QK-norm; partial RoPE (25% of head_dim). Every layer's
MLP is MoE (softmax top-k, renormalised) plus one shared expert scaled by sigmoid(x . w_gate).
All RMSNorms are zero-centred, x * (1 + w) (Megatron's `layernorm_zero_centered_gamma`),
including the GDN output norm: HF keeps that one as a plain gain initialised to ones, which is
the same function with w_megatron = w_hf - 1 (docs/QWEN3_5_LAYOUT.md). Untied embeddings.
Matches transformers' Qwen3_5MoeForConditionalGeneration language model for text-only input.

mRoPE: HF splits the rotary frequencies into (t, h, w) sections with their own position ids.
For text-only input all three position ids are equal, so mRoPE is ordinary partial RoPE, which
is what the Megatron model applies. Image/video positions are not supported (text training).

GDN kernels: Megatron's GatedDeltaNet calls fla's Triton kernels (GPU). `route_gdn_kernels`
leaves it untouched when fla and a GPU are present, and otherwise points it at the torch
implementation in `gdn_torch` (chunked form, same signature).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import megatron.core
import megatron.core.ssm.gated_delta_net as gdn
import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
    get_mtp_num_layers_to_build,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_search.distributed.cpu_compat import rebind_new_modules

from . import gdn_torch
from .norm import RMSNorm
from .provider_common import ProviderError, base_config_kwargs, rope_theta
from .specs import local_spec_fixups

log = logging.getLogger(__name__)


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language-model fields: Qwen3.5 is multimodal and keeps them under `text_config`."""
    return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


def _full_attention_interval(c: dict[str, Any], where: str) -> int:
    types = c.get("layer_types")
    if not types:
        return int(c.get("full_attention_interval", 4))
    interval = types.index("full_attention") + 1 if "full_attention" in types else 0
    expected = ["full_attention" if interval and (i + 1) % interval == 0 else "linear_attention"
                for i in range(len(types))]
    if not interval or types != expected:
        raise ProviderError(f"{where}: layer_types must repeat (linear_attention x n, full_attention); got {types}")
    return interval


def _check_supported(c: dict[str, Any], where: str) -> None:
    if c.get("hidden_act", "silu") != "silu":
        raise ProviderError(f"{where}: hidden_act={c['hidden_act']!r} is not supported (need 'silu')")
    if c.get("attention_bias"):
        raise ProviderError(f"{where}: attention_bias=true is not supported")
    if c.get("tie_word_embeddings"):
        raise ProviderError(f"{where}: tied embeddings are not supported for qwen3_5_moe")
    if not c.get("shared_expert_intermediate_size"):
        raise ProviderError(f"{where}: shared_expert_intermediate_size is missing (Qwen3.5 has a shared expert)")
    if c.get("mlp_only_layers"):
        raise ProviderError(f"{where}: mlp_only_layers (dense layers) is not supported")


# Megatron-Core release that brings context parallelism to GatedDeltaNet (FACTS.md: 0.16.1 has none).
GDN_CONTEXT_PARALLEL_SINCE = (0, 18)


def _megatron_version() -> tuple[int, int]:
    major, minor = megatron.core.__version__.split(".")[:2]
    return int(major), int(minor)


def transformer_config_kwargs(cfg, hf: dict[str, Any], where: str, use_te: bool) -> dict[str, Any]:
    """Architecture fields of the Megatron TransformerConfig for a qwen3_5_moe config.json."""
    c = text_config(hf)
    _check_supported(c, where)
    if cfg.parallel.cp > 1 and _megatron_version() < GDN_CONTEXT_PARALLEL_SINCE:
        # 0.16's GatedDeltaNet would run each CP rank's sequence chunk from a zero state: silently wrong.
        raise ProviderError(
            f"parallel.cp={cfg.parallel.cp}: Gated DeltaNet layers have no context parallelism in "
            f"megatron-core < {'.'.join(map(str, GDN_CONTEXT_PARALLEL_SINCE))}; use parallel.cp=1"
        )
    heads = c["num_attention_heads"]
    kw = base_config_kwargs(cfg, c, use_te)
    kw.update(
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=c.get("num_key_value_heads", heads),
        kv_channels=c.get("head_dim") or c["hidden_size"] // heads,
        ffn_hidden_size=c.get("intermediate_size", c["moe_intermediate_size"]),
        layernorm_epsilon=c.get("rms_norm_eps", 1e-6),
        layernorm_zero_centered_gamma=True,
        qk_layernorm=True,
        attention_output_gate=True,
        activation_func=F.silu,
        gated_linear_unit=True,
        # MoE: softmax -> top-k -> renormalise (== Megatron's top-k logits -> softmax).
        num_moe_experts=c["num_experts"],
        moe_router_topk=c["num_experts_per_tok"],
        moe_ffn_hidden_size=c["moe_intermediate_size"],
        moe_router_pre_softmax=False,
        moe_router_score_function="softmax",
        moe_shared_expert_intermediate_size=c["shared_expert_intermediate_size"],
        moe_shared_expert_gate=True,
        # Gated DeltaNet layers.
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=_full_attention_interval(c, where),
        linear_conv_kernel_dim=c.get("linear_conv_kernel_dim", 4),
        linear_key_head_dim=c["linear_key_head_dim"],
        linear_value_head_dim=c["linear_value_head_dim"],
        linear_num_key_heads=c["linear_num_key_heads"],
        linear_num_value_heads=c["linear_num_value_heads"],
    )
    mtp_layers = int(c.get("mtp_num_hidden_layers", 0) or 0)
    if cfg.model.mtp:
        if mtp_layers == 0:
            raise ProviderError(f"{where}: model.mtp is on but the config has no mtp_num_hidden_layers")
        kw["mtp_num_layers"] = mtp_layers
    return kw


def gpt_model_kwargs(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """GPTModel constructor arguments (embedding / partial RoPE / untied output layer)."""
    c = text_config(hf)
    rope = c.get("rope_parameters") or {}
    return dict(
        vocab_size=c["vocab_size"],
        max_sequence_length=c.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_percent=float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))),
        rotary_base=rope_theta(c, where),
        share_embeddings_and_output_weights=False,
    )


def route_gdn_kernels() -> str:
    """Make Megatron's GatedDeltaNet runnable here; returns 'fla' or 'torch' (the kernels in use).

    With fla importable and a GPU present nothing changes. Otherwise the module-level names the
    layer calls (`chunk_gated_delta_rule`, `l2norm`) are bound to `gdn_torch`, and the
    constructor's HAVE_FLA guard is satisfied because those names now exist. Idempotent.
    """
    if getattr(gdn, "_megatron_search_torch_gdn", False):
        return "torch"
    if gdn.HAVE_FLA and torch.cuda.is_available():
        return "fla"
    if torch.cuda.is_available():
        log.warning("flash-linear-attention is not installed: GDN layers use the (slower) torch gated delta rule")
    gdn.chunk_gated_delta_rule = gdn_torch.chunk_gated_delta_rule
    gdn.l2norm = gdn_torch.l2norm
    gdn.HAVE_FLA = True
    gdn._megatron_search_torch_gdn = True
    rebind_new_modules()  # the layer allocates with torch.cuda.current_device(): let the CPU shim see this module
    return "torch"


def _gdn_attention_spec(use_te: bool):
    if use_te:
        # optional: transformer_engine (GPU extra; the TE specs of model.transformer_impl=transformer_engine)
        from megatron.core.extensions.transformer_engine import (
            TELayerNormColumnParallelLinear,
            TENorm,
            TERowParallelLinear,
        )

        # TE fuses the layer's input norm into in_proj (the layer's input_layernorm is Identity).
        return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=TELayerNormColumnParallelLinear, out_norm=TENorm, out_proj=TERowParallelLinear))
    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=RMSNorm, out_proj=RowParallelLinear))


def _attention_layer_spec(config, use_te: bool):
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm, qk_layernorm=True
        )
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=True, normalization="RMSNorm",
    )
    return local_spec_fixups(spec, RMSNorm)


def layer_specs(config, use_te: bool) -> list:
    """One TransformerLayer spec per global layer: GDN or gated attention, MoE MLP everywhere."""
    attn_layer = _attention_layer_spec(config, use_te)
    subs = attn_layer.submodules
    gdn_layer = dataclasses.replace(
        attn_layer,
        submodules=dataclasses.replace(
            subs,
            self_attention=_gdn_attention_spec(use_te),
            input_layernorm=IdentityOp if use_te else subs.input_layernorm,
            sharded_state_dict_keys_map={},
        ),
    )
    interval = config.linear_attention_freq
    return [attn_layer if (i + 1) % interval == 0 else gdn_layer for i in range(config.num_layers)]


def layer_spec(config, use_te: bool, vp_stage: int | None, pp_rank: int | None):
    """TransformerBlockSubmodules for this pipeline stage (TE when `use_te`, else local specs)."""
    if config.experimental_attention_variant == "gated_delta_net":
        route_gdn_kernels()
    specs = layer_specs(config, use_te)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if use_te:
        # optional: transformer_engine (GPU extra; the TE final norm of model.transformer_impl=transformer_engine)
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        final_norm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=specs[offset : offset + n], layer_norm=final_norm)


def gdn_sections(config) -> dict[str, list[int]]:
    """Row sections of the fused GDN tensors (full, unsharded): in_proj [q|k|v|z|b|a], conv1d [q|k|v]."""
    qk = config.linear_key_head_dim * config.linear_num_key_heads
    v = config.linear_value_head_dim * config.linear_num_value_heads
    nv = config.linear_num_value_heads
    return {"in_proj": [qk, qk, v, v, nv, nv], "conv1d": [qk, qk, v]}


def tp_slice(name: str, full: torch.Tensor, rank: int, size: int, config) -> torch.Tensor | None:
    """Rank's tensor-parallel shard of the GDN tensors (reshard hook); None: the default rule applies.

    Megatron's GDN holds, per TP rank, its slice of *each* section of in_proj ([q_r|k_r|v_r|z_r|b_r|a_r])
    and of conv1d ([q_r|k_r|v_r]); A_log and dt_bias are contiguous per value head. These three are
    marked tensor-parallel without a `partition_dim`, so the generic rule cannot shard them.
    """
    if ".self_attention." not in name:
        return None
    leaf = name.rsplit(".self_attention.", 1)[1]
    if leaf in ("A_log", "dt_bias"):
        sections = [full.shape[0]]
    elif leaf in ("in_proj.weight", "conv1d.weight"):
        sections = gdn_sections(config)[leaf.split(".")[0]]
    else:
        return None
    if sum(sections) != full.shape[0]:
        raise ProviderError(f"{name}: {full.shape[0]} rows, expected sections {sections}")
    parts = []
    for part in torch.split(full, sections, dim=0):
        if part.shape[0] % size:
            raise ProviderError(f"{name}: section of {part.shape[0]} rows is not divisible by TP={size}")
        parts.append(torch.chunk(part, size, dim=0)[rank])
    return torch.cat(parts, dim=0)


def mtp_block_spec(config, use_te: bool, vp_stage: int | None):
    """Multi-token-prediction block for this stage, or None (MTP off, or not on this stage).

    Qwen3.5's MTP module (HF `mtp.*`): fc(cat[norm(embedding of token t+1), norm(hidden_t)]), one
    gated full-attention MoE layer, final norm, the shared output layer. Megatron's
    MultiTokenPredictionLayer has the same structure (enorm, hnorm, eh_proj on [embedding, hidden],
    transformer layer, layer_norm); its transformer layer is our gated-attention layer spec.
    """
    if not config.mtp_num_layers:
        return None
    if get_mtp_num_layers_to_build(config, vp_stage=vp_stage) == 0:
        return None
    if use_te:
        # optional: transformer_engine (GPU extra; the TE specs of model.transformer_impl=transformer_engine)
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear as eh_proj
        from megatron.core.extensions.transformer_engine import TENorm as norm
    else:
        eh_proj, norm = ColumnParallelLinear, RMSNorm
    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=eh_proj,
            transformer_layer=_attention_layer_spec(config, use_te), layer_norm=norm,
        ),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * config.mtp_num_layers)
