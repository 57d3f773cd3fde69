"""Layer-spec selection: Transformer Engine specs when usable, Megatron local specs otherwise.

The local specs come from Megatron-Core's own builders; `replace_norms` then swaps Megatron's torch
fallback norm (which refuses sequence parallel) for our `RMSNorm` everywhere in the spec tree, so
TP > 1 with sequence parallel (required for MoE) also works on CPU, and `use_sdpa_attention` routes
their core attention through torch SDPA (models/sdpa_attention.py); `local_spec_fixups` does both.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from .norm import RMSNorm
from .sdpa_attention import SDPADotProductAttention


def te_available() -> bool:
    """Transformer Engine is importable and a GPU is present (TE has no CPU kernels)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def use_transformer_engine(transformer_impl: str, require_te: bool = False) -> bool:
    """Resolve cfg.model.transformer_impl ('auto' | 'local' | 'transformer_engine'); with cfg.model.require_te a
    build without TE specs is refused (the GPU configs: local specs there would run the experts as a per-expert
    loop, SequentialMLP, and without TE's fused kernels)."""
    if transformer_impl == "local":
        return False
    if transformer_impl == "transformer_engine" or require_te:
        if not te_available():
            field = "model.require_te: true" if require_te else "model.transformer_impl: 'transformer_engine'"
            undo = "model.require_te=false" if require_te else "model.transformer_impl=local"
            raise RuntimeError(
                f"{field} needs Transformer Engine and a GPU (found: transformer_engine "
                f"{'importable' if importlib.util.find_spec('transformer_engine') else 'not importable'}, "
                f"{'a' if torch.cuda.is_available() else 'no'} GPU); install the gpu extra, or set {undo} to build "
                "local specs (experts as a per-expert loop, no fused kernels)"
            )
        return True
    return te_available()


def _fallback_norm_classes() -> tuple[type, ...]:
    return (WrappedTorchNorm,)


def _replace_modules(spec: Any, swap) -> Any:
    """Copy of a ModuleSpec / submodules tree with each module class `cls` replaced by `swap(cls)`."""
    if isinstance(spec, type):
        return swap(spec)
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, module=_replace_modules(spec.module, swap),
                                   submodules=_replace_modules(spec.submodules, swap))
    if isinstance(spec, list):
        return [_replace_modules(s, swap) for s in spec]
    if dataclasses.is_dataclass(spec):
        changes = {f.name: _replace_modules(getattr(spec, f.name), swap) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    return spec


def replace_norms(spec: Any, norm_cls: type = RMSNorm) -> Any:
    """Copy of a spec tree with every torch-fallback norm replaced by `norm_cls` (see module docstring)."""
    fallback = _fallback_norm_classes()
    return _replace_modules(spec, lambda cls: norm_cls if issubclass(cls, fallback) else cls)


def use_sdpa_attention(spec: Any) -> Any:
    """Copy of a local spec tree whose core attention runs through torch SDPA (models/sdpa_attention.py)."""
    return _replace_modules(spec, lambda cls: SDPADotProductAttention if cls is DotProductAttention else cls)


def local_spec_fixups(spec: Any, norm_cls: type = RMSNorm) -> Any:
    """What every local (non-TE) spec of ours gets: SP-capable norms and SDPA core attention."""
    return use_sdpa_attention(replace_norms(spec, norm_cls))


def block_from_layer_spec(layer_spec: Any, config, vp_stage: int | None, pp_rank: int | None, norm_cls: type):
    """TransformerBlockSubmodules for this pipeline stage: its layers plus the final norm."""
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * n, layer_norm=norm_cls)
