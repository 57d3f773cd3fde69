"""Learning-rate schedule: linear warmup, then constant, cosine or linear decay to min_lr.

A pure function of the step, so the schedule's whole state is the step counter a checkpoint
already holds (resuming at step k gives the same LR as the uninterrupted run).
"""
from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based: the first update uses step 0).

    Warmup: lr * (step + 1) / warmup_steps for step < warmup_steps (never 0, so the first
    update moves the weights). Decay runs over the remaining total_steps - warmup_steps steps
    and reaches min_lr at the last step (step total_steps - 1); later steps stay at min_lr.
    """
    if step < 0:
        raise ValueError(f"lr_at: step {step} < 0")
    if schedule not in ("constant", "cosine", "linear"):
        raise ValueError(f"optim.lr_schedule: unknown schedule {schedule!r} (constant, cosine, linear)")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    decay_steps = total_steps - warmup_steps - 1
    if decay_steps <= 0:
        return min_lr
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return lr + (min_lr - lr) * progress
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_from_config(optim, step: int, total_steps: int) -> float:
    """lr_at with the fields of an OptimConfig."""
    return lr_at(step, optim.lr, optim.min_lr, optim.lr_schedule, optim.warmup_steps, total_steps)
