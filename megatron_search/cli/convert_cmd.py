"""`megatron-search convert`: HF safetensors <-> Megatron distributed checkpoint (any TP/PP/EP)."""
from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert checkpoints: HF safetensors <-> Megatron distributed checkpoint")
    p.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf"])
    p.add_argument("--src", required=True, help="source checkpoint directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--config", default=None, help="megatron-search YAML (default: schema defaults)")
    p.add_argument("--hf-config", default=None, help="HF config.json directory (default: the source's)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None, help="expert TP (default: TP when EP=1, else 1)")
    p.add_argument("--bucket-mb", type=int, default=None, help="default: 512, or the embedding's size when larger")
    p.add_argument("--shard-mb", type=int, default=4096)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="key.sub=value",
                   help="config override (repeatable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_search.weights.sources import source_problem

    direction = args.direction.replace("-", "_")
    problem = source_problem(direction, args.src, args.hf_config)  # before torch, Megatron or any process
    if problem:
        print(f"megatron-search convert {args.direction}: {problem}", file=sys.stderr)
        return 2
    from megatron_search.weights.convert import convert

    summary = convert(direction, args.src, args.out, config=args.config, hf_config=args.hf_config, tp=args.tp,
                      pp=args.pp, ep=args.ep, etp=args.etp, overrides=args.overrides, bucket_mb=args.bucket_mb,
                      shard_mb=args.shard_mb, dtype=args.dtype, progress=not args.no_progress)
    if summary:
        print(f"wrote {summary['tensors']} tensors ({summary['bytes'] / 1e6:.1f} MB) to {args.out}")
    else:
        print(f"wrote Megatron distributed checkpoint to {args.out}")
    return 0
