"""TensorBoard scalars and console lines for training runs (rank 0 writes; other ranks no-op)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping

from torch.utils.tensorboard import SummaryWriter


class MetricsWriter:
    def __init__(self, log_dir: str | Path | None, enabled: bool = True):
        self._tb = None
        if enabled and log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if self._tb is None:
            return
        for tag, v in values.items():
            v = float(v)
            if math.isfinite(v):
                self._tb.add_scalar(tag, v, step)
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def format_line(step: int, values: Mapping[str, float], keys: list[str]) -> str:
    parts = [f"step {step}"]
    for k in keys:
        if k in values:
            parts.append(f"{k.split('/')[-1]} {values[k]:.4g}")
    return " | ".join(parts)
