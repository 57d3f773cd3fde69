"""The two implementations of the fused-logprob primitives behind one small interface."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from .backend import resolve_backend
from .logprob_torch import online_stats_torch, write_grad_torch
from .softmax_stats import finalize_torch


def primitives(backend: str, device: torch.device) -> SimpleNamespace:
    """online_stats / write_grad / finalize for the resolved backend (Triton imported only when used)."""
    if resolve_backend(backend, device) == "triton":
        # optional: triton (the GPU backend; a dev/gpu extra)
        from .logprob_triton import finalize_triton, online_stats_triton, write_grad_triton

        return SimpleNamespace(
            name="triton", online_stats=online_stats_triton, write_grad=write_grad_triton, finalize=finalize_triton
        )
    return SimpleNamespace(name="torch", online_stats=online_stats_torch, write_grad=write_grad_torch, finalize=finalize_torch)
