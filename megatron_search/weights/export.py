"""Export a (TP/PP/EP-sharded) Megatron model as HF-named full tensors, in buckets of bounded size.

Collective: every rank of the training world calls it and iterates to the end. Each rank first
publishes what it holds (global name, TP coordinates, shape, dtype); from that all ranks derive
the same plan: the order of parameters (HF layer order), which rank sends which shard, and where
buckets end. Then, bucket by bucket, the owners of the shards (lowest global rank holding each
TP shard: one data-parallel replica, the EP rank that owns the expert, the PP stage that owns
the layer) send them point-to-point to `dst_rank`, one packed message per owner and bucket;
dst reassembles each full tensor with the table's TP layout and converts it to HF names. Buckets are yielded on every rank in the same
sequence (empty on ranks other than `dst_rank`) so callers can keep collectives in step.

Peak extra memory on `dst_rank` is about two buckets (received shards + the HF tensors being
yielded); a sending rank holds one packed copy of its share of a bucket.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_search.config.hf import Architecture
from megatron_search.models.hf_mapping import Mapping, MappingError, Match
from megatron_search.weights.params import LocalParam, local_params, padded_vocab_size

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
    owners: list[int]  # global rank holding TP shard i
    shard_shapes: list[tuple[int, ...]]
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
                 out_dtype: Optional[torch.dtype] = None, world_group=None):
        if bucket_bytes <= 0:
            raise BucketTooSmallError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.world_group = world_group
        self.rank = dist.get_rank(world_group) if dist.is_initialized() else 0
        self.dst_rank = dst_rank
        self.out_dtype = out_dtype
        self.bucket_bytes = bucket_bytes
        mapping0 = Mapping(arch)
        self.local: dict[str, LocalParam] = {p.global_name: p for p in local_params(model_chunks, mapping0, groups)}
        self.mapping = Mapping(arch, padded_vocab_size(list(self.local.values()), arch.vocab_size))
        self.entries = self._plan_entries()
        self.buckets = self._plan_buckets()

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
        entries = []
        for name, d in merged.items():
            if any(o is None for o in d["owners"]):
                raise MappingError(f"{name}: no rank holds TP shard {d['owners'].index(None)}")
            m = self.mapping.match(name)
            full = list(d["shapes"][0])
            if m.rule.tp.dim is not None:
                full[m.rule.tp.dim] = sum(s[m.rule.tp.dim] for s in d["shapes"])
            e = PlanEntry(name, m, tuple(full), getattr(torch, d["dtype"].split(".")[-1]), d["owners"],
                          d["shapes"], d["zc"])
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

    def bucket_meta(self) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
        """Names, shapes and dtypes of every bucket, known on every rank before any data moves."""
        return [[(n, s, self.out_dtype or e.dtype) for e in b for n, s in e.hf] for b in self.buckets]

    @property
    def total_bytes(self) -> int:
        return sum(e.hf_bytes(self.out_dtype) for e in self.entries)

    # ---- data movement ------------------------------------------------------------------------
    def _remote_shards(self, plan: list[PlanEntry]) -> dict[tuple[str, int], torch.Tensor]:
        """Move one bucket's remote shards: each owner packs its shards into one byte buffer and
        sends it in a single message (few large messages instead of one per expert slice).
        Returns {(name, shard index): shard} on dst, {} elsewhere."""
        want: dict[int, list[tuple[PlanEntry, int]]] = {}
        for e in plan:
            for i, owner in enumerate(e.owners):
                if owner != self.dst_rank:
                    want.setdefault(owner, []).append((e, i))
        got: dict[tuple[str, int], torch.Tensor] = {}
        for owner in sorted(want):
            items = want[owner]
            if self.rank == owner:
                flat = [self.local[e.name].tensor.detach().contiguous().reshape(-1).view(torch.uint8) for e, _ in items]
                dist.send(torch.cat(flat), dst=self.dst_rank, group=self.world_group)
            elif self.rank == self.dst_rank:
                sizes = [_numel(e.shard_shapes[i]) * e.dtype.itemsize for e, i in items]
                buf = torch.empty(sum(sizes), dtype=torch.uint8)
                dist.recv(buf, src=owner, group=self.world_group)
                for (e, i), part in zip(items, torch.split(buf, sizes)):
                    if part.storage_offset() % e.dtype.itemsize:  # mixed dtypes: realign before the view
                        part = part.clone()
                    got[(e.name, i)] = part.view(e.dtype).reshape(e.shard_shapes[i])
        return got

    def __iter__(self) -> Iterator[Bucket]:
        for plan in self.buckets:
            remote = self._remote_shards(plan)
            bucket: Bucket = []
            if self.rank != self.dst_rank:
                yield bucket
                continue
            for e in plan:
                shards = [self.local[e.name].tensor.detach() if owner == self.rank else remote.pop((e.name, i))
                          for i, owner in enumerate(e.owners)]
                full = e.match.rule.tp.gather(shards, self.mapping.ctx)
                for name, t in self.mapping.to_hf(e.match, full, e.zero_centered):
                    if self.out_dtype is not None and t.dtype != self.out_dtype:
                        t = t.to(self.out_dtype)
                    elif e.name in self.local and _shares_storage(t, self.local[e.name].tensor):
                        t = t.clone()  # never hand out a view of a live training parameter
                    bucket.append((name, t))
            yield bucket


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def export_hf_weights(model_chunks, arch: Architecture, bucket_bytes: int, groups, *, dst_rank: int = 0,
                      out_dtype: Optional[torch.dtype] = None, world_group=None) -> Iterator[Bucket]:
    """Iterator of buckets [(hf_name, full tensor)]; call on every rank (buckets are empty off dst_rank)."""
    return iter(HFExporter(model_chunks, arch, groups, bucket_bytes, dst_rank=dst_rank, out_dtype=out_dtype,
                           world_group=world_group))
