"""The local Megatron parameters of one rank, named globally and resolved against the mapping table.

Megatron names layers and experts locally (`decoder.layers.0` on the second pipeline stage is a
later layer; `local_experts.0` on EP rank 1 is a later expert; the same holds for the experts of
the MTP block's transformer layer, `mtp.layers.{k}.transformer_layer.`). Every exporter and loader needs
the global names, the tensor-parallel coordinates of each shard, and the norm convention of its
module; `local_params` collects them in one pass.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from megatron_search.distributed.stages import rank_in, size_of
from megatron_search.models.hf_mapping import Mapping, MappingError, Match
from megatron_search.models.wrappers import unwrap

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT = re.compile(r"^(mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


@dataclass
class LocalParam:
    """One parameter shard held by this rank."""

    global_name: str
    match: Match
    tensor: torch.Tensor
    tp_rank: int
    tp_size: int
    zero_centered: bool

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.tensor.shape)
        layout = self.match.rule.tp
        if layout.dim is not None:
            shape[layout.dim] *= self.tp_size
        return tuple(shape)


def _global_experts(layer: torch.nn.Module, rest: str) -> str:
    """`rest` (a name inside a transformer layer) with its local expert index made global."""
    for rx in (_LOCAL_EXPERT, _GROUPED_EXPERT):
        e = rx.match(rest)
        if e:
            ge = layer.mlp.local_expert_indices[int(e.group(2))]
            return f"{e.group(1)}{ge}{e.group(3) if rx is _LOCAL_EXPERT else ''}"
    return rest


def global_name(model: torch.nn.Module, local_name: str) -> str:
    """Megatron name with global layer and expert indices."""
    m = _LAYER.match(local_name)
    if m:
        layer = model.decoder.layers[int(m.group(1))]
        gl = layer.layer_number - 1  # layer_number is global and 1-based (includes the PP/VPP offset)
        return f"decoder.layers.{gl}.{_global_experts(layer, m.group(2))}"
    m = _MTP_LAYER.match(local_name)
    if m:
        mtp_layer = model.mtp.layers[int(m.group(1))]
        gk = mtp_layer.layer_number - 1  # 1-based, includes the MTP offset of a custom PP layout
        rest = m.group(2)
        inner = "transformer_layer."
        if rest.startswith(inner):
            rest = inner + _global_experts(mtp_layer.transformer_layer, rest[len(inner):])
        return f"mtp.layers.{gk}.{rest}"
    return local_name


def built_mtp_layers(model_chunks: Iterable[torch.nn.Module]) -> int:
    """MTP layers the model was configured with (the same on every pipeline stage; 0 = none).

    Read from the TransformerConfig, not from the parameters, so that stages without the MTP
    block (all but the last) build the same mapping as the stage holding it."""
    first = next(iter(model_chunks), None)
    return 0 if first is None else int(getattr(unwrap(first).config, "mtp_num_layers", None) or 0)


def model_mapping(model_chunks, arch, padded_vocab: Optional[int] = None) -> Mapping:
    """The mapping for these model chunks: MTP rules exactly when the model builds MTP layers."""
    return Mapping(arch, padded_vocab, mtp=built_mtp_layers(model_chunks) > 0)


def _zero_centered(model: torch.nn.Module, local_name: str) -> bool:
    owner = model.get_submodule(local_name.rsplit(".", 1)[0]) if "." in local_name else model
    if hasattr(owner, "zero_centered_gamma"):
        return bool(owner.zero_centered_gamma)
    return bool(getattr(getattr(owner, "config", None), "layernorm_zero_centered_gamma", False))


def local_params(model_chunks: Iterable[torch.nn.Module], mapping: Mapping, groups) -> list[LocalParam]:
    """Every parameter of this rank's model chunks, resolved against the mapping.

    `groups` needs `.tp` and optionally `.expt_tp` (a Megatron ProcessGroupCollection works).
    Raises MappingError naming the first parameter the table does not cover.
    """
    tp_group, etp_group = getattr(groups, "tp", None), getattr(groups, "expt_tp", None)
    tp, etp = (rank_in(tp_group), size_of(tp_group)), (rank_in(etp_group), size_of(etp_group))
    out: list[LocalParam] = []
    for chunk in model_chunks:
        model = unwrap(chunk)
        for name, p in model.named_parameters():
            g = global_name(model, name)
            m = mapping.match(g)
            rank, size = etp if m.rule.expert else tp
            is_split = bool(getattr(p, "tensor_model_parallel", False))
            layout = m.rule.tp
            if layout.dim is not None and size > 1 and not is_split:
                raise MappingError(f"{g}: the table says TP-sharded on dim {layout.dim} but the parameter is replicated")
            if is_split and layout.dim is not None and getattr(p, "partition_dim", layout.dim) != layout.dim:
                raise MappingError(f"{g}: Megatron shards dim {p.partition_dim}, the table says {layout.dim}")
            if layout.dim is None or not is_split:
                rank, size = 0, 1
            zc = _zero_centered(model, name) if m.rule.kind == "norm" else False
            out.append(LocalParam(g, m, p, rank, size, zc))
    return out


def padded_vocab_size(params: list[LocalParam], default: Optional[int] = None) -> Optional[int]:
    for p in params:
        if p.match.rule.kind == "vocab":
            return p.full_shape[0]
    return default
