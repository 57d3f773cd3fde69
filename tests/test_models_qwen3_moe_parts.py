"""Building blocks of the Megatron provider: the SP-capable RMSNorm, spec norm replacement, resharding."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_search.models.norm import RMSNorm
from megatron_search.models.reshard import ReshardError, default_tp_slice, full_name


def _cfg(**kw):
    base = dict(params_dtype=torch.float32, sequence_parallel=False, layernorm_zero_centered_gamma=False)
    return SimpleNamespace(**{**base, **kw})


def _reference(x, w, eps, zero_centered):
    x64, w64 = x.double(), w.double()
    scale = (1 + w64) if zero_centered else w64
    return x64 / torch.sqrt((x64 ** 2).mean(-1, keepdim=True) + eps) * scale


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rmsnorm_matches_float64_reference(zero_centered):
    torch.manual_seed(0)
    norm = RMSNorm(_cfg(layernorm_zero_centered_gamma=zero_centered), 8, eps=1e-6)
    assert torch.equal(norm.weight, torch.zeros(8) if zero_centered else torch.ones(8))  # init = identity
    with torch.no_grad():
        norm.weight.normal_(0.5, 0.2)
    x = torch.randn(3, 5, 8)
    assert torch.allclose(norm(x).double(), _reference(x, norm.weight, 1e-6, zero_centered), atol=1e-6)


def test_rmsnorm_bf16_rounds_like_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    torch.manual_seed(0)
    ours = RMSNorm(_cfg(params_dtype=torch.bfloat16), 16, eps=1e-6)
    theirs = Qwen3MoeRMSNorm(16, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.normal_(1, 0.3)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert torch.equal(ours(x), theirs(x))


def test_rmsnorm_marks_weight_for_sequence_parallel_grad_reduction():
    assert RMSNorm(_cfg(sequence_parallel=True), 4).weight.sequence_parallel is True
    assert RMSNorm(_cfg(), 4).weight.sequence_parallel is False


def test_replace_norms_swaps_the_torch_fallback_everywhere():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_search.models.specs import replace_norms

    spec = replace_norms(get_gpt_layer_local_spec(num_experts=4, qk_layernorm=True, normalization="RMSNorm"))
    s = spec.submodules
    assert s.input_layernorm is RMSNorm and s.pre_mlp_layernorm is RMSNorm
    assert s.self_attention.submodules.q_layernorm is RMSNorm and s.self_attention.submodules.k_layernorm is RMSNorm
    assert "WrappedTorchNorm" not in repr(spec) and WrappedTorchNorm is not RMSNorm


def test_full_name_renumbers_layers_and_experts():
    local = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    assert full_name(local, 2, 3) == "decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight"
    assert full_name("embedding.word_embeddings.weight", 2, 3) == "embedding.word_embeddings.weight"


def test_gated_fc1_is_split_per_half():
    gate = torch.arange(4.0).view(4, 1)
    up = 100 + torch.arange(4.0).view(4, 1)
    full = torch.cat([gate, up])
    shard1 = default_tp_slice("x.linear_fc1.weight", full, 0, 1, 2, gated_fc1=True)
    assert shard1.flatten().tolist() == [2.0, 3.0, 102.0, 103.0]  # [gate_1; up_1]
    plain = default_tp_slice("x.linear_proj.weight", torch.arange(6.0).view(2, 3), 1, 1, 3, gated_fc1=True)
    assert plain.flatten().tolist() == [1.0, 4.0]
    with pytest.raises(ReshardError, match="not divisible"):
        default_tp_slice("x.linear_proj.weight", torch.zeros(2, 3), 1, 0, 2, gated_fc1=False)


def test_transformers5_config_with_num_local_experts(tmp_path):
    # transformers 5 saves Qwen3-MoE configs with num_local_experts instead of num_experts.
    import json

    from megatron_search.config import load_config
    from megatron_search.models.provider import transformer_config_from_hf

    d = json.loads(open("configs/models/tiny_qwen3_moe/config.json").read())
    d["num_local_experts"] = d.pop("num_experts")
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = load_config(None, [f"model.hf_config={tmp_path}"])
    assert transformer_config_from_hf(cfg).num_moe_experts == 4
