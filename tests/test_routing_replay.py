"""Routing-replay glue: token order and sequence-parallel slicing of the targets, padding, agreement.

The Megatron forward with replay (100 % of the engine's experts, and arbitrary forced ones, at
TP=2 + SP) runs in tests/test_weights_roundtrip.py::test_routing_replay.
"""
from __future__ import annotations

import torch

from megatron_search.models.routing_replay import _local_tokens, agreement_rate


def test_targets_follow_megatron_token_order_and_sp_slices():
    # experts[b, s] = [10*b + s, 100 + 10*b + s]: every token identifiable.
    B, S = 2, 4
    e = torch.tensor([[[10 * b + s, 100 + 10 * b + s] for s in range(S)] for b in range(B)])
    full = _local_tokens(e, 0, 1, False)
    # Megatron flattens [S, B]: token order (s0 b0), (s0 b1), (s1 b0), ...
    assert full[:, 0].tolist() == [0, 10, 1, 11, 2, 12, 3, 13]
    # Sequence parallel at TP=2: rank 1 routes sequence positions 2..3 only.
    assert _local_tokens(e, 1, 2, True)[:, 0].tolist() == [2, 12, 3, 13]
    assert _local_tokens(e, 1, 2, False).shape == (8, 2)  # no SP: every rank routes all tokens
    assert full.dtype == torch.int64


def test_padding_rows_become_valid_experts():
    e = torch.tensor([[[3, 1], [-1, -1], [2, 0]]])
    assert _local_tokens(e, 0, 1, False).tolist() == [[3, 1], [0, 1], [2, 0]]


def test_agreement_compares_expert_sets_per_token_and_layer():
    a = torch.tensor([[[0, 1], [2, 3]], [[1, 2], [0, 3]]])  # [N=2, L=2, K=2]
    b = torch.tensor([[[1, 0], [2, 1]], [[1, 2], [3, 0]]])
    assert agreement_rate(a, b) == 0.75  # order within top-k ignored; one (token, layer) differs
    assert agreement_rate(a, b, valid_N=torch.tensor([0, 1])) == 1.0
    assert agreement_rate(a, a) == 1.0
