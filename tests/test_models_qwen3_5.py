"""Tiny Qwen3.5-MoE hybrid on Megatron-Core (CPU): provider config, HF logit equality, forward+backward.

The HF reference is transformers' Qwen3_5MoeForConditionalGeneration with random weights; the
weights are moved to Megatron by a conversion written out in this file from the layout facts in
docs/QWEN3_5_LAYOUT.md (independent of megatron_search.models.hf_mapping).
"""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from megatron_search.config.loader import config_from_dict
from megatron_search.models.provider_common import ProviderError

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs/models/tiny_qwen3_5_moe"


def _cfg(**model):
    return config_from_dict({"model": {"hf_config": str(TINY), **model}})


def _hf_raw():
    return json.loads((TINY / "config.json").read_text())


def test_transformer_config_fields():
    from megatron_search.models import qwen3_5

    raw = _hf_raw()
    kw = qwen3_5.transformer_config_kwargs(_cfg(), raw, "tiny", use_te=False)
    text = raw["text_config"]
    assert kw["experimental_attention_variant"] == "gated_delta_net"
    assert kw["linear_attention_freq"] == 4  # layer_types: 3 x linear, then full
    assert kw["attention_output_gate"] and kw["qk_layernorm"] and kw["layernorm_zero_centered_gamma"]
    assert kw["moe_shared_expert_gate"] and kw["moe_shared_expert_intermediate_size"] == 64
    assert (kw["linear_num_key_heads"], kw["linear_num_value_heads"]) == (2, 4)
    assert (kw["linear_key_head_dim"], kw["linear_value_head_dim"], kw["linear_conv_kernel_dim"]) == (16, 16, 4)
    assert kw["kv_channels"] == text["head_dim"] and kw["num_query_groups"] == 2
    assert "mtp_num_layers" not in kw
    gpt = qwen3_5.gpt_model_kwargs(raw, "tiny")
    assert gpt["rotary_percent"] == 0.25 and gpt["rotary_base"] == 1e7
    assert gpt["share_embeddings_and_output_weights"] is False


