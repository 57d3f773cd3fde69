"""megatron-search: Megatron-Core post-training of Qwen MoE policies into web-search agents."""

__version__ = "0.1.0"
