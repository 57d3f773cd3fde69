"""Config schema: loading, overrides, and one clear error per invalid layout (foundation issue)."""
import json

import pytest

from megatron_search.config import Config, ConfigError, load_config

TINY35 = "model.hf_config=configs/models/tiny_qwen3_5_moe"


def problems(*overrides, path=None):
    with pytest.raises(ConfigError) as ei:
        load_config(path, list(overrides))
    return ei.value.problems


def test_defaults_are_the_tiny_cpu_model():
    cfg = load_config(None, [])
    assert cfg.model.architecture.model_type == "qwen3_moe"
    assert cfg.search.max_results == 10 and cfg.search.max_query_chars == 250 and cfg.search.max_calls == 5
    assert cfg.data.mix == {"qa": 0.9, "rubric": 0.1}
    assert cfg.eval.temperature == 0.6 and cfg.eval.max_new_tokens == 8192


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("grpo:\n  group_size: 4\nparallel:\n  tp: 1\n")
    cfg = load_config(p, ["grpo.group_size=16", "grpo.is_cap=2.5", "data.mix={qa: 0.5, rubric: 0.5}"])
    assert cfg.grpo.group_size == 16 and cfg.grpo.is_cap == 2.5
    assert cfg.data.mix == {"qa": 0.5, "rubric": 0.5}


def test_unknown_key_is_named():
    assert problems("grpo.group_sise=4") == ["grpo.group_sise: unknown key"]


def test_wrong_type_is_named():
    (p,) = problems("grpo.group_size=many")
    assert p.startswith("grpo.group_size:") and "integer" in p


def test_world_size_not_tp_pp_cp_dp():
    (p,) = problems("parallel.world_size=6", "parallel.pp=4")
    assert p.startswith("parallel.world_size:") and "TP x PP x CP x DP" in p


def test_experts_not_divisible_by_ep():
    (p,) = problems("parallel.ep=3")
    assert p == "parallel.ep: 4 experts are not divisible by EP=3"


def test_attention_heads_not_divisible_by_tp():
    ps = problems("parallel.tp=3", "parallel.sequence_parallel=true")
    assert "parallel.tp: 4 attention heads are not divisible by TP=3" in ps


def test_gdn_heads_not_divisible_by_tp(tmp_path):
    # A Qwen3.5 config whose GDN key heads (3) do not divide TP=2 while attention heads do.
    raw = json.loads(open("configs/models/tiny_qwen3_5_moe/config.json").read())
    raw["text_config"]["linear_num_key_heads"] = 3
    raw["text_config"]["linear_num_value_heads"] = 3
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ps = problems(f"model.hf_config={tmp_path}", "parallel.tp=2", "parallel.sequence_parallel=true")
    assert ps == [
        "parallel.tp: 3 GDN key heads are not divisible by TP=2",
        "parallel.tp: 3 GDN value heads are not divisible by TP=2",
    ]


def test_moe_with_tp_needs_sequence_parallel():
    (p,) = problems("parallel.tp=2")
    assert p.startswith("parallel.sequence_parallel:")
    load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true"])  # valid


def test_sequence_parallel_needs_seq_length_a_multiple_of_tp():
    (p,) = problems("parallel.tp=2", "parallel.sequence_parallel=true", "sft.seq_length=1023")
    assert p.startswith("sft.seq_length: 1023 is not a multiple of TP=2")
    load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "sft.seq_length=1022"])  # valid


def test_several_problems_each_on_its_own_line():
    ps = problems(TINY35, "parallel.tp=3", "parallel.ep=3")
    assert len(ps) >= 4  # experts/EP, heads/TP, kv heads/TP, GDN heads/TP, sequence parallel
    assert any(p.startswith("parallel.ep:") for p in ps)


