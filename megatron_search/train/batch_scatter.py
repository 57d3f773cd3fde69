"""Each data-parallel replica receives only its slice of the GRPO batch, not the whole batch.

The driver (rank 0) packs the step's rollouts; slice d goes once, point-to-point, to the first rank of
replica d's model-parallel group (TP x PP x CP ranks that train on the same rows), which broadcasts it
within that group. Every rank so receives batch / DP bytes instead of the whole batch (the driver
sends each byte once). Slices are copied before sending: a view would pickle its whole storage.
Routed experts still travel whole to every rank of the replica (all PP stages), not per stage.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_search.distributed import collectives as coll

from .rollout_batch import RolloutBatch


def batch_nbytes(b: Optional[RolloutBatch]) -> int:
    if b is None:
        return 0
    tensors = [b.tokens_BS, b.targets_BS, b.logp_infer_BS, b.mask_BS, b.advantages_B, b.routed_experts_BSLK]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _copy(b: RolloutBatch) -> RolloutBatch:
    re = None if b.routed_experts_BSLK is None else b.routed_experts_BSLK.clone()
    return RolloutBatch(b.tokens_BS.clone(), b.targets_BS.clone(), b.logp_infer_BS.clone(), b.mask_BS.clone(),
                        b.advantages_B.clone(), re)


class BatchScatter:
    """Built on every rank after Megatron's groups exist (collective: it learns each replica's first rank)."""

    def __init__(self):
        from megatron.core import parallel_state as ps

        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.mp_group = ps.get_model_parallel_group()
        self.mp_size = dist.get_world_size(self.mp_group)
        self.leader = dist.get_global_rank(self.mp_group, 0)
        self.rank = dist.get_rank()
        pairs = [None] * dist.get_world_size()
        dist.all_gather_object(pairs, (self.dp_rank, self.leader))
        self.leaders = {d: leader for d, leader in pairs}

    def scatter(self, batch: Optional[RolloutBatch]) -> tuple[Optional[RolloutBatch], dict[str, float]]:
        """Driver passes the whole batch (or None: no signal), others None; returns this rank's slice and, on
        the driver, the bytes of the whole batch and the most any rank received."""
        box = [batch is not None]
        dist.broadcast_object_list(box, src=0)
        if not box[0]:
            return None, {}
        local = None
        if self.rank == 0:
            n = batch.size // self.dp
            for d in range(self.dp):
                part = _copy(batch.slice(d * n, (d + 1) * n))
                if self.leaders[d] == 0:
                    local = part
                else:
                    dist.send_object_list([part], dst=self.leaders[d])
        elif self.rank == self.leader:
            recv = [None]
            dist.recv_object_list(recv, src=0)
            local = recv[0]
        if self.mp_size > 1:
            box = [local]
            dist.broadcast_object_list(box, src=self.leader, group=self.mp_group)
            local = box[0]
        received = torch.tensor([0 if self.rank == 0 else batch_nbytes(local)], dtype=torch.float64)
        coll.all_reduce(received, op=dist.ReduceOp.MAX)
        stats = {"batch/total_MB": batch_nbytes(batch) / 2**20, "batch/max_rank_received_MB": float(received) / 2**20}
        return local, stats if self.rank == 0 else {}
