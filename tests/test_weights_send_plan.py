"""The send plan's rounds: an edge colouring keeps every rank's share of each round equal (weights/send_plan.py).

Properties are checked against counts taken here from the plan's own assignments, not from the scheduler's
internals: every (parameter, destination) is sent once, by an allowed rank, from holders of its shards; no
sender's round exceeds a bucket; and in every round no rank receives or serves more expert units over the
NIC than ceil(its busiest rank's total / rounds) allows. The colouring itself is checked on random bipartite
multigraphs: proper, with no more colours than the largest degree (Koenig).
"""
from __future__ import annotations

import random
from collections import Counter

import pytest

from megatron_search.weights.send_plan import (LinkCosts, ParamShards, build_send_plan, colocated_destinations,
                                               edge_colouring)


@pytest.mark.parametrize("seed", range(20))
def test_edge_colouring_is_proper_with_max_degree_colours(seed):
    rng = random.Random(seed)
    n_left, n_right = rng.randint(1, 9), rng.randint(1, 9)
    edges = [(rng.randrange(n_left), rng.randrange(n_right)) for _ in range(rng.randint(0, 150))]
    colour = edge_colouring(edges)
    degree = Counter(("l", u) for u, _ in edges) + Counter(("r", v) for _, v in edges)
    assert len(colour) == len(edges)
    assert max(colour, default=-1) + 1 <= max(degree.values(), default=0)
    seen = Counter()
    for (u, v), c in zip(edges, colour):
        seen[("l", u, c)] += 1
        seen[("r", v, c)] += 1
    assert max(seen.values(), default=1) == 1


