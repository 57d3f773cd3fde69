"""The local engine server's /update_weights_from_tensor payload: base64 of a safetensors blob per TP rank.

SGLang's own payload is a pickled, process-local (CUDA IPC) handle: meaningless across hosts and unsafe to
unpickle from a socket. The local server takes, per TP rank (it has one), the base64 of a safetensors blob of
the named tensors: portable, typed, and parsed without executing code. The SGLang client sends it to local
servers, the local server reads it."""
from __future__ import annotations

import base64
import binascii
from typing import Iterable

import torch
from safetensors.torch import load, save


class WeightUpdateError(ValueError):
    """A tensor name, shape or file does not fit the served model."""


LOCAL_TENSOR_FORMAT = "safetensors_base64"


def serialize_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """base64(safetensors) of the named tensors, the local server's `serialized_named_tensors` item."""
    tensors = {}
    for name, t in named:
        if name in tensors:
            raise WeightUpdateError(f"serialize_named_tensors: duplicate name {name}")
        tensors[name] = t.detach().to("cpu").contiguous().clone()
    return base64.b64encode(save(tensors)).decode("ascii")


def deserialize_named_tensors(data: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `serialize_named_tensors`; a clear error for anything else."""
    try:
        raw = base64.b64decode(data.encode("ascii"), validate=True)
        return list(load(raw).items())
    except (binascii.Error, ValueError, UnicodeEncodeError) as e:
        raise WeightUpdateError(f"serialized_named_tensors: not base64 safetensors ({type(e).__name__}: {e})") from None
    except Exception as e:  # safetensors raises its own error type on a corrupt header
        raise WeightUpdateError(f"serialized_named_tensors: unreadable safetensors blob ({e})") from None
