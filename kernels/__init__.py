"""Fused kernels (Triton on GPU, torch references on CPU), installed as `megatron_search.kernels`."""
