"""Megatron model providers (Qwen3-MoE, Qwen3.5 hybrid), HF <-> Megatron mapping, routing-replay glue."""
