"""The trainer core that SFT, GRPO and the reward model share: model chunks + Megatron DDP + optimizer
(`core.Trainer`), one training step through Megatron's pipeline schedule (`step.py`), the LR schedule,
dist checkpoints of model + optimizer + run state, weights-only initialisation, metrics and signals."""
