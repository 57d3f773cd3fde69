#!/usr/bin/env python
"""Build the local search_web index from a JSONL corpus (same as `megatron-search build-index`).

    python tools/build_search_index.py --corpus corpus.jsonl --index-dir runs/index [--query "..."]
"""
import sys

from megatron_search.cli import main

if __name__ == "__main__":
    sys.exit(main(["build-index", *sys.argv[1:]]))
