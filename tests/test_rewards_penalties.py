"""Anchored tool and length penalties, gated aggregation and the batch reward, against hand values."""
import math

import pytest
import torch

from megatron_search.config import load_config
from megatron_search.rewards import (
    RolloutScores,
    anchored_length_penalty,
    anchored_tool_penalty,
    compute_rewards,
    compute_rewards_from_config,
    effective_penalty,
    gated_reward,
    reward_generator,
    sample_tool_baseline,
    tool_baseline_bounds,
)

E = math.exp
T = torch.tensor


def ids(*sizes):
    return torch.repeat_interleave(torch.arange(len(sizes)), T(sizes))


# ---------------------------------------------------------------- tool penalty


def test_tool_baseline_bounds_by_hand():
    # g0 winners c~ 1, 2, 2: min 1, mean 5/3 -> ceil 2; g1 winners 2, 4: mean 3 exactly -> 3; g2 no winners
    eff = T([1, 2, 2, 9, 2, 4, 0, 3, 5])
    win = T([1, 1, 1, 0, 1, 1, 0, 0, 0]).bool()
    lo, hi, has = tool_baseline_bounds(eff, win, ids(4, 3, 2), 3)
    assert lo.tolist() == [1, 2, -1] and hi.tolist() == [2, 3, -1] and has.tolist() == [True, True, False]


def test_tool_penalty_by_hand_with_sampled_baseline():
    # one group: winners c~ = 1 and 4 - 1 = 3 (lo 1, hi 2), a loser with 6 calls
    calls, failed, r_base = T([1, 4, 6]), T([0, 1, 0]), T([1.0, 1.0, 0.0])
    seen = set()
    for seed in range(20):
        out = anchored_tool_penalty(
            calls, failed, r_base, ids(3), alpha_win=0.5, alpha_lose=2.0, beta_lose=0.3,
            generator=torch.Generator().manual_seed(seed), dtype=torch.float64,
        )
        b = int(out.baseline[0])
        seen.add(b)
        want = [0.5 * (1 - E(-max(0, 1 - b))), 0.5 * (1 - E(-max(0, 3 - b))), 2.0 * (1 - E(-(6 - b))) + 0.3]
        assert out.penalty.tolist() == pytest.approx(want, rel=1e-12)
        assert out.effective_calls.tolist() == [1, 3, 6]
    assert seen == {1, 2}


def test_tool_penalty_without_winners_is_the_loser_constant():
    out = anchored_tool_penalty(
        T([3, 0, 2, 2]), T([0, 0, 0, 0]), T([0.0, 0.0, 1.0, 1.0]), ids(2, 2),
        alpha_win=1.0, alpha_lose=1.0, beta_lose=0.25, generator=torch.Generator().manual_seed(0),
    )
    assert out.baseline.tolist() == [-1, 2]  # g1: winners 2, 2 -> b = 2 deterministically
    assert out.penalty.tolist() == [0.25, 0.25, 0.0, 0.0]
    assert out.p.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_baseline_sampling_is_uniform_over_the_inclusive_range():
    k = 4000
    lo, hi = torch.zeros(k, dtype=torch.long), torch.full((k,), 3)
    b = sample_tool_baseline(lo, hi, torch.Generator().manual_seed(1))
    counts = torch.bincount(b, minlength=4).tolist()
    assert len(counts) == 4 and all(850 < c < 1150 for c in counts), counts
    again = sample_tool_baseline(lo, hi, torch.Generator().manual_seed(1))
    assert torch.equal(b, again)  # seeded: reproducible


def test_tool_penalty_bad_counts():
    kw = dict(alpha_win=1.0, alpha_lose=1.0, beta_lose=0.0, generator=None)
    with pytest.raises(ValueError, match="failed_calls: 3 failed executions exceed the 2 tool calls at position 1"):
        anchored_tool_penalty(T([1, 2]), T([0, 3]), T([1.0, 0.0]), ids(2), **kw)
    with pytest.raises(ValueError, match="tool_calls: counts must be >= 0, got -1 at position 0"):
        anchored_tool_penalty(T([-1, 2]), T([0, 0]), T([1.0, 0.0]), ids(2), **kw)
    with pytest.raises(ValueError, match="tool_calls: expected an integer tensor"):
        anchored_tool_penalty(T([1.0, 2.0]), T([0, 0]), T([1.0, 0.0]), ids(2), **kw)
    with pytest.raises(ValueError, match="r_base: values must be 0 or 1, got 0.5 at position 1"):
        anchored_tool_penalty(T([1, 2]), T([0, 0]), T([1.0, 0.5]), ids(2), **kw)
    with pytest.raises(ValueError, match="group_ids: not contiguous"):
        anchored_tool_penalty(T([1, 2, 0]), T([0, 0, 0]), T([1.0, 0.0, 0.0]), T([0, 1, 0]), **kw)


# ---------------------------------------------------------------- length penalty


