"""Gated reward aggregation (RECIPE section 5):

    R_i = r_base_i * s_i - pen_eff_i,      pen_eff_i = lambda_tool * pen_tool_i + lambda_len * pen_len_i

Correctness gates the preference credit: a wrong rollout (r_base = 0) earns no preference
score, so with non-negative penalties its reward is never positive (a linear sum let strong
preference scores pay for wrong answers).
"""
from __future__ import annotations

from torch import Tensor

from .groups import check_finite, check_flat


def check_binary(name: str, x: Tensor, n: int | None = None) -> Tensor:
    """A 1-D tensor whose values are all 0 or 1, else a ValueError naming the first bad one."""
    check_flat(name, x, n)
    check_finite(name, x)
    bad = ((x != 0) & (x != 1)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"{name}: values must be 0 or 1, got {float(x[i])} at position {i}")
    return x


def check_unit(name: str, x: Tensor, n: int | None = None) -> Tensor:
    """A 1-D floating tensor with every value in [0, 1], else a ValueError naming the first bad one."""
    check_flat(name, x, n)
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating tensor, got {x.dtype}")
    check_finite(name, x)
    bad = ((x < 0) | (x > 1)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"{name}: values must lie in [0, 1], got {float(x[i])} at position {i}")
    return x


def effective_penalty(pen_tool: Tensor, pen_len: Tensor, lambda_tool: float, lambda_len: float) -> Tensor:
    """pen_eff = lambda_tool * pen_tool + lambda_len * pen_len (lambdas >= 0)."""
    if lambda_tool < 0 or lambda_len < 0:
        raise ValueError(f"lambda_tool/lambda_len: must be >= 0, got {lambda_tool}, {lambda_len}")
    check_flat("pen_tool", pen_tool)
    check_flat("pen_len", pen_len, pen_tool.numel())
    check_finite("pen_tool", pen_tool)
    check_finite("pen_len", pen_len)
    return lambda_tool * pen_tool + lambda_len * pen_len


def gated_reward(r_base: Tensor, s: Tensor, pen_eff: Tensor) -> Tensor:
    """R = r_base * s - pen_eff, elementwise over rollouts [N]; r_base in {0,1}, s in [0,1]."""
    check_unit("s", s)
    n = s.numel()
    check_binary("r_base", r_base, n)
    check_flat("pen_eff", pen_eff, n)
    check_finite("pen_eff", pen_eff)
    return r_base.to(s.dtype) * s - pen_eff.to(s.dtype)


__all__ = ["check_binary", "check_unit", "effective_penalty", "gated_reward"]
