"""`megatron-search launch-plan`: how a Slurm allocation runs a config (used by slurm/lib.sh)."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch-plan", help="split a Slurm allocation into training/rollout nodes and print the commands")
    p.add_argument("stage", choices=["sft", "grpo"])
    p.add_argument("config", help="YAML config")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    p.add_argument("--nodelist", required=True, help="Slurm node list, e.g. node[001-032]")
    p.add_argument("--tasks-per-node", type=int, help="training ranks per node (default: cluster.gpus_per_node)")
    p.add_argument("--format", choices=["text", "shell"], default="text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_search.config import load_config, stage_problems
    from megatron_search.distributed.env import expand_hostlist
    from megatron_search.launch.slurm_plan import LaunchError, describe, make_launch_plan, to_shell
    from megatron_search.plan import format_plan, make_plan

    nodes = len(expand_hostlist(args.nodelist))
    # The real launch (shell) refuses a config its job would refuse, input paths included; a dry run (text)
    # lists what is still to be set and prints the plan anyway.
    cfg = load_config(args.config, [*args.overrides, f"cluster.nodes={nodes}", "parallel.world_size=null"],
                      stage=args.stage if args.format == "shell" else None)
    try:
        plan = make_launch_plan(cfg, args.stage, args.nodelist, args.config, list(args.overrides), args.tasks_per_node)
    except LaunchError as e:
        print(f"error: {e}", file=__import__("sys").stderr)
        return 1
    if args.format == "shell":
        print(to_shell(plan))
        return 0
    print(describe(plan))
    settings = stage_problems(cfg, args.stage, None, inputs=False)
    missing = [p for p in stage_problems(cfg, args.stage, None) if p not in settings]
    if missing:
        print("to set before submitting:\n  " + "\n  ".join(missing))
    if cfg.rollout.engine == "sglang" or cfg.cluster.gpus_per_node > 1:
        print(format_plan(make_plan(cfg, args.stage), f"memory plan on {nodes} x {cfg.cluster.gpus_per_node} GPUs"))
    return 0