def length_case():
    r_base = T([1, 1, 0, 1, 1, 1, 0, 0, 0, 1], dtype=torch.float64)
    s = T([0.8, 0.3, 0.9, 0.5, 0.6, 1.0, 0.0, 0.0, 0.2, 0.9], dtype=torch.float64)
    L = T([150, 60, 20, 100, 130, 90, 0, 50, 0, 30])
    L_ref = T([100, 80, 60, 120, 100, 140, 40, 60, 0, 0])
    return L, L_ref, r_base, s, ids(4, 2, 2, 2)


def test_length_penalty_by_hand():
    out = anchored_length_penalty(*length_case(), dtype=torch.float64)
    want = [
        1.0,  # g0: L 150 > cap max(ref) 120
        1 - E(-(70 / 60 - 1)),  # s 0.3 < 0.5: terse side, b_lose = (80 + 60) / 2
        1 - E(-(70 / 20 - 1)),  # loser
        0.0,  # preferred (s = 0.5 counts), b_win = (100 + 120) / 2 = 110 > 100
        1 - E(-(130 / 120 - 1)),  # g1 all preferred: b_win = 120
        0.0,
        1.0,  # g2 nobody preferred: b_lose = 50, empty answer is maximally terse
        0.0,  # 50 / 50
        0.0,  # g3 all references empty: zero anchors disable both terms, no hard cap
        0.0,
    ]
    assert out.penalty.tolist() == pytest.approx(want, rel=1e-12, abs=0)
    assert out.preferred.tolist() == [True, False, False, True, True, True, False, False, False, True]
    assert out.b_win.tolist()[0] == 110 and out.b_win.tolist()[1] == 120
    assert math.isnan(out.b_win[2]) and math.isnan(out.b_lose[1])  # undefined, reported as NaN
    assert out.b_lose.tolist()[0] == 70 and out.b_lose.tolist()[2] == 50


def test_length_penalty_custom_cap_and_threshold():
    L, L_ref, r_base, s, g = length_case()
    cmp = torch.full_like(L, 1000)
    out = anchored_length_penalty(L, L_ref, r_base, s, g, cmp_lengths=cmp, preference_threshold=0.9, dtype=torch.float64)
    # no cap now; with threshold 0.9 only rollouts 5 and 9 are preferred winners in their groups
    assert out.capped.tolist() == [False] * 10
    assert out.preferred.tolist() == [False] * 5 + [True, False, False, False, True]
    b_lose0 = (100 + 80 + 60 + 120) / 4
    assert float(out.penalty[0]) == pytest.approx(0.0)  # 90 / 150 < 1
    assert float(out.penalty[2]) == pytest.approx(1 - E(-(b_lose0 / 20 - 1)), rel=1e-12)
    assert float(out.penalty[4]) == 0.0  # not preferred now: b_lose = 100 (its own ref) < 130 tokens
    assert float(out.penalty[9]) == 0.0  # preferred against a zero anchor (empty reference): no term
    assert float(out.penalty[5]) == pytest.approx(0.0)  # 90 / 140


def test_length_penalty_bad_input():
    L, L_ref, r_base, s, g = length_case()
    with pytest.raises(ValueError, match="s: values must lie in"):
        anchored_length_penalty(L, L_ref, r_base, s * 2, g)
    with pytest.raises(ValueError, match="lengths: lengths must be >= 0, got -1.0 at position 0"):
        anchored_length_penalty(-torch.ones_like(L), L_ref, r_base, s, g)
    with pytest.raises(ValueError, match="ref_lengths: length 3 does not match the 10 rollouts"):
        anchored_length_penalty(L, L_ref[:3], r_base, s, g)


# ---------------------------------------------------------------- gated aggregation and the batch


def test_gated_reward_and_effective_penalty_by_hand():
    pen = effective_penalty(T([1.0, 0.5]), T([0.5, 1.0]), lambda_tool=0.1, lambda_len=0.2)
    assert pen.tolist() == pytest.approx([0.1 + 0.1, 0.05 + 0.2])
    R = gated_reward(T([1.0, 0.0, 1.0]), T([0.8, 0.9, 0.2]), T([0.1, 0.05, 0.3]))
    assert R.tolist() == pytest.approx([0.7, -0.05, -0.1])


def test_gated_reward_bad_input():
    with pytest.raises(ValueError, match=r"s: values must lie in \[0, 1\], got 1.5 at position 1"):
        gated_reward(T([1.0, 0.0]), T([0.5, 1.5]), T([0.0, 0.0]))
    with pytest.raises(ValueError, match=r"s: 1 NaN/inf value\(s\)"):
        gated_reward(T([1.0, 0.0]), T([0.5, float("nan")]), T([0.0, 0.0]))
    with pytest.raises(ValueError, match="r_base: length 3 does not match the 2 rollouts"):
        gated_reward(T([1.0, 0.0, 1.0]), T([0.5, 0.5]), T([0.0, 0.0]))
    with pytest.raises(ValueError, match="pen_eff: 1 NaN/inf"):
        gated_reward(T([1.0, 0.0]), T([0.5, 0.5]), T([float("inf"), 0.0]))
    with pytest.raises(ValueError, match="lambda_tool/lambda_len: must be >= 0"):
        effective_penalty(T([1.0]), T([1.0]), lambda_tool=-1.0, lambda_len=0.0)


