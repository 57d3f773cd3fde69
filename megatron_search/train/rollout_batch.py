"""Pack finished rollouts into the padded tensors one GRPO training step consumes.

Alignment (next-token prediction): position t of the packed row predicts token t+1 of the
transcript, so for a transcript of n ids

    tokens[t]     = ids[t]            t < n - 1
    targets[t]    = ids[t + 1]
    logp_infer[t] = engine logprob of ids[t + 1]
    mask[t]       = loss_mask[t + 1]  (1 only where the engine sampled ids[t + 1])

Rows are right-padded to a common length rounded up to `pad_multiple` (sequence parallel needs
the sequence divisible by TP); padding has mask 0. Advantages are per rollout and broadcast to
tokens by the loss. Shapes: B rollouts x S positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_search.rollout.engine.types import Rollout


@dataclass
class RolloutBatch:
    tokens_BS: torch.Tensor  # int64
    targets_BS: torch.Tensor  # int64
    logp_infer_BS: torch.Tensor  # float32
    mask_BS: torch.Tensor  # float32, 1 = trained token
    advantages_B: torch.Tensor  # float32
    routed_experts_BSLK: Optional[torch.Tensor] = None  # int32, -1 on padding
    # global layer of each column L of routed_experts_BSLK; None = every layer, column L is layer L
    expert_layers: Optional[tuple[int, ...]] = None

    def moe_layers(self) -> list[int]:
        """The global MoE layer of each column of routed_experts_BSLK."""
        if self.routed_experts_BSLK is None:
            return []
        if self.expert_layers is None:
            return list(range(self.routed_experts_BSLK.shape[2]))
        return list(self.expert_layers)

    def with_experts(self, experts_BSLK: Optional[torch.Tensor], layers: Optional[Sequence[int]]) -> "RolloutBatch":
        """The same rows carrying these experts (columns = `layers`)."""
        return RolloutBatch(self.tokens_BS, self.targets_BS, self.logp_infer_BS, self.mask_BS, self.advantages_B,
                            experts_BSLK, None if layers is None else tuple(layers))

    @property
    def size(self) -> int:
        return self.tokens_BS.shape[0]

    def slice(self, start: int, stop: int) -> "RolloutBatch":
        re = None if self.routed_experts_BSLK is None else self.routed_experts_BSLK[start:stop]
        return RolloutBatch(self.tokens_BS[start:stop], self.targets_BS[start:stop], self.logp_infer_BS[start:stop],
                            self.mask_BS[start:stop], self.advantages_B[start:stop], re, self.expert_layers)

    def cut(self, width: int) -> "RolloutBatch":
        """The first `width` positions of every row (train/microbatches.py: nothing after a row's last trained
        token changes its loss)."""
        re = None if self.routed_experts_BSLK is None else self.routed_experts_BSLK[:, :width]
        return RolloutBatch(self.tokens_BS[:, :width], self.targets_BS[:, :width], self.logp_infer_BS[:, :width],
                            self.mask_BS[:, :width], self.advantages_B, re, self.expert_layers)

    def inert(self) -> "RolloutBatch":
        """The same shapes training nothing: mask and advantages 0, experts -1 (a filler micro-batch)."""
        re = None if self.routed_experts_BSLK is None else torch.full_like(self.routed_experts_BSLK, -1)
        return RolloutBatch(self.tokens_BS, self.targets_BS, self.logp_infer_BS, torch.zeros_like(self.mask_BS),
                            torch.zeros_like(self.advantages_B), re, self.expert_layers)

    def to(self, device) -> "RolloutBatch":
        """The same rows on `device` (the model's: batches are packed and sent on the host)."""
        if self.tokens_BS.device == torch.device(device):
            return self
        mv = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return RolloutBatch(mv(self.tokens_BS), mv(self.targets_BS), mv(self.logp_infer_BS), mv(self.mask_BS),
                            mv(self.advantages_B), mv(self.routed_experts_BSLK), self.expert_layers)

    def select(self, index: Sequence[int]) -> "RolloutBatch":
        idx = torch.as_tensor(list(index), dtype=torch.long)
        re = None if self.routed_experts_BSLK is None else self.routed_experts_BSLK[idx]
        return RolloutBatch(self.tokens_BS[idx], self.targets_BS[idx], self.logp_infer_BS[idx], self.mask_BS[idx],
                            self.advantages_B[idx], re, self.expert_layers)

    def pad_rows(self, n: int, pad_id: int) -> "RolloutBatch":
        """This batch with `n` padding rows appended: pad tokens, mask 0, advantage 0, no experts (-1).
        They add nothing to the loss or to its denominators (sequences or tokens with mask 1)."""
        if n < 0:
            raise ValueError(f"pad_rows: n must be >= 0, got {n}")
        if n == 0:
            return self

        def grow(t: torch.Tensor, fill) -> torch.Tensor:
            return torch.cat([t, torch.full((n, *t.shape[1:]), fill, dtype=t.dtype)])

        re = None if self.routed_experts_BSLK is None else grow(self.routed_experts_BSLK, -1)
        return RolloutBatch(grow(self.tokens_BS, pad_id), grow(self.targets_BS, pad_id), grow(self.logp_infer_BS, 0),
                            grow(self.mask_BS, 0), grow(self.advantages_B, 0), re, self.expert_layers)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n (row widths for sequence parallelism)."""
    return -(-n // multiple) * multiple


def pack_rollouts(rollouts: Sequence[Rollout], advantages: Sequence[float], pad_id: int,
                  pad_multiple: int = 1, with_routed_experts: bool = False) -> RolloutBatch:
    """Padded training tensors for `rollouts` (each checked with Rollout.check first)."""
    if len(rollouts) != len(advantages):
        raise ValueError(f"pack_rollouts: {len(rollouts)} rollouts but {len(advantages)} advantages")
    if not rollouts:
        raise ValueError("pack_rollouts: no rollouts")
    for i, r in enumerate(rollouts):
        r.check()
        if len(r.token_ids) < 2:
            raise ValueError(f"pack_rollouts: rollout {i} has {len(r.token_ids)} token(s); need at least 2")
    s = round_up(max(len(r.token_ids) - 1 for r in rollouts), pad_multiple)
    b = len(rollouts)
    tokens = torch.full((b, s), pad_id, dtype=torch.long)
    targets = torch.full((b, s), pad_id, dtype=torch.long)
    logp = torch.zeros((b, s), dtype=torch.float32)
    mask = torch.zeros((b, s), dtype=torch.float32)
    routed = None
    if with_routed_experts:
        shapes = {r.routed_experts_NLK.shape[1:] for r in rollouts if r.routed_experts_NLK is not None}
        if len(shapes) != 1 or any(r.routed_experts_NLK is None for r in rollouts):
            raise ValueError("pack_rollouts: routing replay needs routed experts of one shape on every rollout")
        (lk,) = shapes
        routed = torch.full((b, s, *lk), -1, dtype=torch.int32)
    for i, r in enumerate(rollouts):
        n = len(r.token_ids) - 1
        ids = torch.as_tensor(r.token_ids, dtype=torch.long)
        tokens[i, :n] = ids[:-1]
        targets[i, :n] = ids[1:]
        logp[i, :n] = torch.as_tensor(r.logprobs[1:], dtype=torch.float32)
        mask[i, :n] = torch.as_tensor(r.loss_mask[1:], dtype=torch.float32)
        if routed is not None:
            # Row t = experts used when token t was fed: exactly the rows of the packed inputs.
            routed[i, :n] = torch.from_numpy(np.asarray(r.routed_experts_NLK[:n], dtype=np.int32))
    adv = torch.as_tensor(list(advantages), dtype=torch.float32)
    return RolloutBatch(tokens, targets, logp, mask, adv, routed)
