#!/usr/bin/env python
"""Weight-sync throughput on CPU: export (TP=2 gather to rank 0) and export + delivery into a local engine.

A Qwen3-MoE model of about `--gb` GB (fp32, random weights) is built at TP=2 on 2 gloo processes and
wrapped in Megatron DDP as the trainer holds it
(`--tp 1`: data parallel; `--ep 2`: experts split over the 2 processes whole, ETP=1, as every GRPO config
places them; both GRPO path only).
Measured in the same run, on the same bytes:
  memcpy      torch copy of every HF tensor's bytes (2 threads) - the machine's ceiling
  gloo p2p    raw send/recv of the bytes rank 1 must ship, in bucket-sized messages
  export      HFExporter: plan, shard transfer, reassembly, HF layout (per bucket size)
  +delivery   the same, pushed into a LocalEngine on rank 0 with update_weights_from_tensor
              (load by HF name into a transformers model; the colocated path)
and the peak extra resident memory on rank 0 during export, next to the bucket size.
The ratio export / memcpy is the figure of merit; on these CPUs gloo bounds it (FACTS.md).
Then the GRPO path itself: `WeightSync` (owner-parallel, both ranks sending, disaggregated broadcast
groups) into a local engine server in its own process, against a raw gloo broadcast of the same
bytes by the same two processes; the ratio raw time / sync time is printed, and the CPU seconds per GB
that each process spent on either (the push's work is spread over three processes on the same cores).

    python tools/bench_weight_sync.py [--gb 1.0] [--buckets-mb 64,256] [--grpo-only [--tp 1] [--ep 2]]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import torch


def model_config(gb: float) -> dict:
    """A Qwen3-MoE config.json of about `gb` GB in fp32 (layer count scales)."""
    hidden, vocab, experts, inter = 1024, 8192, 16, 512
    per_layer = experts * 3 * hidden * inter + 2 * hidden * hidden + 2 * 512 * hidden + experts * hidden
    fixed = 2 * vocab * hidden
    layers = max(2, round((gb * 1e9 / 4 - fixed) / per_layer))
    layers += layers % 2
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": 2048, "num_hidden_layers": layers, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
        "attention_bias": False, "moe_intermediate_size": inter, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "num_experts": experts, "decoder_sparse_step": 1, "mlp_only_layers": [],
    }


class PeakRSS:
    """Samples this process's resident memory in a thread; `peak - base` is the extra memory."""

    def __init__(self, every_s: float = 0.005):
        import psutil

        self.proc, self.every = psutil.Process(), every_s
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.every)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def _grpo_path(chunks, arch, ctx, url: str, bucket_mb: int, repeats: int, total: int, engine_pid: int) -> dict:
    """Best-of-`repeats` seconds of WeightSync.push into the engine, and of a raw gloo broadcast of `total` bytes
    in bucket-sized messages; the two alternate, so both see the same machine (its other load varies). Also the
    CPU seconds each try took in every process (both ranks, and the engine server for the push)."""
    import psutil
    import torch.distributed as dist

    from megatron_search.rollout.sglang.client import SGLangClient
    from megatron_search.weights.delivery import WeightSync

    sync = WeightSync([SGLangClient(url, 3600.0)], "distributed", bucket_bytes=bucket_mb << 20, inflight="abort",
                      rank_node=[0] * dist.get_world_size(), owns_engines=True)
    # written bytes: an untouched buffer reads as the kernel's shared zero page, which a sender sends about
    # 25% faster than real memory (measured: 1 GB broadcast 0.33-0.35 s untouched, 0.44 s filled)
    msg = torch.full((bucket_mb << 20,), 7, dtype=torch.uint8)
    best = raw = None
    sync_all, raw_all, cpu_all = [], [], []
    engine = psutil.Process(engine_pid)

    def engine_cpu() -> float:
        t = engine.cpu_times()
        return t.user + t.system

    for i in range(repeats):
        dist.barrier()
        c0, e0 = time.process_time(), engine_cpu()
        t0 = time.perf_counter()
        stats = sync.push(chunks, arch, ctx.groups, version=f"bench-{i}")
        dt = time.perf_counter() - t0
        cpu = [time.process_time() - c0, engine_cpu() - e0]
        best = dt if best is None else min(best, dt)
        sync_all.append(dt)
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        left = total
        while left > 0:
            n = min(left, msg.numel())
            dist.broadcast(msg[:n], src=0)
            left -= n
        dist.barrier()
        dt = time.perf_counter() - t0
        raw = dt if raw is None else min(raw, dt)
        raw_all.append(dt)
        cpu_t = torch.tensor(cpu + [time.process_time() - c0], dtype=torch.float64)  # push, engine, raw
        every = [torch.empty_like(cpu_t) for _ in range(dist.get_world_size())]
        dist.all_gather(every, cpu_t)
        cpu_all.append([t.tolist() for t in every])
    sync.close()
    in_place = torch.tensor([stats.in_place_bytes], dtype=torch.int64)
    dist.all_reduce(in_place)
    return {"sync_s": best, "raw_broadcast_s": raw, "sync_all": sync_all, "raw_all": raw_all, "cpu_all": cpu_all,
            "in_place_bytes": int(in_place)}


