"""Who holds device memory at each moment of a GRPO run, and what that costs at a config's real sizes.

One vocabulary of holders serves both sides: the run writes a `Ledger` (the offloader, the colocated cycle's
engine calls, the weight push and the training step report arrivals and departures; the driver's GPU is
recorded, every GPU follows the same order), and the planner prices a sequence of moments with the sizes of a
layout (`holder_sizes`). `COLOCATED_ORDER` is the order the colocated loop goes through (train/grpo_run.py,
train/grpo_colocate.py); tests/test_residency.py checks that a CPU run records exactly these moments and that
priced at the 397B and 122B configs none exceeds the GPU. docs/PLANNER.md, "Residency".
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

POLICY_PARAMS, POLICY_GRADS, POLICY_OPTIMIZER, POLICY_ACTIVATIONS = (
    "policy.params", "policy.grads", "policy.optimizer", "policy.activations")
RM_PARAMS, RM_ACTIVATIONS = "reward_model.params", "reward_model.activations"
EXPORT_BUCKETS = "export.buckets"
ENGINE_WEIGHTS, ENGINE_KV_CACHE = "engine.weights", "engine.kv_cache"
HOLDERS = (POLICY_PARAMS, POLICY_GRADS, POLICY_OPTIMIZER, POLICY_ACTIVATIONS, RM_PARAMS, RM_ACTIVATIONS,
           EXPORT_BUCKETS, ENGINE_WEIGHTS, ENGINE_KV_CACHE)
ENGINE_TAGS = {"weights": ENGINE_WEIGHTS, "kv_cache": ENGINE_KV_CACHE}  # SGLang's memory tags


@dataclass(frozen=True)
class Moment:
    name: str
    holders: frozenset


_TRAINER = frozenset({POLICY_PARAMS, POLICY_GRADS, POLICY_OPTIMIZER})
_ENGINE = frozenset({ENGINE_WEIGHTS, ENGINE_KV_CACHE})
OPTIONAL = {"push: engine restarted"}  # moments a run passes through only when something happens
_PUSH = [Moment("push: engine weights back", frozenset({POLICY_PARAMS, ENGINE_WEIGHTS})),
         # only when an engine came back since its release (a restart holds its whole memory until told)
         Moment("push: engine restarted", frozenset({POLICY_PARAMS}) | _ENGINE),
         Moment("push", frozenset({POLICY_PARAMS, ENGINE_WEIGHTS, EXPORT_BUCKETS})),
         Moment("push done: kv cache back", _ENGINE)]
COLOCATED_ORDER: list[Moment] = [
    Moment("start: engines up", _ENGINE),
    Moment("start: engines released", frozenset()),
    Moment("start: trainer built", _TRAINER | {RM_PARAMS}),  # also a resume's checkpoint load
    *_PUSH,  # the initial policy
    Moment("rollout", _ENGINE),
    Moment("scoring", frozenset({RM_PARAMS, RM_ACTIVATIONS})),
    Moment("train", _TRAINER | {POLICY_ACTIVATIONS}),
    Moment("checkpoint save", _TRAINER),  # after the update; a stop during rollouts releases the engines first
    *_PUSH,
]


class Ledger:
    """Holders resident now, and the moments recorded so far (appended to `path` as JSON lines, when given)."""

    def __init__(self, path: Optional[Path] = None):
        self.path = Path(path) if path else None
        self.resident: set[str] = set()
        self.moments: list[Moment] = []

    def arrive(self, *holders: str) -> None:
        self.resident |= set(_known(holders))

    def leave(self, *holders: str) -> None:
        self.resident -= set(_known(holders))

    def moment(self, name: str, step: Optional[int] = None) -> Moment:
        m = Moment(name, frozenset(self.resident))
        self.moments.append(m)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "moment": name, "holders": sorted(m.holders)}) + "\n")
        return m


def _known(holders: Iterable[str]) -> Iterable[str]:
    for h in holders:
        if h not in HOLDERS:
            raise ValueError(f"residency: unknown holder {h!r}; one of {HOLDERS}")
        yield h


def read_ledger(path: Path) -> list[Moment]:
    return [Moment(r["moment"], frozenset(r["holders"])) for r in
            (json.loads(line) for line in Path(path).read_text().splitlines() if line.strip())]


def holder_sizes(stage, rollout, engine_fraction_bytes: float, bucket_bytes: float) -> dict[str, float]:
    """Bytes per GPU of each holder on the GPU of `stage` (plan.memory.StageMemory; `rollout`: RolloutMemory).
    The reward model has the policy's backbone and layout (RECIPE 1) and its scoring activations are bounded by
    the training ones (an overestimate: no backward, no vocabulary logits); SGLang holds mem_fraction_static x
    GPU memory, weights first and the KV cache in the rest; a push stages two buckets."""
    return {POLICY_PARAMS: stage.weights, POLICY_GRADS: stage.grads, POLICY_OPTIMIZER: stage.optimizer,
            POLICY_ACTIVATIONS: stage.activations, RM_PARAMS: stage.weights, RM_ACTIVATIONS: stage.activations,
            EXPORT_BUCKETS: 2 * bucket_bytes, ENGINE_WEIGHTS: rollout.weights,
            ENGINE_KV_CACHE: max(engine_fraction_bytes - rollout.weights, 0.0)}


@dataclass
class PricedMoment:
    moment: Moment
    stage: int
    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def price(moments: Iterable[Moment], sizes_by_stage: dict[int, dict[str, float]]) -> list[PricedMoment]:
    """Every moment on every stage's GPU, priced."""
    return [PricedMoment(m, s, {h: sizes[h] for h in sorted(m.holders)})
            for m in moments for s, sizes in sizes_by_stage.items()]
