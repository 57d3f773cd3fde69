"""The rollout engine interface: what the agent loop and the weight sync need from an engine.

Two implementations speak it: `SGLangClient` (HTTP, for SGLang servers and for the local CPU
engine server, which exposes the same endpoints) and `LocalEngine` (in process). Weights are
addressed by Hugging Face parameter name, as SGLang's update endpoints expect.
"""
from __future__ import annotations

import base64
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import numpy as np
import torch

from megatron_search.rollout.engine.types import GenerateRequest, GenerateResult

PauseMode = Literal["abort", "retract", "in_place"]
MemoryTag = Literal["weights", "kv_cache"]

LOCAL_ENGINE_NAME = "megatron-search-local-cpu"  # `engine` field of the local server's /get_model_info


class EngineError(RuntimeError):
    """The engine refused or failed a request; the message says which endpoint and why."""


class EngineUnreachable(EngineError):
    """No complete answer came back: connection refused, reset or dropped, or a body cut short."""


class EngineTimeout(EngineError):
    """The engine did not answer within the client's request timeout."""


class MalformedReply(EngineError):
    """The engine answered 200 with a body that is not a valid reply (not JSON, wrong types, NaN logprobs...)."""


@dataclass(frozen=True)
class ModelInfo:
    model_path: str
    weight_version: str
    is_generation: bool = True
    num_moe_layers: int = 0
    moe_top_k: int = 0


class Engine(ABC):
    """Async rollout engine. All methods are coroutines; safe to call concurrently."""

    @abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Sample a continuation of `request.input_ids` (token in, token out)."""

    @abstractmethod
    async def update_weights_from_tensor(
        self,
        named_tensors: Sequence[tuple[str, torch.Tensor]],
        weight_version: Optional[str] = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> None:
        """Overwrite parameters by HF name with the given tensors."""

    @abstractmethod
    async def update_weights_from_disk(
        self, model_path: str, weight_version: Optional[str] = None, abort_all_requests: bool = False
    ) -> None:
        """Reload parameters from an HF safetensors directory."""

    @abstractmethod
    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "gloo",
    ) -> None:
        """Join a process group in which the trainer (rank 0) broadcasts weights."""

    @abstractmethod
    async def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group", weight_version: Optional[str] = None,
        flush_cache: bool = True, abort_all_requests: bool = False, load_format: Optional[str] = None,
    ) -> None:
        """Receive the announced tensors from rank 0 of the group and load them: one broadcast per name
        (load_format None) or one broadcast of their bytes back to back ("flattened_bucket", as SGLang)."""

    @abstractmethod
    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Leave the weight-update group."""

    @abstractmethod
    async def begin_weight_update(self) -> None:
        """Open a weight-update session (SGLang >= 0.5.23 takes tensor and distributed updates only inside one)."""

    @abstractmethod
    async def end_weight_update(self) -> None:
        """Close the session `begin_weight_update` opened."""

    @abstractmethod
    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> None:
        """Set the reported weight version without loading anything."""

    @abstractmethod
    async def flush_cache(self) -> None:
        """Drop cached prefixes (KV/state) so no old-weight cache is reused. Refused unless the engine is
        idle (no running request; queued ones only while paused), as SGLang refuses it."""

    @abstractmethod
    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Stop stepping; `abort` also finishes in-flight requests with finish_reason abort."""

    @abstractmethod
    async def continue_generation(self) -> None:
        """Resume after `pause_generation`."""

    @abstractmethod
    async def release_memory_occupation(self, tags: Optional[Sequence[MemoryTag]] = None) -> None:
        """Free weights and/or KV cache memory (colocated training); None means both."""

    @abstractmethod
    async def resume_memory_occupation(self, tags: Optional[Sequence[MemoryTag]] = None) -> None:
        """Re-allocate what `release_memory_occupation` freed (weights must then be updated)."""

    @abstractmethod
    async def health(self) -> bool:
        """True when the engine answers and can generate."""

    @abstractmethod
    async def get_model_info(self) -> ModelInfo:
        """Model path, current weight version and MoE routing shape."""

    async def close(self) -> None:
        """Release connections or background tasks."""


# --- routed experts wire format (SGLang: base64 of little-endian int32, C order) -------------

def encode_routed_experts(experts_NLK: np.ndarray) -> str:
    """Base64 of int32 little-endian [n, layers, top_k], SGLang's `meta_info.routed_experts`."""
    arr = np.ascontiguousarray(experts_NLK, dtype="<i4")
    return base64.b64encode(arr.tobytes()).decode("ascii")


def decode_routed_experts(data: str, num_layers: int, top_k: int, expected_rows: Optional[int] = None) -> np.ndarray:
    """Inverse of `encode_routed_experts`; checks the size against layers * top_k (and rows)."""
    try:
        raw = base64.b64decode(data.encode("ascii"), validate=True)
    except (AttributeError, ValueError) as e:  # not a string, not ASCII, not base64
        raise MalformedReply(f"routed_experts: not a base64 string ({type(e).__name__})") from None
    if len(raw) % 4:
        raise MalformedReply(f"routed_experts: {len(raw)} bytes are not a whole number of int32 values")
    flat = np.frombuffer(raw, dtype="<i4")
    per_row = num_layers * top_k
    if per_row <= 0 or flat.size % per_row:
        raise MalformedReply(
            f"routed_experts: {flat.size} int32 values do not split into rows of {num_layers} layers x top_k {top_k}"
        )
    out = flat.reshape(-1, num_layers, top_k).astype(np.int32)
    if expected_rows is not None and out.shape[0] != expected_rows:
        raise MalformedReply(f"routed_experts: got {out.shape[0]} rows, expected {expected_rows} (seqlen - 1 - start_len)")
    return out
