"""Tiny reward model on CPU (Megatron, 1 process): learns the visible cite-the-source rule to
>= 90% held-out accuracy, its permutation-averaged scores are exactly antisymmetric, the GRPO
service's s moves with the answer, and checkpoints / TensorBoard / policy init work."""
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from _mp import run_spawned
    from _rm_worker import worker

    out = tmp_path_factory.mktemp("rm")
    run_spawned(worker, 1, str(out))
    return json.loads((out / "result.json").read_text())


def test_tiny_rm_learns_the_cite_rule(result):
    ev = result["eval"]
    assert ev["pairs"] == result["held_out_pairs"] >= 40
    assert ev["accuracy"] >= 0.9, ev
    assert ev["margin"] > 0 and ev["loss"] < 0.6931, ev  # below the untrained log 2


def test_permutation_averaged_scores_are_exactly_antisymmetric(result):
    assert result["pointwise_antisymmetric"]
    assert result["pairwise_antisymmetric"] and result["pairwise_in_unit_interval"]
    assert result["pairwise_raw_position_bias"] > 0  # the raw pairwise deltas do depend on order


def test_service_score_changes_with_the_answer(result):
    cited, plain, mixed = result["s_cited"], result["s_plain"], result["s_mixed"]
    assert result["s_dtype"] == "torch.float32"
    assert plain == [0.5] * 12  # answer == reference answer: exactly 1/2
    assert all(c > 0.5 for c in cited)
    assert mixed == cited[:6] + plain[6:]  # each rollout's s depends only on its own answer


def test_checkpoints_tensorboard_and_policy_init(result):
    assert result["checkpoints"][-1] == "step_00000008" and "latest" in result["checkpoints"]
    assert "step_00000004" in result["checkpoints"]
    assert result["reload_max_diff"] == 0.0
    assert "is a pointwise reward model but reward.scorer=pairwise" in result["kind_mismatch_error"]
    assert result["init_backbone_equal"] and result["init_head_fresh"]
    assert result["init_note"].startswith("Megatron checkpoint")
    assert result["hf_init_embedding_equal"] and result["hf_init_note"].startswith("HF checkpoint")
    for tag in ("rm/loss", "rm/accuracy", "rm/margin", "rm/eval_accuracy", "rm/eval_margin", "rm/eval_loss"):
        assert tag in result["tb_tags"]
