"""Combine streaming softmax statistics across the ranks that each hold a vocabulary slice.

Megatron's vocab-parallel cross-entropy contract: tensor-parallel rank r holds logits for vocabulary
ids [vocab_start_r, vocab_start_r + V_local); the max and sum-exp are reduced over the TP group, the
target's logit comes from the rank that owns it (the others contribute exactly 0), and the backward
is local (each rank writes the gradient of its own slice). The process group is always an explicit
argument; this module only runs collectives, it holds no state.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .softmax_stats import SoftmaxStats, rescale


def combine_stats(stats: SoftmaxStats, group: Optional[dist.ProcessGroup]) -> SoftmaxStats:
    """Global state from each rank's local state: one MAX all-reduce, one SUM all-reduce."""
    if group is None or dist.get_world_size(group) == 1:
        return stats
    m_global = stats.m.clone()
    dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=group)
    s, w = rescale(stats.m, stats.s, stats.w, m_global)
    parts = [s, stats.xt] + ([w] if w is not None else [])
    packed = torch.stack(parts)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return SoftmaxStats(
        m=m_global,
        s=packed[0].contiguous(),
        w=packed[2].contiguous() if w is not None else None,
        xt=packed[1].contiguous(),
    )


def vocab_range(local_vocab: int, group: Optional[dist.ProcessGroup], vocab_start: Optional[int], vocab_size: Optional[int]):
    """(first id held here, global vocabulary size); defaults follow Megatron's equal slices by rank."""
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    start = rank * local_vocab if vocab_start is None else int(vocab_start)
    total = local_vocab * world if vocab_size is None else int(vocab_size)
    if start < 0 or start + local_vocab > total:
        raise ValueError(
            f"vocabulary slice [{start}, {start + local_vocab}) of rank {rank} lies outside [0, {total}); "
            "pass vocab_start/vocab_size matching how the output layer was split"
        )
    return start, total
