"""Load full (unsharded, 1-process) Megatron weights into this rank's model by slicing.

A full state is what a 1-process model's `named_parameters()` holds. For this rank's model each
local parameter name is mapped to its full name (pipeline stages renumber layers from 0, expert
parallel ranks renumber their experts from 0) and the full tensor is sliced along the parameter's
tensor-parallel `partition_dim` (experts use the expert-TP group). Gated (SwiGLU) fc1 weights
concatenate [gate; up] and each TP rank holds [gate_r; up_r], so they are sliced per half.

Architectures with other fused layouts supply `tp_slice(name, full, rank, size, config) -> Tensor | None`
on their provider module (None: use the default rules).
"""
from __future__ import annotations

import re
from typing import Callable, Mapping

import torch
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_search.distributed.stages import rank_in, size_of

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"(\.local_experts\.)(\d+)\.")


class ReshardError(ValueError):
    """The full state does not fit this rank's model (missing name or shape mismatch)."""


def full_name(local_name: str, layer_offset: int, expert_offset: int) -> str:
    """decoder.layers.{i}... -> layers.{i + layer_offset}; local_experts.{j} -> j + expert_offset."""
    name = _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.", local_name, count=1)
    return _EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + expert_offset}.", name, count=1)


def default_tp_slice(name: str, full: torch.Tensor, dim: int, rank: int, size: int, gated_fc1: bool) -> torch.Tensor:
    """Rank's shard of `full` along `dim` (per half for gated linear_fc1)."""
    if size == 1:
        return full
    if gated_fc1 and name.endswith("linear_fc1.weight") and dim == 0:
        halves = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(h, size, dim=0)[rank] for h in halves], dim=0)
    if full.shape[dim] % size:
        raise ReshardError(f"{name}: dim {dim} of {tuple(full.shape)} is not divisible by TP={size}")
    return torch.chunk(full, size, dim=dim)[rank]


def _is_routed_expert(name: str) -> bool:
    # Routed experts (sharded by EP and expert-TP); shared experts live under mlp.shared_experts (TP).
    return ".mlp.experts." in name


def load_full_state(model: torch.nn.Module, full: Mapping[str, torch.Tensor], config, groups,
                    vp_stage: int | None = None, tp_slice: Callable | None = None) -> None:
    """Copy this rank's shards (its place in `groups`) of `full` (name -> full tensor) into `model`'s parameters."""
    shards = shard_full_state(model, full, config, groups, vp_stage, tp_slice)
    with torch.no_grad():
        for local, param in model.named_parameters():
            param.copy_(shards[local.removeprefix("module.")])


def shard_full_state(model: torch.nn.Module, full: Mapping[str, torch.Tensor], config, groups,
                     vp_stage: int | None = None, tp_slice: Callable | None = None) -> dict[str, torch.Tensor]:
    """This rank's shard (its place in `groups`: tp, ep, expt_tp) of every tensor in `full`, keyed by `model`'s
    local parameter names."""
    layer_offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    num_experts = config.num_moe_experts or 0
    ep_size, ep_rank = size_of(groups.ep), rank_in(groups.ep)
    expert_offset = ep_rank * (num_experts // ep_size) if num_experts else 0
    tp = (rank_in(groups.tp), size_of(groups.tp))
    etp = (rank_in(groups.expt_tp), size_of(groups.expt_tp))
    out: dict[str, torch.Tensor] = {}
    for local, param in model.named_parameters():
        local = local.removeprefix("module.")
        name = full_name(local, layer_offset, expert_offset)
        if name not in full:
            raise ReshardError(f"{name} (local {local}): not in the full state")
        tensor = full[name]
        if getattr(param, "tensor_model_parallel", False):
            rank, size = etp if _is_routed_expert(name) else tp
            custom = tp_slice(name, tensor, rank, size, config) if tp_slice is not None else None
            tensor = custom if custom is not None else default_tp_slice(
                name, tensor, param.partition_dim, rank, size, bool(config.gated_linear_unit)
            )
        if tensor.shape != param.shape:
            raise ReshardError(f"{name}: full-state shard {tuple(tensor.shape)} != parameter {tuple(param.shape)}")
        out[local] = tensor
    return out


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters of a 1-process model (no parallelism) as a name -> tensor dict (CPU copies)."""
    return {n.removeprefix("module."): p.detach().cpu().clone() for n, p in model.named_parameters()}
