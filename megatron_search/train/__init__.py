"""Training loops (SFT, GRPO) on Megatron-Core, checkpoints, metrics."""
