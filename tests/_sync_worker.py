"""Rank body of the owner-parallel weight-sync test: 4 gloo processes on 2 simulated nodes.

Ranks 0-1 are node 0, ranks 2-3 node 1; the parent serves one local engine per node, bound to a
different loopback address (127.0.0.1 and 127.0.0.2). Per layout (TP2 x PP2, EP2 x PP2) and sync
mode, two pushes, each after the trainer's weights changed. After every push rank 0 exports the
model again through the rank-0 funnel (an independent path: one sender, no plan choices) into a
reference transformers model initialised with another seed, so a parameter the sync missed shows,
and compares each engine's per-parameter sha256 with it.
"""
from __future__ import annotations

import asyncio
import json
import urllib.request

import torch
import torch.distributed as dist

LAYOUTS = {"tp2_pp2": (2, 2, 1), "ep2_pp2": (1, 2, 2)}
RANK_NODE = [0, 0, 1, 1]
MODES = {  # name: (WeightSync mode, node of each engine; None = disaggregated)
    "colocated_tensor": ("tensor", [0, 1]),
    "colocated_shared_node": ("tensor", [0, 0]),  # both engines on node 0: one destination, two hand-offs
    "disaggregated_distributed": ("distributed", None),
    "disaggregated_disk": ("disk", None),
}
SKIP = ".visual."  # the vision tower is not trained, so the sync never carries it


def _cfg(arch_dir: str, tp: int, pp: int, ep: int):
    from megatron_search.config.loader import load_config

    return load_config(None, [f"model.hf_config={arch_dir}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                              f"parallel.ep={ep}", f"parallel.etp={tp if ep == 1 else 1}", "parallel.world_size=4",
                              f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}"])


def _reference_sha(chunks, arch, groups, arch_dir: str, bucket_bytes: int):
    """Rank 0: sha256 per parameter of a differently seeded HF model loaded from the funnel export."""
    from megatron_search.rollout.local.runner import load_hf_model
    from megatron_search.rollout.local.weights import load_named_tensors, weights_sha256
    from megatron_search.weights.export import export_hf_weights

    model = load_hf_model(arch_dir, seed=12345) if dist.get_rank() == 0 else None
    for bucket in export_hf_weights(chunks, arch, bucket_bytes, groups):
        if model is not None:
            load_named_tensors(model, bucket)
    return weights_sha256(model) if model is not None else None


def _engine_sha(url: str) -> dict:
    from megatron_search.rollout.engine.auth import bearer_header, key_from_env

    req = urllib.request.Request(f"{url}/local/weights_sha256", headers=bearer_header(key_from_env()))
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def main(work: str, arch_dir: str, urls: list[str], bucket_bytes: int) -> dict:
    from megatron_search.distributed.init import init_distributed
    from megatron_search.models.provider import build_model
    from megatron_search.rollout.sglang.client import SGLangClient
    from megatron_search.trainer.step import wrap_ddp
    from megatron_search.weights.delivery import WeightSync

    torch.set_num_threads(1)
    out: dict = {}
    for lay, (tp, pp, ep) in LAYOUTS.items():
        cfg = _cfg(arch_dir, tp, pp, ep)
        ctx = init_distributed(cfg)
        chunks = [build_model(cfg, ctx.groups)]
        chunks = wrap_ddp(cfg, chunks, chunks[0].config)  # as the trainer holds them: parameters in DDP's buffers
        arch = cfg.model.architecture
        for name, (mode, engine_node) in MODES.items():
            clients = [SGLangClient(u) for u in urls]
            sync = WeightSync(clients, mode=mode, bucket_bytes=bucket_bytes, rank_node=RANK_NODE,
                              engine_node=engine_node, disk_dir=f"{work}/disk_{lay}",
                              inflight="finish" if engine_node else "abort", in_place_min_bytes=0)
            for step in range(2):
                if mode == "distributed" and step == 1:  # some parameters leave DDP's buffer before they change:
                    for n, p in chunks[0].named_parameters():  # the sync must stage them, not read where they were
                        if "linear_fc1" in n:
                            p.data = p.data.clone()
                with torch.no_grad():  # a new policy: every parameter changes, identically on every replica
                    for p in chunks[0].parameters():
                        p.mul_(1.0 + 0.01 * (step + 1)).add_(0.001)
                tag = f"{lay}-{name}-{step}"
                stats = sync.push(chunks, arch, ctx.groups, version=tag)
                ref = _reference_sha(chunks, arch, ctx.groups, arch_dir, bucket_bytes)
                peaks = [None] * dist.get_world_size()
                dist.all_gather_object(peaks, stats.peak_extra_bytes)
                if dist.get_rank() == 0:
                    engines = [_engine_sha(u) for u in urls]
                    keys = [k for k in ref if SKIP not in k]
                    out[tag] = {
                        "versions": [e["weight_version"] for e in engines],
                        "mismatched": [[k for k in keys if e["sha256"].get(k) != ref[k]] for e in engines],
                        "n_params": len(keys),
                        "rank_sent_bytes": stats.rank_sent_bytes,
                        "peak_extra_bytes": peaks,
                        "model_bytes": stats.bytes,
                        "rounds": stats.buckets,
                        "in_place_bytes": stats.in_place_bytes,
                    }
            sync.close()
            for c in clients:
                asyncio.run(c.close())
        last = ctx  # the next layout re-uses the process group (init_distributed rebuilds Megatron's groups)
    last.teardown()
    return out
