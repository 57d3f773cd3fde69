#!/usr/bin/env python
"""HF safetensors -> Megatron distributed checkpoint (any TP/PP/EP); see megatron_search/weights/convert.py."""
import sys

from megatron_search.weights.convert import main

if __name__ == "__main__":
    sys.exit(main("hf_to_mcore"))
