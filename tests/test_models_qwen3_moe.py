"""Tiny Qwen3-MoE on Megatron-Core (1 process, CPU): config mapping, forward+backward, and the same
logits as transformers' Qwen3MoeForCausalLM with the same weights (weights copied by hand here)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_search.config import load_config

TINY = "configs/models/tiny_qwen3_moe"


@pytest.fixture(scope="module")
def dist_ctx():
    from megatron_search.distributed import init_distributed

    ctx = init_distributed(load_config(None, [f"model.hf_config={TINY}"]))
    yield ctx
    ctx.teardown()


def test_transformer_config_from_hf():
    from megatron_search.models.provider import transformer_config_from_hf

    c = transformer_config_from_hf(load_config(None, [f"model.hf_config={TINY}"]))
    hf = json.loads(open(f"{TINY}/config.json").read())
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels) == (
        hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"])
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (4, 2, 64)
    assert c.qk_layernorm and c.gated_linear_unit and not c.add_bias_linear
    assert c.moe_router_pre_softmax is False  # norm_topk_prob=true: top-k then softmax == renormalised
    assert c.layernorm_epsilon == hf["rms_norm_eps"]
    assert c.moe_router_load_balancing_type == "none" and c.moe_aux_loss_coeff == 0.0
    assert c.moe_token_dispatcher_type == "allgather" and not c.moe_grouped_gemm  # CPU choices


def _random_hf_model(config_dir, seed=0):
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    hf = Qwen3MoeForCausalLM(AutoConfig.from_pretrained(config_dir)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.05)
    return hf


def _hf_to_megatron(hf) -> dict[str, torch.Tensor]:
    """Independent hand mapping: q/k/v interleaved per query group, [gate; up] per expert."""
    c = hf.config
    H = dict(hf.named_parameters())
    groups, hd = c.num_key_value_heads, c.head_dim
    q_per_group = c.num_attention_heads // groups
    sd = {
        "embedding.word_embeddings.weight": H["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": H["model.norm.weight"],
        "output_layer.weight": H["lm_head.weight"],
    }
    for i in range(c.num_hidden_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = H[p + "self_attn.q_proj.weight"].view(groups, q_per_group * hd, -1)
        k = H[p + "self_attn.k_proj.weight"].view(groups, hd, -1)
        v = H[p + "self_attn.v_proj.weight"].view(groups, hd, -1)
        sd[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).reshape(-1, c.hidden_size)
        sd[m + "self_attention.linear_proj.weight"] = H[p + "self_attn.o_proj.weight"]
        sd[m + "self_attention.q_layernorm.weight"] = H[p + "self_attn.q_norm.weight"]
        sd[m + "self_attention.k_layernorm.weight"] = H[p + "self_attn.k_norm.weight"]
        sd[m + "input_layernorm.weight"] = H[p + "input_layernorm.weight"]
        sd[m + "pre_mlp_layernorm.weight"] = H[p + "post_attention_layernorm.weight"]
        sd[m + "mlp.router.weight"] = H[p + "mlp.gate.weight"]
        for j in range(c.num_experts):
            sd[m + f"mlp.experts.local_experts.{j}.linear_fc1.weight"] = H[p + "mlp.experts.gate_up_proj"][j]
            sd[m + f"mlp.experts.local_experts.{j}.linear_fc2.weight"] = H[p + "mlp.experts.down_proj"][j]
    return sd


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_match_transformers(dist_ctx, tmp_path, norm_topk_prob):
    from megatron_search.models.provider import build_model

    raw = json.loads(open(f"{TINY}/config.json").read())
    raw["norm_topk_prob"] = norm_topk_prob
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = _random_hf_model(tmp_path)
    model = build_model(load_config(None, [f"model.hf_config={tmp_path}"]), dist_ctx.groups).eval()
    result = model.load_state_dict(_hf_to_megatron(hf), strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    tokens = torch.randint(0, raw["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        expected = hf(tokens).logits
        got = model(tokens, positions, None)
    assert got.shape == expected.shape
    # Two fp32 implementations (Megatron's fused/blocked ops vs transformers' eager ones) through every layer:
    # their reduction orders differ, so the bound is relative to the logits' size (as in test_models_qwen3_5).
    assert (got - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())


def test_forward_backward_reaches_every_parameter(dist_ctx):
    from megatron_search.models.provider import build_model

    model = build_model(load_config(None, [f"model.hf_config={TINY}"]), dist_ctx.groups)
    tokens = torch.randint(0, 2048, (4, 32), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(32).expand(4, 32)
    per_token = model(tokens[:, :-1], positions[:, :-1], None, labels=tokens[:, 1:])
    loss = per_token.mean()
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(2048)) < 0.5  # ~uniform at init
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_unbatched_p2p_when_vpp_has_two_stages():
    # With PP=2 the previous and next stage are the same peer; batched p2p would swap messages.
    from megatron_search.models.provider import transformer_config_from_hf

    vpp = transformer_config_from_hf(load_config(None, [f"model.hf_config={TINY}", "parallel.pp=2", "parallel.vpp=2"]))
    assert vpp.batch_p2p_comm is False and vpp.virtual_pipeline_model_parallel_size == 2
    assert transformer_config_from_hf(load_config(None, [f"model.hf_config={TINY}", "parallel.pp=2"])).batch_p2p_comm
