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

`rounds(staging=...)` (the weight sync) assembles each round's tensors straight into one flat byte
buffer per destination, back to back in send order, and receives pulled shards into one scratch
buffer: the TP gather writes the full tensor in place (`torch.cat(out=)`), HF tensors that are
contiguous slices of it (copy, vocab, concat rules) need no further copy, and the flat buffer is
already the bytes of SGLang's flattened bucket (`FlatBucket.flat`): no per-round allocations, no
clone, no concatenation before the broadcast. The buffers are reused round after round (the caller
consumes a round before asking for the next) and released by `StagingBuffers.release`.

With `in_place_min_bytes` (the weight sync's broadcasts), whole parameters whose HF tensors are their own
bytes in order (an expert's fc1 is [gate; up], its fc2 is down) are not copied at all when they lie back to
back: Megatron DDP keeps a layer's experts contiguous in its parameter buffer, so a round's run of them is
sent as a flat view of that buffer (`PartedBucket`: the runs, then the staged rest, one broadcast each).
Which of a rank's interchangeable assignments go in which round is ordered by address first, so the runs
are long; no round's bytes or links change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_search.config.hf import Architecture
from megatron_search.models.hf_mapping import MappingError, Match
from megatron_search.models.provider import sync_params
from megatron_search.rollout.sglang.weight_group import round_up_bytes
from megatron_search.weights.params import LocalParam, local_params, model_mapping, padded_vocab_size
from megatron_search.weights.send_plan import Destination, LinkCosts, ParamShards, SendPlan, build_send_plan

Bucket = list[tuple[str, torch.Tensor]]


class FlatBucket(list):
    """A bucket whose tensors are views, back to back in order, of one contiguous byte buffer `flat`
    (SGLang's flattened bucket: a broadcast sends `flat` as is). Valid until the next round."""

    def __init__(self, items: Bucket, flat: torch.Tensor):
        super().__init__(items)
        self.flat = flat


class PartedBucket(list):
    """A destination's round as several flattened buckets (`parts`: runs of parameters sent as they lie, then
    the staged rest); as a list, all their (name, tensor) pairs. Each part is one broadcast."""

    def __init__(self, parts: list[FlatBucket]):
        super().__init__(item for part in parts for item in part)
        self.parts = parts


class StagingBuffers:
    """Reusable byte buffers of one rank's export (per destination, plus one for pulled shards), grown on
    demand and kept until `release` (a weight sync releases them at the end of each push)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._bufs: dict = {}

    def get(self, key, nbytes: int) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            self._bufs.pop(key, None)
            buf = torch.empty(round_up_bytes(nbytes), dtype=torch.uint8, device=self.device)
            self._bufs[key] = buf
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() for b in self._bufs.values())

    def release(self) -> None:
        self._bufs.clear()


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
                 destinations: Optional[Sequence[Destination]] = None, rank_node: Optional[Sequence[int]] = None,
                 link_costs: Optional[LinkCosts] = None, in_place_min_bytes: Optional[int] = None,
                 skip_prefixes: tuple[str, ...] = ()):
        """`skip_prefixes`: Megatron parameter names left out of the export (GRPO's push: "mtp.", see
        weights/delivery.py)."""
        if bucket_bytes <= 0:
            raise BucketTooSmallError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.world_group = world_group
        self.rank = dist.get_rank(world_group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(world_group) if dist.is_initialized() else 1
        self.dst_rank = dst_rank
        self.out_dtype = out_dtype
        self.bucket_bytes = bucket_bytes
        self.model_chunks = list(model_chunks)  # every pass gathers them first (sync_params)
        mapping0 = model_mapping(model_chunks, arch)  # MTP rules when the model builds MTP layers
        self.local: dict[str, LocalParam] = {p.global_name: p for p in local_params(model_chunks, mapping0, groups)
                                             if not p.global_name.startswith(skip_prefixes)}
        first = next(iter(self.local.values()), None)
        self.device = first.tensor.device if first is not None else torch.device("cpu")
        self.mapping = model_mapping(model_chunks, arch, padded_vocab_size(list(self.local.values()), arch.vocab_size))
        self.entries = self._plan_entries()
        self.buckets = self._plan_buckets()  # checks every parameter fits a bucket (the error names the tensor)
        if destinations is None:
            destinations = [Destination(f"rank{dst_rank}", (), (dst_rank,))]
        self.plan: SendPlan = build_send_plan(self.param_shards(), destinations,
                                              rank_node if rank_node is not None else [0] * self.world, bucket_bytes,
                                              link_costs)
        # in place: runs of at least this many bytes of parameters lying back to back go out as they lie
        self.in_place_min_bytes = in_place_min_bytes
        self._lies: dict[int, int] = {}  # entry index -> address of this rank's parameter whose bytes are its HF tensors
        if in_place_min_bytes is not None:
            self._lies = self._entries_that_lie_as_sent()
            self._order_in_place()
        # bytes one pass over the rounds sends from where the parameters lie (the runs are fixed by the plan)
        self.in_place_bytes_per_push = sum(
            self.entries[self.plan.assignments[k].param].hf_bytes(self.out_dtype)
            for rnd in self.plan.rounds for runs in self._split_round(rnd.get(self.rank, []))[0].values()
            for run in runs for k in run)

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
    def _move_shards(self, ids: list[int], staging: Optional[StagingBuffers] = None
                     ) -> dict[tuple[int, int], torch.Tensor]:
        """One round's point-to-point shard moves, all posted before any is waited on. Sources send their
        parameter tensors as they are (contiguous views, no packed copy). Returns {(assignment, shard): tensor}
        received by this rank (views of one scratch buffer when `staging` is given)."""
        works, got = self._post_moves(ids, staging, self.world_group)
        for req in works:
            req.wait()
        return got

    def _post_moves(self, ids: list[int], staging: Optional[StagingBuffers], group) -> tuple[list, dict]:
        """Post a round's shard moves on `group` without waiting: (requests, {(assignment, shard): buffer})."""
        ops, got = [], {}
        scratch, pos = None, 0
        if staging is not None:
            need = sum(_align(n) for n in self._pulled_sizes(ids))
            if need:
                scratch = staging.get("pulled", need)
        for k in ids:
            a = self.plan.assignments[k]
            e = self.entries[a.param]
            for i, src in enumerate(a.sources):
                if src == a.sender:
                    continue
                if self.rank == src:
                    ops.append(dist.P2POp(dist.isend, self.local[e.name].tensor.detach().contiguous(), a.sender,
                                          group=group))
                elif self.rank == a.sender:
                    if scratch is not None:
                        n = _numel(e.shard_shapes[i]) * e.dtype.itemsize
                        buf = scratch[pos:pos + n].view(e.dtype).view(e.shard_shapes[i])
                        pos += _align(n)
                    else:
                        buf = torch.empty(e.shard_shapes[i], dtype=e.dtype, device=self.device)
                    ops.append(dist.P2POp(dist.irecv, buf, src, group=group))
                    got[(k, i)] = buf
        return (dist.batch_isend_irecv(ops) if ops else []), got

    def _pulled_sizes(self, ids: list[int]) -> list[int]:
        """Bytes of every shard this rank receives in a round (in posting order)."""
        out = []
        for k in ids:
            a = self.plan.assignments[k]
            if a.sender != self.rank:
                continue
            e = self.entries[a.param]
            out += [_numel(e.shard_shapes[i]) * e.dtype.itemsize for i, src in enumerate(a.sources) if src != self.rank]
        return out

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

    def _assemble_into(self, k: int, remote: dict, buf: torch.Tensor, off: int) -> tuple[Bucket, int]:
        """`_assemble`, writing the HF tensors back to back into the byte buffer `buf` from offset `off`.
        Returns the (name, view of buf) pairs and the offset after them."""
        a = self.plan.assignments[k]
        e = self.entries[a.param]
        out_dtype = self.out_dtype or e.dtype
        shards = [self.local[e.name].tensor.detach() if src == self.rank else remote.pop((k, i))
                  for i, src in enumerate(a.sources)]
        layout = e.match.rule.tp
        full_bytes = _numel(e.full_shape) * e.dtype.itemsize
        if (len(shards) > 1 and layout.dim is not None and out_dtype == e.dtype and off % e.dtype.itemsize == 0
                and off + full_bytes <= buf.numel()):
            # gather in place: the full tensor is written where its HF tensors go
            full = layout.gather(shards, self.mapping.ctx, out=buf[off:off + full_bytes].view(e.dtype).view(e.full_shape))
        else:  # a replicated parameter (the live tensor itself), or a cast on the way
            full = layout.gather(shards, self.mapping.ctx)
        outs = self.mapping.to_hf(e.match, full, e.zero_centered)
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
        targets, pos = [], off
        for name, t in outs:
            n = t.numel() * out_dtype.itemsize
            # a tensor after one of another dtype may start off its alignment: its bytes are copied as bytes
            targets.append(buf[pos:pos + n].view(out_dtype).view(t.shape) if pos % out_dtype.itemsize == 0
                           else buf[pos:pos + n])
            pos += n
        # an HF tensor that is a view of the in-place full tensor at another place would be overwritten by
        # its siblings' copies: take it out first (no table rule does this today)
        outs = [(name, t.clone() if t.data_ptr() != dst.data_ptr() and lo <= t.data_ptr() < hi else t)
                for (name, t), dst in zip(outs, targets)]
        named = []
        for (name, t), dst in zip(outs, targets):
            if dst.dtype == torch.uint8 and out_dtype != torch.uint8:  # unaligned slot
                t = t.to(out_dtype).contiguous()
                dst.copy_(t.reshape(-1).view(torch.uint8))
                named.append((name, t))
                continue
            if t.data_ptr() != dst.data_ptr() or t.dtype != dst.dtype or t.stride() != dst.stride():
                dst.copy_(t)
            named.append((name, dst))
        return named, pos

    # ---- buckets sent from the parameters as they lie (weight sync, broadcast) -------------------
    def _entries_that_lie_as_sent(self) -> dict[int, int]:
        """{entry index: its parameter's address} for this rank's whole parameters whose HF tensors are their
        bytes in order, in the delivered dtype (an expert's fc1 is [gate; up], its fc2 is down): such a
        parameter's bytes are already its part of a flattened bucket."""
        out = {}
        for i, e in enumerate(self.entries):
            lp = self.local.get(e.name)
            if lp is None or lp.tp_size > 1 or (self.out_dtype not in (None, e.dtype)):
                continue
            t = lp.tensor.detach()
            if not t.is_contiguous():
                continue
            pos = t.data_ptr()
            for _, h in self.mapping.to_hf(e.match, t, e.zero_centered):
                if h.data_ptr() != pos or not h.is_contiguous() or h.dtype != t.dtype:
                    break
                pos += h.numel() * h.element_size()
            else:
                if pos == t.data_ptr() + t.numel() * t.element_size():
                    out[i] = t.data_ptr()
        return out

    def _in_place(self, k: int) -> bool:
        a = self.plan.assignments[k]
        return a.param in self._lies and a.sender == self.rank and all(src == self.rank for src in a.sources)

    def _order_in_place(self) -> None:
        """Give this rank's rounds their in-place parameters in address order: among assignments that differ
        only in which parameter they carry (same destination, same bytes, nothing pulled), the earliest
        round takes the lowest addresses. Every round keeps its bytes and link loads, no other rank's work
        changes, and a round's parameters come out as few runs back to back (Megatron DDP's buffers hold a
        layer's experts contiguously)."""
        slots: dict[tuple, list[tuple[int, int]]] = {}
        for r, rnd in enumerate(self.plan.rounds):
            for pos, k in enumerate(rnd.get(self.rank, [])):
                if self._in_place(k):
                    a = self.plan.assignments[k]
                    slots.setdefault((a.dest, self.plan.params[a.param].hf_bytes), []).append((r, pos))
        for group in slots.values():
            ids = sorted((self.plan.rounds[r][self.rank][pos] for r, pos in group),
                         key=lambda k: self._lies[self.plan.assignments[k].param])
            for (r, pos), k in zip(group, ids):
                self.plan.rounds[r][self.rank][pos] = k

    def _runs(self, ids: list[int]) -> tuple[list[list[int]], list[int]]:
        """This round's in-place assignments for one destination cut into runs that lie back to back and
        reach `in_place_min_bytes`; the rest (and shorter runs) are assembled into the staging buffer."""
        # where each parameter lies now (one moved since the plan, by an offload say, starts a run of its own)
        lying = sorted((k for k in ids if self._in_place(k)),
                       key=lambda k: self.local[self.entries[self.plan.assignments[k].param].name].tensor.data_ptr())
        runs: list[list[int]] = []
        end = storage = None
        for k in lying:
            e = self.entries[self.plan.assignments[k].param]
            t = self.local[e.name].tensor
            start = t.data_ptr()
            if runs and start == end and t.untyped_storage().data_ptr() == storage:  # back to back in one buffer
                runs[-1].append(k)
            else:
                runs.append([k])
            end, storage = start + t.numel() * t.element_size(), t.untyped_storage().data_ptr()
        keep = [run for run in runs
                if sum(self.entries[self.plan.assignments[k].param].hf_bytes(self.out_dtype) for k in run)
                >= self.in_place_min_bytes]
        kept = {k for run in keep for k in run}
        return keep, [k for k in ids if k not in kept]

    def _split_round(self, ids: list[int]) -> tuple[dict[int, list[list[int]]], list[int]]:
        """This rank's assignments of a round: ({destination: its in-place runs}, the ids to stage, in order)."""
        if not self._lies:
            return {}, ids
        runs: dict[int, list[list[int]]] = {}
        staged: set[int] = set()
        for d in sorted({self.plan.assignments[k].dest for k in ids}):
            keep, rest = self._runs([k for k in ids if self.plan.assignments[k].dest == d])
            if keep:
                runs[d] = keep
            staged.update(rest)
        return runs, [k for k in ids if k in staged]

    def _run_bucket(self, run: list[int]) -> "FlatBucket":
        """A run's HF tensors (views of the parameters) and its bytes as one flat view of their storage."""
        named = []
        for k in run:
            e = self.entries[self.plan.assignments[k].param]
            named += self.mapping.to_hf(e.match, self.local[e.name].tensor.detach(), e.zero_centered)
        first = self.local[self.entries[self.plan.assignments[run[0]].param].name].tensor.detach()
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        flat = torch.empty(0, dtype=torch.uint8, device=first.device).set_(
            first.untyped_storage(), first.storage_offset() * first.element_size(), (nbytes,))
        return FlatBucket(named, flat)

    def staged_bytes(self, rnd: dict[int, list[int]]) -> dict[int, int]:
        """Bytes of flat buffer a round needs on this rank, per destination (room for an in-place gather)."""
        need: dict[int, int] = {}
        used: dict[int, int] = {}
        for k in rnd.get(self.rank, []):
            a = self.plan.assignments[k]
            e = self.entries[a.param]
            at = used.get(a.dest, 0)
            used[a.dest] = at + e.hf_bytes(self.out_dtype)
            room = at + _numel(e.full_shape) * e.dtype.itemsize if self.out_dtype in (None, e.dtype) else 0
            need[a.dest] = max(need.get(a.dest, 0), used[a.dest], room)
        return need

    def rounds(self, staging: Optional[StagingBuffers] = None) -> Iterator[dict[int, Bucket]]:
        """Per round, this rank's assembled tensors by destination index ({} when it sends nothing).
        With `staging`, each destination's bucket is a FlatBucket in a reused buffer (see module doc)."""
        if staging is not None:
            staged = StagedRounds(self, staging, self.world_group)
            for k in range(len(self.plan.rounds)):
                yield staged.take(k)
            return
        sync_params(self.model_chunks)
        for rnd in self.plan.rounds:
            ids = [k for sender_ids in rnd.values() for k in sender_ids]
            remote = self._move_shards(ids)
            mine: dict[int, Bucket] = {}
            for k in rnd.get(self.rank, []):
                mine.setdefault(self.plan.assignments[k].dest, []).extend(self._assemble(k, remote))
            yield mine

    def _assemble_round(self, k_round: int, remote: dict, staging: StagingBuffers) -> dict[int, Bucket]:
        runs, ids = self._split_round(self.plan.rounds[k_round].get(self.rank, []))
        need = self.staged_bytes({self.rank: ids})
        offsets: dict[int, int] = {}
        mine: dict[int, Bucket] = {}
        for k in ids:
            d = self.plan.assignments[k].dest
            named, offsets[d] = self._assemble_into(k, remote, staging.get(("dest", d), need[d]), offsets.get(d, 0))
            mine.setdefault(d, []).extend(named)
        out: dict[int, Bucket] = {d: FlatBucket(items, staging.get(("dest", d), need[d])[:offsets[d]])
                                  for d, items in mine.items()}
        for d, keep in runs.items():
            out[d] = PartedBucket([self._run_bucket(run) for run in keep] + ([out[d]] if d in out else []))
        return out

    def __iter__(self) -> Iterator[Bucket]:
        for mine in self.rounds():
            yield [item for bucket in mine.values() for item in bucket]


class StagedRounds:
    """The export round by round into `staging`, with the next round's shard moves in flight meanwhile.

    `take(k)` (rounds in order, on every rank) waits for round k's shard moves, assembles this rank's
    round-k buckets into the staging buffers (FlatBucket per destination) and posts round k+1's moves on
    `group` before returning, so they travel while the caller delivers round k. Round k's buckets stay
    valid until `take(k + 1)`. Pulled shards land in one scratch buffer: round k+1's moves are posted only
    once round k's shards are assembled, so a rank holds at most assembled(k) + max(pulled(k), pulled(k + 1))
    (SendPlan.peak_extra_bytes). Give `group` a process group of its own (a copy of
    the training world) when the caller runs other collectives on the world meanwhile, so neither waits
    behind the other."""

    def __init__(self, exporter: "HFExporter", staging: StagingBuffers, group=None):
        self.exporter, self.staging, self.group = exporter, staging, group
        self._posted: Optional[tuple[int, list, dict]] = None
        self._next = 0
        sync_params(exporter.model_chunks)  # parallel.overlap_param_gather: current parameters before any move
        self._post(0)

    def _post(self, k: int) -> None:
        rounds = self.exporter.plan.rounds
        if k < len(rounds):
            ids = [j for sender_ids in rounds[k].values() for j in sender_ids]
            works, got = self.exporter._post_moves(ids, self.staging, self.group)
            self._posted = (k, works, got)

    def take(self, k: int) -> dict[int, Bucket]:
        if k != self._next or self._posted is None or self._posted[0] != k:
            raise RuntimeError(f"StagedRounds.take({k}): rounds must be taken in order (next is {self._next})")
        _, works, remote = self._posted
        self._posted = None
        for req in works:
            req.wait()
        mine = self.exporter._assemble_round(k, remote, self.staging)
        self._next = k + 1
        self._post(k + 1)
        return mine

    def close(self) -> None:
        """Wait for moves still in flight (every rank posts every round, so none is left unmatched)."""
        if self._posted is not None:
            for req in self._posted[1]:
                req.wait()
            self._posted = None


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def export_hf_weights(model_chunks, arch: Architecture, bucket_bytes: int, groups, *, dst_rank: int = 0,
                      out_dtype: Optional[torch.dtype] = None, world_group=None) -> Iterator[Bucket]:
    """Iterator of buckets [(hf_name, full tensor)]; call on every rank (buckets are empty off dst_rank)."""
    return iter(HFExporter(model_chunks, arch, groups, bucket_bytes, dst_rank=dst_rank, out_dtype=out_dtype,
                           world_group=world_group))
