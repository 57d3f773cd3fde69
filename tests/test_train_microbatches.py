"""train/microbatches.py on plain lists: lengths from masks, groups, splitting to an agreed count, inert fillers."""
import pytest
import torch

from megatron_search.train.microbatches import (build_microbatches, group_rows, plan_groups, split_to,
                                                trained_lengths, width_of)
from megatron_search.train.rollout_batch import RolloutBatch


def test_trained_lengths_are_the_last_trained_position():
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 1, 0, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    assert trained_lengths(mask) == [2, 0, 4, 5]


def test_width_rounds_up_to_the_multiple_and_never_past_the_batch():
    lengths = [5, 0, 9]
    assert width_of([0], lengths, 4, 12) == 8
    assert width_of([1], lengths, 4, 12) == 4  # a row with no trained token still takes one multiple
    assert width_of([2], lengths, 8, 12) == 12  # round_up(9, 8) = 16 > the batch's 12


def test_groups_by_rows_and_by_budget():
    lengths = [3, 10, 7, 1, 8, 2]
    assert group_rows(lengths, 2, None, 1, 10) == [[1, 4], [2, 0], [5, 3]]
    with pytest.raises(ValueError, match="micro_batch_size=4"):
        group_rows(lengths, 4, None, 1, 10)
    # budget 16, longest first: [10] (2 x 10 > 16), [8] (2 x 8 = 16 fits) + [7] -> [8, 7], then 3 x 8 > 16;
    # [3, 2, 1] (3 x 3 = 9)
    assert group_rows(lengths, 1, 16, 1, 10) == [[1], [4, 2], [0, 5, 3]]
    # with multiple 4 widths are 12 > 10 -> 10, 8, 8, 4: [10], [8, 7] (2 x 8), [3, 2, 1] (3 x 4 = 12)
    assert group_rows(lengths, 1, 16, 4, 10) == [[1], [4, 2], [0, 5, 3]]


def test_split_to_an_agreed_count_halves_the_costliest():
    lengths = [10, 8, 7, 3, 2, 1]
    groups = [[0], [1, 2], [3, 4, 5]]  # costs 10, 16, 9
    assert split_to(groups, 4, lengths, 1, 10) == [[0], [1], [2], [3, 4, 5]]
    assert split_to(groups, 5, lengths, 1, 10) == [[0], [1], [2], [3], [4, 5]]
    assert split_to([[0], [1]], 4, lengths, 1, 10) == [[0], [1]]  # single rows: the caller adds inert ones


def test_plan_groups_agrees_and_fills_with_inert_micro_batches():
    lengths = [4, 3]
    calls = []
    groups, inert = plan_groups(lengths, 1, 100, 1, 4, agree=lambda n: calls.append(n) or 4)
    assert calls == [1] and groups == [[0], [1]] and inert == 2
    part = RolloutBatch(torch.arange(8).view(2, 4), torch.arange(8).view(2, 4), torch.zeros(2, 4),
                        torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float32), torch.tensor([1.0, -1.0]))
    mbs = build_microbatches(part, groups, inert, 2, trim=True)
    assert [tuple(m.tokens_BS.shape) for m in mbs] == [(1, 4), (1, 4), (1, 2), (1, 2)]
    assert all(float(m.mask_BS.sum()) == 0 and float(m.advantages_B.abs().sum()) == 0 for m in mbs[2:])
    assert float(mbs[1].advantages_B) == -1.0 and mbs[1].mask_BS.tolist() == [[1, 1, 1, 0]]


def test_a_budget_with_the_allgather_dispatcher_under_ep_or_pp_is_refused_at_config_time():
    from megatron_search.config import ConfigError, load_config
    from megatron_search.config.schema import stage_problems

    budget = ["grpo.max_tokens_per_micro_batch=4096", "model.moe_token_dispatcher=allgather"]
    for layout in (["parallel.ep=2"], ["parallel.pp=2"]):
        cfg = load_config(None, budget + layout)
        (problem,) = [p for p in stage_problems(cfg, "grpo", None, inputs=False) if p.startswith("grpo.max_tokens")]
        assert "allgather MoE dispatcher refuses" in problem and "alltoall" in problem
        with pytest.raises(ConfigError, match="grpo.max_tokens_per_micro_batch"):
            load_config(None, budget + layout, stage="grpo")
    for fine in (budget, ["grpo.max_tokens_per_micro_batch=4096", "parallel.ep=2"]):  # EP=PP=1, or auto
        assert not [p for p in stage_problems(load_config(None, fine), "grpo", None, inputs=False)
                    if p.startswith("grpo.max_tokens")]


def test_a_budget_under_pipeline_parallelism_keeps_enough_micro_batches():
    # 16 rows of 1-3k tokens fit a 16k budget in 3 micro-batches; at PP 4 (min_count 16) each row goes alone,
    # and never more micro-batches than rows (then agreed over DP as before)
    lengths = [1000 + 125 * i for i in range(16)]
    packed, _ = plan_groups(lengths, 1, 16384, 1, 3000)
    assert len(packed) == 3
    alone, inert = plan_groups(lengths, 1, 16384, 1, 3000, min_count=16)
    assert sorted(len(g) for g in alone) == [1] * 16 and inert == 0
    eight, _ = plan_groups(lengths, 1, 16384, 1, 3000, min_count=8)
    assert len(eight) == 8 and sorted(i for g in eight for i in g) == list(range(16))
    few, inert = plan_groups(lengths[:3], 1, 16384, 1, 3000, min_count=16, agree=lambda n: n)
    assert len(few) == 3 and inert == 0
