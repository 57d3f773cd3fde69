"""Launch plan for a Slurm allocation.

The sbatch scripts stay small: they ask this module for the plan (`megatron-search launch-plan`),
which prints shell assignments, and then run the commands. Everything that needs judgement (which
nodes train, which serve SGLang, how many engines, the exact argv) is here, where it is tested.

Engines are authenticated: the plan names the environment variable (`rollout.api_key_env`) that
carries the job's API key to every engine and training rank; slurm/lib.sh fills it (generated per
job unless already set) and srun passes it on. No key is ever part of a command line or the plan.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from megatron_search.config.schema import Config
from megatron_search.distributed.env import expand_hostlist


class LaunchError(ValueError):
    """The allocation cannot run this config."""


@dataclass
class Engine:
    """One SGLang server process: its node, port and argv. A multi-node engine is one process per
    node; only node rank 0 (`serves`) answers HTTP."""

    node: str
    port: int
    argv: list[str]
    serves: bool = True


@dataclass
class LaunchPlan:
    stage: str
    train_nodes: list[str]
    rollout_nodes: list[str]
    tasks_per_node: int
    master_node: str
    engines: list[Engine] = field(default_factory=list)
    train_argv: list[str] = field(default_factory=list)
    api_key_env: str = ""  # the variable holding the engines' API key (the key is never in the plan)
    engine_restarts: int = 0  # slurm/lib.sh starts an engine that exits again, this many times (rollout.health)
    engine_kind: str = "SGLang"  # rollout.engine's servers: SGLang or vLLM

    @property
    def world_size(self) -> int:
        return len(self.train_nodes) * self.tasks_per_node

    def engine_urls(self, addr_of=lambda node: node) -> list[str]:
        return [f"http://{addr_of(e.node)}:{e.port}" for e in self.engines if e.serves]


def sglang_argv(cfg: Config, model_path: str, port: int, nnodes: int, node_rank: int, dist_addr: str,
                base_gpu_id: int = 0, engine_index: int = 0) -> list[str]:
    """argv of one SGLang server process for the cluster: rollout/sglang/client.py's command, reachable from
    the training nodes (0.0.0.0 on the cluster's private network), spread over `nnodes` nodes, and
    with dummy weights unless rollout.sglang.model_path names what to serve (the policy arrives by weight sync
    before the first rollout).
    Each engine samples with its own seed (run.seed + engine_index): the rollouts of one group are
    spread over engines and must not repeat each other's random draws."""
    from megatron_search.rollout.sglang.client import (sglang_command)  # start-up: rollout clients, +0.11 s on launch-plan

    colocated = cfg.rollout.mode == "colocated"  # memory is released only when sharing GPUs with training
    sg = cfg.rollout.sglang.model_copy(update={
        "host": "0.0.0.0", "enable_memory_saver": colocated and cfg.rollout.sglang.enable_memory_saver})
    argv = sglang_command(sg, model_path, port, routed_experts=cfg.grpo.wants_routed_experts(),
                          seed=cfg.run.seed + engine_index, base_gpu_id=base_gpu_id, api_key_env=cfg.rollout.api_key_env)
    argv[0] = "python"  # the compute nodes' interpreter from the job's environment
    if nnodes > 1:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_addr]
    if not cfg.rollout.sglang.model_path:  # the policy is pushed before the first rollout
        argv += ["--load-format", "dummy"]
    return argv


def vllm_argv(cfg: Config, model_path: str, port: int, gpus: list[int], engine_index: int = 0) -> list[str]:
    """argv of one vLLM server for the cluster: rollout/vllm/client.py's `vllm serve` line run through its main (the key
    from $rollout.api_key_env becomes $VLLM_API_KEY there, never an argument), on `gpus` of its node, reachable from
    the training nodes (0.0.0.0 on the private network: vLLM's RL routes are not guarded by its key), seeded per
    engine, dummy weights unless rollout.vllm.model_path is set (the policy arrives by weight sync first)."""
    # start-up: rollout clients, +0.11 s on launch-plan
    from megatron_search.rollout.vllm.client import serve_argv, vllm_command, vllm_language_only

    colocated = cfg.rollout.mode == "colocated"  # memory is released only when sharing GPUs with training
    v = cfg.rollout.vllm.model_copy(update={"host": "0.0.0.0",
                                            "enable_sleep_mode": colocated and cfg.rollout.vllm.enable_sleep_mode})
    inner = vllm_command(v, model_path, port, routed_experts=cfg.grpo.wants_routed_experts(),
                         seed=cfg.run.seed + engine_index, original_logprob=cfg.rollout.return_original_logprob,
                         language_model_only=vllm_language_only(cfg))
    if not cfg.rollout.vllm.model_path:  # the policy is pushed before the first rollout
        inner += ["--load-format", "dummy"]
    if not cfg.rollout.vllm.python:
        inner[0] = "python"  # the compute nodes' interpreter from the job's environment
    argv = serve_argv(inner, cfg.rollout.api_key_env, gpus)
    argv[0] = "python"
    return argv


