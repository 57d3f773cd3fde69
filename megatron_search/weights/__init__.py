"""Megatron weights as HF tensors: loading, bucketed export, delivery into rollout engines."""
