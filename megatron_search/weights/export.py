"""Export a (TP/PP/EP-sharded) Megatron model as HF-named full tensors, in buckets of bounded size.

Collective: every rank of the training world builds it with the same arguments and iterates to the
end. Each rank first publishes what it holds (global name, TP coordinates, shape, dtype); from that
all ranks derive the same plan (weights/send_plan.py): the parameters in HF layer order, and for
each parameter and destination the *sender* rank that assembles it and where each of its TP shards
comes from. Then, round by round, the shards move point-to-point to their senders (on the device the
parameters live on: NCCL moves CUDA tensors, gloo host tensors) and each sender reassembles its full
tensors with the table's TP layout and converts them to HF names.

The default plan gathers everything on `dst_rank` (checkpoint conversion writes from one rank);
the weight sync passes destinations so that every rank sends what it owns (owner-parallel).
`rounds()` yields, per round, this rank's {destination: bucket}; iterating the exporter yields the
buckets flattened (empty on ranks with nothing to send that round), in the same sequence on every
rank so callers can keep collectives in step.

Peak extra memory per rank is about one bucket of assembled HF tensors plus the shards it pulled
for them; shards it sends to others go out as views of its parameters (no packed copy).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_search.config.hf import Architecture
from megatron_search.models.hf_mapping import MappingError, Match
from megatron_search.weights.params import LocalParam, local_params, model_mapping, padded_vocab_size
from megatron_search.weights.send_plan import Destination, ParamShards, SendPlan, build_send_plan

Bucket = list[tuple[str, torch.Tensor]]


class BucketTooSmallError(ValueError):
    """bucket_bytes below the size of one HF tensor (or one group of tensors that travel together)."""


@dataclass
class PlanEntry:
    """One global Megatron parameter: who holds its shards and what HF tensors it becomes."""

    name: str
    match: Match
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    shard_shapes: list[tuple[int, ...]]
    holders: list[list[int]]  # every global rank holding TP shard i (its data-parallel replicas)
    zero_centered: bool
    hf: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def hf_bytes(self, out_dtype: Optional[torch.dtype]) -> int:
        itemsize = (out_dtype or self.dtype).itemsize
        return sum(itemsize * _numel(s) for _, s in self.hf)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _sort_key(e: PlanEntry, rule_index: dict) -> tuple:
    layer = e.match.layer
    if e.match.rule.kind == "vocab":  # embedding first, output layer last
        layer = -1 if e.name.startswith("embedding") else 1 << 30
    elif layer is None:
        layer = (1 << 30) - 1
    return (layer, rule_index[id(e.match.rule)], e.match.expert if e.match.expert is not None else -1, e.name)


class HFExporter:
    """Plan and run the export. Build it on every rank with the same arguments."""

    def __init__(self, model_chunks, arch: Architecture, groups, bucket_bytes: int, *, dst_rank: int = 0,
                 out_dtype: Optional[torch.dtype] = None, world_group=None,
                 destinations: Optional[Sequence[Destination]] = None, rank_node: Optional[Sequence[int]] = None):
        if bucket_bytes <= 0:
            raise BucketTooSmallError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.world_group = world_group
        self.rank = dist.get_rank(world_group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(world_group) if dist.is_initialized() else 1
        self.dst_rank = dst_rank
        self.out_dtype = out_dtype
        self.bucket_bytes = bucket_bytes
        mapping0 = model_mapping(model_chunks, arch)  # MTP rules when the model builds MTP layers
        self.local: dict[str, LocalParam] = {p.global_name: p for p in local_params(model_chunks, mapping0, groups)}
        first = next(iter(self.local.values()), None)
        self.device = first.tensor.device if first is not None else torch.device("cpu")
        self.mapping = model_mapping(model_chunks, arch, padded_vocab_size(list(self.local.values()), arch.vocab_size))
        self.entries = self._plan_entries()
        self.buckets = self._plan_buckets()  # checks every parameter fits a bucket (the error names the tensor)
        if destinations is None:
            destinations = [Destination(f"rank{dst_rank}", (), (dst_rank,))]
        self.plan: SendPlan = build_send_plan(self.param_shards(), destinations,
                                              rank_node if rank_node is not None else [0] * self.world, bucket_bytes)

    # ---- planning (identical on every rank) ---------------------------------------------------
    def _plan_entries(self) -> list[PlanEntry]:
        mine = [(p.global_name, p.tp_rank, p.tp_size, tuple(p.tensor.shape), str(p.tensor.dtype), p.zero_centered)
                for p in self.local.values()]
        if dist.is_initialized():
            everyone: list = [None] * dist.get_world_size(self.world_group)
            dist.all_gather_object(everyone, mine, group=self.world_group)
        else:
            everyone = [mine]
        merged: dict[str, dict] = {}
        for rank, items in enumerate(everyone):
            for name, tp_rank, tp_size, shape, dtype, zc in items:
                d = merged.setdefault(name, {"owners": [None] * tp_size, "shapes": [None] * tp_size,
                                             "dtype": dtype, "zc": zc})
                if len(d["owners"]) != tp_size:
                    raise MappingError(f"{name}: ranks disagree on its TP size")
                if d["owners"][tp_rank] is None:
                    d["owners"][tp_rank], d["shapes"][tp_rank] = rank, shape
                d.setdefault("holders", [[] for _ in range(tp_size)])[tp_rank].append(rank)
        entries = []
        for name, d in merged.items():
            if any(o is None for o in d["owners"]):
                raise MappingError(f"{name}: no rank holds TP shard {d['owners'].index(None)}")
            m = self.mapping.match(name)
            full = list(d["shapes"][0])
            if m.rule.tp.dim is not None:
                full[m.rule.tp.dim] = sum(s[m.rule.tp.dim] for s in d["shapes"])
            e = PlanEntry(name, m, tuple(full), getattr(torch, d["dtype"].split(".")[-1]), d["shapes"],
                          d["holders"], d["zc"])
            e.hf = [(n, tuple(t.shape)) for n, t in
                    self.mapping.to_hf(m, torch.empty(e.full_shape, device="meta"), e.zero_centered)]
            entries.append(e)
        rule_index = {id(r): i for i, r in enumerate(self.mapping.rules)}
        entries.sort(key=lambda e: _sort_key(e, rule_index))
        return entries

    def _plan_buckets(self) -> list[list[PlanEntry]]:
        buckets: list[list[PlanEntry]] = [[]]
        used = 0
        for e in self.entries:
            size = e.hf_bytes(self.out_dtype)
            if size > self.bucket_bytes:
                biggest = max(e.hf, key=lambda h: _numel(h[1]))
                together = f" (it travels with {len(e.hf) - 1} sibling tensor(s): {size} bytes)" if len(e.hf) > 1 else \
                    f" ({size} bytes)"
                raise BucketTooSmallError(
                    f"bucket of {self.bucket_bytes} bytes is smaller than {biggest[0]} {list(biggest[1])}{together}; "
                    f"raise rollout.weight_bucket_mb"
                )
            if used + size > self.bucket_bytes and buckets[-1]:
                buckets.append([])
                used = 0
            buckets[-1].append(e)
            used += size
        return [b for b in buckets if b]

    def param_shards(self) -> list[ParamShards]:
        """The planner's view of every entry (same order as `entries`)."""
        return [ParamShards(e.name, tuple(tuple(h) for h in e.holders),
                            tuple(_numel(s) * e.dtype.itemsize for s in e.shard_shapes), e.hf_bytes(self.out_dtype))
                for e in self.entries]

    @property
    def total_bytes(self) -> int:
        return sum(e.hf_bytes(self.out_dtype) for e in self.entries)

    # ---- data movement ------------------------------------------------------------------------
    def _move_shards(self, ids: list[int]) -> dict[tuple[int, int], torch.Tensor]:
        """One round's point-to-point shard moves, all posted before any is waited on. Sources send their
        parameter tensors as they are (contiguous views, no packed copy). Returns {(assignment, shard): tensor}
        received by this rank."""
        ops, got = [], {}
        for k in ids:
            a = self.plan.assignments[k]
            e = self.entries[a.param]
            for i, src in enumerate(a.sources):
                if src == a.sender:
                    continue
                if self.rank == src:
                    ops.append(dist.P2POp(dist.isend, self.local[e.name].tensor.detach().contiguous(), a.sender,
                                          group=self.world_group))
                elif self.rank == a.sender:
                    buf = torch.empty(e.shard_shapes[i], dtype=e.dtype, device=self.device)
                    ops.append(dist.P2POp(dist.irecv, buf, src, group=self.world_group))
                    got[(k, i)] = buf
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return got

    def _assemble(self, k: int, remote: dict) -> list[tuple[str, torch.Tensor]]:
        a = self.plan.assignments[k]
        e = self.entries[a.param]
        shards = [self.local[e.name].tensor.detach() if src == self.rank else remote.pop((k, i))
                  for i, src in enumerate(a.sources)]
        full = e.match.rule.tp.gather(shards, self.mapping.ctx)
        out = []
        for name, t in self.mapping.to_hf(e.match, full, e.zero_centered):
            if self.out_dtype is not None and t.dtype != self.out_dtype:
                t = t.to(self.out_dtype)
            elif e.name in self.local and _shares_storage(t, self.local[e.name].tensor):
                t = t.clone()  # never hand out a view of a live training parameter
            out.append((name, t))
        return out

    def rounds(self) -> Iterator[dict[int, Bucket]]:
        """Per round, this rank's assembled tensors by destination index ({} when it sends nothing)."""
        for rnd in self.plan.rounds:
            ids = [k for sender_ids in rnd.values() for k in sender_ids]
            remote = self._move_shards(ids)
            mine: dict[int, Bucket] = {}
            for k in rnd.get(self.rank, []):
                mine.setdefault(self.plan.assignments[k].dest, []).extend(self._assemble(k, remote))
            yield mine

    def __iter__(self) -> Iterator[Bucket]:
        for mine in self.rounds():
            yield [item for bucket in mine.values() for item in bucket]


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def export_hf_weights(model_chunks, arch: Architecture, bucket_bytes: int, groups, *, dst_rank: int = 0,
                      out_dtype: Optional[torch.dtype] = None, world_group=None) -> Iterator[Bucket]:
    """Iterator of buckets [(hf_name, full tensor)]; call on every rank (buckets are empty off dst_rank)."""
    return iter(HFExporter(model_chunks, arch, groups, bucket_bytes, dst_rank=dst_rank, out_dtype=out_dtype,
                           world_group=world_group))
