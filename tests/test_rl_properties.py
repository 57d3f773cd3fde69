"""Property tests (hypothesis) for advantages and the IS policy loss."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_search.rl import group_advantages, sequence_is_loss, token_is_loss

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)

group_sizes = st.lists(st.integers(1, 16), min_size=1, max_size=12)


@SETTINGS
@given(group_sizes, st.integers(0, 2**31 - 1), st.booleans(), st.floats(1e-3, 1e3))
def test_group_advantages_sum_to_zero(sizes, seed, std_normalize, scale):
    gen = torch.Generator().manual_seed(seed)
    g = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    r = torch.rand(g.numel(), generator=gen, dtype=torch.float64) * scale
    a = group_advantages(r, g, std_normalize=std_normalize)
    sums = torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, g, a)
    bound = 1e-9 * (1 if std_normalize else scale) * max(sizes)
    assert float(sums.abs().max()) <= bound


def plain_pg_loss(logp, adv, mask, aggregation):
    """-(A * log pi) aggregated like the recipe; written out independently of rl.losses."""
    per_token = torch.where(mask, adv[:, None] * logp, torch.zeros((), dtype=logp.dtype))
    if aggregation == "token_mean":
        return -(per_token.sum() / mask.sum())
    n = mask.sum(-1)
    keep = n > 0
    return -((per_token.sum(-1)[keep] / n[keep]).sum() / keep.sum())


@SETTINGS
@given(
    st.integers(1, 6), st.integers(1, 12), st.integers(0, 2**31 - 1),
    st.sampled_from(["seq_mean_token_mean", "token_mean"]), st.sampled_from([torch.float32, torch.float64]),
)
def test_on_policy_token_is_has_exactly_the_plain_pg_gradient(b, t, seed, aggregation, dtype):
    gen = torch.Generator().manual_seed(seed)
    logp = (-3 * torch.rand(b, t, generator=gen, dtype=torch.float64)).to(dtype)
    mask = torch.rand(b, t, generator=gen) < 0.7
    mask[0, 0] = True
    adv = torch.randn(b, generator=gen, dtype=torch.float64).to(dtype)
    x1 = logp.clone().requires_grad_(True)
    x2 = logp.clone().requires_grad_(True)
    loss, met = token_is_loss(x1, logp.clone(), adv, mask, aggregation=aggregation)
    (g_is,) = torch.autograd.grad(loss, x1)
    (g_pg,) = torch.autograd.grad(plain_pg_loss(x2, adv, mask, aggregation), x2)
    assert torch.equal(g_is, g_pg)
    assert float(met["mismatch_kl_k1"]) == 0.0 and float(met["mismatch_kl_k3"]) == 0.0
    # the sequence-level form agrees up to rounding (its ratio is a mean of log-ratios)
    loss_s, _ = sequence_is_loss(x1, logp.clone(), adv, mask, aggregation=aggregation)
    (g_seq,) = torch.autograd.grad(loss_s, x1)
    torch.testing.assert_close(g_seq, g_pg)


@SETTINGS
@given(st.integers(1, 5), st.integers(1, 10), st.integers(0, 2**31 - 1), st.floats(1.0, 3.0))
def test_mismatch_k3_is_non_negative_and_weights_respect_the_cap(b, t, seed, cap):
    gen = torch.Generator().manual_seed(seed)
    lt = -3 * torch.rand(b, t, generator=gen, dtype=torch.float64)
    li = lt + 0.5 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.bool)
    adv = torch.ones(b, dtype=torch.float64)
    lt.requires_grad_(True)
    loss, met = token_is_loss(lt, li, adv, mask, is_cap=cap, aggregation="token_mean")
    assert float(met["mismatch_kl_k3"]) >= 0.0
    # with A = 1 the objective is the mean truncated weight, so it never exceeds the cap
    assert -loss.item() <= cap + 1e-12
