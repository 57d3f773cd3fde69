"""Turn finished rollouts into the reward inputs of RECIPE section 5 (`RolloutScores`).

Per rollout i of prompt item x:
- r_base: QA -> the final answer matches a reference answer (reward.answer_match); rubric chat ->
  every rubric passes. The caller passes each rubric rollout's verdicts from the rubric judge
  (data/rubrics.RubricJudge: mechanical checks first, the LLM judge for the rest; reward.rubric_judge);
  without them a rubric is graded mechanically (data/rubric_checks.py), and one that is not
  mechanically checkable is an error (never a silent pass or fail).
- s: P_bar(x, y_i, y_ref) from the preference service, against the reference model's answer
  for the same prompt.
- c, e: tool calls and failed executions recorded by the agent loop.
- L, L_ref: generated tokens of the rollout and of the reference rollout it was compared with
  (the generation length the length penalty controls).
A rollout without a final answer (stopped by a length limit) has r_base = 0 and is scored
against the reference with an empty answer.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_search.data.mix import MixItem
from megatron_search.data.rubric_checks import check_rubric
from megatron_search.rewards.answer import qa_reward, rubric_reward
from megatron_search.rewards.batch import RolloutScores
from megatron_search.rewards.preference import ReferenceAnswer
from megatron_search.rollout.engine.types import Rollout


def base_reward(item: MixItem, answer: Optional[str], answer_match: str,
                verdicts: Optional[Sequence[bool]] = None) -> int:
    """r_base of one rollout; `verdicts`: the judge's per-rubric verdicts of a rubric item's answer."""
    if item.kind == "qa":
        return qa_reward(answer, item.answers, mode=answer_match)
    if item.kind == "rubric":
        if answer is None:
            return 0
        if verdicts is not None:
            if len(verdicts) != len(item.rubrics):
                raise ValueError(f"item {item.id}: {len(verdicts)} verdicts for {len(item.rubrics)} rubrics")
            return rubric_reward([bool(v) for v in verdicts])
        passed = []
        for rubric in item.rubrics:
            ok = check_rubric(rubric, answer)
            if ok is None:
                raise ValueError(f"item {item.id}: rubric {rubric!r} needs an LLM judge and none is configured "
                                 f"(reward.rubric_judge)")
            passed.append(bool(ok))
        return rubric_reward(passed)
    raise ValueError(f"item {item.id}: unknown kind {item.kind!r}")


def rubric_jobs(items: Sequence[MixItem], rollouts: Sequence[Rollout]) -> tuple[list[int], list[tuple]]:
    """Rollouts to judge (rubric items with a final answer) and their (messages, answer, rubrics) jobs."""
    index = [i for i, (it, ro) in enumerate(zip(items, rollouts)) if it.kind == "rubric" and ro.final_answer is not None]
    return index, [(items[i].messages, rollouts[i].final_answer, list(items[i].rubrics)) for i in index]


def preference_inputs(items: Sequence[MixItem], rollouts: Sequence[Rollout], references: Sequence[ReferenceAnswer]
                      ) -> tuple[list[list[dict]], list[str], list[str]]:
    """(prompts, answers, reference answers) for rewards.preference.PreferenceScorer.score; no final answer
    scores as ''."""
    return [it.messages for it in items], [r.final_answer or "" for r in rollouts], [ref.answer for ref in references]


def score_rollouts(items: Sequence[MixItem], rollouts: Sequence[Rollout], group_ids: Sequence[int],
                   references: Sequence[ReferenceAnswer], s: torch.Tensor, answer_match: str,
                   rubric_verdicts: Optional[dict[int, Sequence[bool]]] = None) -> RolloutScores:
    """RolloutScores for rollouts[i] of prompt items[i] (items repeat within a group); `s` holds the
    preference scores of `preference_inputs(...)` (computed by the caller: the reward model may be
    sharded over ranks that must score together); `rubric_verdicts[i]`: the judge's verdicts for
    rollout i (rubric items, see rubric_jobs)."""
    n = len(rollouts)
    if not (len(items) == len(group_ids) == len(references) == n):
        raise ValueError(f"score_rollouts: {n} rollouts, {len(items)} items, {len(group_ids)} group ids, "
                         f"{len(references)} references")
    verdicts = rubric_verdicts or {}
    r_base = [base_reward(it, ro.final_answer, answer_match, verdicts.get(i)) for i, (it, ro) in
              enumerate(zip(items, rollouts))]
    return RolloutScores(
        group_ids=torch.as_tensor(list(group_ids), dtype=torch.long),
        r_base=torch.as_tensor(r_base, dtype=torch.long),
        s=torch.as_tensor(s, dtype=torch.float32).reshape(n),
        tool_calls=torch.as_tensor([ro.tool_calls for ro in rollouts], dtype=torch.long),
        failed_calls=torch.as_tensor([ro.failed_executions for ro in rollouts], dtype=torch.long),
        lengths=torch.as_tensor([ro.num_model_tokens for ro in rollouts], dtype=torch.float32),
        ref_lengths=torch.as_tensor([ref.generated_tokens for ref in references], dtype=torch.float32),
    )
