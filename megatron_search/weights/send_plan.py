"""Who sends which weights where: the owner-parallel send plan of a weight sync (pure: plain data in and out).

A weight sync moves every exported HF tensor to every destination. A destination is one engine fed
by its own node's training ranks (colocated: CUDA IPC handles open only on the same node) or all
engines at once through a broadcast (disaggregated). For each (parameter, destination) the plan
picks one *sender*: a training rank that may feed that destination, chosen to balance the time
every rank's links are busy (`LinkCosts`: its share of the node's NICs, its NVLink, and which of the
two carries deliveries), preferring ranks that already hold a shard. The sender assembles the
full tensor from its TP shards, pulling the shards it lacks from a holder (one on its own node
first), converts it to HF names and delivers it. No rank is a funnel: with R ranks per destination
each carries about 1/R of the model.

Round k of the sync is every sender's k-th bucket (at most `bucket_bytes` of assembled tensors), so
every rank holds at most one bucket plus the shards it pulled for it. The rounds follow one another
(round k+1's shards move while round k is delivered), so a round lasts as long as its busiest link and
the rounds must keep every rank equally busy (_schedule_rounds): the equal units that make up most of
a MoE model's pulls are placed by an edge colouring, the rest where they raise a round's busiest link
least. Cut in layer order instead, all senders pull the same layers at once from the few ranks that
hold them (measured on the 397B layout: 9.1 s against 1.97 s, with the same totals).

The same plan is what the sync executes and what the planner prices at the real layout
(`describe`): 256 ranks are a few lists, no process groups needed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import numpy as np


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
class LinkCosts:
    """Seconds per byte on one rank's links, which the plan balances: its share of its node's NICs (shards
    pulled from another node leave one NIC and enter another), its NVLink (shards moved within a node), and
    which of the two carries its deliveries (CUDA IPC to an engine on the node: NVLink; HTTP posts and
    broadcasts to other nodes: NIC). Each direction of a link counts on its own, and a rank's two links
    work at the same time, so a rank is busy for the longer of its NIC and NVLink times."""

    nic: float = 1.0
    nvlink: float = 1.0
    delivery: Literal["nic", "nvlink"] = "nic"

    @classmethod
    def for_cluster(cls, cluster, colocated: bool) -> "LinkCosts":
        """From the config's cluster section (nic_gb_per_s per node, gpus_per_node, nvlink_gb_per_s): colocated
        engines take their weights over NVLink (CUDA IPC), disaggregated ones over the NIC."""
        return cls(cluster.gpus_per_node / (cluster.nic_gb_per_s * 1e9), 1.0 / (cluster.nvlink_gb_per_s * 1e9),
                   "nvlink" if colocated else "nic")


class LinkLoad:
    """Bytes on each rank's links per direction (NIC out/in, NVLink out/in), and the time they take."""

    def __init__(self, world: int, costs: LinkCosts):
        self.costs = costs
        self.nic_out, self.nic_in = [0] * world, [0] * world
        self.nvl_out, self.nvl_in = [0] * world, [0] * world

    def nic_time(self, r: int) -> float:
        return max(self.nic_out[r], self.nic_in[r]) * self.costs.nic

    def nvlink_time(self, r: int) -> float:
        return max(self.nvl_out[r], self.nvl_in[r]) * self.costs.nvlink

    def time(self, r: int) -> float:
        return max(self.nic_time(r), self.nvlink_time(r))

    def move(self, src: int, dst: int, nbytes: int, same_node: bool, sign: int = 1) -> None:
        if same_node:
            self.nvl_out[src] += sign * nbytes
            self.nvl_in[dst] += sign * nbytes
        else:
            self.nic_out[src] += sign * nbytes
            self.nic_in[dst] += sign * nbytes

    def deliver(self, sender: int, nbytes: int, sign: int = 1) -> None:
        if self.costs.delivery == "nvlink":
            self.nvl_out[sender] += sign * nbytes
        else:
            self.nic_out[sender] += sign * nbytes

    def add(self, other: "LinkLoad") -> "LinkLoad":
        """Add `other`'s bytes, rank by rank and direction by direction (links carrying both at once)."""
        for mine, theirs in ((self.nic_out, other.nic_out), (self.nic_in, other.nic_in),
                             (self.nvl_out, other.nvl_out), (self.nvl_in, other.nvl_in)):
            for r, b in enumerate(theirs):
                mine[r] += b
        return self


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
                    bucket_bytes: int, costs: Optional[LinkCosts] = None) -> SendPlan:
    """Assign every (parameter, destination) a sender and shard sources, then cut rounds (see module doc).

    Greedy balance of link time (`costs`; default: a byte costs the same on either link): parameters largest
    first; the sender is the allowed rank whose busiest link (NIC or NVLink, either direction) is free
    soonest after taking the parameter, counting the shards it must pull and the ranks they come from; ties
    to the lower total time, then the lower rank. Each missing shard comes from a holder on the sender's
    node, else from any holder: the one whose outbound direction carries least so far."""
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
    costs = costs if costs is not None else LinkCosts()
    links = LinkLoad(world, costs)
    order = _holder_turns(plan.params)
    chosen: dict[tuple[int, int], tuple[int, list[int]]] = {}  # (destination, parameter) -> (sender, sources)

    def sources_for(p: ParamShards, sender: int) -> list[int]:
        """Per TP shard: the sender itself, else a holder on its node, else any holder; among several, the one
        whose outbound direction carries least so far (a pull adds to that direction only). Expert units keep
        these; the rounds choose again for the other pairs, per round."""
        out = []
        for h in p.holders:
            near = [r for r in h if rank_node[r] == rank_node[sender]]
            if sender in h:
                out.append(sender)
            elif near:
                out.append(min(near, key=lambda r: (links.nvl_out[r], r)))
            else:
                out.append(min(h, key=lambda r: (links.nic_out[r], r)))
        return out

    def take(load: LinkLoad, p: ParamShards, fanout: int, sender: int, sources: list[int], sign: int) -> None:
        for i, src in enumerate(sources):
            if src != sender:
                load.move(src, sender, p.shard_bytes[i], rank_node[src] == rank_node[sender], sign)
        load.deliver(sender, p.hf_bytes * fanout, sign)

    nic_cost, nvl_cost, nvl_delivery = costs.nic, costs.nvlink, costs.delivery == "nvlink"

    def candidate_key(p: ParamShards, fanout: int, sender: int, sources: list[int]) -> tuple:
        """(busiest, total) link time of the ranks `take` would touch, and the sender: what `take(+1)` then
        `links.time` would give, without changing `links` (the greedy tries every allowed sender)."""
        extra = {sender: [0, 0, 0, 0]}  # bytes added per direction: NIC out, NIC in, NVLink out, NVLink in
        for i, src in enumerate(sources):
            if src != sender:
                b = p.shard_bytes[i]
                pair = (2, 3) if rank_node[src] == rank_node[sender] else (0, 1)
                extra.setdefault(src, [0, 0, 0, 0])[pair[0]] += b
                extra[sender][pair[1]] += b
        extra[sender][2 if nvl_delivery else 0] += p.hf_bytes * fanout
        times = {}
        for r, (no, ni, vo, vi) in extra.items():
            times[r] = max(max(links.nic_out[r] + no, links.nic_in[r] + ni) * nic_cost,
                           max(links.nvl_out[r] + vo, links.nvl_in[r] + vi) * nvl_cost)
        touched = {sender, *sources}  # summed in this set's order, as links.time over it would be
        return max(times[r] for r in touched), sum(times[r] for r in touched), sender

    for d, dest in enumerate(plan.destinations):
        allowed = _sort_ranks(dest.ranks)
        if not allowed:
            raise SendPlanError(f"destination {dest.name}: no training rank may send to it")
        for j in order:
            p = plan.params[j]
            best = None
            for s in allowed:
                sources = sources_for(p, s)
                key = candidate_key(p, dest.fanout, s, sources)
                if best is None or key < best[0]:
                    best = (key, s, sources)
            _, sender, sources = best
            take(links, p, dest.fanout, sender, sources, +1)
            chosen[(d, j)] = (sender, sources)
    for rnd in _schedule_rounds(plan, chosen, costs, bucket_bytes):
        plan.rounds.append({})
        for sender, items in sorted(rnd.items()):  # export order within a bucket
            plan.rounds[-1][sender] = []
            for a in sorted(items, key=lambda a: (a.dest, a.param)):
                plan.assignments.append(a)
                plan.rounds[-1][sender].append(len(plan.assignments) - 1)
    return plan


