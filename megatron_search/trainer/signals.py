"""Preemption signals (Slurm sends SIGTERM or the --signal of the job, USR1 here): the handler only
sets a flag; the training loop checks it between steps, saves a checkpoint and exits cleanly."""
from __future__ import annotations

import signal
from typing import Iterable


class StopRequest:
    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1)):
        self.signum: int | None = None
        self._previous = {}
        for s in signals:
            self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
