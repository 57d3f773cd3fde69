"""Fused output layer + logprob vs float64 ground truth, chunked over tokens and vocabulary."""
import os

import pytest
import torch

from _kernels_ref64 import AllocationRecorder, logprob_ref64, rel_err, weighted_loss
from _tolerance import linear_logprob_tols
from megatron_search.kernels import linear_token_logprobs, token_logprobs

BACKENDS = ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


def _case(T, H, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g)
    logp_infer = -torch.rand(T, generator=g) * 5
    mask = torch.rand(T, generator=g) > 0.25
    weights = [torch.randn(T, generator=g) for _ in range(3)]
    return hidden, weight, targets, logp_infer, mask, weights


def _ref64(hidden, weight, targets, logp_infer, mask, weights):
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    logits = h64 @ w64.T
    logq = torch.log_softmax(logits, -1)
    lp = logq.gather(1, targets[:, None]).squeeze(1)
    ent = -(logq.exp() * logq).sum(-1)
    ratio = torch.where(mask, torch.exp(lp - logp_infer.double()), torch.ones_like(lp))
    weighted_loss(lp, ent, ratio, weights).backward()
    return lp, ent, ratio, h64.grad, w64.grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_chunked_matches_float64(backend):
    hidden, weight, targets, logp_infer, mask, weights = _case(13, 16, 300, torch.float32, 0)
    lp, ent, ratio, gh, gw = _ref64(hidden, weight, targets, logp_infer, mask, weights)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    out = linear_token_logprobs(h, w, targets, logp_infer=logp_infer, mask=mask, with_entropy=True,
                                token_chunk=5, vocab_chunk=64, backend=backend)
    weighted_loss(out.logp, out.entropy, out.ratio, weights).backward()
    # fp32 bounds for a length-16 dot product, a 300-term logsumexp merged over 5 vocab chunks, and the
    # upstream gradient's size (the ratio term's is c * ratio); see _tolerance
    upstream = float(weights[0].abs().max() + (weights[2] * ratio).abs().max())
    tol = linear_logprob_tols(hidden, weight, upstream, merges=5, entropy_upstream=float(weights[1].abs().max()))
    assert (out.logp - lp).abs().max() <= tol["logp"] and (out.entropy - ent).abs().max() <= tol["entropy"]
    assert rel_err(out.ratio, ratio) <= 2 * tol["logp"]  # exp(logp - logp_infer): relative error = logp's absolute
    assert (h.grad - gh).abs().max() <= tol["grad_hidden"] and (w.grad - gw).abs().max() <= tol["grad_weight"]
    assert (out.logp <= 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_matches_bf16_rounded_reference(backend):
    """Reference: float64 on the bf16 logits tile values the model itself would produce (hidden @ weight.T in bf16)."""
    hidden, weight, targets, logp_infer, mask, weights = _case(9, 32, 500, torch.bfloat16, 1)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    out = linear_token_logprobs(h, w, targets, logp_infer=logp_infer, mask=mask, with_entropy=True,
                                token_chunk=4, vocab_chunk=128, backend=backend)
    weighted_loss(out.logp, out.entropy, out.ratio, weights).backward()
    x64, lp, ent, ratio = logprob_ref64(hidden @ weight.T, targets, logp_infer, mask)
    weighted_loss(lp, ent, ratio, weights).backward()
    gh = x64.grad @ weight.double()
    gw = x64.grad.T @ hidden.double()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert rel_err(out.logp, lp) <= 2e-2 and rel_err(out.entropy, ent) <= 2e-2
    assert rel_err(h.grad, gh) <= 2e-2 and rel_err(w.grad, gw) <= 2e-2
    assert (out.logp <= 0).all()


def test_equals_unfused_path_on_3d_input_and_frozen_weight():
    """[B, S, H] hidden with a frozen weight: same values and hidden-grad as token_logprobs on the logits."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 7, 12, generator=g, requires_grad=True)
    weight = torch.randn(90, 12, generator=g)
    targets = torch.randint(0, 90, (2, 7), generator=g)
    out = linear_token_logprobs(hidden, weight, targets, token_chunk=3, vocab_chunk=20)
    out.logp.sum().backward()
    grad_fused = hidden.grad.clone()
    hidden.grad = None
    ref = token_logprobs(hidden @ weight.T, targets)
    ref.logp.sum().backward()
    assert out.logp.shape == (2, 7)
    # Both paths are fp32 with different reduction orders (chunked 20-wide vs the BLAS's blocking of one
    # 90-wide matmul): each is within the fp32 bound of the exact value, so they differ by at most twice it.
    # 1e-6 absolute failed on one machine (1.9e-6 on log-probs of size 12: two ulps).
    tol = linear_logprob_tols(hidden, weight, upstream_max=1.0, merges=5)
    assert (out.logp - ref.logp).abs().max() <= 2 * tol["logp"]
    assert (grad_fused - hidden.grad).abs().max() <= 2 * tol["grad_hidden"]


def test_no_logits_sized_tensor_is_ever_allocated():
    T, H, V = 32, 8, 6000
    hidden, weight, targets, logp_infer, mask, _ = _case(T, H, V, torch.bfloat16, 3)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    with AllocationRecorder() as rec:
        out = linear_token_logprobs(h, w, targets, logp_infer=logp_infer, mask=mask, with_entropy=True,
                                    token_chunk=16, vocab_chunk=2048)
        (out.logp.sum() + out.entropy.sum() + out.ratio.sum()).backward()
    largest = max(n for _, dtype, n in rec.allocations if n != V * H)  # V*H: grad_weight itself
    assert largest <= 16 * 2048


def test_bad_input():
    h, w, t = torch.randn(4, 8), torch.randn(20, 8), torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"weight must be \[V_local, H=8\]"):
        linear_token_logprobs(h, torch.randn(20, 7), t)
    with pytest.raises(ValueError, match="must match hidden"):
        linear_token_logprobs(h, w.bfloat16(), t)
    with pytest.raises(ValueError, match=r"found 20"):
        linear_token_logprobs(h, w, torch.tensor([0, 1, 20, 3]))
    with pytest.raises(ValueError, match="targets shape"):
        linear_token_logprobs(h, w, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="token_chunk"):
        linear_token_logprobs(h, w, t, token_chunk=0)
