"""Rollouts -> reward inputs: r_base for QA and rubric items, lengths, preference, counts."""
import pytest
import torch

from megatron_search.data.mix import MixItem
from megatron_search.rewards.preference import ReferenceAnswer
from megatron_search.rollout.engine.types import Rollout, Segment
from megatron_search.train.scoring import preference_inputs, score_rollouts


def ro(answer, model_tokens, calls=0, failed=0):
    n = 2 + model_tokens
    return Rollout(prompt_len=2, token_ids=list(range(n)), logprobs=[0.0] * n, loss_mask=[0, 0] + [1] * model_tokens,
                   segments=[Segment(0, 2, "prompt"), Segment(2, n, "model", "v")], tool_calls=calls,
                   failed_executions=failed, broken_calls={}, final_answer=answer, stop_reason="answer")


class LengthRatioScorer:
    """A test double: prefers the shorter answer, so the expected s is known in the test."""

    def __init__(self):
        self.calls = []

    def score(self, prompts, answers, ref_answers):
        self.calls.append((list(answers), list(ref_answers)))
        return torch.tensor([len(r) / (len(a) + len(r)) for a, r in zip(answers, ref_answers)])


def test_qa_and_rubric_items():
    qa = MixItem("q1", "qa", "qa", [{"role": "user", "content": "Who wrote X?"}], answers=["Ada Quill"])
    rub = MixItem("r1", "rubric", "rubric", [{"role": "user", "content": "Fix: u r late"}],
                  rubrics=['The answer contains "you"', 'The answer has no "u"'])
    items = [qa, qa, rub, rub]
    rollouts = [ro("It was Ada Quill.", 5, calls=2, failed=1), ro("Bob", 3, calls=1), ro("you are late", 4),
                ro("u are late", 4), ]
    refs = [ReferenceAnswer("Ada", 6)] * 2 + [ReferenceAnswer("you're late", 7)] * 2
    scorer = LengthRatioScorer()
    s = score_rollouts(items, rollouts, [0, 0, 1, 1], refs, scorer.score(*preference_inputs(items, rollouts, refs)),
                       "substring")
    assert s.r_base.tolist() == [1, 0, 1, 0]
    assert s.tool_calls.tolist() == [2, 1, 0, 0] and s.failed_calls.tolist() == [1, 0, 0, 0]
    assert s.lengths.tolist() == [5, 3, 4, 4] and s.ref_lengths.tolist() == [6, 6, 7, 7]
    assert torch.allclose(s.s, torch.tensor([3 / 20, 3 / 6, 11 / 23, 11 / 21]))
    assert scorer.calls[0][1] == ["Ada", "Ada", "you're late", "you're late"]


def test_missing_answer_scores_zero_and_unjudgeable_rubric_is_an_error():
    qa = MixItem("q", "qa", "qa", [], answers=["Zed"])
    s = score_rollouts([qa], [ro(None, 3)], [0], [ReferenceAnswer("Zed", 1)], torch.tensor([0.5]), "exact")
    assert s.r_base.tolist() == [0]
    rub = MixItem("r", "rubric", "rubric", [], rubrics=["The tone is warm and friendly"])
    with pytest.raises(ValueError, match=r"needs an LLM judge and none is configured \(reward.rubric_judge\)"):
        score_rollouts([rub], [ro("hi", 1)], [0], [ReferenceAnswer("x", 1)], torch.tensor([0.5]), "exact")
    judged = score_rollouts([rub, rub], [ro("hi", 1), ro("hello", 1)], [0, 0], [ReferenceAnswer("x", 1)] * 2,
                            torch.tensor([0.5, 0.5]), "exact", rubric_verdicts={0: [True], 1: [False]})
    assert judged.r_base.tolist() == [1, 0]
    with pytest.raises(ValueError, match="2 verdicts for 1 rubrics"):
        score_rollouts([rub], [ro("hi", 1)], [0], [ReferenceAnswer("x", 1)], torch.tensor([0.5]), "exact",
                       rubric_verdicts={0: [True, True]})


def test_each_rollout_is_anchored_on_its_own_reference_and_every_length_branch_fires():
    """One reference answer per rollout (rollout k vs reference sample k): the group's reference lengths
    differ, so the verbose-winner branch can fire (with one shared reference it never could: a winner
    longer than the reference was always above the hard cap)."""
    from megatron_search.rewards.length_penalty import anchored_length_penalty

    qa = MixItem("q", "qa", "qa", [{"role": "user", "content": "Who wrote X?"}], answers=["Ada"])
    rollouts = [ro("Ada", 12), ro("Ada", 6), ro("Bob", 4), ro("Bob", 20)]
    refs = [ReferenceAnswer("Ada", 8), ReferenceAnswer("Ada", 12), ReferenceAnswer("Ada", 10), ReferenceAnswer("Ada", 6)]
    s = score_rollouts([qa] * 4, rollouts, [0] * 4, refs, torch.tensor([0.9, 0.8, 0.5, 0.5]), "exact")
    assert s.ref_lengths.tolist() == [8, 12, 10, 6]
    pen = anchored_length_penalty(s.lengths, s.ref_lengths, s.r_base, s.s, s.group_ids, dtype=torch.float64)
    # Winners 0, 1: b_win = (8 + 12) / 2 = 10; losers 2, 3: b_lose = (10 + 6) / 2 = 8; cap = max ref = 12.
    import math

    want = [1 - math.exp(-(12 / 10 - 1)),  # verbose winner, 12 <= cap
            0.0,  # a winner shorter than b_win
            1 - math.exp(-(8 / 4 - 1)),  # terse loser
            1.0]  # 20 > cap 12: hard cap
    assert pen.penalty.tolist() == pytest.approx(want, rel=1e-12, abs=0)
    assert pen.capped.tolist() == [False, False, False, True]
