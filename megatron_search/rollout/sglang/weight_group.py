"""A stand-alone process group for pushing weights from the trainer into rollout engines.

The protocol is SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`:
the sending trainer rank is rank 0 and hosts the TCP store at master_address:master_port; engine
ranks are rank_offset + their TP rank; then, for every (name, dtype, shape) announced over HTTP,
rank 0 broadcasts one tensor in that order. The group is NOT the default torch.distributed group,
so it lives beside Megatron's groups.

`open_weight_group` builds the group exactly as SGLang's `init_custom_process_group` does on the
engine side (a TCP rendezvous, the store prefixed with the group name, torch's process-group helper
with the same name, group ranks equal to the given ranks), so both sides meet on the same store
keys: a hand-built gloo group with other keys would wait forever for SGLang. Checked against
sglang 0.5.23's function by tests/test_rollout_sglang_contract.py.
"""
from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

DEFAULT_TIMEOUT_S = 300.0


def open_weight_group(
    master_address: str, master_port: int, rank: int, world_size: int,
    group_name: str = "weight_update_group", backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the weight-update group of `world_size` ranks; blocks until all have joined."""
    if not 0 <= rank < world_size:
        raise ValueError(f"weight update group: rank {rank} outside world size {world_size}")
    if not group_name:
        raise ValueError("weight update group: group_name must not be empty")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], dist.Backend(backend),
                                           dist.PrefixStore(group_name, store), group_name=group_name,
                                           backend_options=None, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def close_weight_group(group: dist.ProcessGroup) -> None:
    """Forget a group opened by `open_weight_group` (SGLang's destroy does the same on its side)."""
    dist.destroy_process_group(group)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In-place broadcast of `tensor` from rank `src` of `group`."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()
    return tensor


def send_named_tensors(group: dist.ProcessGroup, named: Sequence[tuple[str, torch.Tensor]],
                       device: torch.device | str = "cpu") -> None:
    """Trainer side: broadcast each tensor in order, as announced to the engines, from `device` (CUDA for NCCL)."""
    for _, t in named:
        broadcast(group, t.detach().to(device).contiguous(), src=0)


def receive_named_tensors(
    group: dist.ProcessGroup, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]],
    device: torch.device | str = "cpu",
) -> list[tuple[str, torch.Tensor]]:
    """Engine side: receive one broadcast per announced name from rank 0, into buffers on `device` (CUDA for NCCL)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"update_weights_from_distributed: {len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
    out = []
    for name, dt, shape in zip(names, dtypes, shapes):
        out.append((name, broadcast(group, torch.empty(tuple(shape), dtype=dt, device=device), src=0)))
    return out


FLAT = "flattened_bucket"  # SGLang's load_format: the announced tensors' bytes in one broadcast


def send_flat_bucket(group: dist.ProcessGroup, named: Sequence[tuple[str, torch.Tensor]],
                     device: torch.device | str = "cpu") -> None:
    """Trainer side of load_format "flattened_bucket": every tensor's bytes back to back, one broadcast.
    A bucket that already is those bytes (weights/export.FlatBucket: `.flat`) goes as it is."""
    flat = getattr(named, "flat", None)
    if flat is None or flat.device.type != torch.device(device).type:
        flat = torch.cat([t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for _, t in named])
    broadcast(group, flat, src=0)


def grow_buffer(buffer: Optional[torch.Tensor], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]],
                device: torch.device | str = "cpu") -> torch.Tensor:
    """A uint8 receive buffer on `device` that holds the announced tensors: `buffer` when it is large enough."""
    need = sum(dt.itemsize * int(torch.Size(shape).numel()) for dt, shape in zip(dtypes, shapes))
    if buffer is not None and buffer.numel() >= need and buffer.device == torch.device(device):
        return buffer
    return torch.empty(round_up_bytes(need), dtype=torch.uint8, device=device)


def round_up_bytes(n: int) -> int:
    """`n` rounded up to 1/8 of its power of two (at most 12.5% more): buckets of nearly the same size, as a
    sync's are (each filled up to the bucket size), then fit one buffer instead of regrowing it."""
    if n <= 1 << 20:
        return n
    step = 1 << (n.bit_length() - 4)
    return (n + step - 1) // step * step


def receive_flat_bucket(
    group: dist.ProcessGroup, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]],
    device: torch.device | str = "cpu", buffer: Optional[torch.Tensor] = None,
) -> list[tuple[str, torch.Tensor]]:
    """Engine side of "flattened_bucket": one broadcast into a buffer on `device`, split at the announced sizes.
    `buffer` (uint8, on `device`, at least the bucket's size) is received into instead of a new one: the views
    returned are valid until it is reused."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"update_weights_from_distributed: {len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
    if not names:
        return []
    sizes = [dt.itemsize * int(torch.Size(shape).numel()) for dt, shape in zip(dtypes, shapes)]
    total = sum(sizes)
    if buffer is not None and buffer.dtype == torch.uint8 and buffer.numel() >= total:
        flat = broadcast(group, buffer[:total], src=0)
    else:
        flat = broadcast(group, torch.empty(total, dtype=torch.uint8, device=device), src=0)
    out = []
    for name, dt, shape, part in zip(names, dtypes, shapes, torch.split(flat, sizes)):
        if part.storage_offset() % dt.itemsize:  # mixed dtypes: realign before the view
            part = part.clone()
        out.append((name, part.view(dt).reshape(tuple(shape))))
    return out
