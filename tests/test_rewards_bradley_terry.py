"""Bradley-Terry loss, symmetric loss and position-independent score, against hand values."""
import math

import pytest
import torch

from megatron_search.rewards import (
    bt_loss,
    debiased_delta,
    preference_probability,
    preference_score,
    scorer_deltas,
    scorer_symmetric_loss,
    symmetric_bt_loss,
)

T = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731


def sig(z):
    return 1 / (1 + math.exp(-z))


def test_bt_loss_by_hand():
    d = T(0.0, 2.0, 2.0, 2.0, 100.0, 100.0)
    r = T(1.0, 1.0, 0.0, 0.25, 1.0, 0.0)
    want = [
        math.log(2),
        -math.log(sig(2)),
        -math.log(1 - sig(2)),
        -(0.25 * math.log(sig(2)) + 0.75 * math.log(1 - sig(2))),
        math.exp(-100),  # log(1 + e^-100), finite and tiny
        100.0,  # -log(1 - sigma(100)) without overflow
    ]
    assert bt_loss(d, r).tolist() == pytest.approx(want, rel=1e-12)


def test_symmetric_loss_and_debiased_score_by_hand():
    d_ab, d_ba = T(1.5), T(-0.5)
    want = 0.5 * -math.log(sig(1.5)) + 0.5 * -math.log(1 - sig(-0.5))
    assert float(symmetric_bt_loss(d_ab, d_ba, T(1.0))) == pytest.approx(want, rel=1e-12)
    assert float(debiased_delta(d_ab, d_ba)) == 1.0
    assert float(preference_probability(debiased_delta(d_ab, d_ba))) == pytest.approx(sig(1.0), rel=1e-15)
    assert float(preference_probability(T(-3.0))) == pytest.approx(sig(-3.0), rel=1e-15)


def test_pointwise_scorer():
    scores = {"a": 2.0, "b": 0.5, "ref": 1.0}

    def score(x, y):
        return torch.tensor([scores[v] for v in y], dtype=torch.float64)

    d_ab, d_ba = scorer_deltas("pointwise", score, None, ["a"], ["b"])
    assert d_ab.tolist() == [1.5] and d_ba.tolist() == [-1.5]
    s = preference_score("pointwise", score, None, ["a", "b"], ["ref", "ref"])
    assert s.tolist() == pytest.approx([sig(1.0), sig(-0.5)], rel=1e-15)
    # for a pointwise scorer both orders agree, so L_sym is the plain BT loss
    loss = scorer_symmetric_loss("pointwise", score, None, ["a"], ["b"], T(1.0))
    assert float(loss) == pytest.approx(-math.log(sig(1.5)), rel=1e-12)


def test_pairwise_scorer_position_bias_cancels():
    quality = {"a": 2.0, "b": 0.5}
    bias = 0.7  # the model favours whichever answer it sees first

    def delta(x, first, second):
        return torch.tensor([quality[f] - quality[s] + bias for f, s in zip(first, second)], dtype=torch.float64)

    d_ab, d_ba = scorer_deltas("pairwise", delta, None, ["a"], ["b"])
    assert d_ab.tolist() == pytest.approx([1.5 + bias]) and d_ba.tolist() == pytest.approx([-1.5 + bias])
    p = preference_score("pairwise", delta, None, ["a"], ["b"])
    assert p.tolist() == pytest.approx([sig(1.5)], rel=1e-12)  # bias removed
    loss = scorer_symmetric_loss("pairwise", delta, None, ["a"], ["b"], T(1.0))
    want = 0.5 * -math.log(sig(1.5 + bias)) + 0.5 * -math.log(1 - sig(-1.5 + bias))
    assert float(loss) == pytest.approx(want, rel=1e-12)


def test_gradient_flows_through_the_scorer():
    w = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)

    def score(x, y):
        return w * torch.tensor(y, dtype=torch.float64)

    loss = scorer_symmetric_loss("pointwise", score, None, [2.0], [1.0], T(1.0))
    loss.backward()
    # loss = -log sigma(w * (2 - 1)); d/dw = -(1 - sigma(w))
    assert float(w.grad) == pytest.approx(-(1 - sig(0.3)), rel=1e-12)


def test_bad_input():
    with pytest.raises(ValueError, match=r"r: preference labels must lie in \[0, 1\]"):
        bt_loss(T(1.0), T(1.5))
    with pytest.raises(ValueError, match=r"delta_ba: shape \(2,\) does not match delta \(1,\)"):
        symmetric_bt_loss(T(1.0), T(1.0, 2.0), T(1.0))
    with pytest.raises(ValueError, match=r"delta: 1 NaN/inf"):
        debiased_delta(T(float("nan")), T(0.0))
    with pytest.raises(ValueError, match="scorer kind: 'listwise'"):
        scorer_deltas("listwise", None, None, "a", "b")
