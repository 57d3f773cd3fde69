"""Layer-spec selection: Transformer Engine specs when usable, Megatron local specs otherwise.

The local specs come from Megatron-Core's own builders; `replace_norms` then swaps Megatron's torch
fallback norm (which refuses sequence parallel) for our `RMSNorm` everywhere in the spec tree, so
TP > 1 with sequence parallel (required for MoE) also works on CPU.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch

from .norm import RMSNorm


def te_available() -> bool:
    """Transformer Engine is importable and a GPU is present (TE has no CPU kernels)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def use_transformer_engine(transformer_impl: str) -> bool:
    """Resolve cfg.model.transformer_impl ('auto' | 'local' | 'transformer_engine')."""
    if transformer_impl == "local":
        return False
    if transformer_impl == "transformer_engine":
        if not te_available():
            raise RuntimeError(
                "model.transformer_impl: 'transformer_engine' needs Transformer Engine and a GPU; "
                "install the gpu extra or set model.transformer_impl=local"
            )
        return True
    return te_available()


def _fallback_norm_classes() -> tuple[type, ...]:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return (WrappedTorchNorm,)


def replace_norms(spec: Any, norm_cls: type = RMSNorm) -> Any:
    """Copy of a ModuleSpec / submodules tree with every torch-fallback norm replaced by `norm_cls`."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    fallback = _fallback_norm_classes()
    if isinstance(spec, type) and issubclass(spec, fallback):
        return norm_cls
    if isinstance(spec, ModuleSpec):
        module = norm_cls if isinstance(spec.module, type) and issubclass(spec.module, fallback) else spec.module
        return dataclasses.replace(spec, module=module, submodules=replace_norms(spec.submodules, norm_cls))
    if isinstance(spec, list):
        return [replace_norms(s, norm_cls) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: replace_norms(getattr(spec, f.name), norm_cls) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    return spec


def block_from_layer_spec(layer_spec: Any, config, vp_stage: int | None, pp_rank: int | None, norm_cls: type):
    """TransformerBlockSubmodules for this pipeline stage: its layers plus the final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * n, layer_norm=norm_cls)
