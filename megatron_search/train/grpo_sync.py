"""Builds GRPO's weight sync and its HF checkpoint writes (wiring only; the sync is weights/delivery.py).

Every training rank takes part: the send plan has every rank send what it owns. The engines' URLs
come from the driver (rank 0 starts or attaches to them) and are broadcast; each rank opens its own
HTTP clients. Nodes are told apart by host name (MEGATRON_SEARCH_NODE overrides it, for simulated
multi-node runs on one host). Colocated engines started by rank 0 run on rank 0's node; engines
given as rollout.engine_urls are spread over the nodes in order (engine i on node i * nodes / engines).
"""
from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from megatron_search.rollout.sglang.client import SGLangClient
from megatron_search.rollout.vllm.client import VLLMClient
from megatron_search.weights.checkpoint import copy_side_files, write_passthrough
from megatron_search.weights.delivery import WeightSync
from megatron_search.weights.export import export_hf_weights
from megatron_search.weights.safetensors_writer import ShardedSafetensorsWriter
from megatron_search.weights.send_plan import LinkCosts

NODE_ENV = "MEGATRON_SEARCH_NODE"


def node_ids() -> list[int]:
    """Node index of every training rank, numbered in order of each node's first rank."""
    name = os.environ.get(NODE_ENV) or socket.gethostname()
    names = [name]
    if dist.is_initialized() and dist.get_world_size() > 1:
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, name)
    ids: dict[str, int] = {}
    return [ids.setdefault(n, len(ids)) for n in names]


def engine_nodes(rollout, n_engines: int, rank_node: Sequence[int]) -> Optional[list[int]]:
    """Colocated (a RolloutConfig's mode): the node each engine runs on (see module doc); disaggregated: None."""
    if rollout.mode != "colocated":
        return None
    if rollout.engine_urls:
        n_nodes = max(rank_node) + 1
        return [i * n_nodes // n_engines for i in range(n_engines)]
    return [rank_node[0]] * n_engines


def _sender_address(urls: Sequence[str]) -> str:
    """Where engines reach this rank's broadcast group: loopback when every engine is local."""
    hosts = {urlparse(u).hostname for u in urls}
    if all(h is not None and (h == "localhost" or h.startswith("127.")) for h in hosts):
        return "127.0.0.1"
    return socket.gethostname()


def build_weight_sync(cfg, urls: Sequence[str], output_dir: Path) -> WeightSync:
    """The run's WeightSync on this rank; it owns the engine clients it opens (closed by `close`)."""
    r = cfg.rollout
    arch = cfg.model.architecture
    moe_shape = (arch.num_layers, arch.moe_top_k) if arch.num_experts else None
    kind = "sglang" if r.engine == "sglang" else "auto"
    clients = [SGLangClient(u, r.sglang.request_timeout_s, moe_shape, kind, tp_size=r.sglang.tp) for u in urls]
    if r.engine == "vllm":
        clients = [VLLMClient(u, r.vllm.request_timeout_s, moe_shape) for u in urls]
    rank_node = node_ids()
    engine_node = engine_nodes(cfg.rollout, len(clients), rank_node)
    mode = r.resolved_weight_sync()
    sync = WeightSync(
        clients, mode, bucket_bytes=cfg.weight_bucket_bytes(), inflight=r.inflight_on_update,
        disk_dir=Path(r.weight_sync_dir) if r.weight_sync_dir else output_dir / "weight_sync",
        sender_address=_sender_address(urls), rank_node=rank_node,
        engine_node=engine_node, link_costs=LinkCosts.for_cluster(cfg.cluster, colocated=engine_node is not None),
        engine_ranks=[r.sglang.tp * r.sglang.dp if r.engine == "sglang" else 1] * len(clients),
        backend="nccl" if torch.cuda.is_available() else "gloo", owns_engines=True,
        # GRPO freezes the MTP block (train/grpo_run.py), so the engines keep what they loaded; SGLang 0.5.23's
        # Qwen3.5 load_weights skips every "mtp" name anyway (models/qwen3_5.py): never pushed
        skip_prefixes=("mtp.",),
    )
    return sync


def save_hf_weights(model_chunks, cfg, groups, out_dir: Path, bucket_bytes: int) -> None:
    """Collective: stream the policy bucket by bucket into an HF checkpoint directory written by rank 0
    (sharded safetensors + the model's side files: config, tokenizer, chat template, processor configs),
    never holding more than a bucket and one shard in memory."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    writer = None
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes=4 << 30)
    for bucket in export_hf_weights(model_chunks, cfg.model.architecture, bucket_bytes, groups):
        for name, t in bucket:
            writer.add(name, t)
    if rank0:
        write_passthrough(writer, cfg)  # the vision tower (and mtp.*) the trainer does not hold, from model.path
        writer.close()
        copy_side_files(cfg.model.engine_dir(), tmp)  # config, tokenizer, chat template, processor files
        hf_config = cfg.model.resolved_hf_config()
        if not (tmp / "config.json").exists():
            shutil.copyfile(hf_config / "config.json" if hf_config.is_dir() else hf_config, tmp / "config.json")
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
