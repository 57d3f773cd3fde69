"""Slurm launch plans: node split, SGLang engines, training argv, and the sbatch scripts' --dry-run."""
import os
import secrets
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
    """The dry run shows the engines' API key passing through the environment ($MEGATRON_SEARCH_ENGINE_KEY, read by
    rollout/sglang_serve.py), never on a command line: a key set in the environment appears nowhere in it."""
    key = secrets.token_urlsafe(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["MEGATRON_SEARCH_ENGINE_KEY"] = key
    out = subprocess.run(["bash", "slurm/grpo_397b.sh", "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    engine = "[node032] python -m megatron_search.rollout.sglang_serve --api-key-env MEGATRON_SEARCH_ENGINE_KEY --model-path"
    assert "world 256" in out.stdout and engine in out.stdout
    assert "engine API key: $MEGATRON_SEARCH_ENGINE_KEY in the environment" in out.stdout
    assert "FITS" in out.stdout
    assert key not in out.stdout + out.stderr and "--api-key " not in out.stdout


def test_plan_names_the_key_variable_and_no_argv_holds_a_key():
    from megatron_search.launch.slurm_plan import to_shell

    p = plan_for(["rollout.api_key_env=MY_ENGINE_KEY"], "n[1-2]")
    assert all(e.argv[1:5] == ["-m", "megatron_search.rollout.sglang_serve", "--api-key-env", "MY_ENGINE_KEY"]
               and "--api-key" not in e.argv for e in p.engines)
    assert "MS_ENGINE_KEY_ENV=MY_ENGINE_KEY" in to_shell(p).splitlines()


def test_job_script_generates_a_key_per_job_or_keeps_the_given_one(tmp_path):
    """slurm/lib.sh's ms_engine_key: a fresh secrets.token_urlsafe(32) exported when the variable is unset (two jobs,
    two keys), the job's own key kept otherwise; the log names the variable, never the value."""
    script = ('source slurm/lib.sh; MS_ENGINE_KEY_ENV=MY_ENGINE_KEY; ms_engine_key; '
              'python3 -c "import os; print(os.environ[\'MY_ENGINE_KEY\'])"')
    env = {k: v for k, v in os.environ.items() if k != "MY_ENGINE_KEY"}
    runs = [subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60) for _ in range(2)]
    keys = [r.stdout.strip() for r in runs]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert keys[0] != keys[1] and all(len(k) == 43 for k in keys)  # 32 random bytes, base64url
    assert all("generated for this job in $MY_ENGINE_KEY" in r.stderr and k not in r.stderr for r, k in zip(runs, keys))
    given = secrets.token_urlsafe(32)
    kept = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={**env, "MY_ENGINE_KEY": given},
                          timeout=60)
    assert kept.stdout.strip() == given and "from $MY_ENGINE_KEY" in kept.stderr and given not in kept.stderr
