"""Cluster section: what the job runs on. Used by the planner and the Slurm launcher."""
from __future__ import annotations

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt

from .base import Section


class ClusterConfig(Section):
    nodes: PositiveInt = 1
    gpus_per_node: PositiveInt = 8
    gpu_mem_gib: PositiveFloat = Field(141.0, description="usable memory per GPU (H200: 141 GiB)")
    rollout_nodes: NonNegativeInt = Field(
        0, description="nodes reserved for SGLang in disaggregated mode (0 in colocated mode)"
    )
    memory_headroom_gib: float = Field(
        6.0, ge=0.0, description="per-GPU reserve for the CUDA context, NCCL buffers and fragmentation"
    )
