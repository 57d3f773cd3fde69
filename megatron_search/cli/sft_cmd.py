"""`megatron-search sft`: SFT warm-up on assistant tokens (RECIPE section 2).

    megatron-search sft configs/tiny_cpu.yaml model.tokenizer=runs/tokenizer sft.datasets='{data/sft.jsonl: 1.0}'
    torchrun --nproc-per-node 2 -m megatron_search.cli sft cfg.yaml parallel.tp=2 parallel.sequence_parallel=true
    megatron-search sft cfg.yaml --resume        # continue exactly from the latest checkpoint
"""
from __future__ import annotations

import argparse
import sys
import warnings

from .common import add_config_args, load_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sft", help="SFT on chat data (assistant-only loss), checkpoints, TensorBoard")
    add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint (checkpoint.resume=true)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.resume:
        args.overrides.append("checkpoint.resume=true")
    cfg = load_from_args(args, stage="sft")
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*")
    from megatron_search.data.jsonl import DataError
    from megatron_search.train.sft import run_sft

    try:
        summary = run_sft(cfg)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if summary["rank"] != 0:
        return 0
    if summary["losses"]:
        state = "stopped by signal" if summary["stopped"] else "done"
        print(f"sft {state}: step {summary['iterations'][-1]}, loss {summary['losses'][-1]:.4f}, "
              f"checkpoint {summary['checkpoint']}")
    else:
        print("sft: nothing to do (already at sft.steps)")
    return 0
