"""The RL prompt mix (RECIPE 4.3): 90% verifiable QA / 10% rubric chat, dataset-level reweighting.

Deterministic and resumable. Which dataset a draw comes from follows smooth weighted round-robin:
after n draws each dataset has been drawn round(w * n) times up to one, so the 90/10 ratio holds
over every window, not only in expectation (rubric tasks, easier early on, cannot bunch up). Inside
a dataset, items come in a fresh seeded permutation per epoch. The whole state is a step counter plus
per-dataset counters (`state_dict` / `load_state_dict`, JSON-serialisable), so a resumed run draws
exactly the prompts an uninterrupted run would have.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from .jsonl import DataError
from .records import QARecord


@dataclass
class MixItem:
    """One RL prompt. kind "qa": `answers` are the references; kind "rubric": `rubrics` are the checks."""

    id: str
    dataset: str
    kind: str
    messages: list[dict]
    answers: Optional[list[str]] = None
    rubrics: Optional[list[str]] = None

    def to_dict(self) -> dict:
        d = {"id": self.id, "dataset": self.dataset, "kind": self.kind, "messages": self.messages}
        if self.answers is not None:
            d["answers"] = self.answers
        if self.rubrics is not None:
            d["rubrics"] = self.rubrics
        return d


def qa_item(rec: QARecord, dataset: str = "qa") -> MixItem:
    """A QA record as a prompt in the augmented format (format instruction appended when present)."""
    return MixItem(rec.id, dataset, "qa", [{"role": "user", "content": rec.prompt}], answers=list(rec.answers))


def rubric_item(row: dict, dataset: str = "rubric") -> MixItem:
    """A rubric-chat row {id, messages, rubrics, ...} (the conversation up to the user turn to answer)."""
    rid = row.get("id", "?")
    if not isinstance(row.get("messages"), list) or not row["messages"]:
        raise DataError(f"rubric row {rid}: 'messages' must be a non-empty list")
    rubrics = row.get("rubrics")
    if not isinstance(rubrics, list) or not rubrics or not all(isinstance(r, str) and r.strip() for r in rubrics):
        raise DataError(f"rubric row {rid}: 'rubrics' must be a non-empty list of strings")
    return MixItem(str(rid), dataset, "rubric", row["messages"], rubrics=list(rubrics))


def _perm(n: int, seed: int, name: str, epoch: int) -> list[int]:
    key = hashlib.sha256(f"{seed}:{name}:{epoch}".encode()).digest()
    order = list(range(n))
    random.Random(int.from_bytes(key[:8], "big")).shuffle(order)
    return order


class MixSampler:
    def __init__(self, datasets: dict[str, list[MixItem]], weights: dict[str, float], seed: int = 0):
        missing = sorted(set(weights) - set(datasets))
        if missing:
            raise ValueError(f"data.mix names dataset(s) {missing} that were not provided (have {sorted(datasets)})")
        self.names = sorted(n for n, w in weights.items() if w > 0)
        if not self.names:
            raise ValueError("data.mix: every weight is zero")
        empty = [n for n in self.names if not datasets[n]]
        if empty:
            raise ValueError(f"data.mix: dataset(s) {empty} have a positive weight but no items")
        if any(w < 0 for w in weights.values()):
            raise ValueError(f"data.mix: weights must be >= 0, got {weights}")
        total = sum(weights[n] for n in self.names)
        self.weights = {n: weights[n] / total for n in self.names}
        self.datasets = datasets
        self.seed = seed
        self.step = 0
        self.counts = {n: 0 for n in self.names}
        self._credit = {n: 0.0 for n in self.names}
        self._perms: dict[tuple[str, int], list[int]] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "counts": dict(self.counts), "credit": dict(self._credit), "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed or sorted(state["counts"]) != self.names:
            raise ValueError("mix state was saved with a different seed or dataset list")
        self.step, self.counts, self._credit = state["step"], dict(state["counts"]), dict(state["credit"])

    def _pick_dataset(self) -> str:
        # smooth weighted round-robin: everyone earns its weight, the richest pays 1 and is drawn
        for n in self.names:
            self._credit[n] += self.weights[n]
        best = max(self.names, key=lambda n: (self._credit[n], -self.names.index(n)))
        self._credit[best] -= 1.0
        return best

    def next(self) -> MixItem:
        name = self._pick_dataset()
        items = self.datasets[name]
        epoch, pos = divmod(self.counts[name], len(items))
        key = (name, epoch)
        if key not in self._perms:
            self._perms = {k: v for k, v in self._perms.items() if k[0] != name}
            self._perms[key] = _perm(len(items), self.seed, name, epoch)
        self.counts[name] += 1
        self.step += 1
        return items[self._perms[key][pos]]

    def take(self, n: int) -> list[MixItem]:
        return [self.next() for _ in range(n)]

    def __iter__(self) -> Iterator[MixItem]:
        while True:
            yield self.next()
