"""A scripted engine: a real `Engine` whose "model" is a function from input ids to output ids.

It drives the agent loop through exact multi-turn tool flows (a random tiny model rarely writes
a well-formed tool call) and stands in for a policy in tests of rewards/training code. It keeps
the engine contract: max_new_tokens truncation (finish length), stop ids kept in the output
(finish stop), deterministic per-token logprobs and routed experts that are a pure function of
the fed token and its position, so alignment can be checked exactly:

    logprob(token t at output step i)       = -(1 + t % 7) / 8 - i / 1000
    expert(position p, layer l, slot k)     = (ids[p] + 3 * p + l + k) % num_experts
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from megatron_search.rollout.engine.base import Engine, EngineError, ModelInfo
from megatron_search.rollout.engine.types import FinishReason, GenerateRequest, GenerateResult

Responder = Callable[[list[int]], list[int]]


def scripted_logprob(token: int, step: int) -> float:
    return -(1 + token % 7) / 8 - step / 1000


def scripted_experts(ids: list[int], start: int, stop: int, layers: int, top_k: int, num_experts: int) -> np.ndarray:
    """Rows [start, stop) of the scripted routing for sequence `ids`, shape [stop - start, layers, top_k]."""
    p = np.arange(start, stop)[:, None, None]
    tok = np.asarray(ids, dtype=np.int64)[start:stop][:, None, None]
    lk = np.arange(layers)[None, :, None] + np.arange(top_k)[None, None, :]
    return ((tok + 3 * p + lk) % num_experts).astype(np.int32)


class ScriptedEngine(Engine):
    """Replays `responder(input_ids)`; records every request and weight update it receives."""

    def __init__(self, responder: Responder, moe_shape: tuple[int, int] = (2, 2), num_experts: int = 4,
                 weight_version: str = "scripted-0"):
        self.responder = responder
        self.moe_shape = moe_shape
        self.num_experts = num_experts
        self.weight_version = weight_version
        self.requests: list[GenerateRequest] = []
        self.updates: list[list[str]] = []
        self.paused = False

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.paused:
            raise EngineError("scripted engine is paused")
        self.requests.append(request)
        script = [int(t) for t in self.responder(list(request.input_ids))]
        sp = request.sampling
        out, finish = [], FinishReason("length")
        for tok in script:
            out.append(tok)
            if tok in sp.stop_token_ids:
                finish = FinishReason("stop", matched=tok)
                break
            if len(out) >= sp.max_new_tokens:
                break
        if not out:
            raise EngineError("scripted engine: the responder returned no tokens")
        experts = None
        if request.return_routed_experts:
            full = list(request.input_ids) + out
            layers, top_k = self.moe_shape
            experts = scripted_experts(full, request.routed_experts_start_len, len(full) - 1, layers, top_k,
                                       self.num_experts)
        return GenerateResult(
            output_ids=out,
            output_logprobs=[scripted_logprob(t, i) for i, t in enumerate(out)] if request.return_logprob else None,
            finish_reason=finish, weight_version=self.weight_version, prompt_tokens=len(request.input_ids),
            routed_experts_NLK=experts,
        )

    async def update_weights_from_tensor(self, named_tensors, weight_version=None, flush_cache=True, abort_all_requests=False):
        self.updates.append([n for n, _ in named_tensors])
        if weight_version is not None:
            self.weight_version = str(weight_version)

    async def update_weights_from_disk(self, model_path, weight_version=None, abort_all_requests=False):
        self.updates.append([str(model_path)])
        if weight_version is not None:
            self.weight_version = str(weight_version)

    async def init_weights_update_group(self, *args, **kwargs) -> None:
        raise EngineError("scripted engine has no weights to receive over a process group")

    async def update_weights_from_distributed(self, *args, **kwargs) -> None:
        raise EngineError("scripted engine has no weights to receive over a process group")

    async def destroy_weights_update_group(self, group_name="weight_update_group") -> None:
        raise EngineError("scripted engine has no weight update group")

    async def begin_weight_update(self) -> None:
        return None

    async def end_weight_update(self) -> None:
        return None

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> None:
        self.weight_version = str(new_version)

    async def flush_cache(self) -> None:
        return None

    async def pause_generation(self, mode="abort") -> None:
        self.paused = True

    async def continue_generation(self) -> None:
        self.paused = False

    async def release_memory_occupation(self, tags=None) -> None:
        return None

    async def resume_memory_occupation(self, tags=None) -> None:
        return None

    async def health(self) -> bool:
        return True

    async def get_model_info(self) -> ModelInfo:
        return ModelInfo("scripted", self.weight_version, True, self.moe_shape[0], self.moe_shape[1])