def make_launch_plan(
    cfg: Config,
    stage: str,
    nodelist: str,
    config_path: str,
    overrides: list[str],
    tasks_per_node: int | None = None,
) -> LaunchPlan:
    """Split the allocation and build every command. Raises LaunchError with the reason."""
    nodes = expand_hostlist(nodelist)
    c = cfg.cluster
    tasks = tasks_per_node or c.gpus_per_node
    rollout_nodes: list[str] = []
    served = cfg.rollout.engine in ("sglang", "vllm")  # engines the plan starts (local engines are the trainer's)
    if stage == "grpo" and served and cfg.rollout.mode == "disaggregated":
        if not 0 < c.rollout_nodes < len(nodes):
            raise LaunchError(
                f"cluster.rollout_nodes={c.rollout_nodes}: disaggregated mode needs 1..{len(nodes) - 1} of the "
                f"{len(nodes)} allocated nodes for SGLang"
            )
        rollout_nodes = nodes[len(nodes) - c.rollout_nodes:]
        train_nodes = nodes[: len(nodes) - c.rollout_nodes]
    else:
        train_nodes = nodes
    # Colocated, an engine the job script starts again would claim mem_fraction_static of its GPUs at whatever moment
    # it exits, the trainer resident beside it (an OOM on both): the script never restarts one there, the driver
    # counts it down (rollout.health.max_lost_capacity). Disaggregated engines have their GPUs to themselves.
    restarts = cfg.rollout.health.max_restarts if cfg.rollout.mode == "disaggregated" else 0
    plan = LaunchPlan(stage, train_nodes, rollout_nodes, tasks, train_nodes[0], api_key_env=cfg.rollout.api_key_env,
                      engine_restarts=restarts)
    plan.engine_kind = "vLLM" if cfg.rollout.engine == "vllm" else "SGLang"
    if stage == "grpo" and cfg.rollout.engine == "vllm":
        _plan_vllm(plan, cfg, rollout_nodes or nodes)
    if stage == "grpo" and cfg.rollout.engine == "sglang":
        serve_nodes = rollout_nodes or nodes
        gpus_per_engine = cfg.rollout.sglang.tp * cfg.rollout.sglang.dp
        per_node = c.gpus_per_node
        if gpus_per_engine % per_node and per_node % gpus_per_engine:
            raise LaunchError(
                f"rollout.sglang: an engine of {gpus_per_engine} GPUs must fill whole nodes of {per_node} GPUs "
                f"or divide one"
            )
        model = cfg.rollout.sglang.model_path or str(cfg.model.engine_dir())
        port = cfg.rollout.sglang.base_port
        if gpus_per_engine >= per_node:
            span = gpus_per_engine // per_node
            if len(serve_nodes) % span:
                raise LaunchError(f"rollout: {len(serve_nodes)} nodes do not split into engines of {span} nodes")
            for i in range(0, len(serve_nodes), span):
                group = serve_nodes[i : i + span]
                for rank, node in enumerate(group):
                    argv = sglang_argv(cfg, model, port, span, rank, f"{group[0]}:{port + 1000}",
                                       engine_index=i // span)
                    plan.engines.append(Engine(node, port, argv, serves=rank == 0))
        else:
            # start-up: rollout clients, +0.11 s on launch-plan
            from megatron_search.rollout.engine.process import ENGINE_PORT_STRIDE

            per_node_engines = per_node // gpus_per_engine
            for n, node in enumerate(serve_nodes):  # engines sharing a node: disjoint GPUs and port ranges
                for j in range(per_node_engines):
                    p = port + ENGINE_PORT_STRIDE * j
                    argv = sglang_argv(cfg, model, p, 1, 0, "", base_gpu_id=j * gpus_per_engine,
                                       engine_index=n * per_node_engines + j)
                    plan.engines.append(Engine(node, p, argv))
    extra = []
    if plan.engines:
        extra.append("rollout.engine_urls=[" + ",".join(plan.engine_urls()) + "]")
    plan.train_argv = ["megatron-search", stage, config_path, *overrides, *extra]
    return plan


def _plan_vllm(plan: LaunchPlan, cfg: Config, serve_nodes: list[str]) -> None:
    """vLLM engines: each within one node (TP x DP GPUs), engines sharing a node on disjoint GPUs and ports."""
    # start-up: rollout clients (aiohttp, safetensors: +0.11 s on launch-plan), only for plans with engines
    from megatron_search.rollout.engine.process import ENGINE_PORT_STRIDE

    v, per_node = cfg.rollout.vllm, cfg.cluster.gpus_per_node
    gpus = v.tp * v.dp
    if per_node % gpus:
        raise LaunchError(f"rollout.vllm: an engine of TP x DP = {gpus} GPUs must divide a node of {per_node} GPUs "
                          "(multi-node vLLM engines need its Ray or --nnodes setup, which this plan does not make)")
    model = v.model_path or str(cfg.model.engine_dir())
    per = per_node // gpus
    for n, node in enumerate(serve_nodes):
        for j in range(per):
            port = v.base_port + ENGINE_PORT_STRIDE * j
            argv = vllm_argv(cfg, model, port, list(range(j * gpus, (j + 1) * gpus)), engine_index=n * per + j)
            plan.engines.append(Engine(node, port, argv))


def to_shell(plan: LaunchPlan, addr_of=lambda n: n) -> str:
    """Shell assignments for slurm/lib.sh (values quoted; arrays for lists)."""
    q = shlex.quote
    arr = lambda xs: "(" + " ".join(q(x) for x in xs) + ")"  # noqa: E731
    lines = [
        f"MS_STAGE={q(plan.stage)}",
        f"MS_TRAIN_NODES={arr(plan.train_nodes)}",
        f"MS_ROLLOUT_NODES={arr(plan.rollout_nodes)}",
        f"MS_TASKS_PER_NODE={plan.tasks_per_node}",
        f"MS_WORLD_SIZE={plan.world_size}",
        f"MS_MASTER_NODE={q(plan.master_node)}",
        f"MS_TRAIN_ARGV={arr(plan.train_argv)}",
        f"MS_ENGINE_COUNT={len(plan.engines)}",
        f"MS_ENGINE_KEY_ENV={q(plan.api_key_env)}",
        f"MS_ENGINE_RESTARTS={plan.engine_restarts}",
        f"MS_ENGINE_KIND={q(plan.engine_kind)}",
    ]
    for i, e in enumerate(plan.engines):
        lines.append(f"MS_ENGINE_NODE_{i}={q(e.node)}")
        lines.append(f"MS_ENGINE_PORT_{i}={e.port}")
        lines.append(f"MS_ENGINE_ARGV_{i}={arr(e.argv)}")
    lines.append(f"MS_ENGINE_URLS={q(','.join(plan.engine_urls(addr_of)))}")
    return "\n".join(lines)


def describe(plan: LaunchPlan) -> str:
    """Human-readable plan for --dry-run."""
    q = shlex.join
    lines = [
        f"stage: {plan.stage}",
        f"training: {len(plan.train_nodes)} node(s) x {plan.tasks_per_node} ranks = world {plan.world_size}; "
        f"master {plan.master_node}; nodes {plan.train_nodes[0]}..{plan.train_nodes[-1]}",
    ]
    if plan.rollout_nodes:
        lines.append(f"rollout nodes: {len(plan.rollout_nodes)} ({plan.rollout_nodes[0]}..{plan.rollout_nodes[-1]})")
    lines.append(f"engine API key: ${plan.api_key_env} in the environment of every engine and rank (generated per job "
                 "when unset; never on a command line)")
    lines.append(f"{plan.engine_kind} engines: {len(plan.engine_urls())} ({len(plan.engines)} server processes; one that exits is "
                 f"started again, up to {plan.engine_restarts} times, and re-synced by the trainer)")
    for e in plan.engines:
        lines.append(f"  [{e.node}] {q(e.argv)}")
    lines.append(
        f"train: srun --nodes={len(plan.train_nodes)} --ntasks-per-node={plan.tasks_per_node} {q(plan.train_argv)}"
    )
    return "\n".join(lines)
