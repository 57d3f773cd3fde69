#!/usr/bin/env python
"""Check a parallel layout on a cluster and estimate per-GPU memory (same as `megatron-search plan`).

    python tools/plan_parallelism.py configs/qwen3_5_397b_a17b_grpo.yaml --nodes 32 --gpus-per-node 8 --gpu-mem 141
"""
import sys

from megatron_search.cli import main

if __name__ == "__main__":
    sys.exit(main(["plan", *sys.argv[1:]]))
