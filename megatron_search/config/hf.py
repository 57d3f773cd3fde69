"""Read a Hugging Face `config.json` into the few architecture numbers the stack validates against.

Only plain data here (no torch, no transformers): config validation must be cheap and must not
import upward. The full provider (Megatron TransformerConfig + specs) lives in `models/`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3_5_moe")


class HFConfigError(ValueError):
    """A config.json that cannot describe a supported model."""


@dataclass(frozen=True)
class Architecture:
    """Architecture numbers shared by validation, the planner and the model providers."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    moe_top_k: int
    moe_ffn_hidden_size: int
    shared_expert_intermediate_size: int
    vocab_size: int
    # Gated DeltaNet (Qwen3.5 hybrid); zero for all-attention models.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    full_attention_interval: int = 1
    mtp_num_layers: int = 0

    @property
    def is_hybrid(self) -> bool:
        return self.linear_num_key_heads > 0

    def is_full_attention(self, layer: int) -> bool:
        """Layer i (0-based) is full attention when (i + 1) % interval == 0 (FACTS.md)."""
        return (layer + 1) % self.full_attention_interval == 0


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    # Qwen3.5 is multimodal: the language model's numbers sit under "text_config".
    if "text_config" in raw and isinstance(raw["text_config"], dict):
        merged = dict(raw["text_config"])
        merged.setdefault("model_type", raw.get("model_type"))
        merged["model_type"] = raw.get("model_type", merged["model_type"])
        return merged
    return raw


def _need(cfg: dict[str, Any], key: str, where: str) -> Any:
    if key not in cfg:
        raise HFConfigError(f"{where}: missing field '{key}'")
    return cfg[key]


def _full_attention_interval(c: dict[str, Any], where: str) -> int:
    """Period of full-attention layers, from `layer_types` when present (it must be periodic)."""
    types = c.get("layer_types")
    if not types:
        return int(c.get("full_attention_interval", 4))
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if not full:
        raise HFConfigError(f"{where}: layer_types has no full_attention layer")
    interval = full[0] + 1
    expected = [i for i in range(len(types)) if (i + 1) % interval == 0]
    if full != expected:
        raise HFConfigError(f"{where}: layer_types is not periodic (full attention at {full})")
    return interval


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """Load config.json from a file or a checkpoint directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise HFConfigError(f"{p}: no such config.json")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{p}: not valid JSON ({e})") from e


def architecture_from_hf(raw: dict[str, Any], where: str = "config.json") -> Architecture:
    """Architecture numbers of a qwen3_moe or qwen3_5_moe config."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFConfigError(
            f"{where}: model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
        )
    c = _text_config(raw)
    heads = _need(c, "num_attention_heads", where)
    hidden = _need(c, "hidden_size", where)
    common = dict(
        model_type=model_type,
        num_layers=_need(c, "num_hidden_layers", where),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or hidden // heads,
        num_experts=_need(c, "num_experts" if "num_experts" in c else "num_local_experts", where),
        moe_top_k=_need(c, "num_experts_per_tok", where),
        moe_ffn_hidden_size=_need(c, "moe_intermediate_size", where),
        vocab_size=_need(c, "vocab_size", where),
    )
    if model_type == "qwen3_moe":
        return Architecture(shared_expert_intermediate_size=0, **common)
    return Architecture(
        shared_expert_intermediate_size=c.get("shared_expert_intermediate_size", 0),
        linear_num_key_heads=_need(c, "linear_num_key_heads", where),
        linear_num_value_heads=_need(c, "linear_num_value_heads", where),
        linear_key_head_dim=_need(c, "linear_key_head_dim", where),
        linear_value_head_dim=_need(c, "linear_value_head_dim", where),
        linear_conv_kernel_dim=c.get("linear_conv_kernel_dim", 4),
        full_attention_interval=_full_attention_interval(c, where),
        mtp_num_layers=c.get("mtp_num_hidden_layers", 0),
        **common,
    )