_NIC_OUT, _NIC_IN, _NVL_OUT, _NVL_IN = range(4)


def _holder_turns(params: Sequence[ParamShards]) -> list[int]:
    """The order the greedy takes parameters in: largest first, and parameters of one size (a MoE layer's
    experts) in turns of their holder sets (each EP rank's first expert, then each one's second, ...).
    Taken in layer order instead, one rank's experts come in a row and the greedy balances the senders by
    pulling half of them to another rank (measured at EP=2 on 2 ranks: 235 MB of 487 MB pulled per rank,
    where what each rank holds balances them with no pull)."""
    turn: dict[int, int] = {}
    taken: dict[tuple, int] = {}
    for j in sorted(range(len(params)), key=lambda j: (-params[j].hf_bytes, j)):
        group = (params[j].hf_bytes, params[j].holders)
        turn[j] = taken.get(group, 0)
        taken[group] = turn[j] + 1
    return sorted(range(len(params)), key=lambda j: (-params[j].hf_bytes, turn[j], j))


def _schedule_rounds(plan: SendPlan, chosen: dict[tuple[int, int], tuple[int, list[int]]], costs: LinkCosts,
                     bucket_bytes: int) -> list[dict[int, list[Assignment]]]:
    """Cut the chosen (sender, sources) of every (destination, parameter) into rounds.

    The rounds follow one another, so the sync lasts about the sum over rounds of each round's busiest link,
    and what matters is that no rank is busier than the rest in any round. The bulk of a large model's pulls
    are equal units (one EP rank's experts of a layer, or one expert's weight), each one shard over the NIC:
    they are placed by a proper edge colouring of the multigraph sender (receiving) - source (serving),
    whose colours are matchings, so a round made of u colours asks no rank to receive or serve more than u
    units. K rounds: enough that no sender's bucket overflows, u colours at most per round. The other pairs
    follow, largest first, each into the round (and each of its shards onto the holder) that raises that
    round's busiest link least, then leaves the touched links freest, where the sender's bucket has room
    (a round is added when none has); ties go to a round that depends on the sender, so that equal pairs
    spread out. Returns per round {sender: assignments}."""
    node = plan.rank_node
    world = len(node)
    keys = sorted(chosen, key=lambda dj: (-plan.params[dj[1]].hf_bytes, dj[1], dj[0]))
    totals: dict[int, int] = {}
    for d, j in keys:
        totals[chosen[(d, j)][0]] = totals.get(chosen[(d, j)][0], 0) + plan.params[j].hf_bytes
    k_min = max(max((-(-t // bucket_bytes) for t in totals.values()), default=1), 1)

    def far_pulls(d: int, j: int) -> list[tuple[int, int]]:
        s, sources = chosen[(d, j)]
        return [(b, src) for b, src in zip(plan.params[j].shard_bytes, sources) if src != s and node[src] != node[s]]

    def near_pull(d: int, j: int) -> bool:
        s, sources = chosen[(d, j)]
        return any(src != s and node[src] == node[s] for src in sources)

    counts: dict[int, int] = {}
    for d, j in keys:
        far = far_pulls(d, j)
        if len(far) == 1 and not near_pull(d, j):
            counts[far[0][0]] = counts.get(far[0][0], 0) + 1
    unit = max(counts, key=lambda b: (counts[b], b)) if counts else 0
    units = [dj for dj in sorted(chosen, key=lambda dj: (dj[0], -plan.params[dj[1]].hf_bytes, dj[1]))
             if unit and [b for b, _ in far_pulls(*dj)] == [unit] and not near_pull(*dj)]
    colour = edge_colouring([(chosen[dj][0], far_pulls(*dj)[0][1]) for dj in units])
    n_colours = max(colour, default=-1) + 1
    k = k_min
    if n_colours:
        per_round = max(1, min(n_colours // k_min, bucket_bytes // unit))
        k = max(k_min, -(-n_colours // per_round))

    per_byte = np.array([costs.nic, costs.nic, costs.nvlink, costs.nvlink])
    deliver_link = _NVL_OUT if costs.delivery == "nvlink" else _NIC_OUT
    load = np.zeros((4, world, k))
    room = np.full((world, k), float(bucket_bytes))
    rounds: list[dict[int, list[Assignment]]] = [{} for _ in range(k)]

    def contributions(d: int, j: int, sources: Sequence[int]) -> list[tuple[int, int, float]]:
        s = chosen[(d, j)][0]
        p = plan.params[j]
        out = [(deliver_link, s, p.hf_bytes * plan.destinations[d].fanout * per_byte[deliver_link])]
        for b, src in zip(p.shard_bytes, sources):
            if src != s:
                o, i = (_NVL_OUT, _NVL_IN) if node[src] == node[s] else (_NIC_OUT, _NIC_IN)
                out += [(o, src, b * per_byte[o]), (i, s, b * per_byte[i])]
        return out

    def place(d: int, j: int, r: int, sources: Sequence[int]) -> None:
        s = chosen[(d, j)][0]
        for link, rank, sec in contributions(d, j, sources):
            load[link, rank, r] += sec
        room[s, r] -= plan.params[j].hf_bytes
        rounds[r].setdefault(s, []).append(Assignment(j, d, s, tuple(sources)))

    for (d, j), c in zip(units, colour):
        place(d, j, c * k // n_colours, chosen[(d, j)][1])  # each round gets floor or ceil of n_colours / k colours
    placed = set(units)
    for d, j in keys:
        if (d, j) in placed:
            continue
        s = chosen[(d, j)][0]
        p = plan.params[j]
        if not (room[s] >= p.hf_bytes).any():
            load = np.concatenate([load, np.zeros((4, world, 1))], axis=2)
            room = np.concatenate([room, np.full((world, 1), float(bucket_bytes))], axis=1)
            rounds.append({})
        k_now = room.shape[1]
        steps = np.arange(k_now)
        worst = load[deliver_link, s] + p.hf_bytes * plan.destinations[d].fanout * per_byte[deliver_link]
        inbound = np.zeros(4)
        best_holder = []
        for b, h in zip(p.shard_bytes, p.holders):
            if s in h:
                best_holder.append(None)
                continue
            near = [r for r in h if node[r] == node[s]]
            o, i = (_NVL_OUT, _NVL_IN) if near else (_NIC_OUT, _NIC_IN)
            cand = np.array(near or list(h))
            busy = load[o][cand] + b * per_byte[o]  # (holders, rounds): this shard's holders, each round
            pick = busy.argmin(axis=0)
            worst = np.maximum(worst, busy[pick, steps])
            inbound[i] += b * per_byte[i]
            best_holder.append(cand[pick])
        for i in (_NIC_IN, _NVL_IN):
            if inbound[i]:
                worst = np.maximum(worst, load[i, s] + inbound[i])
        rise = np.where(room[s] >= p.hf_bytes, np.maximum(worst - load.max(axis=(0, 1)), 0.0), np.inf)
        r = int(np.lexsort(((steps - s * k_now // world) % k_now, worst, rise))[0])
        place(d, j, r, [s if c is None else int(c[r]) for c in best_holder])
    return [r for r in rounds if r]


def edge_colouring(edges: Sequence[tuple[int, int]]) -> list[int]:
    """A proper colouring of a bipartite multigraph's edges (left, right) with as many colours as its largest
    degree (Koenig's theorem): no two edges at a vertex share a colour. Each edge takes the lowest colour a
    free at its left end; when a is taken at the right end, the path from there alternating a and b (the
    lowest colour free at the right end) is flipped first, which frees a there without taking it at the left."""
    at_l: dict[int, dict[int, int]] = {}
    at_r: dict[int, dict[int, int]] = {}
    used_l: dict[int, int] = {}  # vertex -> bit mask of colours in use
    used_r: dict[int, int] = {}
    colour = [0] * len(edges)

    def lowest_free(mask: int) -> int:
        return (~mask & (mask + 1)).bit_length() - 1

    def unset(f: int) -> None:
        u, v = edges[f]
        del at_l[u][colour[f]], at_r[v][colour[f]]
        used_l[u] &= ~(1 << colour[f])
        used_r[v] &= ~(1 << colour[f])

    def put(f: int, c: int) -> None:
        u, v = edges[f]
        colour[f] = c
        at_l.setdefault(u, {})[c] = f
        at_r.setdefault(v, {})[c] = f
        used_l[u] = used_l.get(u, 0) | 1 << c
        used_r[v] = used_r.get(v, 0) | 1 << c

    for e, (u, v) in enumerate(edges):
        a, b = lowest_free(used_l.get(u, 0)), lowest_free(used_r.get(v, 0))
        if used_r.get(v, 0) >> a & 1:
            path, on_right, vertex, c = [], True, v, a
            while True:
                f = (at_r if on_right else at_l).get(vertex, {}).get(c)
                if f is None:
                    break
                path.append(f)
                vertex = edges[f][0] if on_right else edges[f][1]
                on_right, c = not on_right, (b if c == a else a)
            for f in path:
                unset(f)
            for f in path:
                put(f, b if colour[f] == a else a)
        put(e, a)
    return colour

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
