"""Who sends which weights where: the owner-parallel send plan of a weight sync (pure: plain data in and out).

A weight sync moves every exported HF tensor to every destination. A destination is one engine fed
by its own node's training ranks (colocated: CUDA IPC handles open only on the same node) or all
engines at once through a broadcast (disaggregated). For each (parameter, destination) the plan
picks one *sender*: a training rank that may feed that destination, chosen to balance the bytes
every rank puts on its links, preferring ranks that already hold a shard. The sender assembles the
full tensor from its TP shards, pulling the shards it lacks from a holder (one on its own node
first), converts it to HF names and delivers it. No rank is a funnel: with R ranks per destination
each carries about 1/R of the model.

Each sender's parameters, in export order, are cut into buckets of at most `bucket_bytes`; round k
of the sync is every sender's k-th bucket, so every rank holds at most one bucket of assembled
tensors plus the shards it pulled for it.

The same plan is what the sync executes and what the planner prices at the real layout
(`describe`): 256 ranks are a few lists, no process groups needed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence


class SendPlanError(ValueError):
    """The layout cannot feed a destination (no allowed rank, a shard nobody holds, bucket too small)."""


@dataclass(frozen=True)
class ParamShards:
    """One exported Megatron parameter: every rank holding each of its TP shards, and its sizes."""

    name: str
    holders: tuple[tuple[int, ...], ...]  # per TP shard: global ranks holding it (all DP replicas)
    shard_bytes: tuple[int, ...]
    hf_bytes: int  # its HF tensors, in the delivered dtype


@dataclass(frozen=True)
class Destination:
    """A full copy of the weights must reach `engines` (indices); `ranks` may send to it.
    `fanout` is how many copies a sender's link carries per byte: 1 for a broadcast or one engine,
    the number of engines when a sender posts to each of them in turn."""

    name: str
    engines: tuple[int, ...]
    ranks: tuple[int, ...]
    fanout: int = 1


@dataclass(frozen=True)
class Assignment:
    param: int  # index into SendPlan.params
    dest: int  # index into SendPlan.destinations
    sender: int
    sources: tuple[int, ...]  # per TP shard, the rank it comes from (the sender itself when it holds it)


@dataclass
class SendPlan:
    params: list[ParamShards]
    destinations: list[Destination]
    rank_node: list[int]
    bucket_bytes: int
    assignments: list[Assignment] = field(default_factory=list)
    rounds: list[dict[int, list[int]]] = field(default_factory=list)  # round -> sender -> assignment ids

    # ---- accounting (what each rank's links carry) -------------------------------------------------
    def sent_bytes(self) -> list[int]:
        """Per rank: bytes it sends to engines (times the destination's fanout) plus shards it sends to senders."""
        out = [0] * len(self.rank_node)
        for a in self.assignments:
            p = self.params[a.param]
            out[a.sender] += p.hf_bytes * self.destinations[a.dest].fanout
            for i, src in enumerate(a.sources):
                if src != a.sender:
                    out[src] += p.shard_bytes[i]
        return out

    def pulled_bytes(self) -> list[int]:
        """Per rank: shard bytes it receives from other ranks to assemble what it sends."""
        out = [0] * len(self.rank_node)
        for a in self.assignments:
            p = self.params[a.param]
            out[a.sender] += sum(b for b, src in zip(p.shard_bytes, a.sources) if src != a.sender)
        return out

    def cross_node_bytes(self) -> int:
        """Shard bytes that travel between nodes while assembling (engine-bound bytes not included)."""
        n = 0
        for a in self.assignments:
            p = self.params[a.param]
            n += sum(b for b, src in zip(p.shard_bytes, a.sources) if self.rank_node[src] != self.rank_node[a.sender])
        return n

    def peak_extra_bytes(self) -> list[int]:
        """Per rank, the most it holds at once: a round's assembled HF bytes plus the shards pulled for them,
        or, while that round is delivered, plus the next round's pulled shards (their moves are in flight
        then; weights/export.StagedRounds)."""
        world = len(self.rank_node)
        assembled = [[0] * world for _ in self.rounds]
        pulled = [[0] * world for _ in self.rounds]
        for k, rnd in enumerate(self.rounds):
            for sender, ids in rnd.items():
                for j in ids:
                    a = self.assignments[j]
                    p = self.params[a.param]
                    assembled[k][sender] += p.hf_bytes
                    pulled[k][sender] += sum(b for b, s in zip(p.shard_bytes, a.sources) if s != sender)
        peak = [0] * world
        for k in range(len(self.rounds)):
            nxt = pulled[k + 1] if k + 1 < len(self.rounds) else [0] * world
            for r in range(world):
                peak[r] = max(peak[r], assembled[k][r] + max(pulled[k][r], nxt[r]))
        return peak

    def describe(self) -> dict:
        sent = self.sent_bytes()
        busy = [s for s in sent if s > 0]
        mean = sum(sent) / max(len(sent), 1)
        return {
            "ranks": len(sent), "senders": len(busy), "rounds": len(self.rounds),
            "max_sent_bytes": max(sent, default=0), "mean_sent_bytes": mean,
            "max_over_mean": max(sent, default=0) / mean if mean else 0.0,
            "cross_node_shard_bytes": self.cross_node_bytes(),
            "max_peak_extra_bytes": max(self.peak_extra_bytes(), default=0),
        }


def _sort_ranks(ranks: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted(set(ranks)))


def build_send_plan(params: Sequence[ParamShards], destinations: Sequence[Destination], rank_node: Sequence[int],
                    bucket_bytes: int) -> SendPlan:
    """Assign every (parameter, destination) a sender and shard sources, then cut rounds (see module doc).

    Greedy balance: parameters largest first; a sender is the allowed rank that minimises its link load
    after taking the parameter (its sent bytes so far + this parameter's delivery + the shards it must
    pull), ties to the lower rank. Each missing shard comes from the least-loaded holder on the sender's
    node, else the least-loaded holder anywhere."""
    if bucket_bytes <= 0:
        raise SendPlanError(f"bucket_bytes must be positive, got {bucket_bytes}")
    plan = SendPlan(list(params), list(destinations), list(rank_node), bucket_bytes)
    world = len(rank_node)
    for p in plan.params:
        if p.hf_bytes > bucket_bytes:
            raise SendPlanError(f"bucket of {bucket_bytes} bytes is smaller than {p.name} ({p.hf_bytes} bytes of HF "
                                f"tensors that travel together); raise rollout.weight_bucket_mb")
        for i, h in enumerate(p.holders):
            if not h:
                raise SendPlanError(f"{p.name}: no rank holds TP shard {i}")
            if any(not 0 <= r < world for r in h):
                raise SendPlanError(f"{p.name}: holder rank outside the world of {world}")
    load = [0] * world
    order = sorted(range(len(plan.params)), key=lambda j: (-plan.params[j].hf_bytes, j))
    chosen: dict[tuple[int, int], Assignment] = {}
    for d, dest in enumerate(plan.destinations):
        allowed = _sort_ranks(dest.ranks)
        if not allowed:
            raise SendPlanError(f"destination {dest.name}: no training rank may send to it")
        for j in order:
            p = plan.params[j]
            best, best_cost = None, None
            for s in allowed:
                pull = sum(b for b, h in zip(p.shard_bytes, p.holders) if s not in h)
                cost = load[s] + p.hf_bytes * dest.fanout + pull
                if best_cost is None or cost < best_cost:
                    best, best_cost = s, cost
            sources = []
            for i, h in enumerate(p.holders):
                if best in h:
                    sources.append(best)
                    continue
                near = [r for r in h if rank_node[r] == rank_node[best]] or list(h)
                src = min(near, key=lambda r: (load[r], r))
                load[src] += p.shard_bytes[i]
                sources.append(src)
            load[best] += p.hf_bytes * dest.fanout
            chosen[(d, j)] = Assignment(j, d, best, tuple(sources))
    # Export order within each sender (parameters were given in HF layer order), destination-major.
    per_sender: dict[int, list[int]] = {}
    for d in range(len(plan.destinations)):
        for j in range(len(plan.params)):
            a = chosen[(d, j)]
            plan.assignments.append(a)
            per_sender.setdefault(a.sender, []).append(len(plan.assignments) - 1)
    buckets: dict[int, list[list[int]]] = {}
    for s, ids in per_sender.items():
        cut: list[list[int]] = [[]]
        used = 0
        for k in ids:
            size = plan.params[plan.assignments[k].param].hf_bytes
            if used + size > bucket_bytes and cut[-1]:
                cut.append([])
                used = 0
            cut[-1].append(k)
            used += size
        buckets[s] = cut
    n_rounds = max((len(b) for b in buckets.values()), default=0)
    plan.rounds = [{s: b[k] for s, b in sorted(buckets.items()) if k < len(b)} for k in range(n_rounds)]
    return plan


def funnel_plan(params: Sequence[ParamShards], world: int, dst_rank: int, bucket_bytes: int,
                engines: Sequence[int] = (0,)) -> SendPlan:
    """Everything gathered on `dst_rank` (a checkpoint writer, or the old rank-0 sync priced for comparison)."""
    dest = Destination("rank%d" % dst_rank, tuple(engines), (dst_rank,), fanout=max(len(engines), 1))
    return build_send_plan(params, [dest], [0] * world, bucket_bytes)


def colocated_destinations(rank_node: Sequence[int], engine_node: Sequence[int]) -> list[Destination]:
    """One destination per node that hosts engines, fed only by that node's training ranks. Engines sharing
    a node share the destination: each tensor is assembled once there and handed to each of them (fanout),
    so the node pulls its missing shards once, not once per engine."""
    out = []
    for node in sorted(set(engine_node)):
        engines = tuple(e for e, n in enumerate(engine_node) if n == node)
        ranks = tuple(r for r, n in enumerate(rank_node) if n == node)
        if not ranks:
            raise SendPlanError(f"colocated engine(s) {list(engines)} on node {node}, where no training rank runs")
        out.append(Destination(f"node{node}", engines, ranks, fanout=len(engines)))
    return out


def disaggregated_destination(world: int, n_engines: int, broadcast: bool,
                              senders: Optional[Sequence[int]] = None) -> list[Destination]:
    """All engines as one destination; a broadcast carries each byte once per sender link, HTTP posts once per engine."""
    ranks = tuple(senders) if senders is not None else tuple(range(world))
    return [Destination("engines", tuple(range(n_engines)), ranks, fanout=1 if broadcast else n_engines)]
