"""GRPO policy losses: values, gradients and metrics computed by hand; registry; bad input."""
import math

import pytest
import torch

from megatron_search.config import load_config
from megatron_search.rl import build_policy_loss, get_policy_loss, policy_loss_names, sequence_is_loss, token_is_loss

E = math.exp
NAN = float("nan")


def batch():
    """Two rollouts, three positions; position (0, 2) and (1, 1) are off the loss mask (and hold junk)."""
    logp_train = torch.tensor([[-1.0, -2.0, NAN], [-0.3, NAN, -1.2]], dtype=torch.float64, requires_grad=True)
    logp_infer = torch.tensor([[-1.1, -1.8, 0.0], [-0.3, -5.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    return logp_train, logp_infer, adv, mask


def grad_of(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def test_token_is_seq_mean_token_mean_by_hand():
    lt, li, adv, m = batch()
    loss, met = token_is_loss(lt, li, adv, m)
    # token ratios pi_train / mu: seq 0: e^0.1, e^-0.2; seq 1: e^0, e^-0.2
    want = -0.5 * ((2 * E(0.1) + 2 * E(-0.2)) / 2 + (-1 * 1 - 1 * E(-0.2)) / 2)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    g = grad_of(loss, lt)
    want_g = [[-0.25 * 2 * E(0.1), -0.25 * 2 * E(-0.2), 0.0], [0.25 * 1, 0.0, 0.25 * E(-0.2)]]
    torch.testing.assert_close(g, torch.tensor(want_g, dtype=torch.float64), rtol=1e-12, atol=0)
    w = [E(0.1), E(-0.2), 1.0, E(-0.2)]
    d = [0.1, -0.2, 0.0, -0.2]  # logp_train - logp_infer
    assert float(met["is_weight_mean"]) == pytest.approx(sum(w) / 4, rel=1e-12)
    assert float(met["is_weight_min"]) == pytest.approx(E(-0.2), rel=1e-12)
    assert float(met["is_weight_max"]) == pytest.approx(E(0.1), rel=1e-12)
    assert float(met["mismatch_kl_k1"]) == pytest.approx(sum(-x for x in d) / 4, rel=1e-9)
    assert float(met["mismatch_kl_k3"]) == pytest.approx(sum(E(x) - 1 - x for x in d) / 4, rel=1e-9)
    assert float(met["is_truncated_frac"]) == 0.0 and float(met["clip_frac"]) == 0.0
    assert float(met["num_tokens"]) == 4 and float(met["num_sequences"]) == 2


def test_token_is_token_mean_by_hand():
    lt, li, adv, m = batch()
    loss, _ = token_is_loss(lt, li, adv, m, aggregation="token_mean")
    assert loss.item() == pytest.approx(-(2 * E(0.1) + 2 * E(-0.2) - 1 - E(-0.2)) / 4, rel=1e-12)
    g = grad_of(loss, lt)
    want_g = [[-2 * E(0.1) / 4, -2 * E(-0.2) / 4, 0.0], [1 / 4, 0.0, E(-0.2) / 4]]
    torch.testing.assert_close(g, torch.tensor(want_g, dtype=torch.float64), rtol=1e-12, atol=0)


def test_explicit_denominator_for_gradient_accumulation():
    lt, li, adv, m = batch()
    loss, _ = token_is_loss(lt, li, adv, m, aggregation="token_mean", denominator=10.0)
    assert loss.item() == pytest.approx(-(2 * E(0.1) + 2 * E(-0.2) - 1 - E(-0.2)) / 10, rel=1e-12)


def test_truncated_is_by_hand():
    lt, li, adv, m = batch()
    loss, met = token_is_loss(lt, li, adv, m, is_cap=1.05)
    # only e^0.1 = 1.105 exceeds the cap; its weight becomes 1.05, its gradient 1.05 * A
    want = -0.5 * ((2 * 1.05 + 2 * E(-0.2)) / 2 + (-1 - E(-0.2)) / 2)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert float(grad_of(loss, lt)[0, 0]) == pytest.approx(-0.25 * 2 * 1.05, rel=1e-12)
    assert float(met["is_truncated_frac"]) == 0.25
    assert float(met["is_weight_max"]) == pytest.approx(E(0.1), rel=1e-12)  # reported before truncation


def test_ppo_clip_with_pi_old_by_hand():
    lt, li, adv, m = batch()
    # log pi_old: rho = pi_theta / pi_old = e^0.3, e^-0.05 (seq 0); e^-0.4, e^0 (seq 1)
    lo = torch.tensor([[-1.3, -1.95, 0.0], [0.1, 0.0, -1.2]], dtype=torch.float64)
    loss, met = token_is_loss(lt, li, adv, m, logp_old=lo, clip_eps_low=0.2, clip_eps_high=0.2)
    # IS weights pi_old / mu: e^-0.2, e^-0.15, e^0.4, e^-0.2
    o00 = E(-0.2) * 1.2 * 2  # rho 1.35 > 1.2, A > 0: clipped
    o01 = E(-0.15) * E(-0.05) * 2
    o10 = E(0.4) * 0.8 * -1  # rho 0.67 < 0.8, A < 0: clipped
    o12 = E(-0.2) * 1.0 * -1
    assert loss.item() == pytest.approx(-0.5 * ((o00 + o01) / 2 + (o10 + o12) / 2), rel=1e-12)
    want_g = [[0.0, -0.25 * E(-0.15) * 2 * E(-0.05), 0.0], [0.0, 0.0, 0.25 * E(-0.2)]]
    torch.testing.assert_close(grad_of(loss, lt), torch.tensor(want_g, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert float(met["clip_frac"]) == 0.5
    d_old = [-0.2, -0.15, 0.4, -0.2]  # log pi_old - log mu: the mismatch is measured at pi_old
    assert float(met["mismatch_kl_k1"]) == pytest.approx(sum(-x for x in d_old) / 4, rel=1e-9)
    assert float(met["is_weight_mean"]) == pytest.approx(sum(E(x) for x in d_old) / 4, rel=1e-12)
    q = [0.3, -0.05, -0.4, 0.0]  # log pi_theta - log pi_old: the policy's drift from pi_old
    assert float(met["policy_kl_k1"]) == pytest.approx(sum(-x for x in q) / 4, rel=1e-9)
    assert float(met["policy_kl_k3"]) == pytest.approx(sum(E(x) - 1 - x for x in q) / 4, rel=1e-9)
    assert float(met["policy_log_ratio_abs_max"]) == pytest.approx(0.4, rel=1e-12)


@pytest.mark.parametrize("loss_fn", [token_is_loss, sequence_is_loss])
def test_policy_drift_is_exactly_zero_at_pi_old_and_absent_without_it(loss_fn):
    """The first of several updates sees pi_theta == pi_old: every drift metric is exactly 0, not small."""
    lt, li, adv, m = batch()
    _, met = loss_fn(lt, li, adv, m, logp_old=lt.detach().clone())
    assert float(met["policy_kl_k1"]) == 0.0 and float(met["policy_kl_k3"]) == 0.0
    assert float(met["policy_log_ratio_abs_max"]) == 0.0
    _, plain = loss_fn(lt, li, adv, m)
    assert not any(k.startswith("policy_") for k in plain)


def test_sequence_is_by_hand():
    lt, li, adv, m = batch()
    loss, met = sequence_is_loss(lt, li, adv, m)
    # geometric means of the token ratios: seq 0 exp((0.1 - 0.2) / 2), seq 1 exp((0 - 0.2) / 2)
    w0, w1 = E(-0.05), E(-0.1)
    assert loss.item() == pytest.approx(-0.5 * (2 * w0 - w1), rel=1e-12)
    want_g = [[-0.25 * 2 * w0, -0.25 * 2 * w0, 0.0], [0.25 * w1, 0.0, 0.25 * w1]]
    torch.testing.assert_close(grad_of(loss, lt), torch.tensor(want_g, dtype=torch.float64), rtol=1e-12, atol=0)
    assert float(met["is_weight_mean"]) == pytest.approx((w0 + w1) / 2, rel=1e-12)
    loss_tm, _ = sequence_is_loss(lt, li, adv, m, aggregation="token_mean")
    assert loss_tm.item() == pytest.approx(-(2 * 2 * w0 + 2 * -w1) / 4, rel=1e-12)
    loss_cap, met_cap = sequence_is_loss(lt, li, adv, m, is_cap=0.93)
    assert loss_cap.item() == pytest.approx(-0.5 * (2 * 0.93 - w1), rel=1e-12)
    assert float(met_cap["is_truncated_frac"]) == 0.5


def test_sequence_is_clipped_against_pi_old_by_hand():
    lt, li, adv, m = batch()
    lo = torch.tensor([[-1.3, -1.95, 0.0], [0.1, 0.0, -1.2]], dtype=torch.float64)
    loss, met = sequence_is_loss(lt, li, adv, m, logp_old=lo, clip_eps_low=0.1, clip_eps_high=0.2)
    rho0 = E((0.3 - 0.05) / 2)  # 1.133, inside [0.9, 1.2]
    w0, w1 = E((-0.2 - 0.15) / 2), E((0.4 - 0.2) / 2)
    o0 = w0 * rho0 * 2
    o1 = w1 * 0.9 * -1  # rho1 = e^-0.2 = 0.82 < 0.9 with A < 0: clipped
    assert loss.item() == pytest.approx(-0.5 * (o0 + o1), rel=1e-12)
    g0 = -0.5 * w0 * 2 * rho0 * 0.5
    want_g = [[g0, g0, 0.0], [0.0, 0.0, 0.0]]
    torch.testing.assert_close(grad_of(loss, lt), torch.tensor(want_g, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert float(met["clip_frac"]) == 0.5


def test_float_mask_and_float32_inputs():
    lt = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = token_is_loss(lt, lt.detach(), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]))
    assert loss.item() == -1.0 and loss.dtype == torch.float32


def test_registry_and_config():
    assert {"token_is", "sequence_is"} <= set(policy_loss_names())
    assert get_policy_loss("token_is") is token_is_loss
    with pytest.raises(KeyError, match="unknown policy loss 'ppo'"):
        get_policy_loss("ppo")
    cfg = load_config(None, ["grpo.is_level=sequence", "grpo.is_cap=0.93"])
    fn = build_policy_loss(cfg.grpo)
    lt, li, adv, m = batch()
    loss, _ = fn(lt, li, adv, m)
    assert loss.item() == pytest.approx(-0.5 * (2 * 0.93 - E(-0.1)), rel=1e-12)


@pytest.mark.parametrize("fn", [token_is_loss, sequence_is_loss])
def test_bad_inputs_are_named(fn):
    lt, li, adv, m = batch()
    with pytest.raises(ValueError, match=r"logp_infer: shape \(2, 2\) does not match logp_train \(2, 3\)"):
        fn(lt, li[:, :2], adv, m)
    with pytest.raises(ValueError, match=r"advantages: expected shape \(2,\)"):
        fn(lt, li, adv[:1], m)
    with pytest.raises(ValueError, match=r"mask: shape \(2, 2\)"):
        fn(lt, li, adv, m[:, :2])
    with pytest.raises(ValueError, match="mask: values must be 0 or 1"):
        fn(lt, li, adv, m * 2)
    bad = li.clone()
    bad[1, 2] = NAN
    with pytest.raises(ValueError, match=r"logp_infer: NaN/inf at 1 loss token\(s\), first at \(row, col\) \(1, 2\)"):
        fn(lt, bad, adv, m)
    with pytest.raises(ValueError, match="advantages: NaN/inf"):
        fn(lt, li, torch.tensor([NAN, 0.0], dtype=torch.float64), m)
    with pytest.raises(ValueError, match="mask: selects no tokens"):
        fn(lt, li, adv, torch.zeros_like(m))
    with pytest.raises(ValueError, match="aggregation: 'sum'"):
        fn(lt, li, adv, m, aggregation="sum")
    with pytest.raises(ValueError, match="is_cap: must be > 0"):
        fn(lt, li, adv, m, is_cap=0.0)
    with pytest.raises(ValueError, match="norm_tokens: must be > 0"):
        fn(lt, li, adv, m, aggregation="seq_mean_token_sum_norm", norm_tokens=0)


def test_bf16_logprobs_are_computed_in_fp32():
    lt = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    li = torch.tensor([[-1.0, -2.015625]], dtype=torch.bfloat16)  # one bf16 step (2^-6) below -2
    loss, met = token_is_loss(lt, li, torch.tensor([1.0]), torch.tensor([[1, 1]]), aggregation="token_mean")
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(-(1 + E(0.015625)) / 2, rel=1e-6)
    (g,) = torch.autograd.grad(loss, lt)
    assert g.dtype == torch.bfloat16


def test_registered_losses_share_one_signature():
    import inspect

    sigs = {name: inspect.signature(get_policy_loss(name)) for name in policy_loss_names()}
    ref = sigs["token_is"]
    for name, sig in sigs.items():
        assert list(sig.parameters)[:4] == ["logp_train", "logp_infer", "advantages", "mask"], name
        assert [p for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY] == [
            p for p in ref.parameters.values() if p.kind is p.KEYWORD_ONLY
        ], name


def test_dr_grpo_sum_norm_aggregation_by_hand():
    lt, li, adv, m = batch()
    loss, _ = token_is_loss(lt, li, adv, m, aggregation="seq_mean_token_sum_norm")
    # token sums per rollout divided by the padded width T = 3, then the mean over the 2 rollouts
    want = -0.5 * ((2 * E(0.1) + 2 * E(-0.2)) / 3 + (-1 - E(-0.2)) / 3)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    loss8, _ = token_is_loss(lt, li, adv, m, aggregation="seq_mean_token_sum_norm", norm_tokens=8)
    assert loss8.item() == pytest.approx(want * 3 / 8, rel=1e-12)
    assert float(grad_of(loss8, lt)[0, 0]) == pytest.approx(-0.5 * 2 * E(0.1) / 8, rel=1e-12)
    cfg = load_config(None, ["grpo.loss_aggregation=seq_mean_token_sum_norm", "grpo.loss_norm_tokens=8"])
    loss_cfg, _ = build_policy_loss(cfg.grpo)(lt, li, adv, m)
    assert loss_cfg.item() == pytest.approx(want * 3 / 8, rel=1e-12)
