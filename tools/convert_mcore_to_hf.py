#!/usr/bin/env python
"""Megatron distributed checkpoint (or a training run's checkpoint) -> HF safetensors.

`megatron-search convert mcore-to-hf` with the same flags: --src, --out, --tp/--pp/--ep, --set key.sub=value."""
import sys

from megatron_search.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "mcore-to-hf", *sys.argv[1:]]))
