"""RMSNorm for Megatron layer specs on CPU (local spec): sequence-parallel capable, optional zero-centred gamma.

Why not Megatron's torch fallback (`WrappedTorchNorm`): it refuses `sequence_parallel=True`, and
MoE with TP > 1 requires sequence parallel. Under sequence parallel each TP rank normalises a
different slice of the sequence with the same (replicated) weight, so the weight gradients must be
summed across the TP group. Megatron's `finalize_model_grads` does that for every parameter that
carries `sequence_parallel=True`; this module sets that attribute exactly as Transformer Engine's
norm does.

Numerics follow Hugging Face so converted checkpoints give the same outputs:
  plain (Qwen3):           w * (x / rms(x)).to(dtype)       (normalise in fp32, cast, then scale)
  zero-centred (Qwen3.5):  ((x / rms(x)) * (1 + w)).to(dtype) (all in fp32, w initialised to 0)
Both are identical in fp32; they differ only in where bf16 rounding happens.
"""
from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """Megatron-spec-compatible RMSNorm: constructed as `RMSNorm(config, hidden_size, eps)`."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, zero_centered_gamma: bool | None = None, **_):
        super().__init__()
        self.config = config
        self.eps = eps
        self.zero_centered_gamma = (
            bool(getattr(config, "layernorm_zero_centered_gamma", False))
            if zero_centered_gamma is None
            else zero_centered_gamma
        )
        dtype = getattr(config, "params_dtype", torch.float32)
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype))
        # Read by finalize_model_grads: sum this weight's grad over TP when sequence parallel is on.
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered_gamma:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"
