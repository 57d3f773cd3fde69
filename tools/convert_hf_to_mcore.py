#!/usr/bin/env python
"""HF safetensors -> Megatron distributed checkpoint (any TP/PP/EP).

`megatron-search convert hf-to-mcore` with the same flags: --src, --out, --tp/--pp/--ep, --set key.sub=value."""
import sys

from megatron_search.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-mcore", *sys.argv[1:]]))
