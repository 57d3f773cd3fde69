"""The preference service of the GRPO loop (RECIPE 5.1): s(tau_i) = P_bar(x, y_i, y_ref).

- `PreferenceService.score(prompts, answers, ref_answers) -> Tensor [n] in [0, 1]` satisfies
  rewards/preference.py's `PreferenceScorer`: each rollout's final answer is compared with the
  reference model's answer for the same prompt, in one batched, order-averaged pass of the RM
  (identical answers score exactly 0.5; distinct texts are scored once per call).
  In-process: it runs on the ranks holding the reward model (every rank of its layout calls it
  with the same arguments), CPU or GPU.
- `ReferenceCache`: the frozen reference engine's answers for each prompt, generated once (all
  (prompt, sample) pairs missing from the cache in one batched call) and kept in a JSONL file, keyed
  by a hash of the prompt's chat messages and the sample index k: GRPO compares rollout k of a group
  with reference sample k of its prompt (RECIPE 5.2: "the reference model's answer it was compared
  with"), so the group's reference lengths vary. The file is rewritten atomically after each addition;
  records written before samples existed are sample 0.
- `agent_reference_generator(agent)`: the generator that runs the search agent on the frozen
  reference engine (rollout/agent/loop.py) and keeps each rollout's final answer and its length.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from megatron_search.data.jsonl import write_jsonl
from megatron_search.rewards.preference import ReferenceAnswer
from megatron_search.rollout.agent.loop import AgentTask

# (prompts, sample indices) -> one reference answer per pair; sample k is seeded apart from the others.
ReferenceGenerator = Callable[[list[list[dict]], list[int]], list[ReferenceAnswer]]


class PreferenceService:
    """P_bar of answers against reference answers on a reward model (rm.scorer.RMScorer)."""

    def __init__(self, scorer):
        self.scorer = scorer

    def score(self, prompts: Sequence[list[dict]], answers: Sequence[str], ref_answers: Sequence[str]) -> torch.Tensor:
        """P_bar(x_i, answers[i], ref_answers[i]) in [0, 1], float32 [n]."""
        n = len(answers)
        if not (len(prompts) == n == len(ref_answers)):
            raise ValueError(f"PreferenceService.score: {len(prompts)} prompts, {n} answers, "
                             f"{len(ref_answers)} reference answers")
        for i, (a, r) in enumerate(zip(answers, ref_answers)):
            if not isinstance(a, str) or not isinstance(r, str):
                raise ValueError(f"PreferenceService.score: item {i}: answer and reference answer must be strings "
                                 f"(use '' for a rollout without a final answer)")
        if n == 0:
            return torch.zeros(0, dtype=torch.float32)
        return self.scorer.p_bar([list(p) for p in prompts], list(answers), list(ref_answers)).float()


def prompt_key(messages: Sequence[dict]) -> str:
    """Stable key of a prompt: sha256 of its chat messages as canonical JSON."""
    blob = json.dumps(list(messages), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ReferenceCache:
    """Reference answers per (prompt, sample index), generated once by `generate` and persisted at `path`."""

    def __init__(self, path: str | Path, generate: ReferenceGenerator, write: bool = True):
        self.path, self.generate, self.write = Path(path), generate, write
        self._entries: dict[tuple[str, int], ReferenceAnswer] = {}
        self.generated = 0  # (prompt, sample) pairs this process generated (not read from the file)
        if self.path.is_file():
            self._load()

    def _load(self) -> None:
        with open(self.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    sample = int(d.get("sample", 0))
                    if sample < 0:
                        raise ValueError(f"sample index {sample} < 0")
                    self._entries[(d["key"], sample)] = ReferenceAnswer(str(d["answer"]), int(d["generated_tokens"]))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
                    raise ValueError(f"{self.path}:{lineno}: not a reference-answer record ({e})") from None

    def __len__(self) -> int:
        return len(self._entries)

    def _save(self) -> None:
        write_jsonl(self.path, ({"key": k, "sample": i, "answer": v.answer, "generated_tokens": v.generated_tokens}
                                for (k, i), v in self._entries.items()))

    def get(self, prompts: Sequence[list[dict]], samples: Optional[Sequence[int]] = None) -> list[ReferenceAnswer]:
        """Reference sample samples[i] (default 0) of each prompt; the missing ones are generated in one call."""
        samples = [0] * len(prompts) if samples is None else [int(k) for k in samples]
        if len(samples) != len(prompts):
            raise ValueError(f"ReferenceCache.get: {len(prompts)} prompts, {len(samples)} sample indices")
        if any(k < 0 for k in samples):
            raise ValueError(f"ReferenceCache.get: sample indices must be >= 0, got {min(samples)}")
        keys = [(prompt_key(p), k) for p, k in zip(prompts, samples)]
        missing: dict[tuple[str, int], list[dict]] = {}
        for key, p in zip(keys, prompts):
            if key not in self._entries and key not in missing:
                missing[key] = list(p)
        if missing:
            made = self.generate(list(missing.values()), [k for _, k in missing])
            if len(made) != len(missing):
                raise ValueError(f"reference generator returned {len(made)} answers for {len(missing)} prompts")
            for k, ref in zip(missing, made):
                if not isinstance(ref, ReferenceAnswer):
                    raise TypeError(f"reference generator must return ReferenceAnswer, got {type(ref).__name__}")
                self._entries[k] = ref
            self.generated += len(missing)
            if self.write:
                self._save()
        return [self._entries[k] for k in keys]


def reference_seed(seed: Optional[int], sample: int) -> Optional[int]:
    """Sampling seed of reference sample k: sample 0 keeps `seed` (caches made before samples stay valid)."""
    return seed if seed is None or sample == 0 else seed + 1_000_003 * sample


def agent_reference_generator(agent, seed: Optional[int] = None, progress: bool = False) -> ReferenceGenerator:
    """Reference answers from the search agent on the frozen reference engine (rollout/agent/loop.py).

    A rollout without a final answer (length stop) gives the empty answer, as in train/scoring.py.
    """
    def generate(prompts: list[list[dict]], samples: list[int]) -> list[ReferenceAnswer]:
        tasks = [AgentTask(messages=list(p), seed=reference_seed(seed, k)) for p, k in zip(prompts, samples)]
        rollouts = asyncio.run(agent.run_many(tasks, progress=progress, desc="reference rollouts"))
        return [ReferenceAnswer(r.final_answer or "", int(r.num_model_tokens)) for r in rollouts]

    return generate
