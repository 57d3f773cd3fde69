"""Input checks shared by the fused kernels: every bad input gets an error naming what and where."""
from __future__ import annotations

from typing import Optional

import torch

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def flatten_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """[..., C] -> [R, C] as a view (a copy would break the in-place backward and cost memory)."""
    if x.dim() < 2:
        raise ValueError(f"{name} must have shape [..., V] with at least 2 dims, got {tuple(x.shape)}")
    if x.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    try:
        flat = x.view(-1, x.shape[-1])
    except RuntimeError as err:
        raise ValueError(
            f"{name} with shape {tuple(x.shape)} and strides {x.stride()} cannot be viewed as rows "
            f"without a copy; pass a contiguous tensor (e.g. {name}.contiguous())"
        ) from err
    if (flat.shape[1] > 1 and flat.stride(1) == 0) or (flat.shape[0] > 1 and flat.stride(0) == 0):
        raise ValueError(f"{name} has zero strides {x.stride()} (an expanded tensor); pass a materialised tensor")
    return flat


def check_targets(targets: torch.Tensor, rows_shape: torch.Size, vocab_size: int, device: torch.device,
                  check_values: bool = True) -> torch.Tensor:
    """Targets as a contiguous int64 [R]; raises unless shape matches and (with `check_values`: two host syncs)
    every id is in [0, vocab_size)."""
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}")
    if tuple(targets.shape) != tuple(rows_shape):
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal the leading logits/hidden shape {tuple(rows_shape)}")
    if targets.device != device:
        raise ValueError(f"targets are on {targets.device} but the logits/hidden are on {device}")
    flat = targets.reshape(-1).to(torch.int64).contiguous()
    if check_values and flat.numel():
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= vocab_size:
            bad = int(((flat < 0) | (flat >= vocab_size)).nonzero()[0, 0])
            raise ValueError(
                f"targets must lie in [0, {vocab_size}); found {int(flat[bad])} at flat position {bad} "
                f"(min {lo}, max {hi}); mask padding positions with a valid id, not -100"
            )
    return flat


def check_per_token(x: Optional[torch.Tensor], name: str, rows_shape: torch.Size, device: torch.device, *, as_bool: bool,
                    check_values: bool = True):
    """Optional per-token tensor (logp_infer or mask) as a contiguous fp32/bool [R] (a float mask's 0/1 values
    checked with `check_values`: a host sync)."""
    if x is None:
        return None
    if tuple(x.shape) != tuple(rows_shape):
        raise ValueError(f"{name} shape {tuple(x.shape)} must equal the targets shape {tuple(rows_shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the logits/hidden are on {device}")
    flat = x.detach().reshape(-1)
    if as_bool:
        if flat.dtype != torch.bool:
            if check_values and flat.dtype.is_floating_point and not bool(((flat == 0) | (flat == 1)).all()):
                raise ValueError(f"{name} must be boolean or 0/1 valued")
            flat = flat != 0
        return flat.contiguous()
    if not flat.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor of log-probabilities, got {flat.dtype}")
    return flat.float().contiguous()
