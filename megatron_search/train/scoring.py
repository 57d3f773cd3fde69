"""Turn finished rollouts into the reward inputs of RECIPE section 5 (`RolloutScores`).

Per rollout i of prompt item x:
- r_base: QA -> the final answer matches a reference answer (reward.answer_match); rubric chat ->
  every rubric passes. Rubrics are graded mechanically (data/rubric_checks.py) and, for the ones
  that are not mechanically checkable, by the rubric judge when one is given; without a judge such
  a rubric is an error (never a silent pass or fail).
- s: P_bar(x, y_i, y_ref) from the preference service, against the reference model's answer
  for the same prompt.
- c, e: tool calls and failed executions recorded by the agent loop.
- L, L_ref: generated tokens of the rollout and of the reference rollout it was compared with
  (the generation length the length penalty controls).
A rollout without a final answer (stopped by a length limit) has r_base = 0 and is scored
against the reference with an empty answer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch

from megatron_search.data.mix import MixItem
from megatron_search.data.rubric_checks import check_rubric
from megatron_search.rewards.answer import qa_reward, rubric_reward
from megatron_search.rewards.batch import RolloutScores
from megatron_search.rollout.types import Rollout


class PreferenceScorer(Protocol):
    def score(self, prompts: Sequence[list[dict]], answers: Sequence[str], ref_answers: Sequence[str]) -> torch.Tensor:
        """P_bar(x, y, y_ref) in [0, 1] for each triple."""


@dataclass(frozen=True)
class ReferenceAnswer:
    """The frozen reference model's rollout summary for one prompt (cached once per prompt)."""

    answer: str
    generated_tokens: int


RubricJudge = Callable[[str, str], bool]  # (rubric, response) -> pass


def base_reward(item: MixItem, answer: Optional[str], answer_match: str, judge: Optional[RubricJudge]) -> int:
    if item.kind == "qa":
        return qa_reward(answer, item.answers, mode=answer_match)
    if item.kind == "rubric":
        if answer is None:
            return 0
        passed = []
        for rubric in item.rubrics:
            ok = check_rubric(rubric, answer)
            if ok is None:
                if judge is None:
                    raise ValueError(f"item {item.id}: rubric {rubric!r} needs an LLM judge and none is configured")
                ok = judge(rubric, answer)
            passed.append(bool(ok))
        return rubric_reward(passed)
    raise ValueError(f"item {item.id}: unknown kind {item.kind!r}")


def preference_inputs(items: Sequence[MixItem], rollouts: Sequence[Rollout], references: Sequence[ReferenceAnswer]
                      ) -> tuple[list[list[dict]], list[str], list[str]]:
    """(prompts, answers, reference answers) for PreferenceScorer.score; no final answer scores as ''."""
    return [it.messages for it in items], [r.final_answer or "" for r in rollouts], [ref.answer for ref in references]


def score_rollouts(items: Sequence[MixItem], rollouts: Sequence[Rollout], group_ids: Sequence[int],
                   references: Sequence[ReferenceAnswer], s: torch.Tensor, answer_match: str,
                   judge: Optional[RubricJudge] = None) -> RolloutScores:
    """RolloutScores for rollouts[i] of prompt items[i] (items repeat within a group); `s` holds the
    preference scores of `preference_inputs(...)` (computed by the caller: the reward model may be
    sharded over ranks that must score together)."""
    n = len(rollouts)
    if not (len(items) == len(group_ids) == len(references) == n):
        raise ValueError(f"score_rollouts: {n} rollouts, {len(items)} items, {len(group_ids)} group ids, "
                         f"{len(references)} references")
    r_base = [base_reward(it, ro.final_answer, answer_match, judge) for it, ro in zip(items, rollouts)]
    return RolloutScores(
        group_ids=torch.as_tensor(list(group_ids), dtype=torch.long),
        r_base=torch.as_tensor(r_base, dtype=torch.long),
        s=torch.as_tensor(s, dtype=torch.float32).reshape(n),
        tool_calls=torch.as_tensor([ro.tool_calls for ro in rollouts], dtype=torch.long),
        failed_calls=torch.as_tensor([ro.failed_executions for ro in rollouts], dtype=torch.long),
        lengths=torch.as_tensor([ro.num_model_tokens for ro in rollouts], dtype=torch.float32),
        ref_lengths=torch.as_tensor([ref.generated_tokens for ref in references], dtype=torch.float32),
    )
