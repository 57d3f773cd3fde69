"""Collectives outside Megatron-Core's own code, with every tensor on its group's device.

NCCL groups take CUDA tensors only; a host scalar reduced over an NCCL group fails at once (and a
CUDA tensor over a gloo group fails too). Each helper moves its tensor to the group's device (the
current CUDA device for NCCL, the host for gloo), runs the collective there and writes the result back
into the caller's tensor, so call sites stay device-agnostic. tests/test_device_discipline.py fails on
a raw tensor collective anywhere in train/, distributed/, weights/ or rm/ outside this module.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_device(group=None) -> torch.device:
    """Where `group`'s collectives take their tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _run(fn, t: torch.Tensor, group, **kw) -> torch.Tensor:
    dev = group_device(group)
    work = t if t.device == dev else t.to(dev)
    fn(work, group=group, **kw)
    if work is not t:
        t.copy_(work)
    return t


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """In-place all-reduce of `t` (any device) over `group`; returns `t`."""
    return _run(dist.all_reduce, t, group, op=op)


def broadcast(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """In-place broadcast of `t` from global rank `src` over `group`; returns `t`."""
    return _run(dist.broadcast, t, group, src=src)


def barrier(group=None) -> None:
    """A barrier on `group` (NCCL's runs on the current device, so none is guessed)."""
    if dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)
