"""Typed records that cross the rollout boundary: engine requests/responses and the `Rollout`.

Token-in, token-out: every record carries token ids, never text that would have to be
re-tokenised. Shapes in names: `routed_experts_NLK` is [tokens, MoE layers, top_k] int32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np

FinishType = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """SGLang `sampling_params` subset this project uses.

    temperature 0 means greedy. `stop_token_ids` end generation and are kept in the output
    (the trainer must learn to emit them). `seed` maps to SGLang's `sampling_seed`.
    """

    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"sampling_params.temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def to_json(self) -> dict:
        out = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
        }
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out

    @classmethod
    def from_json(cls, d: dict) -> "SamplingParams":
        """From SGLang's `sampling_params` JSON; a wrong type or value is a ValueError naming the key."""
        known = {"max_new_tokens", "temperature", "top_p", "stop_token_ids", "ignore_eos", "sampling_seed"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"sampling_params: unsupported keys {unknown} (supported: {sorted(known)})")

        def get(key, kind, default):
            v = d.get(key)
            if v is None:
                return default
            if kind is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, kind) or (kind in (int, float) and isinstance(v, bool)):
                raise ValueError(f"sampling_params.{key} must be {kind.__name__}, got {type(v).__name__}")
            return v

        stops = get("stop_token_ids", list, [])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in stops):
            raise ValueError("sampling_params.stop_token_ids must be a list of integers")
        seed = get("sampling_seed", int, None)
        if seed is not None and not 0 <= seed < 1 << 63:
            raise ValueError(f"sampling_params.sampling_seed must be in [0, 2**63), got {seed}")
        return cls(
            max_new_tokens=get("max_new_tokens", int, cls.max_new_tokens),
            temperature=get("temperature", float, cls.temperature),
            top_p=get("top_p", float, cls.top_p),
            stop_token_ids=tuple(stops),
            ignore_eos=get("ignore_eos", bool, False),
            seed=seed,
        )


@dataclass(frozen=True)
class GenerateRequest:
    """One `/generate` call from token ids.

    Routed experts, when asked, cover positions [routed_experts_start_len, seqlen - 1) of the
    whole sequence (prompt + output), as SGLang reports them: the last sampled token never
    went through the model.
    """

    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = True
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    rid: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError("input_ids must not be empty")
        if not 0 <= self.routed_experts_start_len <= len(self.input_ids):
            raise ValueError(
                f"routed_experts_start_len must be in [0, {len(self.input_ids)}] (the prompt length), "
                f"got {self.routed_experts_start_len}"
            )


@dataclass(frozen=True)
class FinishReason:
    """SGLang's `meta_info.finish_reason`: stop (matched token), length, or abort."""

    type: FinishType
    matched: Optional[int] = None
    message: Optional[str] = None

    def to_json(self) -> dict:
        out: dict = {"type": self.type}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        return out

    @classmethod
    def from_json(cls, d) -> "FinishReason":
        if d is None:
            return cls("abort", message="engine returned no finish_reason")
        if isinstance(d, str):  # some SGLang versions/paths send a bare string
            return cls(d if d in ("stop", "length", "abort") else "abort", message=None if d in ("stop", "length") else d)
        if not isinstance(d, dict) or not isinstance(d.get("type"), str):
            raise ValueError(f"finish_reason must be a string or an object with a string 'type', got {d!r:.100}")
        kind, matched, message = d["type"], d.get("matched"), d.get("message")
        message = None if message is None else str(message)
        if kind not in ("stop", "length", "abort"):  # an unknown kind is treated like an abort, as a bare string is
            kind, message = "abort", f"finish_reason type {kind!r}" + (f": {message}" if message else "")
        return cls(kind, matched=matched if isinstance(matched, int) and not isinstance(matched, bool) else None,
                   message=message)


@dataclass
class GenerateResult:
    """The engine's answer: output ids, their fp32 sampling logprobs, optional routed experts."""

    output_ids: list[int]
    output_logprobs: Optional[list[float]]
    finish_reason: FinishReason
    weight_version: str
    prompt_tokens: int
    cached_tokens: int = 0
    routed_experts_NLK: Optional[np.ndarray] = None


@dataclass
class Segment:
    """A contiguous span of the transcript: who produced it and with which weights."""

    start: int
    end: int
    source: Literal["prompt", "model", "tool"]
    weight_version: Optional[str] = None


@dataclass
class Rollout:
    """One finished multi-turn search-agent episode, ready for rewards and training.

    Invariants: len(token_ids) == len(logprobs) == len(loss_mask); loss_mask is 1 exactly on
    model-sampled tokens; logprobs are the engine's sampling logprobs there and 0.0 elsewhere;
    routed_experts_NLK, when present, has len(token_ids) - 1 rows (row t = experts used when
    token t was fed to the model).
    """

    prompt_len: int
    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    segments: list[Segment]
    tool_calls: int
    failed_executions: int
    broken_calls: dict[str, int]
    final_answer: Optional[str]
    stop_reason: str
    routed_experts_NLK: Optional[np.ndarray] = None
    messages: list[dict] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    search_failures: dict[str, int] = field(default_factory=dict)  # failed executions by class (search/tool.py)

    @property
    def num_model_tokens(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def weight_versions(self) -> list[str]:
        """Distinct weight versions of the model segments, in order of first use."""
        seen: list[str] = []
        for s in self.segments:
            if s.source == "model" and s.weight_version is not None and s.weight_version not in seen:
                seen.append(s.weight_version)
        return seen

    def check(self) -> None:
        """Raise ValueError naming the first broken invariant (used by tests and the trainer's intake)."""
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.loss_mask) != n:
            raise ValueError(f"rollout: {n} ids but {len(self.logprobs)} logprobs and {len(self.loss_mask)} mask entries")
        if not all(math.isfinite(lp) for lp in self.logprobs):
            raise ValueError("rollout: logprobs must be finite (an engine sent NaN or infinity)")
        if self.segments and (self.segments[0].start != 0 or self.segments[-1].end != n):
            raise ValueError("rollout: segments must cover the transcript from 0 to len(token_ids)")
        for a, b in zip(self.segments, self.segments[1:]):
            if a.end != b.start:
                raise ValueError(f"rollout: segments not contiguous at {a.end} / {b.start}")
        for s in self.segments:
            want = 1 if s.source == "model" else 0
            if any(m != want for m in self.loss_mask[s.start : s.end]):
                raise ValueError(f"rollout: loss mask of the {s.source} segment [{s.start}, {s.end}) must be {want}")
        if self.routed_experts_NLK is not None and self.routed_experts_NLK.shape[0] != n - 1:
            raise ValueError(
                f"rollout: routed experts have {self.routed_experts_NLK.shape[0]} rows, expected {n - 1}"
            )
