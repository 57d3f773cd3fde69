#!/usr/bin/env python
"""Megatron distributed checkpoint -> HF safetensors (any TP/PP/EP); see megatron_search/weights/convert.py."""
import sys

from megatron_search.weights.convert import main

if __name__ == "__main__":
    sys.exit(main("mcore_to_hf"))