def test_compute_rewards_end_to_end_by_hand():
    # one group of 3: winners with c~ 2 and 2 (baseline 2 for any draw), one loser
    scores = RolloutScores(
        group_ids=ids(3),
        r_base=T([1.0, 1.0, 0.0], dtype=torch.float64),
        s=T([0.9, 0.4, 0.7], dtype=torch.float64),
        tool_calls=T([2, 3, 5]),
        failed_calls=T([0, 1, 0]),
        lengths=T([120, 50, 10]),
        ref_lengths=T([100, 60, 80]),
    )
    out = compute_rewards(
        scores, lambda_tool=0.1, lambda_len=0.2, alpha_win=1.0, alpha_lose=0.5, beta_lose=0.05,
        preference_threshold=0.5, generator=reward_generator(7, 3),
    )
    pen_tool = [0.0, 0.0, 0.5 * (1 - E(-3)) + 0.05]
    # preferred: rollout 0 only; b_win = 100, b_lose = (60 + 80) / 2 = 70; cap = 100
    pen_len = [1.0, 1 - E(-(70 / 50 - 1)), 1 - E(-(70 / 10 - 1))]
    R = [0.9 - 0.1 * pen_tool[0] - 0.2 * pen_len[0], 0.4 - 0.1 * pen_tool[1] - 0.2 * pen_len[1],
         -0.1 * pen_tool[2] - 0.2 * pen_len[2]]
    assert out.pen_tool.tolist() == pytest.approx(pen_tool, rel=1e-12)
    assert out.pen_len.tolist() == pytest.approx(pen_len, rel=1e-12)
    assert out.reward.tolist() == pytest.approx(R, rel=1e-12)
    assert out.tool_baseline.tolist() == [2]
    m = out.metrics(scores)
    assert m["reward/r_base"] == pytest.approx(2 / 3) and m["reward/tool_calls"] == pytest.approx(10 / 3)


def test_compute_rewards_from_config_and_16k_batch():
    cfg = load_config(None, []).reward
    n, g = 16384, 16
    gen = torch.Generator().manual_seed(0)
    scores = RolloutScores(
        group_ids=torch.arange(n // g).repeat_interleave(g),
        r_base=(torch.rand(n, generator=gen) < 0.4).float(),
        s=torch.rand(n, generator=gen),
        tool_calls=torch.randint(0, 6, (n,), generator=gen),
        failed_calls=torch.zeros(n, dtype=torch.long),
        lengths=torch.randint(0, 500, (n,), generator=gen),
        ref_lengths=torch.randint(1, 500, (n,), generator=gen),
    )
    a = compute_rewards_from_config(scores, cfg, reward_generator(cfg.seed, 5))
    b = compute_rewards_from_config(scores, cfg, reward_generator(cfg.seed, 5))
    assert a.reward.shape == (n,) and torch.equal(a.reward, b.reward)  # same seed and step: same baselines
    assert bool(((scores.r_base == 0) <= (a.reward <= 0)).all())


def test_a_groups_baseline_ignores_other_groups_outcomes():
    calls, failed = T([1, 5, 3, 2, 2, 4]), torch.zeros(6, dtype=torch.long)
    kw = dict(alpha_win=1.0, alpha_lose=1.0, beta_lose=0.0)
    # group 0 (winners c~ 1 and 5: b in 1..3) keeps its draw whether group 1 has winners or not
    a = anchored_tool_penalty(calls, failed, T([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), ids(3, 3), **kw,
                              generator=reward_generator(0, 11))
    b = anchored_tool_penalty(calls, failed, T([1.0, 1.0, 0.0, 0.0, 0.0, 0.0]), ids(3, 3), **kw,
                              generator=reward_generator(0, 11))
    assert int(a.baseline[0]) == int(b.baseline[0]) and 1 <= int(a.baseline[0]) <= 3
    assert int(b.baseline[1]) == -1


def test_reward_generator_is_reproducible_per_step():
    draws = [torch.rand(4, generator=reward_generator(3, step)) for step in (0, 1, 0)]
    assert torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[1])


def test_compute_rewards_rejects_bad_batches():
    good = dict(
        group_ids=ids(2), r_base=T([1.0, 0.0]), s=T([0.5, 0.5]), tool_calls=T([1, 1]), failed_calls=T([0, 0]),
        lengths=T([10, 10]), ref_lengths=T([10, 10]),
    )
    kw = dict(lambda_tool=0.1, lambda_len=0.1, alpha_win=1.0, alpha_lose=1.0, beta_lose=0.0,
              preference_threshold=0.5, generator=None)
    compute_rewards(RolloutScores(**good), **kw)
    for field, value, message in [
        ("r_base", T([1.0, float("nan")]), r"r_base: 1 NaN/inf value\(s\)"),
        ("s", T([0.5, -0.1]), r"s: values must lie in \[0, 1\], got -0.1"),
        ("group_ids", T([1, 1]), "group_ids: ids must start at 0"),
        ("lengths", T([10, 10, 10]), "lengths: length 3 does not match the 2 rollouts"),
    ]:
        with pytest.raises(ValueError, match=message):
            compute_rewards(RolloutScores(**{**good, field: value}), **kw)
