"""Fill a (sharded) Megatron model from HF tensors, one parameter at a time.

Every rank reads only the HF tensors its own parameters need, builds the full Megatron tensor
with the mapping table, keeps its TP slice and copies it in place, so a rank never holds more
than one full parameter beside its shard. Afterwards the ranks agree on what was read: a stored
tensor that no rank used (other than the carried-through vision weights, and the MTP weights when the
model builds no MTP block) is an error, as is a missing one or a shape that does not fit.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_search.config.hf import Architecture
from megatron_search.models.hf_mapping import Mapping, MappingError
from megatron_search.weights.hf_source import HFTensorSource
from megatron_search.weights.params import local_params, model_mapping, padded_vocab_size


class CheckpointMismatchError(MappingError):
    """The HF checkpoint does not fit the model (missing / extra tensors, wrong shapes)."""


@torch.no_grad()
def load_hf_into_model(model_chunks, arch: Architecture, source: HFTensorSource, groups, *,
                       world_group=None, strict: bool = True, progress: bool = False) -> set[str]:
    """Copy HF tensors into this rank's parameters; returns the HF names this rank read.

    Collective when torch.distributed is initialised (the extra-tensor check gathers names).
    """
    params = local_params(model_chunks, model_mapping(model_chunks, arch), groups)
    mapping = model_mapping(model_chunks, arch, padded_vocab_size(params, arch.vocab_size))
    used: set[str] = set()
    rank0 = not dist.is_initialized() or dist.get_rank(world_group) == 0
    error: Optional[str] = None
    try:
        for p in tqdm(params, desc="load HF -> Megatron", disable=not (progress and rank0)):
            _load_one(p, source, mapping)
            used.update(p.match.hf_names)
    except (MappingError, KeyError) as e:
        error = str(e)
    _raise_if_any_failed(error, world_group)  # every rank raises, so no rank waits in a collective
    if strict:
        check_all_used(source, used, mapping, world_group)
    return used


def _load_one(p, source: HFTensorSource, mapping: Mapping) -> None:
    m = p.match
    tensors = [source.get(n) for n in m.hf_names]
    want = mapping.expected_hf_shapes(m, p.full_shape)
    for name, t, shape in zip(m.hf_names, tensors, want):
        if tuple(t.shape) != shape:
            raise CheckpointMismatchError(
                f"{source.where}: tensor {name!r} has shape {list(t.shape)}, the model needs {list(shape)} "
                f"(for Megatron {p.global_name}); does the checkpoint match the config?"
            )
    full = mapping.to_mcore(m, tensors, p.zero_centered, p.full_shape)
    shard = m.rule.tp.shard(full, p.tp_rank, p.tp_size, mapping.ctx)
    p.tensor.data.copy_(shard.to(p.tensor.dtype))


def _raise_if_any_failed(error: Optional[str], world_group) -> None:
    errors = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size(world_group)
        dist.all_gather_object(errors, error, group=world_group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, msg = failed[0]
        raise CheckpointMismatchError(msg if len(errors) == 1 else f"rank {rank}: {msg}")


def check_all_used(source: HFTensorSource, used: set[str], mapping: Mapping, world_group=None) -> None:
    """Raise naming the stored tensors no rank used (ignoring carried-through prefixes)."""
    everything: set[str] = set(used)
    if dist.is_initialized():
        gathered: list[Optional[set[str]]] = [None] * dist.get_world_size(world_group)
        dist.all_gather_object(gathered, used, group=world_group)
        for g in gathered:
            everything |= g or set()
    extra = source.unused(everything, tuple(mapping.passthrough))
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        raise CheckpointMismatchError(
            f"{source.where}: {len(extra)} tensor(s) the {mapping.arch.model_type} model does not use: "
            f"{', '.join(extra[:5])}{more}; does the checkpoint match the config?"
        )
