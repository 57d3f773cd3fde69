"""What a training checkpoint costs at a layout: bytes written and read, host memory per rank, save and resume
time on the cluster's shared filesystem (docs/PLANNER.md).

The checkpoint (trainer/checkpoint.py) holds every parameter once in params_dtype, and the distributed
optimizer's fp32 master copy and Adam moments (12 bytes per parameter). Written with checkpoint.fully_parallel,
replicated weights are spread over the DP ranks, so every rank writes about 1/world of the total.
checkpoint.optimizer_format:
- dp_reshardable: each rank writes its own optimizer shard as it lies; a resume reads each byte once; the host
  holds what the writer threads stage, one tensor each at a time (torch.distributed.checkpoint's serial CPU
  loader): bounded here by checkpoint.write_threads x the largest tensor, the fp32 embedding shard;
- fully_reshardable: Megatron gathers each DP group's optimizer state per parameter into host tensors on every
  DP rank before writing (the rank's model-parallel shard x 12 bytes), and a resume has each DP rank read the
  full per-parameter state of its shard (DP times the optimizer bytes).
Times are bytes over min(nodes x cluster.storage_node_gb_per_s, cluster.storage_gb_per_s): the filesystem's
bandwidth is an assumption of the config, not a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_search.config.schema import Config

from .memory import ADAM_STATE_BYTES, DTYPE_BYTES, Plan


@dataclass
class CheckpointEstimate:
    optimizer_format: str
    bytes_written: float  # one save, all ranks
    bytes_read: float  # one resume, all ranks
    host_bytes_per_rank: float  # the largest extra host buffer one rank holds while saving
    save_s: float
    resume_s: float
    notice_s: float  # cluster.preemption_notice_s


def checkpoint_estimate(cfg: Config, plan: Plan) -> CheckpointEstimate:
    c, p = cfg.cluster, cfg.parallel
    params = plan.counts.total
    weights = params * DTYPE_BYTES[cfg.model.params_dtype]
    optimizer = params * ADAM_STATE_BYTES
    world = plan.train_gpus
    nodes = max(world // c.gpus_per_node, 1)
    bandwidth = min(nodes * c.storage_node_gb_per_s, c.storage_gb_per_s) * 1e9
    shard = max((s.params for s in plan.stages), default=params)  # parameters one model-parallel rank holds
    written = weights + optimizer
    if cfg.checkpoint.optimizer_format == "fully_reshardable" and p.distributed_optimizer:
        host = shard * ADAM_STATE_BYTES
        # every rank of a DP group reads the whole per-parameter state of the group's shard: dense parameters
        # DP x CP times over, routed experts over their own (smaller) expert-DP group
        experts = plan.counts.experts_per_layer * len(plan.counts.dense_per_layer)
        expert_dp = max(p.tp * p.cp * plan.dp // (p.ep * p.etp), 1)
        read = weights + ADAM_STATE_BYTES * ((params - experts) * plan.dp * p.cp + experts * expert_dp)
    else:
        host = cfg.checkpoint.write_threads * plan.counts.embedding / p.tp * 4
        read = written
    return CheckpointEstimate(cfg.checkpoint.optimizer_format, written, read, host, written / bandwidth,
                              read / bandwidth, c.preemption_notice_s)


def format_checkpoint(est: CheckpointEstimate) -> str:
    line = (f"checkpoint ({est.optimizer_format}): {est.bytes_written / 1e12:.2f} TB per save, "
            f"{est.bytes_read / 1e12:.2f} TB read per resume, {est.host_bytes_per_rank / 1e9:.1f} GB host memory "
            f"per rank; save {est.save_s:.0f} s, resume {est.resume_s:.0f} s at the configured filesystem bandwidth")
    if est.save_s > est.notice_s:
        line += f"; longer than the {est.notice_s:.0f} s of preemption notice"
    return line
