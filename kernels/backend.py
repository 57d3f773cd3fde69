"""Pick the implementation of a kernel: Triton on GPU, the torch reference on CPU.

Every kernel in this package comes as a pair with identical signatures (`*_torch`, `*_triton`).
`resolve_backend` turns the user's choice ("auto" | "torch" | "triton") into one of the two.
Triton runs on CPU tensors only under the interpreter (TRITON_INTERPRET=1, read by Triton when
a kernel is decorated, i.e. when `megatron_search.kernels.*_triton` modules are first imported);
tests use that to check the Triton code without a GPU.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Literal

import torch

Backend = Literal["auto", "torch", "triton"]
BACKENDS = ("auto", "torch", "triton")


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_backend(backend: str, device: torch.device) -> Literal["torch", "triton"]:
    """'auto' -> 'triton' for CUDA tensors when Triton is installed, else 'torch'.

    An explicit 'triton' on a CPU tensor is allowed only under TRITON_INTERPRET=1, because compiled
    Triton kernels cannot read host memory.
    """
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_importable() else "torch"
    if backend == "triton":
        if not triton_importable():
            raise RuntimeError("backend='triton' requested but triton is not installed (pip install triton)")
        if device.type != "cuda" and not triton_interpreting():
            raise RuntimeError(
                f"backend='triton' on a {device.type} tensor needs TRITON_INTERPRET=1 set before the kernels "
                "are imported (the Triton interpreter); use backend='torch' or 'auto' on CPU"
            )
    return backend  # type: ignore[return-value]
