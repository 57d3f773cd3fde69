"""Fused token logprob + IS ratio + entropy vs float64 ground truth (torch path; Triton under the interpreter).

The "triton" cases run only when TRITON_INTERPRET=1 is set before import, which
test_kernels_triton_interpret.py does in a subprocess so the setting never leaks into this process.
"""
import math
import os

import pytest
import torch

from _kernels_ref64 import AllocationRecorder, logprob_ref64, rel_err, weighted_loss
from _tolerance import entropy_tol, logprob_tol, softmax_grad_tol, sum_tol
from megatron_search.kernels import mismatch_stats, token_logprobs
from megatron_search.kernels.softmax_stats import SoftmaxStats, finalize_torch

BACKENDS = ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


def _inputs(shape, vocab, dtype, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g) * scale).to(dtype)
    targets = torch.randint(0, vocab, shape, generator=g)
    logp_infer = -torch.rand(shape, generator=g) * 6
    mask = torch.rand(shape, generator=g) > 0.3
    weights = [torch.randn(shape, generator=g) for _ in range(3)]
    return logits, targets, logp_infer, mask, weights


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inplace", [False, True])
def test_fp32_matches_float64_values_and_grads(backend, inplace):
    logits, targets, logp_infer, mask, weights = _inputs((3, 5), 1000, torch.float32)
    x64, lp64, h64, r64 = logprob_ref64(logits, targets, logp_infer, mask)
    weighted_loss(lp64, h64, r64, weights).backward()
    leaf = logits.clone().requires_grad_()
    x = leaf * 1.0  # non-leaf, so the in-place backward may overwrite it
    out = token_logprobs(x, targets, logp_infer=logp_infer, mask=mask, with_entropy=True,
                         inplace_backward=inplace, backend=backend)
    assert out.logp.dtype == torch.float32 and out.logp.shape == (3, 5)
    # fp32 worst-case bounds for a 1000-term logsumexp of logits this large, in one tile (_tolerance)
    M = float(logits.abs().max())
    assert (out.logp - lp64).abs().max() <= logprob_tol(M, 1000)
    assert (out.entropy - h64).abs().max() <= entropy_tol(M, 1000)
    assert rel_err(out.ratio, r64) <= 2 * logprob_tol(M, 1000)  # exp(logp - logp_infer): logp's error, relative
    assert torch.equal(out.ratio[~mask], torch.ones(int((~mask).sum())))
    weighted_loss(out.logp, out.entropy, out.ratio, weights).backward()
    upstream = float(weights[0].abs().max() + (weights[2] * r64).abs().max())
    assert (leaf.grad - x64.grad).abs().max() <= softmax_grad_tol(upstream, M, 1000, entropy_upstream=float(weights[1].abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_within_2e2_of_bf16_rounded_reference(backend):
    logits, targets, logp_infer, mask, weights = _inputs((4, 6), 2000, torch.bfloat16, scale=5.0, seed=1)
    x64, lp64, h64, r64 = logprob_ref64(logits, targets, logp_infer, mask)  # exact on the bf16 values
    weighted_loss(lp64, h64, r64, weights).backward()
    x = logits.clone().requires_grad_()
    out = token_logprobs(x, targets, logp_infer=logp_infer, mask=mask, with_entropy=True, backend=backend)
    weighted_loss(out.logp, out.entropy, out.ratio, weights).backward()
    assert x.grad.dtype == torch.bfloat16
    assert rel_err(out.logp, lp64) <= 2e-2 and rel_err(out.entropy, h64) <= 2e-2
    assert rel_err(x.grad, x64.grad) <= 2e-2
    assert (out.logp <= 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiles_smaller_than_vocab_and_many_rows(backend):
    """Many tiles per row and rows per program: the streaming state must be carried correctly."""
    from megatron_search.kernels.impl import primitives

    rows = 20
    logits, targets, *_ = _inputs((rows,), 300, torch.float32, seed=2)
    impl = primitives(backend, logits.device)
    stats = SoftmaxStats.empty(rows, logits.device, with_entropy=True)
    impl.online_stats(logits, targets, 0, stats, block_rows=8, block_cols=64)
    lse, logp, entropy, _, _ = impl.finalize(stats, None, None)
    _, lp64, h64, _ = logprob_ref64(logits, targets)
    M = float(logits.abs().max())  # 300 logits in 5 column tiles: 4 merges of the running (max, sum)
    assert (lse - torch.logsumexp(logits.double(), -1)).abs().max() <= logprob_tol(M, 300, merges=5)
    assert (logp - lp64).abs().max() <= logprob_tol(M, 300, merges=5)
    assert (entropy - h64).abs().max() <= entropy_tol(M, 300, merges=5)
    grad = torch.empty_like(logits)
    g = torch.randn(rows, generator=torch.Generator().manual_seed(3))
    impl.write_grad(logits, grad, targets, 0, lse, None, g, None, block_rows=8, block_cols=64)
    expected = -torch.softmax(logits.double(), -1) * g[:, None].double()
    expected[torch.arange(rows), targets] += g.double()
    # float32 rounding of g * (softmax - onehot): the absolute error grows with |g| (1.6e-6 seen at |g| ~ 2)
    assert (grad - expected).abs().max() <= softmax_grad_tol(float(g.abs().max()), M, 300, merges=5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_rows_and_minus_inf_logits(backend):
    """A row-strided view (a slice of a wider buffer) and -inf logits (masked vocab) are handled exactly."""
    base = torch.randn(4, 130, generator=torch.Generator().manual_seed(3))
    base[:, 100:110] = float("-inf")
    logits = base[:, :120]  # stride (130, 1): not contiguous
    targets = torch.tensor([0, 5, 119, 50])
    leaf = base.clone().requires_grad_()
    view = leaf[:, :120]
    out = token_logprobs(view, targets, with_entropy=True, backend=backend)
    x64, lp64, h64, _ = logprob_ref64(logits, targets)
    M = float(logits[torch.isfinite(logits)].abs().max())  # 110 finite logits of 120 (fp32 bounds, _tolerance)
    assert (out.logp - lp64).abs().max() <= logprob_tol(M, 120) and (out.entropy - h64).abs().max() <= entropy_tol(M, 120)
    (out.logp.sum() + out.entropy.sum()).backward()
    (lp64.sum() + h64.sum()).backward()
    assert torch.isfinite(leaf.grad).all()
    assert (leaf.grad[:, :120] - x64.grad).abs().max() <= softmax_grad_tol(1.0, M, 120, entropy_upstream=1.0)
    assert (leaf.grad[:, 100:110] == 0).all() and (leaf.grad[:, 120:] == 0).all()


def test_logp_never_positive_at_qwen35_vocab_with_huge_logits():
    """V = 248,320 with |logits| ~ 1e4 (fp32 and bf16): logp <= 0 exactly and close to float64."""
    vocab = 248_320
    g = torch.Generator().manual_seed(4)
    rows = [torch.randn(vocab, generator=g) * 1e4]
    dominant = torch.full((vocab,), -1e4)
    dominant[123_456] = 1e4  # logp of the target is 0 up to e^-20000
    rows.append(dominant)
    rows.append(torch.full((vocab,), 1e4))  # all equal: logp = -log V
    near = torch.full((vocab,), 1e4)
    near[-1] = 1e4 + 1.0  # the max is in the last tile
    rows.append(near)
    logits32 = torch.stack(rows)
    targets = torch.stack([logits32[0].argmax(), torch.tensor(123_456), torch.tensor(7), torch.tensor(vocab - 1)])
    for dtype in (torch.float32, torch.bfloat16):
        logits = logits32.to(dtype)
        out = token_logprobs(logits, targets, with_entropy=True, backend="torch")
        _, lp64, h64, _ = logprob_ref64(logits, targets)
        assert (out.logp <= 0).all(), out.logp
        # absolute error is bounded by the fp32 spacing at 1e4 (~1e-3), not by the magnitude of the logits
        assert (out.logp - lp64).abs().max() <= 2e-3
        assert (out.entropy - h64).abs().max() <= 2e-3
    assert abs(float(out.logp[2]) + torch.log(torch.tensor(float(vocab))).item()) <= 2e-3
    assert float(out.logp[1]) == 0.0


def test_finalize_identity_gives_exact_zero_when_target_is_the_only_mass():
    stats = SoftmaxStats(m=torch.tensor([5.0]), s=torch.tensor([1.0]), w=torch.tensor([0.0]), xt=torch.tensor([5.0]))
    lse, logp, entropy, _, _ = finalize_torch(stats, None, None)
    assert float(lse) == 5.0 and float(logp) == 0.0 and float(entropy) == 0.0


def test_nd_input_and_stats_match_hand_values():
    logits = torch.tensor([[[0.0, 0.0], [1.0, 0.0]], [[0.0, 2.0], [0.0, 0.0]]])  # [B=2, S=2, V=2]
    targets = torch.tensor([[0, 0], [1, 1]])
    logp_infer = torch.log(torch.tensor([[0.25, 0.5], [0.5, 0.5]]))
    mask = torch.tensor([[True, True], [True, False]])
    out = token_logprobs(logits, targets, logp_infer=logp_infer, mask=mask)
    # by hand: p = [1/2, e/(1+e), e^2/(1+e^2), 1/2]
    p = torch.tensor([[0.5, 2.718281828 / 3.718281828], [7.389056099 / 8.389056099, 0.5]])
    assert torch.allclose(out.logp, p.log(), atol=1e-6)
    d = (p.log() - logp_infer)[mask]
    assert torch.allclose(out.stats["k1"], (-d).mean(), atol=1e-6)
    assert torch.allclose(out.stats["k3"], (d.exp() - 1 - d).mean(), atol=1e-6)
    assert torch.allclose(out.stats["ratio_max"], d.exp().max(), atol=1e-6)
    assert float(out.stats["n_tokens"]) == 3.0


def test_mismatch_stats_hand_values_and_empty_mask():
    logp = torch.tensor([-1.0, -2.0, -3.0])
    infer = torch.tensor([-1.5, -2.0, float("-inf")])  # the -inf is padding, masked out
    st = mismatch_stats(logp, infer, torch.tensor([True, True, False]))
    # d = [0.5, 0]: k1 = -0.25, k3 = (e^0.5 - 1.5 + 0) / 2
    assert abs(float(st["k1"]) + 0.25) < 1e-7
    assert abs(float(st["k3"]) - (1.6487212707 - 1.5) / 2) < 1e-6
    assert abs(float(st["ratio_min"]) - 1.0) < 1e-7 and abs(float(st["ratio_max"]) - 1.6487212707) < 1e-6
    empty = mismatch_stats(logp, infer, torch.zeros(3, dtype=torch.bool))
    assert all(float(v) == 0.0 for v in empty.values())


def test_inplace_backward_allocates_no_vocab_sized_tensor():
    """Logits from an output layer, then fused logprob: forward + in-place backward create no [T, V] tensor
    (the gradient is written into the logits' storage and consumed by the matmul's backward); the
    out-of-place backward creates exactly one, the gradient buffer in the logits' dtype."""
    T, H, V = 64, 8, 20_000  # T * V = 1.28M elements > one torch tile (64 x 8192)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float32).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=torch.float32).to(torch.bfloat16).requires_grad_()
    _, targets, logp_infer, mask, _ = _inputs((T,), V, torch.bfloat16, seed=5)
    for inplace, allowed in ((True, 0), (False, 1)):
        logits = hidden @ weight.T
        with AllocationRecorder() as rec:
            out = token_logprobs(logits, targets, logp_infer=logp_infer, mask=mask, with_entropy=True, inplace_backward=inplace)
            (out.logp.sum() + out.entropy.sum() + out.ratio.sum()).backward()
        big = [a for a in rec.allocations if a[2] >= T * V]
        assert len(big) == allowed, big
        assert all(dtype == torch.bfloat16 for _, dtype, _ in big)


def test_inplace_backward_refuses_silent_reuse_of_saved_logits():
    """If another op saved the logits for its backward, the in-place gradient write is detected by autograd."""
    x = torch.randn(3, 50, requires_grad=True)
    y = x * 1.0
    other = (y * y).sum()  # saves y
    out = token_logprobs(y, torch.tensor([1, 2, 3]), inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.logp.sum() + other).backward()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.randn(4, 10), torch.randint(0, 10, (5,))), "targets shape"),
        (lambda: (torch.randn(4, 10), torch.tensor([0, 1, 10, 2])), r"\[0, 10\); found 10 at flat position 2"),
        (lambda: (torch.randn(4, 10), torch.tensor([0, -100, 1, 2])), "found -100"),
        (lambda: (torch.randn(4, 10), torch.tensor([0.0, 1, 2, 3])), "integer"),
        (lambda: (torch.randn(4, 10).double(), torch.tensor([0, 1, 2, 3])), "float32, bfloat16 or float16"),
        (lambda: (torch.randn(10, 4, 3).transpose(0, 1), torch.zeros(4, 10, dtype=torch.long)), "contiguous"),
        (lambda: (torch.randn(1, 10).expand(4, 10), torch.tensor([0, 1, 2, 3])), "expanded"),
        (lambda: (torch.randn(10), torch.tensor([0])), "at least 2 dims"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_error(make, match):
    logits, targets = make()
    with pytest.raises((ValueError, TypeError), match=match):
        token_logprobs(logits, targets)


def test_bad_per_token_inputs_and_backend():
    logits, targets = torch.randn(4, 10), torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match="logp_infer shape"):
        token_logprobs(logits, targets, logp_infer=torch.zeros(3))
    with pytest.raises(ValueError, match="pass logp_infer"):
        token_logprobs(logits, targets, mask=torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="0/1"):
        token_logprobs(logits, targets, logp_infer=torch.zeros(4), mask=torch.full((4,), 0.5))
    with pytest.raises(ValueError, match="backend must be one of"):
        token_logprobs(logits, targets, backend="cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            token_logprobs(logits, targets, backend="triton")


def test_composes_with_rl_token_is_loss_like_the_unfused_path():
    """logp from the fused kernel feeds rl.losses.token_is_loss: same loss, metrics and logits-gradient
    as log_softmax + gather (float64 reference of the same fp32 logits)."""
    from megatron_search.rl.losses import token_is_loss

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 6, 40, generator=g) * 2
    targets = torch.randint(0, 40, (3, 6), generator=g)
    logp_infer = torch.log_softmax(logits + 0.05 * torch.randn(3, 6, 40, generator=g), -1).gather(-1, targets[..., None]).squeeze(-1)
    mask = torch.rand(3, 6, generator=g) > 0.2
    adv = torch.tensor([1.0, -0.5, 0.25])
    x = logits.clone().requires_grad_()
    fused = token_logprobs(x, targets, logp_infer=logp_infer, mask=mask)
    loss, metrics = token_is_loss(fused.logp, logp_infer, adv, mask, is_cap=2.0)
    loss.backward()
    x64, lp64, _, _ = logprob_ref64(logits, targets)
    loss64, metrics64 = token_is_loss(lp64, logp_infer.double(), adv.double(), mask, is_cap=2.0)
    loss64.backward()
    # Every value below is a masked mean of terms built from logp (ratio = exp(logp - logp_infer), capped),
    # so its error is logp's fp32 bound times the terms' size, plus the 18-term mean (_tolerance).
    M, n_tok = float(logits.abs().max()), int(mask.sum())
    ratio64 = (lp64.detach() - logp_infer.double()).exp().clamp(max=2.0)
    size = float((adv.abs().max() * ratio64.max()).clamp_min(1.0))
    lp_tol = logprob_tol(M, 40)
    assert abs(loss.item() - loss64.item()) <= size * lp_tol + sum_tol(size, n_tok)
    assert (x.grad - x64.grad).abs().max() <= softmax_grad_tol(size, M, 40)
    d = float((lp64.detach() - logp_infer.double()).abs().max())
    assert abs(float(fused.stats["k3"]) - float(metrics64["mismatch_kl_k3"])) <= (math.exp(d) + 1) * lp_tol + sum_tol(math.exp(d) + d, n_tok)
    assert abs(float(fused.stats["k1"]) - float(metrics64["mismatch_kl_k1"])) <= lp_tol + sum_tol(d, n_tok)
