"""A rank's coordinates read from the process groups it is handed (a Megatron ProcessGroupCollection or
anything with the same attributes), never from Megatron's global parallel_state: every package outside
distributed/ takes its groups as an argument (tests/test_layering.py forbids the global getters there)."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from megatron.core import parallel_state as ps


def rank_in(group) -> int:
    """This rank's index in `group`; 0 for None (a group of one)."""
    return 0 if group is None else group.rank()


def size_of(group) -> int:
    """The size of `group`; 1 for None."""
    return 1 if group is None else group.size()


def is_first_stage(groups) -> bool:
    """The first pipeline stage (ignoring virtual stages)."""
    return rank_in(groups.pp) == 0


def is_last_stage(groups) -> bool:
    """The last pipeline stage (ignoring virtual stages)."""
    return rank_in(groups.pp) == size_of(groups.pp) - 1


def chunk_stage_flags(groups, vp_stage: Optional[int], vpp: Optional[int]) -> tuple[bool, bool]:
    """(pre_process, post_process) of the model chunk of virtual stage `vp_stage` out of `vpp` (None: no
    virtual pipeline): the embedding sits on the first chunk of the first stage, the output layer on the
    last chunk of the last stage."""
    first_chunk = vp_stage is None or vp_stage == 0
    last_chunk = vp_stage is None or vpp is None or vp_stage == vpp - 1
    return is_first_stage(groups) and first_chunk, is_last_stage(groups) and last_chunk


def require_model_parallel(what: str) -> None:
    """Megatron's modules read its global parallel state while they are built: refuse to build before
    init_distributed set it up."""
    if not ps.model_parallel_is_initialized():
        raise RuntimeError(f"{what}: model parallel state is not initialised; call init_distributed(cfg) first")


def last_stage_rank(groups) -> int:
    """The global rank of the last pipeline stage in this rank's pipeline group."""
    if groups.pp is None or groups.pp.size() == 1:
        return dist.get_rank() if dist.is_initialized() else 0
    return dist.get_process_group_ranks(groups.pp)[-1]
