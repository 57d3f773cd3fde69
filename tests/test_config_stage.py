"""Per-job config checks (config.stage_problems): reported when the config is loaded for a stage, by
`megatron-search config --stage` and `plan`, and again at start-up with the real world size."""
import pytest

from megatron_search.config import ConfigError, load_config, stage_problems
from megatron_search.plan import make_plan

RANDOM = "model.init=random"  # the default config names no pretrained weights (tests/test_real_model_workflow.py)
GRPO_INPUTS = ["rm.load=RM", "data.qa_path=QA.jsonl", "data.mix={qa: 1.0}", RANDOM]


def stage_fields(stage, *overrides):
    """The field each problem names (the text before the first colon), loading the config for `stage`."""
    with pytest.raises(ConfigError) as ei:
        load_config(None, [RANDOM, *overrides], stage=stage)
    return [p.split(":")[0] for p in ei.value.problems]


def test_a_complete_grpo_config_passes_and_the_stage_is_opt_in():
    load_config(None, GRPO_INPUTS, stage="grpo")
    load_config(None, ["rollout.temperature=0"])  # no stage: eval or data jobs may decode greedily
    load_config(None, ["rollout.temperature=0", RANDOM], stage="sft")


def test_grpo_checks_each_name_their_field():
    assert stage_fields("grpo", *GRPO_INPUTS, "rollout.temperature=0") == ["rollout.temperature"]
    assert stage_fields("grpo", "data.qa_path=QA.jsonl", "data.mix={qa: 1.0}") == ["rm.load"]
    # the default mix weighs qa 0.9 and rubric 0.1, and neither path is set
    assert stage_fields("grpo", "rm.load=RM") == ["data.mix", "data.mix"]
    assert stage_fields("grpo", "rm.load=RM", "data.rubric_path=R", "data.mix={qa: 0.0, rubric: 1.0}",
                        "grpo.eval_interval=5") == ["grpo.eval_interval"]
    assert stage_fields("grpo", *GRPO_INPUTS[:2], "data.mix={qa: 0.0}") == ["data.mix"]


def test_training_stages_need_initial_weights():
    with pytest.raises(ConfigError) as ei:
        load_config(None, GRPO_INPUTS[:3], stage="grpo")
    assert [p.split(":")[0] for p in ei.value.problems] == ["model.path"]
    with pytest.raises(ConfigError, match=r"checkpoint.load: NOWHERE does not exist"):
        load_config(None, ["checkpoint.load=NOWHERE"], stage="sft")
    load_config(None, [], stage="rm")  # the reward model starts from rm.init_from (or a random init)


def test_context_parallelism_is_refused_for_every_training_stage():
    for stage in ("sft", "rm", "grpo"):
        assert "parallel.cp" in stage_fields(stage, *GRPO_INPUTS, "parallel.cp=2")
    load_config(None, ["parallel.cp=2"])  # the layout itself is valid (plan and convert may use it)


def test_batch_sizes_are_checked_against_the_data_parallel_size():
    # world 4, TP 1: DP 4; 6 sequences do not split over 4 ranks, 8 do (2 micro-batches of 1 each)
    assert stage_fields("sft", "parallel.world_size=4", "sft.global_batch_size=6") == ["sft.global_batch_size"]
    load_config(None, ["parallel.world_size=4", "sft.global_batch_size=8", RANDOM], stage="sft")
    # DP 2 x micro-batch 3 = 6: 12 pairs split, 8 do not
    fields = stage_fields("rm", "parallel.world_size=2", "rm.global_batch_pairs=8", "rm.micro_batch_pairs=3")
    assert fields == ["rm.global_batch_pairs"]
    load_config(None, ["parallel.world_size=2", "rm.global_batch_pairs=12", "rm.micro_batch_pairs=3"], stage="rm")
    # unknown world size: nothing to check yet; the job checks at start-up with the real one
    cfg = load_config(None, ["sft.global_batch_size=6", RANDOM], stage="sft")
    assert stage_problems(cfg, "sft", 4) == ["sft.global_batch_size: 6 is not a multiple of data-parallel size 4 x "
                                             "sft.micro_batch_size=1 (world size 4)"]
    assert stage_problems(cfg, "sft", 3) == []  # DP 3 divides 6


def test_unknown_mix_datasets_are_refused_for_any_stage():
    with pytest.raises(ConfigError, match=r"data\.mix: .*unknown dataset\(s\) \['web'\]"):
        load_config(None, ["data.mix={qa: 1.0, web: 0.5}"])
    with pytest.raises(ConfigError, match=r"data\.mix: .*negative weight"):
        load_config(None, ["data.mix={qa: -1.0}"])


def test_the_planner_reports_settings_but_not_input_paths():
    cfg = load_config(None, ["rollout.temperature=0"])
    plan = make_plan(cfg, "grpo")
    assert any(p.startswith("rollout.temperature") for p in plan.problems) and not plan.fits
    assert not any(p.startswith(("rm.load", "data.mix")) for p in plan.problems)  # set on the launch line


def test_start_up_runs_the_stage_checks_at_the_real_world_size():
    from megatron_search.distributed import DistEnv, LayoutError, init_distributed

    cfg = load_config(None, ["rollout.temperature=0"])
    with pytest.raises(LayoutError, match=r"rollout\.temperature: 0 samples greedily"):
        init_distributed(cfg, env=DistEnv(0, 1, 0, "127.0.0.1", 0, "single"), stage="grpo")


def test_config_command_takes_the_stage(capsys):
    from megatron_search.cli import main

    assert main(["config", "rollout.temperature=0"]) == 0
    capsys.readouterr()
    assert main(["config", "--stage", "grpo", *GRPO_INPUTS, "rollout.temperature=0"]) == 2
    assert "rollout.temperature: 0 samples greedily" in capsys.readouterr().err
