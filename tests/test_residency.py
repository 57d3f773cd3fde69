"""The residency ledger (plan/residency.py): who holds device memory at each moment of a GRPO run, written by
the run and priced by the planner. The CPU runs of tests/test_train_grpo.py record it (check_ledger, called
there); here the ledger's interface and why the order matters: the order the loop had before (engines up while
the trainer was built, the KV cache back while the parameters were resident) does not fit a 141 GiB H200 at
the 397B and 122B configs, the current one does."""
from pathlib import Path

import pytest

from megatron_search.config import load_config
from megatron_search.plan import make_plan
from megatron_search.plan.memory import GIB
from megatron_search.plan.residency import (
    COLOCATED_ORDER,
    ENGINE_KV_CACHE,
    ENGINE_WEIGHTS,
    POLICY_GRADS,
    POLICY_OPTIMIZER,
    POLICY_PARAMS,
    RM_PARAMS,
    OPTIONAL,
    Ledger,
    Moment,
    holder_sizes,
    price,
    read_ledger,
)

CONFIGS = ["configs/qwen3_5_397b_a17b_grpo.yaml", "configs/qwen3_5_122b_a10b_grpo.yaml"]


def _sizes(path: str):
    cfg = load_config(path, ["parallel.world_size=null"])
    plan = make_plan(cfg)
    fraction = cfg.rollout.sglang.mem_fraction_static * cfg.cluster.gpu_mem_gib * GIB
    usable = (cfg.cluster.gpu_mem_gib - cfg.cluster.memory_headroom_gib) * GIB
    return {st.stage: holder_sizes(st, plan.rollout, fraction, cfg.weight_bucket_bytes()) for st in plan.stages}, usable


def check_ledger(run_dir: Path, trained: bool, saved: bool) -> None:
    """A colocated CPU run's ledger: every moment one of COLOCATED_ORDER's, holding no more than it (all of them,
    holding exactly that, when it trained and saved), and priced at the 397B and 122B configs none exceeds the
    GPU."""
    recorded = read_ledger(run_dir / "residency.jsonl")
    planned = {m.name: m.holders for m in COLOCATED_ORDER}
    # a run holds at most what the plan prices (a CPU run in fp32 has no optimizer state before its first step)
    more = [(m.name, sorted(m.holders - planned.get(m.name, frozenset()))) for m in recorded
            if m.name not in planned or not m.holders <= planned[m.name]]
    assert not more, more
    names = [m.name for m in COLOCATED_ORDER if m.name not in OPTIONAL]
    assert [m.name for m in recorded[:6]] == names[:6]  # start-up, then the initial push
    if trained and saved:
        assert {m.name for m in recorded} - OPTIONAL == set(names)
        skip = OPTIONAL | {"start: trainer built"}
        assert {(m.name, m.holders) for m in recorded if m.name not in skip} == \
            {(m.name, m.holders) for m in COLOCATED_ORDER if m.name not in skip}
    for path in CONFIGS:
        sizes, usable = _sizes(path)
        peak = max(price(recorded, sizes), key=lambda m: m.total)
        assert peak.total <= usable, (path, peak.moment.name, peak.total / GIB)


def test_the_ledger_tracks_arrivals_and_departures(tmp_path):
    ledger = Ledger(tmp_path / "r.jsonl")
    ledger.arrive(ENGINE_WEIGHTS, ENGINE_KV_CACHE)
    ledger.moment("start: engines up", None)
    ledger.leave(ENGINE_KV_CACHE, ENGINE_WEIGHTS)
    ledger.leave(ENGINE_WEIGHTS)  # leaving twice is no error: a release after a failed resume
    ledger.arrive(POLICY_PARAMS)
    ledger.moment("train", 3)
    assert read_ledger(tmp_path / "r.jsonl") == [Moment("start: engines up", frozenset({ENGINE_WEIGHTS, ENGINE_KV_CACHE})),
                                                Moment("train", frozenset({POLICY_PARAMS}))]
    with pytest.raises(ValueError, match="unknown holder 'engine.cuda_graphs'"):
        ledger.arrive("engine.cuda_graphs")


@pytest.mark.parametrize("path", CONFIGS)
def test_the_old_order_does_not_fit_and_the_current_one_does(path):
    sizes, usable = _sizes(path)
    trainer = frozenset({POLICY_PARAMS, POLICY_GRADS, POLICY_OPTIMIZER})
    old = [Moment("trainer built beside the started engines", trainer | {RM_PARAMS, ENGINE_WEIGHTS, ENGINE_KV_CACHE}),
           Moment("save with the engines resident", trainer | {ENGINE_WEIGHTS, ENGINE_KV_CACHE})]
    for m in price(old, sizes):
        assert m.total > usable, (m.moment.name, m.stage, m.total / GIB)
    assert max(m.total for m in price(COLOCATED_ORDER, sizes)) <= usable
    assert make_plan(load_config(path, ["parallel.world_size=null"])).fits