def test_mtp_requested_without_mtp_layers_is_an_error(tmp_path):
    from megatron_search.config.loader import ConfigError
    from megatron_search.models import qwen3_5

    with pytest.raises(ConfigError, match="model.mtp"):  # refused when the config is built
        _cfg(mtp=True)
    raw = _hf_raw()
    raw["text_config"]["mtp_num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = config_from_dict({"model": {"hf_config": str(tmp_path), "mtp": True}})
    with pytest.raises(ProviderError, match="mtp"):  # and by the provider, handed a config.json without MTP
        qwen3_5.transformer_config_kwargs(cfg, _hf_raw(), "tiny", use_te=False)


def test_context_parallel_refused_on_megatron_without_gdn_cp():
    from megatron_search.models import qwen3_5

    if qwen3_5._megatron_version() >= qwen3_5.GDN_CONTEXT_PARALLEL_SINCE:
        pytest.skip("this megatron-core has GDN context parallelism")
    cfg = config_from_dict({"model": {"hf_config": str(TINY)}, "parallel": {"cp": 2}})
    with pytest.raises(ProviderError, match="parallel.cp=2"):
        qwen3_5.transformer_config_kwargs(cfg, _hf_raw(), "tiny", use_te=False)


def test_non_periodic_layer_types_rejected():
    from megatron_search.models import qwen3_5

    raw = _hf_raw()
    raw["text_config"]["layer_types"] = ["linear_attention", "full_attention", "linear_attention", "full_attention"][::-1]
    with pytest.raises(ProviderError, match="layer_types"):
        qwen3_5.transformer_config_kwargs(_cfg(), raw, "tiny", use_te=False)


def test_gdn_kernels_routed_to_torch_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("routing to torch kernels applies on CPU machines only")
    import megatron.core.ssm.gated_delta_net as gdn

    from megatron_search.models import gdn_torch, qwen3_5

    assert qwen3_5.route_gdn_kernels() == "torch"
    assert gdn.chunk_gated_delta_rule is gdn_torch.chunk_gated_delta_rule
    assert gdn.l2norm is gdn_torch.l2norm


def test_tp_slice_takes_each_gdn_section_per_rank():
    from types import SimpleNamespace

    from megatron_search.models import qwen3_5

    # qk = 2 heads x 2, vd = 4 heads x 3, nv = 4: in_proj rows q 0-3, k 4-7, v 8-19, z 20-31, b 32-35, a 36-39
    config = SimpleNamespace(linear_key_head_dim=2, linear_num_key_heads=2,
                             linear_value_head_dim=3, linear_num_value_heads=4)
    rows = torch.arange(40.0)[:, None]
    name = "decoder.layers.0.self_attention.in_proj.weight"
    rank1 = qwen3_5.tp_slice(name, rows, 1, 2, config)
    want = [2, 3, 6, 7, *range(14, 20), *range(26, 32), 34, 35, 38, 39]
    assert rank1[:, 0].tolist() == want
    conv = torch.arange(20.0)[:, None, None]
    rank0 = qwen3_5.tp_slice("decoder.layers.0.self_attention.conv1d.weight", conv, 0, 2, config)
    assert rank0[:, 0, 0].tolist() == [0, 1, 4, 5, *range(8, 14)]
    a_log = qwen3_5.tp_slice("decoder.layers.0.self_attention.A_log", torch.arange(4.0), 1, 2, config)
    assert a_log.tolist() == [2, 3]
    assert qwen3_5.tp_slice("decoder.layers.0.self_attention.out_proj.weight", rows, 0, 2, config) is None
    with pytest.raises(ProviderError, match="sections"):
        qwen3_5.tp_slice(name, torch.zeros(39, 1), 0, 2, config)


# ---- HF -> Megatron conversion written from the layout facts --------------------------------------

def hf_to_megatron(sd: dict, text: dict) -> dict:
    nh, ng, hd = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    qpg = nh // ng
    p = "model.language_model."
    out = {
        "embedding.word_embeddings.weight": sd[p + "embed_tokens.weight"],
        "output_layer.weight": sd["lm_head.weight"],
        "decoder.final_layernorm.weight": sd[p + "norm.weight"],  # both x * (1 + w)
    }
    for i, kind in enumerate(text["layer_types"]):
        h, m = f"{p}layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"]
        if kind == "linear_attention":
            a = h + "linear_attn."
            # in_proj rows: [q | k | v | z | b | a]
            out[m + "self_attention.in_proj.weight"] = torch.cat(
                [sd[a + n] for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")]
            )
            for n in ("conv1d.weight", "A_log", "dt_bias", "out_proj.weight"):
                out[m + "self_attention." + n] = sd[a + n]
            # HF gated norm: w * x_hat; Megatron zero-centred norm: (1 + w') * x_hat.
            out[m + "self_attention.out_norm.weight"] = sd[a + "norm.weight"] - 1
        else:
            a = h + "self_attn."
            # HF q_proj rows per head: [query_h (hd) | gate_h (hd)]; Megatron per group: [q.. | gate.. | k | v]
            qg = sd[a + "q_proj.weight"].view(nh, 2, hd, -1)
            q = qg[:, 0].reshape(ng, qpg * hd, -1)
            gate = qg[:, 1].reshape(ng, qpg * hd, -1)
            k = sd[a + "k_proj.weight"].view(ng, hd, -1)
            v = sd[a + "v_proj.weight"].view(ng, hd, -1)
            out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, gate, k, v], 1).reshape(-1, q.shape[-1])
            out[m + "self_attention.linear_proj.weight"] = sd[a + "o_proj.weight"]
            out[m + "self_attention.q_layernorm.weight"] = sd[a + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = sd[a + "k_norm.weight"]
        out[m + "mlp.router.weight"] = sd[h + "mlp.gate.weight"]
        for e in range(text["num_experts"]):
            out[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = sd[h + "mlp.experts.gate_up_proj"][e]
            out[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = sd[h + "mlp.experts.down_proj"][e]
        s = h + "mlp.shared_expert."
        out[m + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"]])
        out[m + "mlp.shared_experts.linear_fc2.weight"] = sd[s + "down_proj.weight"]
        out[m + "mlp.shared_experts.gate_weight"] = sd[h + "mlp.shared_expert_gate.weight"]
    return out


def _randomised_hf_model(seed: int):
    from transformers import AutoConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(AutoConfig.from_pretrained(TINY)).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point():  # every tensor random, norms and A_log/dt_bias included
                t.copy_(torch.randn(t.shape, generator=gen) * (0.3 if "norm" in name else 0.1))
    return model


def _worker(rank: int, out_file: str) -> None:
    torch.set_num_threads(1)
    from megatron_search.distributed import init_distributed
    from megatron_search.models.provider import build_model

    cfg = _cfg()
    ctx = init_distributed(cfg)
    try:
        text = _hf_raw()["text_config"]
        hf = _randomised_hf_model(seed=3)
        model = build_model(cfg, ctx.groups)
        converted = hf_to_megatron(hf.state_dict(), text)
        own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
        result = {"missing": sorted(own - set(converted)), "unexpected": sorted(set(converted) - own)}
        model.load_state_dict(converted, strict=False)
        model.eval()

        b, t = 2, 70  # > one 64-token GDN chunk, not a multiple of it
        ids = torch.randint(0, text["vocab_size"], (b, t), generator=torch.Generator().manual_seed(5))
        pos = torch.arange(t).expand(b, t)
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
            got = model(input_ids=ids, position_ids=pos, attention_mask=None)
        result["max_abs_diff"] = (got - ref).abs().max().item()
        result["ref_max"] = ref.abs().max().item()

        # Forward + backward with labels: per-token losses [b, t].
        model.train()
        labels = torch.roll(ids, -1, dims=1)
        losses = model(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels)
        loss = losses.float().mean()
        loss.backward()
        ref_loss = torch.nn.functional.cross_entropy(ref.reshape(-1, ref.shape[-1]), labels.reshape(-1))
        result["loss"], result["ref_loss"] = loss.item(), ref_loss.item()
        result["no_grad"] = sorted(
            n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()
            or p.grad.abs().sum() == 0
        )
        result["n_params"] = sum(1 for _ in model.parameters())
        result.update(_mtp_run(Path(out_file).parent, ids, pos, labels, ctx.groups))
        Path(out_file).write_text(json.dumps(result))
    finally:
        ctx.teardown()


def _mtp_run(tmp: Path, ids, pos, labels, groups) -> dict:
    """Same tiny model with one MTP layer (model.mtp=true): builds, trains, MTP params get gradients."""
    from megatron_search.models.provider import build_model

    raw = _hf_raw()
    raw["text_config"]["mtp_num_hidden_layers"] = 1
    (tmp / "mtp").mkdir(exist_ok=True)
    (tmp / "mtp" / "config.json").write_text(json.dumps(raw))
    model = build_model(config_from_dict({"model": {"hf_config": str(tmp / "mtp"), "mtp": True}}), groups)
    loss = model(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels).float().mean()
    loss.backward()
    mtp = [(n, p) for n, p in model.named_parameters() if n.startswith("mtp.")]
    return {
        "mtp_loss": loss.item(),
        "mtp_param_names": sorted({n.split(".transformer_layer.")[-1] if ".transformer_layer." in n else n for n, _ in mtp}),
        "mtp_no_grad": sorted(n for n, p in mtp if p.grad is None or p.grad.abs().sum() == 0),
    }


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_5") / "result.json"
    mp.spawn(_worker, args=(str(out),), nprocs=1, join=True)
    return json.loads(out.read_text())


@pytest.mark.multiprocess
def test_conversion_covers_every_parameter(one_process_run):
    assert one_process_run["missing"] == [] and one_process_run["unexpected"] == []


@pytest.mark.multiprocess
def test_megatron_logits_match_hf(one_process_run):
    r = one_process_run
    assert r["max_abs_diff"] <= 1e-4 * max(1.0, r["ref_max"]), r


@pytest.mark.multiprocess
def test_forward_backward_finite_and_every_parameter_gets_a_gradient(one_process_run):
    r = one_process_run
    assert math.isfinite(r["loss"]) and r["n_params"] > 50
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-4 * r["ref_loss"]
    assert r["no_grad"] == []


@pytest.mark.multiprocess
def test_mtp_layer_builds_and_trains(one_process_run):
    r = one_process_run
    assert math.isfinite(r["mtp_loss"]) and r["mtp_no_grad"] == []
    names = r["mtp_param_names"]
    # enorm / hnorm / eh_proj over [embedding, hidden], then a gated-attention MoE layer, then a norm.
    for want in ("mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
                 "self_attention.linear_qkv.weight", "mlp.shared_experts.gate_weight", "mtp.layers.0.final_layernorm.weight"):
        assert want in names, (want, names)
