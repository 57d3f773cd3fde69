"""SDPA core attention (models/sdpa_attention.py) against Megatron's own unfused DotProductAttention:
same outputs and gradients on the causal path (GQA, fp32), the parent's path kept for the rest,
and the local specs of both architectures use it."""
from __future__ import annotations

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


def _pair(dist_ctx, **overrides):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_search.models.sdpa_attention import SDPADotProductAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                            attention_dropout=0.0, **overrides)
    make = lambda cls: cls(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return make(DotProductAttention), make(SDPADotProductAttention)


def _qkv(s=37, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, 4, 16, generator=g)
    k, v = torch.randn(s, b, 2, 16, generator=g), torch.randn(s, b, 2, 16, generator=g)
    return q, k, v


def _run(module, q, k, v, mask=None):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = module(*leaves, attention_mask=mask)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [x.grad for x in leaves]


def test_sdpa_matches_unfused_outputs_and_gradients(dist_ctx):
    ref_mod, sdpa_mod = _pair(dist_ctx)
    q, k, v = _qkv()
    ref, ref_grads = _run(ref_mod, q, k, v)
    out, grads = _run(sdpa_mod, q, k, v)
    assert out.shape == (37, 3, 64)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=1e-5, rtol=1e-5)
    # Causality by hand: the first position attends only to itself, so its context is v[0] of its group.
    assert torch.allclose(out[0].view(3, 4, 16), v[0].repeat_interleave(2, dim=1), atol=1e-6)


def test_explicit_mask_and_decode_shapes_take_the_parent_path(dist_ctx, monkeypatch):
    import torch.nn.functional as F

    _, sdpa_mod = _pair(dist_ctx)
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v = _qkv()
    mask = torch.ones(1, 1, 37, 37, dtype=torch.bool).triu(1)  # True = masked (Megatron's convention)
    sdpa_mod(q, k, v, attention_mask=mask)
    sdpa_mod(q[-1:], k, v, attention_mask=None)  # one query against a cache: not top-left causal
    assert calls == []
    sdpa_mod(q, k, v, attention_mask=None)
    assert calls == [1]


def test_local_specs_use_sdpa():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_search.models import qwen3_5, qwen3_moe
    from megatron_search.models.provider import transformer_config_from_hf
    from megatron_search.models.sdpa_attention import SDPADotProductAttention

    cfg = transformer_config_from_hf(load_config(None, [f"model.hf_config={TINY}"]))
    block = qwen3_moe.layer_spec(cfg, use_te=False, vp_stage=None, pp_rank=0)
    cores = {s.submodules.self_attention.submodules.core_attention for s in block.layer_specs}
    assert cores == {SDPADotProductAttention}
    attn = qwen3_5._attention_layer_spec(cfg, use_te=False)
    assert attn.submodules.self_attention.submodules.core_attention is SDPADotProductAttention
    assert not issubclass(DotProductAttention, SDPADotProductAttention)
