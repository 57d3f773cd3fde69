"""A stand-alone process group for pushing weights from the trainer into rollout engines.

The protocol is SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`:
the trainer is rank 0 and hosts the TCP store at master_address:master_port; engine ranks
are rank_offset + local rank; then, for every (name, dtype, shape) announced over HTTP, rank 0
broadcasts one tensor in that order. The group is NOT the default torch.distributed group,
so it can live beside Megatron's groups (gloo here; NCCL on GPUs via SGLang itself).
"""
from __future__ import annotations

import datetime
from typing import Sequence

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0


def open_gloo_group(
    master_address: str, master_port: int, rank: int, world_size: int,
    group_name: str = "weight_update_group", timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dist.ProcessGroup:
    """Join (rank 0: host) a gloo group of `world_size` ranks; blocks until all have joined."""
    if not 0 <= rank < world_size:
        raise ValueError(f"weight update group: rank {rank} outside world size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(group_name, store), rank, world_size, timeout)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In-place broadcast of `tensor` from rank `src` of `group`."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()
    return tensor


def send_named_tensors(group: dist.ProcessGroup, named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Trainer side: broadcast each tensor (contiguous, CPU) in order, as announced to the engines."""
    for _, t in named:
        broadcast(group, t.detach().contiguous().cpu(), src=0)


def receive_named_tensors(
    group: dist.ProcessGroup, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> list[tuple[str, torch.Tensor]]:
    """Engine side: receive one broadcast per announced name from rank 0."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"update_weights_from_distributed: {len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
    out = []
    for name, dt, shape in zip(names, dtypes, shapes):
        out.append((name, broadcast(group, torch.empty(tuple(shape), dtype=dt), src=0)))
    return out
