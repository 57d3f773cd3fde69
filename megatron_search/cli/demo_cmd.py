"""`megatron-search demo`: the whole recipe end to end on one CPU machine (see demo/pipeline.py)."""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="end-to-end demo on CPU: world, SFT, reward model, GRPO, held-out eval")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides of configs/demo.yaml")
    p.add_argument("--out", default="runs/demo", help="output directory (stages already done there are skipped)")
    p.add_argument("--config", default=None, help="demo config (default: configs/demo.yaml)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*")
    from megatron_search.config.model import resolve_repo_path
    from megatron_search.demo.pipeline import DEMO_CONFIG, Demo

    config = args.config or str(resolve_repo_path(DEMO_CONFIG))
    Demo(Path(args.out), config, list(args.overrides)).run()
    return 0