def _expert_layout(nodes: int, per_node: int, layers: int, unit: int, dense: int):
    """An EP layout in miniature: each rank owns one expert unit per layer (and its twin on the node `nodes // 2`
    away holds the same), and every rank holds the dense weights (TP1)."""
    world = nodes * per_node
    params = []
    for layer in range(layers):
        params.append(ParamShards(f"l{layer}.dense", (tuple(range(world)),), (dense,), dense))
        half = world // 2
        for e in range(half):
            params.append(ParamShards(f"l{layer}.ep{e}", ((e, e + half),), (unit,), unit))
    return params, [r // per_node for r in range(world)]


def test_rounds_balance_every_rank_in_every_round():
    unit, bucket = 100, 1000
    params, rank_node = _expert_layout(nodes=4, per_node=4, layers=6, unit=unit, dense=30)
    world = len(rank_node)
    dests = colocated_destinations(rank_node, list(range(4)))
    plan = build_send_plan(params, dests, rank_node, bucket, LinkCosts(nic=8.0, nvlink=1.0, delivery="nvlink"))
    # every (parameter, destination) once, by an allowed rank, from a holder
    sent = Counter((a.param, a.dest) for a in plan.assignments)
    assert sent == Counter({(j, d): 1 for j in range(len(params)) for d in range(len(dests))})
    for a in plan.assignments:
        assert a.sender in dests[a.dest].ranks
        assert all(src in h for src, h in zip(a.sources, params[a.param].holders))
    # rounds: every assignment in exactly one, each sender's round within a bucket
    in_rounds = sorted(i for rnd in plan.rounds for ids in rnd.values() for i in ids)
    assert in_rounds == list(range(len(plan.assignments)))
    for rnd in plan.rounds:
        for sender, ids in rnd.items():
            assert all(plan.assignments[i].sender == sender for i in ids)
            assert sum(params[plan.assignments[i].param].hf_bytes for i in ids) <= bucket
    # per round, expert units pulled across nodes: at most ceil(busiest total / rounds) per rank and direction
    def cross(i):
        a = plan.assignments[i]
        return [(a.sender, src) for src, b in zip(a.sources, params[a.param].shard_bytes)
                if b == unit and rank_node[src] != rank_node[a.sender]]
    total_in, total_out = Counter(), Counter()
    for i in range(len(plan.assignments)):
        for s, src in cross(i):
            total_in[s] += 1
            total_out[src] += 1
    busiest = max(list(total_in.values()) + list(total_out.values()))
    assert busiest > len(plan.rounds)  # several units per round: the bound below is not trivial
    cap = -(-busiest // len(plan.rounds))
    for rnd in plan.rounds:
        got_in, got_out = Counter(), Counter()
        for ids in rnd.values():
            for i in ids:
                for s, src in cross(i):
                    got_in[s] += 1
                    got_out[src] += 1
        assert max(got_in.values(), default=0) <= cap and max(got_out.values(), default=0) <= cap
    # the busiest rank's cross-node traffic, in bytes, is within one unit of the mean (senders balanced)
    nic_in = [total_in[r] * unit for r in range(world)]
    assert max(nic_in) - sum(nic_in) / world <= unit


def test_plan_is_the_same_on_every_call():
    """Every rank derives the plan on its own: it must not depend on anything but its arguments."""
    params, rank_node = _expert_layout(nodes=2, per_node=2, layers=3, unit=64, dense=16)
    dests = colocated_destinations(rank_node, [0, 1])
    plans = [build_send_plan(params, dests, rank_node, 512, LinkCosts(delivery="nvlink")) for _ in range(2)]
    assert plans[0].assignments == plans[1].assignments and plans[0].rounds == plans[1].rounds


def test_sync_time_overlaps_each_rounds_moves_with_the_last_rounds_deliveries():
    """Two ranks on two nodes, one colocated engine on node 0, two 100-byte parameters only rank 1 holds,
    one per round (bucket 100). By hand, with a NIC byte at 2 s and an NVLink byte at 1 s: stage 0 is round
    0's pull (200 s), stage 1 round 1's pull beside round 0's delivery (max(200, 100)), stage 2 round 1's
    delivery (100 s): 500 s."""
    from megatron_search.plan.weight_sync import estimate_sync

    params = [ParamShards(f"p{i}", ((1,),), (100,), 100) for i in range(2)]
    rank_node = [0, 1]
    costs = LinkCosts(nic=2.0, nvlink=1.0, delivery="nvlink")
    plan = build_send_plan(params, colocated_destinations(rank_node, [0]), rank_node, 100, costs)
    assert len(plan.rounds) == 2 and all(a.sender == 0 and a.sources == (1,) for a in plan.assignments)
    est = estimate_sync("t", plan, rank_node, [0], costs, nic_node=1.0, turns=False)
    assert est.seconds == 500.0
    assert est.nic_seconds == 400.0 and est.nvlink_seconds == 200.0


@pytest.mark.parametrize("per_rank", [1, 4])
def test_experts_go_out_from_their_holders_when_that_balances(per_rank):
    """EP=2 on one node, one disaggregated destination: each rank holds half of every layer's experts whole,
    so each can deliver its own half with no shard moved. Before the greedy took equal parameters in turns of
    their holders, it took one rank's experts in a row and pulled half of them to the other rank."""
    from megatron_search.weights.send_plan import disaggregated_destination

    unit, layers, experts = 64, 5, 2 * per_rank
    params = []
    for layer in range(layers):
        params.append(ParamShards(f"l{layer}.qkv", ((0,), (1,)), (10, 10), 20))  # TP=2: one shard each
        params += [ParamShards(f"l{layer}.e{e}", ((e // per_rank,),), (unit,), unit) for e in range(experts)]
    plan = build_send_plan(params, disaggregated_destination(2, 1, True), [0, 0], bucket_bytes=1000)
    expert_pulls = [a for a in plan.assignments if ".e" in params[a.param].name and a.sources != (a.sender,)]
    assert expert_pulls == []
    delivered = Counter()
    for a in plan.assignments:
        if ".e" in params[a.param].name:
            delivered[a.sender] += unit
    assert delivered == {0: layers * per_rank * unit, 1: layers * per_rank * unit}
