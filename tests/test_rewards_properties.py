"""Property tests (hypothesis) for the gated reward, the anchored penalties and P_bar."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_search.rewards import (
    RolloutScores,
    anchored_length_penalty,
    anchored_tool_penalty,
    compute_rewards,
    debiased_delta,
    preference_probability,
)

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)
coef = st.floats(0.0, 5.0)


def random_scores(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    g = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    n = g.numel()
    calls = torch.randint(0, 30, (n,), generator=gen)
    return RolloutScores(
        group_ids=g,
        r_base=(torch.rand(n, generator=gen) < 0.5).double(),
        s=torch.rand(n, generator=gen, dtype=torch.float64),
        tool_calls=calls,
        failed_calls=(calls.double() * torch.rand(n, generator=gen, dtype=torch.float64)).long(),
        lengths=torch.randint(0, 300, (n,), generator=gen),
        ref_lengths=torch.randint(0, 300, (n,), generator=gen),
    )


sizes_st = st.lists(st.integers(1, 16), min_size=1, max_size=10)


@SETTINGS
@given(sizes_st, st.integers(0, 2**31 - 1), coef, coef, coef, coef, coef)
def test_wrong_rollouts_never_get_positive_reward(sizes, seed, lt, ll, aw, al, bl):
    sc = random_scores(sizes, seed)
    out = compute_rewards(
        sc, lambda_tool=lt, lambda_len=ll, alpha_win=aw, alpha_lose=al, beta_lose=bl,
        preference_threshold=0.5, generator=torch.Generator().manual_seed(seed),
    )
    wrong = sc.r_base == 0
    assert bool((out.reward[wrong] <= 0).all())
    assert bool((out.reward <= sc.s).all())  # penalties only ever subtract


@SETTINGS
@given(sizes_st, st.integers(0, 2**31 - 1), coef, coef, coef)
def test_tool_penalty_ranges_and_baseline_bounds(sizes, seed, aw, al, bl):
    sc = random_scores(sizes, seed)
    out = anchored_tool_penalty(
        sc.tool_calls, sc.failed_calls, sc.r_base, sc.group_ids, alpha_win=aw, alpha_lose=al, beta_lose=bl,
        generator=torch.Generator().manual_seed(seed), dtype=torch.float64,
    )
    win = sc.r_base == 1
    assert bool(((out.penalty[win] >= 0) & (out.penalty[win] <= aw)).all())
    assert bool(((out.penalty[~win] >= bl) & (out.penalty[~win] <= bl + al + 1e-12)).all())
    eff = (sc.tool_calls - sc.failed_calls).tolist()
    start = 0
    for k, size in enumerate(sizes):  # baseline within [min, ceil(mean)] of the winners, by plain Python
        w = [eff[i] for i in range(start, start + size) if win[i]]
        b = int(out.baseline[k])
        if w:
            assert min(w) <= b <= -(-sum(w) // len(w))
        else:
            assert b == -1
        start += size


@SETTINGS
@given(sizes_st, st.integers(0, 2**31 - 1), st.floats(0.0, 1.0))
def test_length_penalty_range(sizes, seed, threshold):
    sc = random_scores(sizes, seed)
    out = anchored_length_penalty(sc.lengths, sc.ref_lengths, sc.r_base, sc.s, sc.group_ids,
                                  preference_threshold=threshold, dtype=torch.float64)
    assert bool(((out.penalty >= 0) & (out.penalty <= 1)).all())
    assert bool((out.penalty[out.capped] == 1).all())


finite = st.floats(-1e6, 1e6, allow_nan=False, width=64)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(finite, finite, st.sampled_from([torch.float32, torch.float64]))
def test_p_bar_is_exactly_antisymmetric(d_ab, d_ba, dtype):
    x, y = torch.tensor([d_ab], dtype=dtype), torch.tensor([d_ba], dtype=dtype)
    p_ab = preference_probability(debiased_delta(x, y))
    p_ba = preference_probability(debiased_delta(y, x))
    assert torch.equal(p_ab, 1 - p_ba)
    assert bool(((p_ab >= 0) & (p_ab <= 1)).all())
