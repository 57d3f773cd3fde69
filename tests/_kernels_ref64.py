"""Float64 ground truth for the kernel tests (plain autograd on log_softmax; independent of kernels/)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def logprob_ref64(logits, targets, logp_infer=None, mask=None):
    """(x64 leaf, logp, entropy, ratio or None) computed in float64 from the given (rounded) values."""
    x = logits.detach().double().requires_grad_()
    logq = torch.log_softmax(x, dim=-1)
    logp = logq.gather(-1, targets.long()[..., None]).squeeze(-1)
    finite = torch.where(torch.isfinite(logq), logq, torch.zeros_like(logq))  # p log p = 0 at p = 0
    entropy = -(logq.exp() * finite).sum(-1)
    ratio = None
    if logp_infer is not None:
        ratio = torch.exp(logp - logp_infer.double())
        if mask is not None:
            ratio = torch.where(mask.bool(), ratio, torch.ones_like(ratio))
    return x, logp, entropy, ratio


def weighted_loss(logp, entropy, ratio, weights):
    """sum(a*logp + b*entropy + c*ratio): exercises every output's gradient at once."""
    a, b, c = (w.to(logp.dtype) for w in weights)
    loss = (logp * a).sum()
    if entropy is not None:
        loss = loss + (entropy * b).sum()
    if ratio is not None:
        loss = loss + (ratio * c).sum()
    return loss


def rel_err(actual, expected):
    """max |actual - expected| / max |expected| (normwise), in float64."""
    expected = expected.detach().double()
    return float((actual.detach().double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


class AllocationRecorder(TorchDispatchMode):
    """Records (op name, dtype, numel) of every fresh tensor an op returns (views and in-place ops excluded)."""

    def __init__(self):
        super().__init__()
        self.allocations = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        aliasing = any(r.alias_info is not None for r in returns)
        if not aliasing:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for t in outs:
                if isinstance(t, torch.Tensor):
                    self.allocations.append((str(func), t.dtype, t.numel()))
        return out