def test_valid_layouts():
    load_config(None, ["parallel.world_size=8", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=4"])
    load_config(None, [TINY35, "parallel.world_size=2", "parallel.pp=2"])


def test_missing_file_and_bad_yaml(tmp_path):
    assert "no such file" in problems(path=tmp_path / "nope.yaml")[0]
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    assert "not valid YAML" in problems(path=bad)[0]


def test_every_shipped_config_loads():
    import glob

    for path in glob.glob("configs/*.yaml"):
        assert isinstance(load_config(path), Config)


def _qwen35_with_mtp(tmp_path, layers: int) -> str:
    raw = json.loads(open("configs/models/tiny_qwen3_5_moe/config.json").read())
    raw["text_config"]["mtp_num_hidden_layers"] = layers
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return f"model.hf_config={tmp_path}"


def test_mtp_needs_exactly_one_mtp_layer_in_the_model(tmp_path):
    (p,) = problems(TINY35, "model.mtp=true")  # the shipped tiny config has no MTP layer
    assert p.startswith("model.mtp:") and "mtp_num_hidden_layers=0" in p
    (p,) = problems("model.mtp=true")  # Qwen3-MoE has none either
    assert p.startswith("model.mtp:")
    (p,) = problems(_qwen35_with_mtp(tmp_path, 2), "model.mtp=true")
    assert p.startswith("model.mtp: mtp_num_hidden_layers=2") and "exactly one" in p
    cfg = load_config(None, [_qwen35_with_mtp(tmp_path, 1), "model.mtp=true"])
    assert cfg.model.architecture.mtp_num_layers == 1 and cfg.model.mtp_loss_scaling_factor == 0.1


def test_mtp_settings_reach_the_transformer_config(tmp_path):
    from megatron_search.models.provider import transformer_config_from_hf

    c = transformer_config_from_hf(load_config(None, [_qwen35_with_mtp(tmp_path, 1), "model.mtp=true",
                                                      "model.mtp_loss_scaling_factor=0.3"]))
    assert c.mtp_num_layers == 1 and c.mtp_loss_scaling_factor == 0.3
    off = transformer_config_from_hf(load_config(None, [_qwen35_with_mtp(tmp_path, 1)]))
    assert off.mtp_num_layers is None  # model.mtp=false: no MTP block even though the checkpoint has one


@pytest.mark.parametrize("arch", ["tiny_qwen3_moe", "tiny_qwen3_5_moe"])
def test_router_loss_coefficients_come_from_our_config_only(tmp_path, arch):
    """The HF config's router_aux_loss_coef (0.001 in Qwen3-30B-A3B's and Qwen3.5's) must not reach RL
    (Megatron-LM #5694: inherited, it multiplied a peer's grad norm 3.4x); nor a z-loss key."""
    from megatron_search.models.provider import transformer_config_from_hf

    raw = json.loads(open(f"configs/models/{arch}/config.json").read())
    text = raw.get("text_config", raw)
    text["router_aux_loss_coef"] = 0.001
    text["router_z_loss_coef"] = 0.001
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = transformer_config_from_hf(load_config(None, [f"model.hf_config={tmp_path}"]))
    assert c.moe_aux_loss_coeff == 0.0 and c.moe_router_load_balancing_type == "none"
    assert c.moe_z_loss_coeff is None  # Megatron's "off"
    c = transformer_config_from_hf(load_config(None, [f"model.hf_config={tmp_path}", "model.moe_aux_loss_coeff=0.01",
                                                      "model.moe_z_loss_coeff=0.002"]))
    assert c.moe_aux_loss_coeff == 0.01 and c.moe_router_load_balancing_type == "aux_loss"
    assert c.moe_z_loss_coeff == 0.002
    assert "moe_z_loss_coeff: Input should be greater than or equal to 0" in problems(
        f"model.hf_config={tmp_path}", "model.moe_z_loss_coeff=-1")[0]


def test_demo_mix_parts_must_be_written():
    """A demo mix that weighs a part its worlds do not produce is refused when the config is built."""
    (p,) = problems("demo.reading_worlds=0")  # the default reading warm-up trains on 'short' trajectories
    assert p.startswith("demo:") and "reading_warmup_mix weighs 'short'" in p and "reading_worlds is 0" in p
    assert load_config(None, ["demo.reading_worlds=0", "demo.reading_warmup_mix={read: 1.0}"]).demo.reading_worlds == 0
    (p,) = problems("demo.practice_worlds=0")
    assert "sft_mix weighs 'practice'" in p
