"""`megatron-search plan`: check a parallel layout on a cluster and estimate per-GPU memory."""
from __future__ import annotations

import argparse

from .common import add_config_args, load_from_args


def add_plan_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--nodes", type=int, help="override cluster.nodes")
    p.add_argument("--gpus-per-node", type=int, help="override cluster.gpus_per_node")
    p.add_argument("--gpu-mem", type=float, help="override cluster.gpu_mem_gib (GiB per GPU)")
    p.add_argument("--stage", choices=["grpo", "sft"], help="default: from the config file name, else grpo")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="check a parallel layout on N nodes and estimate per-GPU memory")
    add_plan_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_search.plan import format_plan, make_plan

    for flag, key in (("nodes", "cluster.nodes"), ("gpus_per_node", "cluster.gpus_per_node"), ("gpu_mem", "cluster.gpu_mem_gib")):
        value = getattr(args, flag)
        if value is not None:
            args.overrides.append(f"{key}={value}")
    # Validation of the layout against the cluster happens in the planner, which reports every
    # problem together with the memory table; the config's own world_size check is left out.
    args.overrides.append("parallel.world_size=null")
    cfg = load_from_args(args)
    stage = args.stage or ("sft" if args.config and "sft" in str(args.config) else "grpo")
    plan = make_plan(cfg, stage)
    print(format_plan(plan, f"{args.config or 'defaults'} ({stage}) on {cfg.cluster.nodes} x {cfg.cluster.gpus_per_node} GPUs"))
    return 0 if plan.fits else 1
