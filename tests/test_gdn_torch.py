"""The torch gated delta rule: chunked form == token recurrence == a hand computation."""
import math

import pytest
import torch

from megatron_search.models.gdn_torch import (
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)

F64 = torch.float64


def _inputs(b=2, t=11, h=2, hv=4, dk=5, dv=3, seed=0, dtype=F64, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=gen, dtype=dtype)
    k = torch.randn(b, t, h, dk, generator=gen, dtype=dtype)
    v = torch.randn(b, t, hv, dv, generator=gen, dtype=dtype)
    g = -torch.rand(b, t, hv, generator=gen, dtype=dtype) * 2  # log decay <= 0
    beta = torch.rand(b, t, hv, generator=gen, dtype=dtype)
    state = torch.randn(b, hv, dk, dv, generator=gen, dtype=dtype)
    xs = [q, k, v, g, beta, state]
    if requires_grad:
        xs = [x.requires_grad_() for x in xs]
    return xs


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 16, 64])
@pytest.mark.parametrize("l2", [False, True])
def test_chunk_matches_recurrence(chunk_size, l2):
    q, k, v, g, beta, s0 = _inputs(t=13)  # 13 is a multiple of none of the chunk sizes > 1
    ref_o, ref_s = recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=l2
    )
    o, s = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=s0, output_final_state=True,
        use_qk_l2norm_in_kernel=l2, chunk_size=chunk_size,
    )
    torch.testing.assert_close(o, ref_o, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, ref_s, rtol=1e-10, atol=1e-10)


def test_chunk_gradients_match_recurrence():
    xs = _inputs(b=1, t=9, h=1, hv=2, dk=4, dv=3, requires_grad=True)
    weights = torch.randn(1, 9, 2, 3, dtype=F64)

    def grads(fn, **kw):
        o, s = fn(*xs[:5], initial_state=xs[5], output_final_state=True, **kw)
        return torch.autograd.grad((o * weights).sum() + s.square().sum(), xs)

    for got, want in zip(grads(chunk_gated_delta_rule, chunk_size=4), grads(recurrent_gated_delta_rule)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_chunk_gradcheck():
    xs = _inputs(b=1, t=5, h=1, hv=2, dk=3, dv=2, requires_grad=True)

    def fn(q, k, v, g, beta, s0):
        return chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=s0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, chunk_size=2,
        )

    assert torch.autograd.gradcheck(fn, xs, eps=1e-6, atol=1e-6)


def test_two_tokens_by_hand():
    """T = 2, one head, K = V = 2: unroll the definition with plain Python floats."""
    q = [[0.3, -1.2], [0.5, 0.7]]
    k = [[1.0, 0.4], [-0.6, 0.9]]
    v = [[0.2, -0.5], [1.5, 0.1]]
    g = [-0.1, -0.7]
    beta = [0.6, 0.3]
    s0 = [[0.5, -0.2], [0.1, 0.4]]  # S[key][value]
    scale = 1 / math.sqrt(2)

    s = [row[:] for row in s0]
    expected_o = []
    for t in range(2):
        s = [[x * math.exp(g[t]) for x in row] for row in s]
        kv = [sum(k[t][a] * s[a][j] for a in range(2)) for j in range(2)]
        delta = [beta[t] * (v[t][j] - kv[j]) for j in range(2)]
        s = [[s[a][j] + k[t][a] * delta[j] for j in range(2)] for a in range(2)]
        expected_o.append([sum(q[t][a] * scale * s[a][j] for a in range(2)) for j in range(2)])

    def t4(x):  # [T, K] -> [B=1, T, H=1, K]
        return torch.tensor(x, dtype=F64)[None, :, None, :]

    args = (t4(q), t4(k), t4(v), torch.tensor(g, dtype=F64)[None, :, None],
            torch.tensor(beta, dtype=F64)[None, :, None])
    state = torch.tensor(s0, dtype=F64)[None, None]
    for fn, kw in ((recurrent_gated_delta_rule, {}), (chunk_gated_delta_rule, {"chunk_size": 2}),
                   (chunk_gated_delta_rule, {"chunk_size": 64})):
        o, final = fn(*args, initial_state=state, output_final_state=True, **kw)
        torch.testing.assert_close(o[0, :, 0], torch.tensor(expected_o, dtype=F64), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(final[0, 0], torch.tensor(s, dtype=F64), rtol=1e-12, atol=1e-12)


def test_qk_l2norm_option_equals_prenormalised_inputs():
    q, k, v, g, beta, _ = _inputs()
    a, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, chunk_size=4)
    nq = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    nk = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    b, _ = chunk_gated_delta_rule(nq, nk, v, g, beta, chunk_size=4)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(l2norm(q), nq, rtol=1e-12, atol=1e-12)


def test_grouped_value_heads_equal_repeated_query_key_heads():
    q, k, v, g, beta, _ = _inputs(h=2, hv=4)
    a, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4)
    b, _ = recurrent_gated_delta_rule(q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), v, g, beta)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_packed_sequences_restart_state():
    q, k, v, g, beta, s0 = _inputs(b=1, t=12)
    cu = torch.tensor([0, 5, 5, 12])
    states = torch.cat([s0, torch.zeros_like(s0), -s0])
    o, final = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=states, output_final_state=True, cu_seqlens=cu, chunk_size=4
    )
    for i, (a, b) in enumerate([(0, 5), (5, 5), (5, 12)]):
        part = [x[:, a:b] for x in (q, k, v, g, beta)]
        want_o, want_s = recurrent_gated_delta_rule(
            *part, initial_state=states[i : i + 1], output_final_state=True
        )
        torch.testing.assert_close(o[:, a:b], want_o, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(final[i : i + 1], want_s, rtol=1e-10, atol=1e-10)


def test_float32_inputs_keep_dtype_and_accuracy():
    q, k, v, g, beta, _ = _inputs(t=70, dtype=torch.float32)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.float32 and s is not None
    ref, _ = recurrent_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o.double(), ref, rtol=1e-4, atol=1e-5)
    none_o, none_s = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert none_s is None and torch.equal(none_o, o)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda x: x.__setitem__(2, x[2][..., :3, :]), "value heads"),
        (lambda x: x.__setitem__(3, x[3][:, :, :1]), "g must be"),
        (lambda x: x.__setitem__(1, x[1][:, :5]), "q and k"),
        (lambda x: x.__setitem__(5, x[5][:1]), "initial_state"),
    ],
)
def test_bad_shapes_are_named(mutate, message):
    xs = _inputs()
    mutate(xs)
    with pytest.raises(ValueError, match=message):
        chunk_gated_delta_rule(*xs[:5], initial_state=xs[5])


def test_bad_cu_seqlens_rejected():
    q, k, v, g, beta, _ = _inputs(b=1, t=6)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4]))
    q2, k2, v2, g2, b2, _ = _inputs(b=2, t=6)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_gated_delta_rule(q2, k2, v2, g2, b2, cu_seqlens=torch.tensor([0, 6]))


def test_bfloat16_inputs_compute_in_float32():
    q, k, v, g, beta, s0 = _inputs(t=40, dtype=torch.bfloat16)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, chunk_size=16)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32  # the state stays in the compute dtype
    ref, ref_s = recurrent_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta)), initial_state=s0.double(),
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    # Only the final cast to bf16 rounds (relative step 2^-8).
    torch.testing.assert_close(o.double(), ref, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(s.double(), ref_s, rtol=1e-5, atol=1e-5)
