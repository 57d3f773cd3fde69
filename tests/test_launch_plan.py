"""Slurm launch plans: node split, SGLang engines, training argv, and the sbatch scripts' --dry-run."""
import os
import subprocess

import pytest

from megatron_search.config import load_config
from megatron_search.launch.slurm_plan import LaunchError, make_launch_plan

BIG = "configs/qwen3_5_397b_a17b_grpo.yaml"


def plan_for(overrides, nodelist, stage="grpo"):
    cfg = load_config(BIG, [*overrides, "parallel.world_size=null"])
    return make_launch_plan(cfg, stage, nodelist, BIG, list(overrides))


def test_colocated_one_engine_per_node():
    p = plan_for([], "node[001-032]")
    assert p.world_size == 256 and p.master_node == "node001" and not p.rollout_nodes
    assert [e.node for e in p.engines] == [f"node{i:03d}" for i in range(1, 33)]
    assert all("--enable-memory-saver" in e.argv for e in p.engines)
    assert p.train_argv[:3] == ["megatron-search", "grpo", BIG]
    assert p.train_argv[-1] == "rollout.engine_urls=[" + ",".join(f"http://node{i:03d}:30000" for i in range(1, 33)) + "]"


def test_disaggregated_split_takes_the_last_nodes_for_rollout():
    p = plan_for(["rollout.mode=disaggregated", "cluster.rollout_nodes=2"], "gpu[1-4]")
    assert p.train_nodes == ["gpu1", "gpu2"] and p.rollout_nodes == ["gpu3", "gpu4"]
    assert [e.node for e in p.engines] == ["gpu3", "gpu4"]
    assert all("--enable-memory-saver" not in e.argv for e in p.engines)


def test_engine_spanning_two_nodes():
    p = plan_for(["rollout.sglang.tp=16", "rollout.sglang.ep=16"], "n[1-4]")
    assert [(e.node, e.serves) for e in p.engines] == [("n1", True), ("n2", False), ("n3", True), ("n4", False)]
    second = p.engines[1].argv
    assert second[second.index("--node-rank") + 1] == "1" and second[second.index("--nnodes") + 1] == "2"
    assert p.engine_urls() == ["http://n1:30000", "http://n3:30000"]


def test_several_engines_per_node_get_distinct_ports_and_disjoint_gpus():
    p = plan_for(["rollout.sglang.tp=2", "rollout.sglang.ep=2"], "n[1-2]")
    # an SGLang server takes a few ports after its HTTP one: engines on a node are 10 ports apart
    assert [(e.node, e.port) for e in p.engines] == [("n1", 30000), ("n1", 30010), ("n1", 30020), ("n1", 30030),
                                                      ("n2", 30000), ("n2", 30010), ("n2", 30020), ("n2", 30030)]
    for node in ("n1", "n2"):  # 8 GPUs, TP2 engines: GPUs {0,1}, {2,3}, {4,5}, {6,7}
        gpus = []
        for e in (e for e in p.engines if e.node == node):
            base = int(e.argv[e.argv.index("--base-gpu-id") + 1]) if "--base-gpu-id" in e.argv else 0
            gpus.append(set(range(base, base + 2)))
        assert gpus == [{0, 1}, {2, 3}, {4, 5}, {6, 7}]


def test_bad_split_is_refused():
    with pytest.raises(LaunchError, match="rollout_nodes=4"):
        plan_for(["rollout.mode=disaggregated", "cluster.rollout_nodes=4"], "n[1-4]")


def test_sbatch_script_dry_run_without_slurm():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    out = subprocess.run(["bash", "slurm/grpo_397b.sh", "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "world 256" in out.stdout and "[node032] python -m sglang.launch_server" in out.stdout
    assert "FITS" in out.stdout
