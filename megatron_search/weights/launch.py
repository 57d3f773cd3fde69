"""Run a function on every rank of a small local world: under torchrun/Slurm as is, else by spawning.

The conversion tools need TP x PP x EP processes. Started by torchrun (or srun) they run in
place; started as a plain `python tools/...` they spawn that many local processes with gloo on
127.0.0.1 and a free port, and re-raise the first worker failure with its traceback.
"""
from __future__ import annotations

import os
import queue as queue_mod
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from megatron_search.distributed.init import free_port


class WorkerError(RuntimeError):
    """A spawned rank failed; the message carries its traceback."""


def launched_externally() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ or "SLURM_PROCID" in os.environ


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        result = fn(*args)
        queue.put((rank, True, result))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1)


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 1800.0) -> list[Any]:
    """Results of fn(*args) per rank (index = rank). Runs in place when launched by torchrun/Slurm."""
    if launched_externally():
        return [fn(*args)]

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: list[Any] = [None] * world_size
    failure = None
    try:
        pending, waited = set(range(world_size)), 0.0
        while pending and failure is None:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_mod.Empty:
                waited += 1.0
                dead = [r for r in pending if procs[r].exitcode not in (None, 0)]
                if dead:
                    failure = f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                elif waited > timeout_s:
                    failure = f"ranks {sorted(pending)} did not finish within {timeout_s} s"
                continue
            pending.discard(rank)
            if not ok:
                failure = f"rank {rank} failed:\n{value}"
            else:
                results[rank] = value
    finally:
        if failure is not None:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join()
    if failure is not None:
        raise WorkerError(failure)
    return results
