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
    nic_gb_per_s: PositiveFloat = Field(
        400.0, description="network bandwidth per node, GB/s, all NICs together (8 x 400 Gb/s InfiniBand); "
        "the planner's weight-sync estimate gives each GPU an equal share")
    nvlink_gb_per_s: PositiveFloat = Field(
        450.0, description="NVLink bandwidth per GPU and direction, GB/s (H100/H200: 900 GB/s both ways)")
    storage_node_gb_per_s: PositiveFloat = Field(
        10.0, description="what one node writes to (or reads from) the shared filesystem, GB/s (an assumption: "
        "measure yours); the planner's checkpoint save and resume times")
    storage_gb_per_s: PositiveFloat = Field(
        100.0, description="the shared filesystem's aggregate bandwidth, GB/s (an assumption), the cap on all "
        "nodes together")
    preemption_notice_s: PositiveFloat = Field(
        300.0, description="seconds between Slurm's preemption signal and the kill (`#SBATCH --signal=B:USR1@300` "
        "in slurm/*.sh): the step in flight and a checkpoint must fit in it")
    train_tflops_per_gpu: PositiveFloat = Field(
        200.0, description="the throughput a training GPU sustains, TFLOP/s of the model's FLOPs recompute included "
        "(an assumption: Megatron-Core reports 253 FP8 for Qwen3-235B on H100; measure yours); the planner's step "
        "time and preemption margin")
    engine_tokens_per_s: PositiveFloat = Field(
        8000.0, description="tokens one rollout engine generates per second over many concurrent requests (an "
        "assumption: measure yours); the planner's time for GRPO's step-0 reference answers")
    memory_headroom_gib: float = Field(
        6.0, ge=0.0, description="per-GPU reserve for the CUDA context, NCCL buffers and fragmentation"
    )
