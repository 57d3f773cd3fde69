"""`megatron-search grpo`: on-policy GRPO with token-level IS (RECIPE section 3)."""
from __future__ import annotations

import argparse
import warnings

from .common import add_config_args, load_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("grpo", help="GRPO training: rollouts, rewards, token-IS policy updates, weight sync")
    add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint (checkpoint.resume=true)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.resume:
        args.overrides.append("checkpoint.resume=true")
    cfg = load_from_args(args, stage="grpo")
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*")
    from megatron_search.train.grpo import run_grpo

    run_grpo(cfg)
    return 0
