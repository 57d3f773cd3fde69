"""Weight-sync time at the real layout, from the same send plan the sync executes (weights/send_plan.py).

The parameters are placed on ranks arithmetically, the way Megatron-Core's rank generator lays them
out (order tp-cp-ep-dp-pp for dense weights, tp-ep-dp-pp with ETP for routed experts), grouped the way
they travel (one entry per layer for its TP-sharded dense block, its norms, and per EP rank its
experts), in the delivered dtype (bf16). No process group is needed: 256 ranks are a few lists.

Time model: every GPU has an equal share of its node's NIC bandwidth and its own NVLink. Shards
pulled from another node cross both NICs; within a node they go over NVLink, as do colocated
deliveries (CUDA IPC: the engine reads the trainer's memory on the same node). A disaggregated
broadcast leaves the sender over its NIC and enters every engine node over that node's NICs; the
senders take turns, so their NIC times add up. The estimate is the busiest NIC plus the busiest
NVLink (pulls and deliveries are not assumed to overlap). The physical floor is what the busiest
node must receive over its NICs: the bytes of every engine on it that no rank of that node holds.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_search.config.hf import Architecture
from megatron_search.weights.send_plan import (ParamShards, SendPlan, build_send_plan, colocated_destinations,
                                               disaggregated_destination, funnel_plan)

from .params import count_params

BF16 = 2


@dataclass
class SyncEstimate:
    name: str
    seconds: float
    max_rank_sent_gb: float
    max_over_mean: float
    nic_seconds: float
    nvlink_seconds: float


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


def _estimate(name: str, plan: SendPlan, rank_node: list[int], engine_node: list[int] | None, gpus_per_node: int,
              nic_node: float, nvlink: float, ipc_delivery: bool, turns: bool) -> SyncEstimate:
    nic_gpu = nic_node / gpus_per_node
    world = len(rank_node)
    nic_out, nic_in, nvl = [0.0] * world, [0.0] * world, [0.0] * world
    engine_in: dict[int, float] = {}
    for a in plan.assignments:
        p = plan.params[a.param]
        for i, src in enumerate(a.sources):
            if src == a.sender:
                continue
            b = p.shard_bytes[i]
            if rank_node[src] != rank_node[a.sender]:
                nic_out[src] += b
                nic_in[a.sender] += b
            else:
                nvl[src] += b
        dest = plan.destinations[a.dest]
        if ipc_delivery:
            nvl[a.sender] += p.hf_bytes * dest.fanout  # one IPC hand-off per engine on the node
        else:
            nic_out[a.sender] += p.hf_bytes * dest.fanout
            if engine_node is not None:
                for e in dest.engines:
                    engine_in[engine_node[e]] = engine_in.get(engine_node[e], 0.0) + p.hf_bytes
    per_rank_nic = [max(o, i) / nic_gpu for o, i in zip(nic_out, nic_in)]
    nic_s = sum(per_rank_nic) if turns else max(per_rank_nic)
    nic_s = max([nic_s] + [b / nic_node for b in engine_in.values()])
    nvl_s = max(nvl) / nvlink
    sent = plan.sent_bytes()
    mean = sum(sent) / max(len(sent), 1)
    return SyncEstimate(name, (nic_s + nvl_s), max(sent) / 1e9, max(sent) / mean if mean else 0.0, nic_s, nvl_s)


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


def weight_sync_report(cfg, train_gpus: int) -> SyncReport:
    """The planned owner-parallel sync and a rank-0 funnel, priced for `cfg` on its cluster."""
    a, p, c, r = cfg.model.architecture, cfg.parallel, cfg.cluster, cfg.rollout
    params = layout_params(a, p.tp, p.pp, p.ep, p.etp, train_gpus)
    gpn = c.gpus_per_node
    rank_node = [rank // gpn for rank in range(train_gpus)]
    engine_gpus = r.sglang.tp * r.sglang.dp
    bucket = cfg.weight_bucket_bytes()
    nic, nvl = c.nic_gb_per_s * 1e9, c.nvlink_gb_per_s * 1e9
    if r.mode == "colocated":
        n_engines = train_gpus // engine_gpus
        engine_node = [e * engine_gpus // gpn for e in range(n_engines)]
        planned = build_send_plan(params, colocated_destinations(rank_node, engine_node), rank_node, bucket)
        est = _estimate("owner-parallel, node-local", planned, rank_node, engine_node, gpn, nic, nvl,
                        ipc_delivery=True, turns=False)
        floor_s, floor_gb = _floor(params, rank_node, engine_node, nic)
    else:
        n_engines = c.rollout_nodes * gpn // engine_gpus
        first = train_gpus // gpn
        engine_node = [first + e * engine_gpus // gpn for e in range(n_engines)]
        broadcast = r.resolved_weight_sync() != "tensor"
        planned = build_send_plan(params, disaggregated_destination(train_gpus, n_engines, broadcast), rank_node, bucket)
        est = _estimate("owner-parallel, broadcast turns" if broadcast else "owner-parallel, HTTP", planned,
                        rank_node, engine_node, gpn, nic, nvl, ipc_delivery=False, turns=broadcast)
        model = sum(q.hf_bytes for q in params)
        floor_s, floor_gb = model / nic, model / 1e9  # every engine node receives the whole model
    funnel = funnel_plan(params, train_gpus, 0, bucket, engines=tuple(range(n_engines)))
    fun = _estimate("rank-0 funnel", funnel, rank_node, engine_node, gpn, nic, nvl, ipc_delivery=False, turns=False)
    return SyncReport(sum(q.hf_bytes for q in params) / 1e9, est, fun, floor_s, floor_gb, train_gpus, n_engines,
                      c.nic_gb_per_s, c.nvlink_gb_per_s)


def format_sync_report(rep: SyncReport) -> str:
    lines = [f"weight sync: {rep.model_gb:.1f} GB of bf16 weights from {rep.ranks} training ranks into {rep.engines} "
             f"engine(s); NIC {rep.nic_gb_per_s:g} GB/s per node, NVLink {rep.nvlink_gb_per_s:g} GB/s per GPU"]
    for e in (rep.planned, rep.funnel):
        lines.append(f"  {e.name:32s} {e.seconds:8.2f} s  (NIC {e.nic_seconds:.2f} s + NVLink {e.nvlink_seconds:.2f} s;"
                     f" busiest rank sends {e.max_rank_sent_gb:.1f} GB, {e.max_over_mean:.2f}x the mean)")
    lines.append(f"  {'physical floor':32s} {rep.floor_seconds:8.2f} s  (the busiest node must receive "
                 f"{rep.floor_node_gb:.1f} GB over its NICs)")
    return "\n".join(lines)
