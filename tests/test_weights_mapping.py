"""The mapping table's transforms and TP layouts against layouts written out by hand (no Megatron)."""
from __future__ import annotations

import pytest
import torch

from megatron_search.config.hf import Architecture
from megatron_search.models.hf_mapping import COLUMN, EXPERT_FC1, GDN_IN, Mapping, MappingError
from megatron_search.weights.hf_source import HFTensorSource, MissingTensorError
from megatron_search.weights.safetensors_writer import ShardedSafetensorsWriter


def _arch(model_type: str = "qwen3_moe", heads: int = 4, kv: int = 2, d: int = 3, **kw) -> Architecture:
    base = dict(model_type=model_type, num_layers=2, hidden_size=5, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=d, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=6,
                shared_expert_intermediate_size=0, vocab_size=10)
    base.update(kw)
    return Architecture(**base)


def _qwen35() -> Architecture:
    return _arch("qwen3_5_moe", shared_expert_intermediate_size=4, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=3, linear_value_head_dim=2, linear_conv_kernel_dim=4, full_attention_interval=2)


def _rows(n: int, tag: float) -> torch.Tensor:
    """Rows labelled tag + row index, so every row is identifiable after reordering."""
    return (tag + torch.arange(n, dtype=torch.float64)).unsqueeze(1).repeat(1, 5)


