"""`megatron-search config`: validate a config and print it fully resolved."""
from __future__ import annotations

import argparse

from .common import add_config_args, load_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="validate a config (+ overrides) and print it resolved")
    add_config_args(p)
    p.add_argument("--stage", choices=["sft", "rm", "grpo"],
                   help="also check what this job needs (batch sizes at parallel.world_size, rm.load, data paths, ...)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_search.config import dump_config

    cfg = load_from_args(args, stage=args.stage)
    print(dump_config(cfg), end="")
    return 0
