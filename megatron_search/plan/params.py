"""Parameter counts of the supported architectures, split the way Megatron shards them.

Counts come from the HF layouts in FACTS.md (per layer: attention or Gated DeltaNet, router, routed
experts, shared expert, norms). They let the planner place every parameter on a rank: embedding on
the first pipeline stage, output layer on the last, dense weights sharded by TP, routed experts by
EP x ETP.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_search.config.hf import Architecture


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of the language model (vision tower excluded), by sharding class."""

    embedding: int  # input embedding [V, H]
    output_layer: int  # LM head [V, H] (not tied in Qwen3-MoE / Qwen3.5)
    dense_per_layer: tuple[int, ...]  # attention or GDN + router + shared expert, TP-sharded
    norms_per_layer: tuple[int, ...]  # replicated across TP
    experts_per_layer: int  # routed experts, sharded over EP x ETP
    final_norm: int
    mtp: int  # multi-token-prediction block(s), when built

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.output_layer
            + sum(self.dense_per_layer)
            + sum(self.norms_per_layer)
            + self.experts_per_layer * len(self.dense_per_layer)
            + self.final_norm
            + self.mtp
        )


def attention_params(a: Architecture, gated: bool) -> int:
    """q/k/v/o projections plus q/k norms; a gated q_proj is twice as wide (query + sigmoid gate)."""
    q_out = a.num_attention_heads * a.head_dim * (2 if gated else 1)
    kv_out = 2 * a.num_key_value_heads * a.head_dim
    o_in = a.num_attention_heads * a.head_dim
    return a.hidden_size * (q_out + kv_out) + o_in * a.hidden_size + 2 * a.head_dim


def gdn_params(a: Architecture) -> int:
    """Gated DeltaNet: in_proj_qkv/z/b/a, depthwise conv1d over q,k,v channels, A_log, dt_bias,
    the gated output norm (one weight of size dv) and out_proj."""
    qk = 2 * a.linear_num_key_heads * a.linear_key_head_dim
    v = a.linear_num_value_heads * a.linear_value_head_dim
    nv = a.linear_num_value_heads
    in_proj = a.hidden_size * (qk + v + v + 2 * nv)
    conv = (qk + v) * a.linear_conv_kernel_dim
    return in_proj + conv + 2 * nv + a.linear_value_head_dim + v * a.hidden_size


def moe_dense_params(a: Architecture) -> int:
    """Router plus the shared expert (SwiGLU) and its scalar sigmoid gate."""
    router = a.num_experts * a.hidden_size
    shared = 0
    if a.shared_expert_intermediate_size:
        shared = 3 * a.hidden_size * a.shared_expert_intermediate_size + a.hidden_size
    return router + shared


def count_params(a: Architecture, include_mtp: bool = False) -> ParamCounts:
    dense, norms = [], []
    gated = a.model_type == "qwen3_5_moe"
    for layer in range(a.num_layers):
        mixer = attention_params(a, gated) if a.is_full_attention(layer) else gdn_params(a)
        dense.append(mixer + moe_dense_params(a))
        norms.append(2 * a.hidden_size)  # input and pre-MLP RMSNorm
    experts = a.num_experts * 3 * a.hidden_size * a.moe_ffn_hidden_size
    mtp = 0
    if include_mtp and a.mtp_num_layers:
        # One full-attention MoE block per MTP layer, its eh_proj [H, 2H] and three norms.
        block = attention_params(a, gated) + moe_dense_params(a) + experts + 2 * a.hidden_size
        mtp = a.mtp_num_layers * (block + 2 * a.hidden_size * a.hidden_size + 3 * a.hidden_size)
    v = a.vocab_size * a.hidden_size
    return ParamCounts(v, v, tuple(dense), tuple(norms), experts, a.hidden_size, mtp)


def active_params(a: Architecture) -> int:
    """Parameters touched per token: everything but the routed experts not selected (top-k of E)."""
    c = count_params(a)
    per_expert = c.experts_per_layer // a.num_experts
    return c.total - c.experts_per_layer * a.num_layers + a.moe_top_k * per_expert * a.num_layers
