"""Fused group advantages: hand values, a float64 per-group loop on random ragged batches, token broadcast,
bad input. (rl.advantages.group_advantages is this kernel behind a group-id front end: not a reference.)"""
import os

import pytest
import torch

from megatron_search.kernels import fused_group_advantages, offsets_from_group_ids

BACKENDS = ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_values_ragged_groups_and_token_broadcast(backend):
    # groups: [1, 0, 1] | [5] | [2, 2] | [0, 4]
    rewards = torch.tensor([1.0, 0.0, 1.0, 5.0, 2.0, 2.0, 0.0, 4.0])
    goff = torch.tensor([0, 3, 4, 6, 8])
    toff = torch.tensor([0, 2, 2, 5, 6, 6, 7, 9, 10])  # rollout 1 and 4 have no tokens
    out = fused_group_advantages(rewards, goff, toff, eps=0.0, backend=backend)
    # group 0: mean 2/3, sample std sqrt(((1/3)^2*2 + (2/3)^2) / 2) = sqrt(1/3)
    s0 = (1 / 3) ** 0.5
    # group 3: mean 2, sample std sqrt((4 + 4) / 1) = 2*sqrt(2)
    expected = torch.tensor([(1 / 3) / s0, (-2 / 3) / s0, (1 / 3) / s0, 0.0, 0.0, 0.0, -2 / 8**0.5, 2 / 8**0.5])
    assert torch.allclose(out.per_rollout, expected, atol=1e-6)
    assert torch.equal(out.per_token, torch.repeat_interleave(out.per_rollout, toff.diff()))
    pop = fused_group_advantages(rewards, goff, None, std_normalize=True, unbiased=False, eps=0.0, backend=backend)
    assert abs(float(pop.per_rollout[7]) - 1.0) < 1e-6 and pop.per_token is None  # population std of [0, 4] is 2
    centred = fused_group_advantages(rewards, goff, toff, std_normalize=False, backend=backend)
    assert torch.allclose(centred.per_rollout, torch.tensor([1 / 3, -2 / 3, 1 / 3, 0, 0, 0, -2, 2]), atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("std_normalize, unbiased", [(True, True), (True, False), (False, True)])
def test_agrees_with_a_float64_loop_on_random_batches(backend, std_normalize, unbiased):
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 40, (25,), generator=g)  # ragged, some groups larger than one Triton block
    group_ids = torch.repeat_interleave(torch.arange(25), sizes)
    rewards = torch.randint(0, 3, (int(sizes.sum()),), generator=g).double() + torch.rand(int(sizes.sum()), generator=g).double() * (
        torch.rand(int(sizes.sum()), generator=g) > 0.5
    )
    rewards[group_ids == 3] = 1.0  # a constant group
    expected = torch.zeros_like(rewards)
    for g_id in range(25):  # one group at a time, torch.std in float64
        r = rewards[group_ids == g_id]
        if bool((r == r[0]).all()):
            continue  # no signal: exactly 0
        centred = r - r.mean()
        if std_normalize:
            centred = centred / (r.std(correction=1 if unbiased else 0) + 1e-6)
        expected[group_ids == g_id] = centred
    out = fused_group_advantages(rewards, offsets_from_group_ids(group_ids), std_normalize=std_normalize,
                                 eps=1e-6, unbiased=unbiased, backend=backend)
    assert (out.per_rollout.double() - expected).abs().max() <= 1e-5
    assert (out.per_rollout[group_ids == 3] == 0).all()


def test_offsets_from_group_ids():
    assert torch.equal(offsets_from_group_ids(torch.tensor([0, 0, 1, 2, 2, 2])), torch.tensor([0, 2, 3, 6]))
    with pytest.raises(ValueError, match="contiguous"):
        offsets_from_group_ids(torch.tensor([0, 1, 0]))


def test_bad_input():
    r = torch.tensor([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="start at 0 and end at 3"):
        fused_group_advantages(r, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="must not decrease"):
        fused_group_advantages(r, torch.tensor([0, 2, 1, 3]))
    with pytest.raises(ValueError, match="finite"):
        fused_group_advantages(torch.tensor([1.0, float("nan"), 0.0]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="N\\+1 = 4"):
        fused_group_advantages(r, torch.tensor([0, 3]), torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="integer"):
        fused_group_advantages(r, torch.tensor([0.0, 3.0]))
    with pytest.raises(ValueError, match="1-D floating"):
        fused_group_advantages(torch.tensor([1, 2, 3]), torch.tensor([0, 3]))
