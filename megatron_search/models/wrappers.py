"""The GPTModel under Megatron's wrappers (DDP, Float16Module): what weights/, models/routing_replay.py
and the policy step read the config and modules from."""
from __future__ import annotations

import torch


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers down to the GPTModel."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
