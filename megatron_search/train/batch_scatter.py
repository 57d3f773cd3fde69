"""Each data-parallel replica receives only its slice of the GRPO batch, not the whole batch; each
pipeline stage receives only the routed experts of its own layers.

The driver (rank 0) packs the step's rollouts; slice d goes once, point-to-point, to the first rank of
replica d's model-parallel group (TP x PP ranks that train on the same rows). That leader broadcasts the
rows without experts within the group, and sends each other stage's expert columns once, point-to-point,
to that stage's first rank, which broadcasts them within its TP group. So every rank receives
batch / DP bytes of rows plus only its layers' experts (at 397B with routing replay the experts are
most of the batch: ~20 GB a step), and the driver sends each byte once. Slices are copied before
sending: a view would pickle its whole storage.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_search.distributed import collectives as coll
from megatron_search.distributed.init import host_group
from megatron_search.distributed.stages import rank_in, size_of

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
    """Built on every rank after Megatron's groups exist (collective: it learns each replica's first rank and
    each rank's MoE layers). `groups`: this rank's process groups (DistContext.groups); `moe_layers`: the
    global MoE layers of this rank's model chunks."""

    def __init__(self, groups, moe_layers: Sequence[int] = ()):
        self.dp = size_of(groups.dp)
        self.dp_rank = rank_in(groups.dp)
        self.mp_group = groups.mp
        self.mp_size = dist.get_world_size(self.mp_group)
        self.leader = dist.get_global_rank(self.mp_group, 0)
        self.tp_group = groups.tp
        self.tp_size = size_of(groups.tp)
        self.stage_leader = dist.get_global_rank(self.tp_group, 0)  # this stage's first rank (TP rank 0)
        self.rank = dist.get_rank()
        self.layers = tuple(sorted(moe_layers))
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, (self.dp_rank, self.leader, self.stage_leader, self.layers))
        self.leaders = {d: leader for d, leader, _, _ in rows}
        # the other stages of my replica: their first rank and their layers (what my leader sends them)
        self.stages = {sl: layers for r, (_, leader, sl, layers) in enumerate(rows)
                       if leader == self.leader and r == sl and sl != self.stage_leader}

    def scatter(self, batch: Optional[RolloutBatch]) -> tuple[Optional[RolloutBatch], dict[str, float]]:
        """Driver passes the whole batch (or None: no signal), others None; returns this rank's slice and, on
        the driver, the bytes of the whole batch and the most any rank received."""
        box = [batch is not None]
        dist.broadcast_object_list(box, src=0, group=host_group())  # the others wait off the GPU while it packs
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
            local = self._within_replica(local)
        elif local.routed_experts_BSLK is not None:
            local = _own_layers(local, self.layers)
        received = torch.tensor([0 if self.rank == 0 else batch_nbytes(local)], dtype=torch.float64)
        coll.all_reduce(received, op=dist.ReduceOp.MAX)
        stats = {"batch/total_MB": batch_nbytes(batch) / 2**20, "batch/max_rank_received_MB": float(received) / 2**20}
        return local, stats if self.rank == 0 else {}

    def _within_replica(self, local: Optional[RolloutBatch]) -> RolloutBatch:
        """Rows to the whole model-parallel group; expert columns per stage (leader -> stage leader -> its TP group)."""
        experts = None
        if self.rank == self.leader:
            experts, local = local.routed_experts_BSLK, local.with_experts(None, None)
        box = [(local, experts is not None)]
        dist.broadcast_object_list(box, src=self.leader, group=self.mp_group)
        local, has_experts = box[0]
        if not has_experts:
            return local
        mine = None
        if self.rank == self.leader:
            for stage_leader, layers in self.stages.items():
                dist.send_object_list([_columns(experts, layers)], dst=stage_leader)
            mine = _columns(experts, self.layers)
        elif self.rank == self.stage_leader:
            recv = [None]
            dist.recv_object_list(recv, src=self.leader)
            mine = recv[0]
        if self.tp_size > 1:
            box = [mine]
            dist.broadcast_object_list(box, src=self.stage_leader, group=self.tp_group)
            mine = box[0]
        return local.with_experts(mine, self.layers)


def _columns(experts_BSLK: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
    """Copy of the expert columns of these global layers (column L of the packed batch is layer L)."""
    return experts_BSLK[:, :, list(layers)].clone()


def _own_layers(b: RolloutBatch, layers: Sequence[int]) -> RolloutBatch:
    return b.with_experts(_columns(b.routed_experts_BSLK, layers), layers)