def test_qkv_interleaves_per_query_group():
    a = _arch()  # 4 query heads, 2 groups, head dim 3
    m = Mapping(a).match("decoder.layers.1.self_attention.linear_qkv.weight")
    assert m.hf_names == tuple(f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv")
    q, k, v = _rows(12, 100), _rows(6, 200), _rows(6, 300)
    full = Mapping(a).to_mcore(m, [q, k, v])
    # Hand layout: group g = [q head 2g, q head 2g+1, k head g, v head g], 3 rows per head.
    want = []
    for g in range(2):
        want += [q[6 * g: 6 * g + 6], k[3 * g: 3 * g + 3], v[3 * g: 3 * g + 3]]
    assert torch.equal(full, torch.cat(want))
    back = Mapping(a).to_hf(m, full)
    assert all(torch.equal(x, y) for (_, x), y in zip(back, (q, k, v)))


def test_gated_qkv_takes_gate_rows_from_each_query_head():
    a = _qwen35()
    m = Mapping(a).match("decoder.layers.1.self_attention.linear_qkv.weight")
    assert m.rule.kind == "gated_qkv"
    # HF q_proj: per query head h, rows [q_h (3 rows); gate_h (3 rows)].
    q_proj, k, v = _rows(24, 100), _rows(6, 200), _rows(6, 300)
    full = Mapping(a).to_mcore(m, [q_proj, k, v])
    heads = q_proj.reshape(4, 2, 3, 5)  # [head, q|gate, D, H]
    want = []
    for g in range(2):
        hs = [2 * g, 2 * g + 1]
        want += [heads[h, 0] for h in hs] + [heads[h, 1] for h in hs] + [k[3 * g: 3 * g + 3], v[3 * g: 3 * g + 3]]
    assert torch.equal(full, torch.cat(want))
    assert all(torch.equal(x, y) for (_, x), y in zip(Mapping(a).to_hf(m, full), (q_proj, k, v)))


def test_glu_fc1_shards_hold_gate_and_up_slices():
    a = _arch()
    ctx = Mapping(a).ctx
    gate, up = _rows(6, 0), _rows(6, 100)
    full = torch.cat([gate, up])
    r1 = EXPERT_FC1.shard(full, 1, 2, ctx)
    assert torch.equal(r1, torch.cat([gate[3:], up[3:]]))  # Megatron: each rank's fc1 = [gate_r; up_r]
    shards = [EXPERT_FC1.shard(full, r, 2, ctx) for r in range(2)]
    assert torch.equal(EXPERT_FC1.gather(shards, ctx), full)
    assert torch.equal(COLUMN.gather([COLUMN.shard(full, r, 3, ctx) for r in range(3)], ctx), full)


def test_gdn_in_proj_sections_split_per_rank():
    a = _qwen35()
    ctx = Mapping(a).ctx
    sizes = [6, 6, 8, 8, 4, 4]  # q, k (2 heads x 3), v, z (4 heads x 2), b, a (4 heads)
    parts = [_rows(s, 100 * i) for i, s in enumerate(sizes)]
    full = torch.cat(parts)
    r0 = GDN_IN.shard(full, 0, 2, ctx)
    assert torch.equal(r0, torch.cat([p[: len(p) // 2] for p in parts]))
    assert torch.equal(GDN_IN.gather([GDN_IN.shard(full, r, 2, ctx) for r in range(2)], ctx), full)
    m = Mapping(a).match("decoder.layers.0.self_attention.in_proj.weight")
    hf = dict(Mapping(a).to_hf(m, full))
    pre = "model.language_model.layers.0.linear_attn."
    assert torch.equal(hf[pre + "in_proj_qkv.weight"], torch.cat(parts[:3]))
    assert torch.equal(hf[pre + "in_proj_z.weight"], parts[3])
    assert torch.equal(hf[pre + "in_proj_a.weight"], parts[5])


def test_norm_shift_follows_both_conventions():
    a = _qwen35()
    mp = Mapping(a)
    w = torch.tensor([0.25, -0.5, 1.5])
    gdn = mp.match("decoder.layers.0.self_attention.out_norm.weight")  # HF: plain gain
    assert torch.equal(mp.to_mcore(gdn, [w], mcore_zero_centered=True), w - 1)
    assert torch.equal(mp.to_mcore(gdn, [w], mcore_zero_centered=False), w)
    ln = mp.match("decoder.layers.0.input_layernorm.weight")  # HF Qwen3.5: x * (1 + w)
    assert torch.equal(mp.to_mcore(ln, [w], mcore_zero_centered=True), w)
    assert torch.equal(mp.to_mcore(ln, [w], mcore_zero_centered=False), w + 1)
    assert torch.equal(mp.to_hf(gdn, w - 1, mcore_zero_centered=True)[0][1], w)


def test_experts_and_layers_use_global_indices_and_alternatives():
    mp = Mapping(_arch())
    te = mp.match("decoder.layers.3.mlp.experts.linear_fc1.weight2")
    local = mp.match("decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight")
    assert te.hf_names == local.hf_names == ("model.layers.3.mlp.experts.2.gate_proj.weight",
                                             "model.layers.3.mlp.experts.2.up_proj.weight")
    assert mp.match("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight").hf_names == (
        "model.layers.0.input_layernorm.weight",)
    with pytest.raises(MappingError, match="decoder.layers.0.mystery.weight"):
        mp.match("decoder.layers.0.mystery.weight")


def test_vocab_padding_is_dropped_and_restored():
    mp = Mapping(_arch(), padded_vocab_size=16)
    m = mp.match("output_layer.weight")
    hf = _rows(10, 0)
    full = mp.to_mcore(m, [hf], full_shape=(16, 5))
    assert full.shape == (16, 5) and torch.equal(full[:10], hf) and not full[10:].any()
    assert torch.equal(mp.to_hf(m, full)[0][1], hf)


def test_source_serves_per_expert_names_from_fused_tensors(tmp_path):
    gate_up = torch.randn(4, 12, 5)  # [E, 2I, H], gate rows first
    down = torch.randn(4, 5, 6)
    pre = "model.language_model.layers.0.mlp.experts."
    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=1000)  # small: forces several files
    w.add(pre + "gate_up_proj", gate_up)
    w.add(pre + "down_proj", down)
    files = w.close()
    assert len(files) == 2 and (tmp_path / "model.safetensors.index.json").is_file()
    for src in (HFTensorSource.from_dir(tmp_path), HFTensorSource.from_state_dict({pre + "gate_up_proj": gate_up,
                                                                                    pre + "down_proj": down})):
        assert torch.equal(src.get(pre + "2.gate_proj.weight"), gate_up[2, :6])
        assert torch.equal(src.get(pre + "2.up_proj.weight"), gate_up[2, 6:])
        assert torch.equal(src.get(pre + "3.down_proj.weight"), down[3])
        assert src.unused([pre + "0.gate_proj.weight"]) == [pre + "down_proj"]
        with pytest.raises(MissingTensorError, match="layers.1.mlp.experts.0.up_proj.weight"):
            src.get("model.language_model.layers.1.mlp.experts.0.up_proj.weight")


def test_fuser_rebuilds_fused_experts_from_per_expert_stream():
    from megatron_search.weights.expert_layout import ExpertFuser, is_fused_checkpoint

    gate_up, down = torch.randn(3, 4, 5), torch.randn(3, 5, 2)  # E=3, I=2, H=5
    pre = "model.language_model.layers.1.mlp.experts."
    stream = [(f"{pre}{e}.gate_proj.weight", gate_up[e, :2]) for e in range(3)]
    stream += [(f"{pre}{e}.up_proj.weight", gate_up[e, 2:]) for e in (2, 0, 1)]  # any order
    stream += [(f"{pre}{e}.down_proj.weight", down[e]) for e in range(3)]
    stream += [("mtp.layers.0.mlp.experts.0.down_proj.weight", down[0]), ("lm_head.weight", down[1])]
    fuser = ExpertFuser(3)
    out = [pair for name, t in stream for pair in fuser.feed(name, t)]
    fuser.close()
    names = [n for n, _ in out]
    assert names == [pre + "gate_up_proj", pre + "down_proj", "mtp.layers.0.mlp.experts.0.down_proj.weight",
                     "lm_head.weight"]
    assert torch.equal(out[0][1], gate_up) and torch.equal(out[1][1], down)
    assert is_fused_checkpoint(names) and not is_fused_checkpoint(["mtp.layers.0.mlp.experts.gate_up_proj"])
    half = ExpertFuser(3)
    list(half.feed(f"{pre}0.down_proj.weight", down[0]))
    with pytest.raises(ValueError, match="only 1 of 3 experts"):
        half.close()
