"""Start torch.distributed + Megatron model parallel for a config; hand back the groups explicitly.

`init_distributed(cfg)` reads the placement (torchrun or Slurm, see env.py), checks the real world
size against the parallel layout (the same rules as config validation; with `stage=`, the job's own
checks too, batch sizes against the real data-parallel size), initialises the process
group (nccl on GPU, gloo on CPU, or cfg.parallel.backend), Megatron's TP/PP/VPP/CP/EP/ETP groups
and RNG seeds, and switches on the CPU compatibility layer when there is no GPU. The returned
`DistContext` carries the ranks and Megatron's ProcessGroupCollection; `teardown()` undoes it all.
It also gives every rank rank 0's rollout-engine API key (`share_engine_key`).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_search.config.schema import layout_problems, stage_problems
from megatron_search.rollout.engine.auth import EngineKeyError, job_key, use_key_env

from .cpu_compat import define_missing_te_gemm, enable_cpu_compat
from .env import DistEnv, read_dist_env


class LayoutError(RuntimeError):
    """The launched world does not fit cfg.parallel, or the config does not fit the job (config.stage_problems)."""


@dataclass
class DistContext:
    """This rank's place in the job and its Megatron process groups (pass `groups` explicitly)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    groups: Any  # megatron.core.process_groups_config.ProcessGroupCollection
    tp_rank: int
    pp_rank: int
    ep_rank: int
    dp_rank: int
    dp_size: int
    env: DistEnv
    host_group: Any = None  # gloo over every rank, long timeout: phase hand-offs (None alone)
    _owns_process_group: bool = field(default=True, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def teardown(self) -> None:
        """Destroy Megatron's groups and (if we created it) the default process group."""
        from megatron.core import parallel_state as ps  # start-up: megatron.core (3.7 s), kept off launch-plan

        ps.destroy_model_parallel()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and read back what the OS chose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_backend(choice: str) -> str:
    if choice == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if choice == "nccl" and not torch.cuda.is_available():
        raise LayoutError("parallel.backend: nccl needs a GPU; use gloo (or auto) on CPU")
    return choice


def _init_process_group(env: DistEnv, backend: str, timeout_s: float) -> bool:
    """Returns True when this call created the default group (False: it existed already)."""
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size:
            raise LayoutError(f"process group has world size {dist.get_world_size()}, environment says {env.world_size}")
        return False
    timeout = timedelta(seconds=timeout_s)
    if env.world_size == 1:
        # A lone process needs no rendezvous: an in-memory store avoids binding a port.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )
    return True


def share_engine_key(name: str, group=None) -> None:
    """Rank 0's engine API key ($name, generated there when unset: rollout/auth.job_key) into $name on every rank,
    and clients built without a key read $name. The driver (rank 0) starts local engines with it; every rank
    pushes weights to them. A job script that exported the key gives every rank the same one anyway."""
    if dist.get_rank() == 0:
        try:
            msg = ["key", job_key(name)]
        except EngineKeyError as e:
            msg = ["error", str(e)]
    else:
        msg = [None, None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(msg, src=0, group=group)  # an object collective: pickled, on the group's device
    if msg[0] == "error":
        raise EngineKeyError(f"rank 0: {msg[1]}")
    os.environ[name] = msg[1]
    use_key_env(name)


_HOST_GROUP = None


def host_group():
    """The host (gloo) group over every rank with parallel.phase_timeout_s (None without one: a lone process)."""
    return _HOST_GROUP


def _new_host_group(world_size: int, timeout_s: float):
    """A gloo group over all ranks whose collectives wait on the host with a long timeout: what a rank blocks on
    while another works alone (rank 0's rollouts), instead of an NCCL kernel under its 600 s watchdog."""
    global _HOST_GROUP
    _HOST_GROUP = None if world_size == 1 else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return _HOST_GROUP


def init_distributed(cfg, env: DistEnv | None = None, timeout_s: float = 600.0,
                     stage: str | None = None) -> DistContext:
    """Initialise torch.distributed and Megatron model parallel for `cfg`; see module docstring. With `stage`
    (sft, rm, grpo) that job's config checks run too, at the real world size (config.stage_problems)."""
    # start-up: megatron.core (3.7 s) deferred: launch-plan loads this package (via distributed.env) without it
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    env = env or read_dist_env()
    problems = layout_problems(cfg, env.world_size) + stage_problems(cfg, stage, env.world_size)
    if problems:
        raise LayoutError(f"world size {env.world_size} ({env.source}):\n  " + "\n  ".join(problems))
    backend = resolve_backend(cfg.parallel.backend)
    if torch.cuda.is_available():
        define_missing_te_gemm()  # Megatron without TE (see cpu_compat); enable_cpu_compat does it on CPU
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        enable_cpu_compat()
        device = torch.device("cpu")
    owns = _init_process_group(env, backend, timeout_s)
    host = _new_host_group(env.world_size, cfg.parallel.phase_timeout_s)
    share_engine_key(cfg.rollout.api_key_env, host)
    p = cfg.parallel
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
        expert_tensor_parallel_size=p.etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.model.seed)
    return DistContext(
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        backend=backend,
        device=device,
        groups=ProcessGroupCollection.use_mpu_process_groups(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        env=env,
        host_group=host,
        _owns_process_group=owns,
    )
