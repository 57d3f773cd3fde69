"""The `megatron-search` command. Each subcommand lives in its own module with a
`register(subparsers)` function; only working subcommands are listed in COMMANDS."""
from __future__ import annotations

import argparse
import importlib
import sys

# Module names under megatron_search.cli, in the order `--help` shows them.
COMMANDS = [
    "demo_cmd",
    "config_cmd",
    "smoke",
    "plan_cmd",
    "launch_cmd",
    "data_cmd",
    "index_cmd",
    "tokenizer_cmd",
    "sft_cmd",
    "grpo_cmd",
    "rm_cmd",
    "eval_cmd",
    "convert_cmd",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-search",
        description="Post-train Qwen MoE policies into web-search agents (SFT + GRPO on Megatron-Core).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from megatron_search.config import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
