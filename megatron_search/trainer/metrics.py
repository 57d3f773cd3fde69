"""TensorBoard (and Weights & Biases) scalars and console lines for training runs (rank 0 writes; other ranks
no-op)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping

from torch.utils.tensorboard import SummaryWriter


class MetricsWriter:
    """Scalars to TensorBoard at `log_dir` (when `enabled`) and, from `for_run` with logging.wandb, to a Weights &
    Biases run; non-finite values are left out of both."""

    def __init__(self, log_dir: str | Path | None, enabled: bool = True):
        self._tb = None
        self._wandb = None
        if enabled and log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(log_dir=str(log_dir))

    @classmethod
    def for_run(cls, cfg, out: str | Path, main: bool) -> "MetricsWriter":
        """The run's writer from `cfg.logging` (the main rank writes): <out>/tensorboard, <out>/wandb."""
        lg = cfg.logging
        writer = cls(Path(out) / "tensorboard", enabled=main and lg.tensorboard)
        if main and lg.wandb:
            writer._wandb = _wandb_run(lg.wandb_project, cfg.run.name, lg.wandb_mode, str(out),
                                       cfg.model_dump(mode="json"))
        return writer

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        finite = {tag: float(v) for tag, v in values.items() if math.isfinite(float(v))}
        if self._tb is not None:
            for tag, v in finite.items():
                self._tb.add_scalar(tag, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(finite, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _wandb_run(project: str, name: str, mode: str, dir: str, config: dict):
    try:
        # optional: wandb (the `wandb` extra; only runs with logging.wandb import it)
        import wandb
    except ImportError:
        raise ImportError("logging.wandb: the wandb package is not installed (pip install '.[wandb]', or set "
                          "logging.wandb=false)") from None
    Path(dir).mkdir(parents=True, exist_ok=True)
    return wandb.init(project=project, name=name, mode=mode, dir=dir, config=config, reinit="create_new")


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
