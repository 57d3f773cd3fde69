"""Arguments shared by subcommands: a YAML config plus `key.sub=value` overrides."""
from __future__ import annotations

import argparse


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, help="YAML config (defaults: the tiny CPU model)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")


def load_from_args(args: argparse.Namespace, stage: str | None = None):
    """The config of `args` (YAML + overrides); with `stage`, validated for that job (config.stage_problems)."""
    from megatron_search.config import load_config

    overrides = list(args.overrides)
    # `megatron-search cmd a.b=1` with no config: the first positional is an override.
    config = args.config
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides.insert(0, config)
        config = None
    return load_config(config, overrides, stage=stage)
