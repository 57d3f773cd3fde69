"""Slurm plans with rollout.engine=vllm (issue 23.2): vLLM servers per node on disjoint GPUs, health-checked by
slurm/lib.sh like SGLang's (GET /health, which vLLM leaves open), their key only in the environment."""
import os
import secrets
import subprocess
import sys

import pytest

from megatron_search.config import load_config
from megatron_search.launch.slurm_plan import LaunchError, make_launch_plan, to_shell

BIG = "configs/qwen3_5_397b_a17b_grpo.yaml"
VLLM = ["rollout.engine=vllm", "rollout.vllm.tp=4"]


def plan_for(overrides, nodelist):
    cfg = load_config(BIG, [*overrides, "parallel.world_size=null"])
    return make_launch_plan(cfg, "grpo", nodelist, BIG, list(overrides))


def test_vllm_engines_per_node_on_disjoint_gpus():
    p = plan_for(VLLM, "n[1-2]")  # 8 GPUs per node, TP=4: two engines per node
    assert p.engine_kind == "vLLM" and [e.node for e in p.engines] == ["n1", "n1", "n2", "n2"]
    assert p.engine_urls() == ["http://n1:30000", "http://n1:30010", "http://n2:30000", "http://n2:30010"]
    for i, e in enumerate(p.engines):
        a = e.argv
        assert a[:5] == ["python", "-m", "megatron_search.rollout.vllm.client", "--api-key-env", "MEGATRON_SEARCH_ENGINE_KEY"]
        assert a[a.index("--gpus") + 1] == ("0,1,2,3" if i % 2 == 0 else "4,5,6,7")
        assert a[a.index("--") + 1:a.index("--") + 5] == ["python", "-m", "megatron_search.rollout.vllm.launcher", "serve"]
        assert a[a.index("--host") + 1] == "0.0.0.0" and a[a.index("--port") + 1] == str(e.port)
        assert a[a.index("--seed") + 1] == str(1234 + i)  # the config's run.seed + engine index
        assert "--enable-sleep-mode" in a and "--load-format" in a  # colocated; no HF checkpoint in this config
        # token ids only, and Qwen3.5 as its text model: vLLM's vision-language class builds a multimodal processor
        # at start-up that needs the tokenizer --skip-tokenizer-init leaves out, unless --language-model-only
        assert "--skip-tokenizer-init" in a and "--language-model-only" in a
        assert not any("api-key" in x and x != "--api-key-env" for x in a)
    assert "MS_ENGINE_KIND=vLLM" in to_shell(p).splitlines()
    assert p.train_argv[-1].startswith("rollout.engine_urls=[http://n1:30000,")


def test_vllm_disaggregated_and_refusals():
    p = plan_for([*VLLM, "rollout.mode=disaggregated", "cluster.rollout_nodes=1"], "n[1-3]")
    assert p.train_nodes == ["n1", "n2"] and {e.node for e in p.engines} == {"n3"}
    assert all("--enable-sleep-mode" not in e.argv for e in p.engines)
    with pytest.raises(LaunchError, match="must divide a node"):
        plan_for(["rollout.engine=vllm", "rollout.vllm.tp=16"], "n[1-2]")


@pytest.mark.multiprocess
def test_vllm_serve_wrapper_puts_the_key_in_the_environment(tmp_path):
    """rollout/vllm/client.py's main execs the given python args with VLLM_API_KEY from the named variable."""
    key = secrets.token_urlsafe(32)
    probe = "import os; print(os.environ['VLLM_API_KEY'] == os.environ['K'], os.environ['VLLM_SERVER_DEV_MODE'], " \
            "os.environ['CUDA_VISIBLE_DEVICES'])"
    out = subprocess.run([sys.executable, "-m", "megatron_search.rollout.vllm.client", "--api-key-env", "K", "--gpus", "2,3",
                          "--", sys.executable, "-c", probe], capture_output=True, text=True, env={**os.environ, "K": key},
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "1", "2,3"] and key not in out.stderr
    # another interpreter (rollout.vllm.python: vLLM's own venv) finds the launcher through a path holding only
    # this package: the base interpreter, outside our venv, imports it and nothing else of ours
    other = os.path.realpath(sys.executable)
    probe = "import megatron_search.rollout.vllm.launcher as m, sys; print(m.EXTENSION); print(sys.path[1])"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-m", "megatron_search.rollout.vllm.client", "--api-key-env", "K",
                          "--", other, "-c", probe], capture_output=True, text=True, env={**env, "K": key}, timeout=120)
    assert out.returncode == 0, out.stderr
    ext, path = out.stdout.split()
    assert ext.endswith("MegatronSearchWorkerExtension") and os.listdir(path) == ["megatron_search"]


@pytest.mark.multiprocess
def test_sbatch_dry_run_shows_vllm_servers():
    key = secrets.token_urlsafe(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["MEGATRON_SEARCH_ENGINE_KEY"] = key
    out = subprocess.run(["bash", "slurm/grpo_397b.sh", "--dry-run", *VLLM], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "vLLM engines: 64 (64 server processes" in out.stdout
    assert "[node032] python -m megatron_search.rollout.vllm.client --api-key-env MEGATRON_SEARCH_ENGINE_KEY --gpus 4,5,6,7" \
        in out.stdout
    assert key not in out.stdout + out.stderr
