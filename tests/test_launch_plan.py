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


@pytest.mark.multiprocess
def test_sbatch_script_dry_run_without_slurm():
    """The dry run shows the engines' API key passing through the environment ($MEGATRON_SEARCH_ENGINE_KEY, read by
    rollout/sglang/serve.py), never on a command line: a key set in the environment appears nowhere in it."""
    key = secrets.token_urlsafe(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["MEGATRON_SEARCH_ENGINE_KEY"] = key
    out = subprocess.run(["bash", "slurm/grpo_397b.sh", "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    engine = "[node032] python -m megatron_search.rollout.sglang.serve --api-key-env MEGATRON_SEARCH_ENGINE_KEY --model-path"
    assert "world 256" in out.stdout and engine in out.stdout
    assert "engine API key: $MEGATRON_SEARCH_ENGINE_KEY in the environment" in out.stdout
    assert "FITS" in out.stdout and "signal margin: a stop needs 80 s" in out.stdout  # tests/test_plan.py by hand
    assert key not in out.stdout + out.stderr and "--api-key " not in out.stdout


def test_a_dry_run_with_a_config_that_does_not_load_says_why_and_stops():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    out = subprocess.run(["bash", "slurm/grpo_397b.sh", "--dry-run", "model.path=/nonexistent"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "model.path: /nonexistent does not exist" in out.stderr and "does not load" in out.stderr


def test_plan_names_the_key_variable_and_no_argv_holds_a_key():
    from megatron_search.launch.slurm_plan import to_shell

    p = plan_for(["rollout.api_key_env=MY_ENGINE_KEY"], "n[1-2]")
    assert all(e.argv[1:5] == ["-m", "megatron_search.rollout.sglang.serve", "--api-key-env", "MY_ENGINE_KEY"]
               and "--api-key" not in e.argv for e in p.engines)
    assert "MS_ENGINE_KEY_ENV=MY_ENGINE_KEY" in to_shell(p).splitlines()


@pytest.mark.multiprocess
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


def test_plan_restarts_engines_up_to_the_configured_limit():
    from megatron_search.launch.slurm_plan import describe, to_shell

    dis = ["rollout.mode=disaggregated", "cluster.rollout_nodes=1"]
    p = plan_for([*dis, "rollout.health.max_restarts=5"], "n[1-2]")
    assert p.engine_restarts == 5 and "MS_ENGINE_RESTARTS=5" in to_shell(p).splitlines()
    assert "started again, up to 5 times" in describe(p)
    assert plan_for(dis, "n[1-2]").engine_restarts == 3  # the schema's default
    # colocated: an engine started again by the script would claim its GPUs beside the resident trainer
    co = plan_for(["rollout.health.max_restarts=5"], "n[1-2]")
    assert co.engine_restarts == 0 and "MS_ENGINE_RESTARTS=0" in to_shell(co).splitlines()


def _fake_srun(tmp_path):
    """An `srun` that drops its options and runs the command here (no Slurm needed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.multiprocess
def test_job_script_starts_an_engine_that_exits_again_up_to_the_limit(tmp_path):
    """slurm/lib.sh's ms_serve_engine: an engine that keeps exiting runs 1 + MS_ENGINE_RESTARTS times, into one log."""
    script = (f'source slurm/lib.sh; MS_LOG_DIR={tmp_path}; mkdir -p {tmp_path}/sglang; MS_ENGINE_NODE_0=n7; '
              f'MS_ENGINE_ARGV_0=(bash -c "echo run >> {tmp_path}/runs; exit 3"); MS_ENGINE_RESTARTS=2; '
              'MS_ENGINE_RESTART_DELAY=0; ms_serve_engine 0')
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=_fake_srun(tmp_path), timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "runs").read_text() == "run\n" * 3
    assert "engine 0 on n7 exited (code 3); starting it again (1 of 2)" in r.stderr
    assert "exited (code 3); starting it again (2 of 2)" in r.stderr
    assert "exited (code 3); restarted 2 time(s), not again" in r.stderr


@pytest.mark.multiprocess
def test_job_script_stops_a_supervised_engine_on_sigterm(tmp_path):
    """ms_cleanup's SIGTERM to the supervisor stops the engine it runs, and no restart follows."""
    import signal
    import time

    script = (f'source slurm/lib.sh; MS_LOG_DIR={tmp_path}; mkdir -p {tmp_path}/sglang; MS_ENGINE_NODE_0=n7; '
              f'MS_ENGINE_ARGV_0=(bash -c "echo \\$\\$ >> {tmp_path}/pids; exec sleep 300"); MS_ENGINE_RESTARTS=3; '
              'MS_ENGINE_RESTART_DELAY=0; ms_serve_engine 0')
    sup = subprocess.Popen(["bash", "-c", script], env=_fake_srun(tmp_path), stderr=subprocess.PIPE, text=True)
    pids = tmp_path / "pids"
    deadline = time.monotonic() + 30
    while not (pids.exists() and pids.read_text().strip()):
        assert time.monotonic() < deadline, "the engine never started"
        time.sleep(0.05)
    engine = int(pids.read_text().split()[0])
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=30) == 0
    time.sleep(0.3)
    assert pids.read_text().split() == [str(engine)]  # not started again
    with pytest.raises(ProcessLookupError):
        os.kill(engine, 0)
