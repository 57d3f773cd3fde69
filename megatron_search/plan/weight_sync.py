"""Weight-sync time at the real layout, from the same send plan the sync executes (weights/send_plan.py).

The parameters are placed on ranks arithmetically, the way Megatron-Core's rank generator lays them
out (order tp-cp-ep-dp-pp for dense weights, tp-ep-dp-pp with ETP for routed experts), grouped the way
they travel (one entry per layer for its TP-sharded dense block, its norms, and per EP rank its
experts), in the delivered dtype (bf16). No process group is needed: 256 ranks are a few lists.

Time model (estimate_sync): every GPU has an equal share of its node's NIC bandwidth and its own NVLink,
each direction on its own. Shards pulled from another node cross both NICs; within a node they go over
NVLink, as do colocated deliveries (CUDA IPC: the engine reads the trainer's memory on the same node). A
disaggregated broadcast leaves the sender over its NIC and enters every engine node over that node's
NICs; the senders take turns. The sync runs round by round, round k+1's shard moves beside round k's
deliveries (weights/export.StagedRounds): the estimate is the sum over those stages of the busiest rank's
busier link. The physical floor is what the busiest node must receive over its NICs: the bytes of every
engine on it that no rank of that node holds.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from megatron_search.config.hf import Architecture
from megatron_search.weights.send_plan import (LinkCosts, LinkLoad, ParamShards, SendPlan, build_send_plan,
                                               colocated_destinations, disaggregated_destination, funnel_plan)

from .params import count_params

BF16 = 2


@dataclass
class SyncEstimate:
    name: str
    seconds: float
    max_rank_sent_gb: float
    max_over_mean: float
    nic_seconds: float  # the busiest rank's NIC (either direction) over the whole sync
    nvlink_seconds: float  # the busiest rank's NVLink
    rounds: int


@dataclass
class SyncReport:
    model_gb: float
    planned: SyncEstimate
    funnel: SyncEstimate
    floor_seconds: float
    floor_node_gb: float
    ranks: int
    engines: int
    nic_gb_per_s: float
    nvlink_gb_per_s: float


def layout_params(a: Architecture, tp: int, pp: int, ep: int, etp: int, world: int) -> list[ParamShards]:
    """Exported parameters of the language model with the ranks holding each TP shard (see module doc)."""
    c = count_params(a)
    per_stage = world // pp
    dp = per_stage // tp
    edp = per_stage // (ep * etp)
    layers_per_stage = a.num_layers // pp

    def dense_holders(stage: int, t: int) -> tuple[int, ...]:
        return tuple(stage * per_stage + t + tp * d for d in range(dp))

    def sharded(name: str, n: int, stage: int) -> ParamShards:
        shard = n * BF16 // tp
        return ParamShards(name, tuple(dense_holders(stage, t) for t in range(tp)), (shard,) * tp, n * BF16)

    def replicated(name: str, n: int, stage: int) -> ParamShards:
        ranks = tuple(range(stage * per_stage, (stage + 1) * per_stage))
        return ParamShards(name, (ranks,), (n * BF16,), n * BF16)

    out = [sharded("embedding", c.embedding, 0)]
    per_ep = c.experts_per_layer // ep  # the experts one EP rank owns in a layer
    for layer in range(a.num_layers):
        s = layer // layers_per_stage
        out.append(sharded(f"layers.{layer}.dense", c.dense_per_layer[layer], s))
        out.append(replicated(f"layers.{layer}.norms", c.norms_per_layer[layer], s))
        for e in range(ep):
            holders = tuple(tuple(s * per_stage + t + etp * (e + ep * d) for d in range(edp)) for t in range(etp))
            out.append(ParamShards(f"layers.{layer}.experts.ep{e}", holders, (per_ep * BF16 // etp,) * etp,
                                   per_ep * BF16))
    out.append(replicated("final_norm", c.final_norm, pp - 1))
    out.append(sharded("output_layer", c.output_layer, pp - 1))
    return out


def _round_loads(plan: SendPlan, rank_node: list[int], costs: LinkCosts) -> list[tuple[LinkLoad, LinkLoad, dict]]:
    """Per round of the plan: (its shard moves, its deliveries, {engine node: bytes it receives})."""
    world = len(rank_node)
    out = []
    for rnd in plan.rounds:
        moves, deliveries, engine_in = LinkLoad(world, costs), LinkLoad(world, costs), {}
        for sender, ids in rnd.items():
            for j in ids:
                a = plan.assignments[j]
                p = plan.params[a.param]
                for i, src in enumerate(a.sources):
                    if src != sender:
                        moves.move(src, sender, p.shard_bytes[i], rank_node[src] == rank_node[sender])
                dest = plan.destinations[a.dest]
                deliveries.deliver(sender, p.hf_bytes * dest.fanout)
                for e in dest.engines:
                    engine_in[e] = engine_in.get(e, 0) + p.hf_bytes
        out.append((moves, deliveries, engine_in))
    return out


def estimate_sync(name: str, plan: SendPlan, rank_node: list[int], engine_node: list[int] | None, costs: LinkCosts,
                  nic_node: float, turns: bool) -> SyncEstimate:
    """Time of the sync as weights/delivery.py runs it: round k+1's shard moves travel while round k is
    delivered (export.StagedRounds), so stage j is moves(j) beside deliveries(j - 1), and the stages follow
    one another. Within a stage a rank is busy for its busier link; with `turns` (a broadcast per sender)
    the senders deliver one after another. Engine nodes also receive over their NICs (disaggregated)."""
    world = len(rank_node)
    rounds = _round_loads(plan, rank_node, costs)
    empty = (LinkLoad(world, costs), LinkLoad(world, costs), {})
    total = 0.0
    for j in range(len(rounds) + 1):
        moves = rounds[j][0] if j < len(rounds) else empty[0]
        _, deliveries, engine_in = rounds[j - 1] if j > 0 else empty
        both = LinkLoad(world, costs).add(moves).add(deliveries)
        if turns:
            stage = max(max(map(moves.time, range(world))), sum(map(deliveries.time, range(world))))
        else:
            stage = max(map(both.time, range(world)))
        if engine_node is not None and costs.delivery == "nic":
            per_node: dict[int, int] = {}
            for e, b in engine_in.items():
                per_node[engine_node[e]] = per_node.get(engine_node[e], 0) + b
            stage = max([stage] + [b / nic_node for b in per_node.values()])
        total += stage
    whole = LinkLoad(world, costs)
    for moves, deliveries, _ in rounds:
        whole.add(moves).add(deliveries)
    sent = plan.sent_bytes()
    mean = sum(sent) / max(len(sent), 1)
    return SyncEstimate(name, total, max(sent) / 1e9, max(sent) / mean if mean else 0.0,
                        max(map(whole.nic_time, range(world))), max(map(whole.nvlink_time, range(world))),
                        len(plan.rounds))


def _floor(params: list[ParamShards], rank_node: list[int], engine_node: list[int], nic_node: float) -> tuple[float, float]:
    """(seconds, GB) for the node that must receive the most over its NICs."""
    worst = 0
    for node in sorted(set(engine_node)):
        held = 0
        for p in params:
            for h, b in zip(p.holders, p.shard_bytes):
                if any(rank_node[r] == node for r in h):
                    held += b
        need = sum(p.hf_bytes for p in params) - held
        worst = max(worst, need)
    return worst / nic_node, worst / 1e9


_REPORTS: dict[tuple, SyncReport] = {}  # the send plan takes seconds at 397B; configs differing elsewhere share it


def weight_sync_report(cfg, train_gpus: int) -> SyncReport:
    """The planned owner-parallel sync and a rank-0 funnel, priced for `cfg` on its cluster (a copy; computed
    once per process for each distinct input: model, layout, cluster, engines, bucket and sync path)."""
    p, c, r = cfg.parallel, cfg.cluster, cfg.rollout
    key = (cfg.model.architecture, p.tp, p.pp, p.ep, p.etp, train_gpus, c.model_dump_json(), r.mode, r.sglang.tp,
           r.sglang.dp, cfg.weight_bucket_bytes(), r.resolved_weight_sync())
    if key not in _REPORTS:
        _REPORTS[key] = _weight_sync_report(cfg, train_gpus)
    return copy.deepcopy(_REPORTS[key])


def _weight_sync_report(cfg, train_gpus: int) -> SyncReport:
    a, p, c, r = cfg.model.architecture, cfg.parallel, cfg.cluster, cfg.rollout
    params = layout_params(a, p.tp, p.pp, p.ep, p.etp, train_gpus)
    gpn = c.gpus_per_node
    rank_node = [rank // gpn for rank in range(train_gpus)]
    engine_gpus = r.sglang.tp * r.sglang.dp
    bucket = cfg.weight_bucket_bytes()
    nic = c.nic_gb_per_s * 1e9
    over_nic = LinkCosts.for_cluster(c, colocated=False)
    if r.mode == "colocated":
        n_engines = train_gpus // engine_gpus
        engine_node = [e * engine_gpus // gpn for e in range(n_engines)]
        costs = LinkCosts.for_cluster(c, colocated=True)
        planned = build_send_plan(params, colocated_destinations(rank_node, engine_node), rank_node, bucket, costs)
        est = estimate_sync("owner-parallel, node-local", planned, rank_node, engine_node, costs, nic, turns=False)
        floor_s, floor_gb = _floor(params, rank_node, engine_node, nic)
    else:
        n_engines = c.rollout_nodes * gpn // engine_gpus
        first = train_gpus // gpn
        engine_node = [first + e * engine_gpus // gpn for e in range(n_engines)]
        broadcast = r.resolved_weight_sync() != "tensor"
        planned = build_send_plan(params, disaggregated_destination(train_gpus, n_engines, broadcast), rank_node, bucket,
                                  over_nic)
        est = estimate_sync("owner-parallel, broadcast turns" if broadcast else "owner-parallel, HTTP", planned,
                            rank_node, engine_node, over_nic, nic, turns=broadcast)
        model = sum(q.hf_bytes for q in params)
        floor_s, floor_gb = model / nic, model / 1e9  # every engine node receives the whole model
    funnel = funnel_plan(params, train_gpus, 0, bucket, engines=tuple(range(n_engines)))
    fun = estimate_sync("rank-0 funnel", funnel, rank_node, engine_node, over_nic, nic, turns=False)
    return SyncReport(sum(q.hf_bytes for q in params) / 1e9, est, fun, floor_s, floor_gb, train_gpus, n_engines,
                      c.nic_gb_per_s, c.nvlink_gb_per_s)


def format_sync_report(rep: SyncReport) -> str:
    lines = [f"weight sync: {rep.model_gb:.1f} GB of bf16 weights from {rep.ranks} training ranks into {rep.engines} "
             f"engine(s); NIC {rep.nic_gb_per_s:g} GB/s per node, NVLink {rep.nvlink_gb_per_s:g} GB/s per GPU"]
    for e in (rep.planned, rep.funnel):
        lines.append(f"  {e.name:32s} {e.seconds:8.2f} s  ({e.rounds} rounds, each one's moves beside the last one's "
                     f"deliveries; busiest NIC {e.nic_seconds:.2f} s, busiest NVLink {e.nvlink_seconds:.2f} s; busiest "
                     f"rank sends {e.max_rank_sent_gb:.1f} GB, {e.max_over_mean:.2f}x the mean)")
    lines.append(f"  {'physical floor':32s} {rep.floor_seconds:8.2f} s  (the busiest node must receive "
                 f"{rep.floor_node_gb:.1f} GB over its NICs)")
    return "\n".join(lines)
