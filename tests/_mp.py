"""Run a function on N local processes with torch.multiprocessing spawn (gloo on 127.0.0.1).

`run_spawned(fn, nprocs, *args)` calls fn(rank, nprocs, port, *args) in each process; `port` is a
free TCP port for the rendezvous (found by binding port 0). A failing rank fails the caller.
"""
from __future__ import annotations

import os

import torch.multiprocessing as mp

from megatron_search.distributed import free_port


def _entry(rank: int, fn, nprocs: int, port: int, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fn(rank, nprocs, port, *args)


def run_spawned(fn, nprocs: int, *args, timeout_s: float = 600.0) -> None:
    port = free_port()
    ctx = mp.start_processes(_entry, args=(fn, nprocs, port, args), nprocs=nprocs, join=False, start_method="spawn")
    import time

    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"spawned ranks still running after {timeout_s:.0f}s")
