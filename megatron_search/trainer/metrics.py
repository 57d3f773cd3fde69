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


def _clock(seconds: float) -> str:
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def format_progress(done: int, total: int, elapsed_s: float, done_this_run: int) -> str:
    """'step k/N | h:mm:ss elapsed, ETA h:mm:ss': the ETA from this run's own pace (a resumed run's earlier
    steps are not in its elapsed time)."""
    eta = elapsed_s / done_this_run * (total - done) if done_this_run > 0 else float("nan")
    return f"step {done}/{total} | {_clock(elapsed_s)} elapsed, ETA " + (_clock(eta) if eta == eta else "?")


def format_line(step: int, values: Mapping[str, float], keys: list[str], head: str | None = None) -> str:
    """'step N | key value | ...' for the `keys` present in `values`; `head` replaces 'step N'."""
    parts = [head or f"step {step}"]
    for k in keys:
        if k in values:
            parts.append(f"{k.split('/')[-1]} {values[k]:.4g}")
    return " | ".join(parts)
