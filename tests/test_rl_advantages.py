"""Group-relative advantages: hand-computed values, ragged groups, bad input."""
import math

import pytest
import torch

from megatron_search.rl import group_advantages

EPS = 1e-6


def test_one_group_sample_std_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    a = group_advantages(r, torch.zeros(4, dtype=torch.long), eps=EPS)
    # mean 0.5, deviations +-0.5, sample variance 4 * 0.25 / 3
    std = math.sqrt(1.0 / 3.0)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64) / (std + EPS)
    torch.testing.assert_close(a, expected, rtol=1e-12, atol=0)


def test_population_std_and_no_std_division():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    g = torch.zeros(4, dtype=torch.long)
    pop = group_advantages(r, g, eps=EPS, unbiased=False)
    torch.testing.assert_close(pop, torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=torch.float64) / (0.5 + EPS))
    plain = group_advantages(r, g, std_normalize=False)
    assert plain.tolist() == [0.5, -0.5, -0.5, 0.5]


def test_ragged_groups_and_degenerate_groups():
    # group 0: three rollouts; group 1: one survivor; group 2: all equal rewards
    r = torch.tensor([3.0, 1.0, 2.0, 7.0, 5.0, 5.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 1, 2, 2])
    a = group_advantages(r, g, eps=EPS)
    # group 0: mean 2, deviations 1, -1, 0, sample std sqrt(2/2) = 1
    assert a[:3].tolist() == pytest.approx([1 / (1 + EPS), -1 / (1 + EPS), 0.0], abs=1e-15)
    assert a[3:].tolist() == [0.0, 0.0, 0.0]


def test_constant_group_is_exactly_zero_even_with_rounding_and_zero_eps():
    # 0.1 * 3 / 3 != 0.1 in binary floating point; the advantage must still be exactly 0.
    r = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    a = group_advantages(r, torch.zeros(3, dtype=torch.long), eps=0.0)
    assert a.tolist() == [0.0, 0.0, 0.0]


def test_large_batch_matches_per_group_reference():
    gen = torch.Generator().manual_seed(0)
    sizes = [16] * 1000 + [3, 1, 7]
    g = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    r = torch.rand(g.numel(), generator=gen, dtype=torch.float64)
    a = group_advantages(r, g, eps=EPS)
    start = 0
    for size in sizes:
        x = r[start:start + size].tolist()
        mean = sum(x) / size
        std = math.sqrt(sum((v - mean) ** 2 for v in x) / (size - 1)) if size > 1 else 0.0
        want = [(v - mean) / (std + EPS) if size > 1 else 0.0 for v in x]
        assert a[start:start + size].tolist() == pytest.approx(want, rel=1e-9, abs=1e-12)
        start += size


@pytest.mark.parametrize(
    "ids, message",
    [
        ([0, 1, 0], "not contiguous at position 2 (id 0 follows 1)"),
        ([0, 0, 2], "not contiguous at position 2 (id 2 follows 0)"),
        ([1, 1, 2], "ids must start at 0"),
    ],
)
def test_non_contiguous_group_ids(ids, message):
    with pytest.raises(ValueError, match="group_ids: ") as ei:
        group_advantages(torch.zeros(3), torch.tensor(ids))
    assert message in str(ei.value)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"rewards: 1 NaN/inf value\(s\), first at position\(s\) \[1\]"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="group_ids: length 3 does not match the 2 rollouts"):
        group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="rewards: expected a 1-D"):
        group_advantages(torch.zeros(2, 2), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="group_ids: expected an integer tensor"):
        group_advantages(torch.zeros(2), torch.tensor([0.0, 0.0]))


def test_filtered_groups_by_correctness():
    from megatron_search.rl.advantages import filtered_groups

    # groups: 0 = all wrong, 1 = mixed, 2 = all correct, 3 = a single wrong rollout
    r_base = torch.tensor([0, 0, 0, 1, 0, 1, 1, 0])
    g = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3])
    assert filtered_groups(r_base, g, "none").tolist() == [False] * 4
    assert filtered_groups(r_base, g, "no_winner").tolist() == [True, False, False, True]
    assert filtered_groups(r_base, g, "uniform_correctness").tolist() == [True, False, True, True]
    with pytest.raises(ValueError, match="group filter: expected one of none, no_winner, uniform_correctness"):
        filtered_groups(r_base, g, "all")
    with pytest.raises(ValueError, match="r_base: values must be 0 or 1, got 2.0 at position 1"):
        filtered_groups(torch.tensor([0, 2]), torch.tensor([0, 0]), "no_winner")