def _rank(model_dir: str, buckets_mb: list[int], repeats: int, url: str, grpo_repeats: int, grpo_only: bool,
          engine_pid: int, tp: int, ep: int) -> dict:
    import torch.distributed as dist

    from megatron_search.config.loader import load_config
    from megatron_search.distributed.init import init_distributed
    from megatron_search.models.provider import build_model_chunks
    from megatron_search.trainer.step import wrap_ddp
    from megatron_search.weights.export import HFExporter

    torch.set_num_threads(1)
    etp = tp if ep == 1 else 1  # experts either tensor-parallel with the rest or spread over EP (ETP=1)
    cfg = load_config(None, [f"model.hf_config={model_dir}", f"parallel.tp={tp}", f"parallel.ep={ep}",
                             f"parallel.etp={etp}", f"parallel.sequence_parallel={tp > 1}", "parallel.world_size=2"])
    ctx = init_distributed(cfg)
    arch = cfg.model.architecture
    chunks = build_model_chunks(cfg, ctx.groups)
    chunks = wrap_ddp(cfg, chunks, chunks[0].config)  # as the trainer holds them: parameters in DDP's buffers
    rank = dist.get_rank()
    out: dict = {"rows": []}
    probe = HFExporter(chunks, arch, ctx.groups, max(buckets_mb) << 20)
    total = probe.total_bytes
    sent = sum(p.tensor.numel() * p.tensor.element_size() for p in probe.local.values()
               if p.tp_size > 1) if rank == 1 else 0
    sent_t = torch.tensor([sent], dtype=torch.int64)
    dist.broadcast(sent_t, src=1)
    sent = int(sent_t)
    out.update(total_bytes=total, shipped_bytes=sent)
    if grpo_only:
        out["grpo"] = _grpo_path(chunks, arch, ctx, url, max(buckets_mb), grpo_repeats, total, engine_pid)
        ctx.teardown()
        return out

    # Raw gloo p2p of the bytes rank 1 ships, in 64 MB messages.
    msg = torch.full((64 << 20,), 7, dtype=torch.uint8)  # written bytes (see _grpo_path)
    dist.barrier()
    t0 = time.perf_counter()
    left = sent
    while left > 0:
        n = min(left, msg.numel())
        (dist.send if rank == 1 else dist.recv)(msg[:n], 1 - rank)
        left -= n
    dist.barrier()
    out["gloo_s"] = time.perf_counter() - t0

    engine = loop = None
    if rank == 0:
        import asyncio

        from megatron_search.rollout.local.engine import LocalEngine

        # memcpy of the same bytes (2 threads), median of 3.
        torch.set_num_threads(2)
        src = torch.empty(total // 4, dtype=torch.float32).fill_(1.0)
        dst = torch.empty_like(src)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        out["memcpy_s"] = sorted(times)[1]
        del src, dst
        torch.set_num_threads(1)
        engine = LocalEngine(model_dir)
        loop = asyncio.new_event_loop()
    for mb in buckets_mb:
        for deliver in (False, True):
            best, peak = None, 0.0
            for _ in range(repeats):
                dist.barrier()
                exporter = HFExporter(chunks, arch, ctx.groups, mb << 20)
                if deliver and rank == 0:  # tensor updates run inside a weight-update session
                    loop.run_until_complete(engine.begin_weight_update())
                with PeakRSS() as mem:
                    t0 = time.perf_counter()
                    for bucket in exporter:
                        if deliver and rank == 0:
                            loop.run_until_complete(engine.update_weights_from_tensor(bucket))
                        del bucket
                    dt = time.perf_counter() - t0
                if deliver and rank == 0:
                    loop.run_until_complete(engine.end_weight_update())
                dist.barrier()
                best = dt if best is None else min(best, dt)
                peak = max(peak, mem.extra_mb)
            out["rows"].append({"bucket_mb": mb, "delivery": deliver, "s": best, "extra_mb": peak,
                                "buckets": len(exporter.buckets)})
    if loop is not None:
        loop.run_until_complete(engine.close())
    out["grpo"] = _grpo_path(chunks, arch, ctx, url, max(buckets_mb), grpo_repeats, total, engine_pid)
    ctx.teardown()
    return out


def _print_export(res: dict, gb: float, total: int) -> None:
    memcpy = gb / res["memcpy_s"]
    gloo = res["shipped_bytes"] / 1e9 / res["gloo_s"]
    print(f"model: {gb:.2f} GB of HF tensors (fp32), TP=2 on 2 gloo processes; rank 1 ships "
          f"{res['shipped_bytes'] / 1e9:.2f} GB")
    print(f"memcpy      {memcpy:8.2f} GB/s   (torch copy of {gb:.2f} GB, 2 threads)")
    print(f"gloo p2p    {gloo:8.2f} GB/s   (raw send/recv of the {res['shipped_bytes'] / 1e9:.2f} GB rank 1 ships)")
    print(f"{'bucket MB':>9} {'path':>18} {'buckets':>7} {'s':>7} {'GB/s':>7} {'/memcpy':>8} {'/gloo*':>7} "
          f"{'peak extra MB':>13}")
    for r in res["rows"]:
        rate = gb / r["s"]
        path = "export+tensor" if r["delivery"] else "export"
        print(f"{r['bucket_mb']:>9} {path:>18} {r['buckets']:>7} {r['s']:>7.2f} {rate:>7.2f} {rate / memcpy:>8.3f} "
              f"{rate / (gloo * total / max(res['shipped_bytes'], 1)):>7.3f} {r['extra_mb']:>13.0f}")
    print("/gloo*: against the time raw gloo needs for the shipped bytes, expressed per exported byte.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="model size in GB (fp32)")
    ap.add_argument("--buckets-mb", default="64,256")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--grpo-repeats", type=int, default=4, help="pushes (and raw broadcasts, alternating) on the GRPO path")
    ap.add_argument("--grpo-only", action="store_true", help="only the GRPO path against the raw broadcast")
    ap.add_argument("--tp", type=int, choices=(1, 2), default=2,
                    help="tensor parallel size of the 2 training processes (1: data parallel, no TP gathers; only "
                         "with --grpo-only)")
    ap.add_argument("--ep", type=int, choices=(1, 2), default=1,
                    help="expert parallel size (2: each process holds half the experts whole, ETP=1, the layout of "
                         "every GRPO config; 1: experts tensor-parallel like the rest; only with --grpo-only)")
    args = ap.parse_args()
    if args.tp == 1 and not args.grpo_only:
        ap.error("--tp 1 measures the GRPO path only: pass --grpo-only")
    if args.ep == 2 and not args.grpo_only:
        ap.error("--ep 2 measures the GRPO path only: pass --grpo-only")
    from megatron_search.rollout.local.launch import launch_local_server
    from megatron_search.weights.launch import run_ranks

    buckets = [int(x) for x in args.buckets_mb.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(model_config(args.gb)))
        server = launch_local_server(None, [f"model.hf_config={tmp}"], Path(tmp) / "engine.log", timeout_s=600)
        try:
            res = run_ranks(_rank, 2, tmp, buckets, args.repeats, server.url, args.grpo_repeats, args.grpo_only,
                            server.proc.pid, args.tp, args.ep)[0]
        finally:
            server.stop()
    total = res["total_bytes"]
    gb = total / 1e9
    if not args.grpo_only:
        _print_export(res, gb, total)
    g = res["grpo"]
    print(f"GRPO path   {gb / g['sync_s']:8.2f} GB/s   (WeightSync.push, both ranks sending, broadcast groups into a "
          f"local engine server, {max(buckets)} MB buckets, TP={args.tp}, "
          f"{'EP=2 ETP=1' if args.ep == 2 else f'ETP={args.tp}'})")
    print(f"in place    {g['in_place_bytes'] / 1e9:8.2f} GB     (broadcast from where the parameters lie in DDP's "
          f"buffers, not copied into a staging buffer first)")
    print(f"raw gloo    {gb / g['raw_broadcast_s']:8.2f} GB/s   (dist.broadcast of the same {gb:.2f} GB by the same "
          f"2 processes)")
    print(f"ratio       {g['raw_broadcast_s'] / g['sync_s']:8.3f}        (GRPO path / raw broadcast, best of "
          f"{len(g['sync_all'])} each, alternating; target >= 0.5)")
    print("  each try (s): sync " + " ".join(f"{t:.2f}" for t in g["sync_all"]) + " | raw "
          + " ".join(f"{t:.2f}" for t in g["raw_all"]))
    # CPU seconds per GB, median over the tries after the first (which opens the groups and allocates)
    tries = g["cpu_all"][1:] or g["cpu_all"]

    def med(xs):
        return sorted(xs)[len(xs) // 2] / gb

    sync_cpu = [med([t[r][0] for t in tries]) for r in range(len(tries[0]))] + [med([t[0][1] for t in tries])]
    raw_cpu = [med([t[r][2] for t in tries]) for r in range(len(tries[0]))]
    print("CPU s/GB    sync: " + " + ".join(f"rank {r} {c:.2f}" for r, c in enumerate(sync_cpu[:-1]))
          + f" + engine {sync_cpu[-1]:.2f} = {sum(sync_cpu):.2f} | raw: "
          + " + ".join(f"rank {r} {c:.2f}" for r, c in enumerate(raw_cpu)) + f" = {sum(raw_cpu):.2f} "
          f"(median; on {os.cpu_count()} cores a push needs at least {sum(sync_cpu) / os.cpu_count():.2f} s/GB)")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
