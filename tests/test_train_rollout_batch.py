"""Packing rollouts into training tensors: next-token alignment, masks, padding."""
import numpy as np
import pytest
import torch

from megatron_search.rollout.engine.types import Rollout, Segment
from megatron_search.train.rollout_batch import pack_rollouts


def rollout(ids, model_span, tool_span=None, routed=False):
    n = len(ids)
    mask = [0] * n
    logp = [0.0] * n
    for t in range(*model_span):
        mask[t], logp[t] = 1, -0.1 * (t + 1)
    segs = [Segment(0, model_span[0], "prompt"), Segment(model_span[0], model_span[1], "model", "v1")]
    if model_span[1] < n:
        segs.append(Segment(model_span[1], n, "tool"))
    rex = np.arange((n - 1) * 2 * 2, dtype=np.int32).reshape(n - 1, 2, 2) if routed else None
    return Rollout(prompt_len=model_span[0], token_ids=ids, logprobs=logp, loss_mask=mask, segments=segs,
                   tool_calls=0, failed_executions=0, broken_calls={}, final_answer="x", stop_reason="answer",
                   routed_experts_NLK=rex)


def test_alignment_and_padding():
    a = rollout([5, 6, 7, 8, 9], (2, 4))  # prompt 5,6 | model 7,8 | tool 9
    b = rollout([1, 2, 3], (1, 3))
    batch = pack_rollouts([a, b], [0.5, -1.0], pad_id=0, pad_multiple=4)
    assert batch.tokens_BS.tolist() == [[5, 6, 7, 8], [1, 2, 0, 0]]
    assert batch.targets_BS.tolist() == [[6, 7, 8, 9], [2, 3, 0, 0]]
    # position t is trained when token t+1 was sampled by the engine
    assert batch.mask_BS.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0]]
    assert torch.allclose(batch.logp_infer_BS[0], torch.tensor([0.0, -0.3, -0.4, 0.0]))
    assert torch.allclose(batch.logp_infer_BS[1], torch.tensor([-0.2, -0.3, 0.0, 0.0]))
    assert batch.advantages_B.tolist() == [0.5, -1.0]


def test_routed_experts_rows_follow_inputs():
    a = rollout([5, 6, 7, 8], (2, 4), routed=True)
    batch = pack_rollouts([a], [1.0], pad_id=0, pad_multiple=4, with_routed_experts=True)
    assert batch.routed_experts_BSLK.shape == (1, 4, 2, 2)
    assert torch.equal(batch.routed_experts_BSLK[0, :3], torch.from_numpy(a.routed_experts_NLK))
    assert (batch.routed_experts_BSLK[0, 3] == -1).all()


def test_bad_input():
    a = rollout([5, 6, 7], (1, 3))
    with pytest.raises(ValueError, match="2 advantages"):
        pack_rollouts([a], [1.0, 2.0], pad_id=0)
    a.loss_mask[0] = 1
    with pytest.raises(ValueError, match="loss mask of the prompt segment"):
        pack_rollouts([a], [1.0], pad_id=0)


def test_pad_rows_append_inert_rows():
    a = rollout([5, 6, 7, 8], (2, 4), routed=True)
    batch = pack_rollouts([a], [0.5], pad_id=3, with_routed_experts=True)
    padded = batch.pad_rows(2, pad_id=3)
    assert padded.size == 3
    assert torch.equal(padded.slice(0, 1).tokens_BS, batch.tokens_BS)
    assert padded.tokens_BS[1:].tolist() == [[3, 3, 3]] * 2 and padded.targets_BS[1:].tolist() == [[3, 3, 3]] * 2
    assert padded.mask_BS[1:].sum() == 0 and padded.logp_infer_BS[1:].abs().sum() == 0
    assert padded.advantages_B.tolist() == [0.5, 0.0, 0.0]
    assert (padded.routed_experts_BSLK[1:] == -1).all()
    assert batch.pad_rows(0, pad_id=3) is batch
    with pytest.raises(ValueError, match="n must be >= 0"):
        batch.pad_rows(-1, pad_id=3)
