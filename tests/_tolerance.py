"""Float error bounds for the numeric tests: they scale with the values' magnitude and the reduction length.

The order in which a BLAS, a kernel or a collective reduces is not fixed: it changes with the
machine's vector width, the library's blocking and the number of ranks. An absolute bound such as
1e-6 on log-probs of size 12 is two float32 ulps there, and fails on the next machine. These bounds
are worst cases over every order (Higham, Accuracy and Stability of Numerical Algorithms, ch. 3-4),
so a test that uses them fails on a wrong result, never on a legal reordering.

u is the unit roundoff (eps / 2) of the dtype the computation ran in.
"""
from __future__ import annotations

import math

import torch


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps / 2


def sum_tol(abs_sum: float, n: int, dtype: torch.dtype = torch.float32, safety: float = 2.0) -> float:
    """Error of a length-n sum (or dot product) in any order: (n - 1) u sum|x_i|, plus the final rounding
    (so n u sum|x_i|); `safety` covers the one or two elementwise roundings of the terms themselves."""
    return safety * n * unit_roundoff(dtype) * float(abs_sum)


def logprob_tol(max_abs_logit: float, n: int, dtype: torch.dtype = torch.float32, merges: int = 1,
                safety: float = 2.0) -> float:
    """Absolute error of log p = x_t - logsumexp(x) over n logits with |x| <= M, computed in dtype.

    Shifting by the max costs u |x - m| <= 2uM per term (an absolute error in the exponent), the sum of
    n positive exponentials a relative (n - 1)u, exp and log one u each, the final subtraction
    u (|lse| + |log p|) with |lse| <= M + log n. Each merge of two partial (max, sum) states in a chunked
    or online kernel rescales by exp(m_old - m_new): another 2uM.
    """
    lse = float(max_abs_logit) + math.log(max(n, 1))
    return safety * unit_roundoff(dtype) * ((n + 1) + 2 * (merges + 1) * float(max_abs_logit) + 2 * lse)


def entropy_tol(max_abs_logit: float, n: int, dtype: torch.dtype = torch.float32, merges: int = 1) -> float:
    """H = lse - sum p x: the lse error of logprob_tol plus a length-n sum of terms |p x| <= |x| <= M weighted by p."""
    return logprob_tol(max_abs_logit, n, dtype, merges) + sum_tol(max_abs_logit, n, dtype)


def softmax_grad_tol(upstream_max: float, max_abs_logit: float, n: int, dtype: torch.dtype = torch.float32,
                     merges: int = 1, entropy_upstream: float = 0.0) -> float:
    """Gradient of sum(g * logp + b * H) w.r.t. one logit, |g| <= upstream_max, |b| <= entropy_upstream:
    g (onehot - p) and b p (log p + H). p = exp(x - lse) carries lse's error (logprob_tol) as a relative
    error; |log p + H| <= 2 (M + log n)."""
    scale = float(upstream_max) + float(entropy_upstream) * 2 * (float(max_abs_logit) + math.log(max(n, 1)))
    return scale * (logprob_tol(max_abs_logit, n, dtype, merges) + 4 * unit_roundoff(dtype))


def linear_logprob_tols(hidden: torch.Tensor, weight: torch.Tensor, upstream_max: float, merges: int = 1,
                        dtype: torch.dtype = torch.float32, entropy_upstream: float = 0.0) -> dict:
    """Bounds for log-probs of logits = hidden @ weight.T ([T, H] x [V, H]) and for the gradients of
    sum(g * logp + b * H) w.r.t. hidden and weight, with |g| <= upstream_max, |b| <= entropy_upstream.

    Each logit is a length-H dot product (sum_tol of sum_h |hidden| |weight|); that error passes 1:1 into
    x_t and into lse, so twice into log p. grad_hidden = grad_logits @ weight sums V terms, grad_weight =
    grad_logits.T @ hidden sums T terms: each carries the per-logit gradient bound times the other factor's
    largest entry, plus its own length-V (or length-T) sum."""
    h = hidden.detach().double().reshape(-1, hidden.shape[-1])
    w = weight.detach().double()
    T, H = h.shape
    V = w.shape[0]
    logits_abs = h.abs() @ w.abs().T
    M = float((h @ w.T).abs().max())
    dot = sum_tol(float(logits_abs.max()), H, dtype)
    g_logit = softmax_grad_tol(upstream_max, M + dot, V, dtype, merges, entropy_upstream)
    g_logit += 2 * (upstream_max + entropy_upstream) * dot
    g_scale = 2 * float(upstream_max) + float(entropy_upstream) * 2 * (M + math.log(V))  # largest |d loss / d logit|
    w_max, h_max = float(w.abs().max()), float(h.abs().max())
    return {
        "logp": logprob_tol(M, V, dtype, merges) + 2 * dot,
        "entropy": entropy_tol(M, V, dtype, merges) + 2 * dot,
        "grad_hidden": w_max * 2 * g_logit + sum_tol(w_max * g_scale, V, dtype),
        "grad_weight": h_max * T * g_logit + sum_tol(h_max * g_scale, T, dtype),
    }
