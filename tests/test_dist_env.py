"""Process placement from torchrun / Slurm variables, Slurm host-list expansion, layout checks at launch."""
from __future__ import annotations

import pytest

from megatron_search.config import load_config
from megatron_search.config.loader import ConfigError
from megatron_search.distributed.env import DistEnvError, expand_hostlist, read_dist_env


@pytest.mark.parametrize(
    "spec, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("a[08-10]", ["a08", "a09", "a10"]),
        ("r[1-2]n[3,5]", ["r1n3", "r1n5", "r2n3", "r2n5"]),
        ("x[1-2]-ib,y", ["x1-ib", "x2-ib", "y"]),
    ],
)
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["node[01-03", "node]1", "node[3-1]", "node[a-b]", "a,,b"])
def test_expand_hostlist_rejects_malformed(spec):
    with pytest.raises(DistEnvError, match="SLURM_JOB_NODELIST"):
        expand_hostlist(spec)


def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    e = read_dist_env(env)
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.source) == (
        3, 8, 1, "10.0.0.1", 1234, "torchrun")


def test_slurm_variables_pick_first_host_as_master():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[12-13,20]", "SLURM_JOB_ID": "4242"}
    e = read_dist_env(env)
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.source) == (5, 16, 1, "gpu12", "slurm")
    assert e.master_port == 20000 + 4242  # derived from the job id: same on every task of the job
    assert read_dist_env({**env, "MASTER_PORT": "29999"}).master_port == 29999


def test_torchrun_wins_over_slurm():
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1",
           "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n1"}
    assert read_dist_env(env).source == "torchrun"


def test_single_process_without_launcher():
    e = read_dist_env({})
    assert (e.rank, e.world_size, e.source) == (0, 1, "single")


@pytest.mark.parametrize(
    "env, message",
    [
        ({"WORLD_SIZE": "4"}, "neither torchrun variables"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR is missing"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "rank 2 outside"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_JOB_NODELIST is missing"),
        ({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"}, "SLURM_PROCID='x' is not an integer"),
    ],
)
def test_bad_environments_name_the_problem(env, message):
    with pytest.raises(DistEnvError, match=message):
        read_dist_env(env)


def test_expert_tp_must_equal_tp_without_expert_parallel():
    # EP=1 + ETP != TP would reduce expert grads over the wrong group (caught by the parallel harness).
    with pytest.raises(ConfigError, match=r"parallel\.etp: with EP=1"):
        load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.etp=1"])
    assert load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true"]).parallel.etp == 2  # follows TP
    load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.etp=2"])
    load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.world_size=4"])


def test_init_distributed_checks_the_real_world_size():
    from megatron_search.distributed import DistEnv, LayoutError, init_distributed

    cfg = load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true"])
    with pytest.raises(LayoutError, match=r"parallel\.world_size: 1 is not TP x PP x CP x DP"):
        init_distributed(cfg, env=DistEnv(0, 1, 0, "127.0.0.1", 0, "single"))
