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
