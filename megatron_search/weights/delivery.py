"""Push the trainer's weights into rollout engines: the three SGLang update paths, with versions.

    sync = WeightSync(engines, mode="tensor" | "distributed" | "disk", bucket_bytes=512 << 20)
    stats = sync.push(model_chunks, arch, groups)     # on every training rank, every GRPO step

Every training rank runs the exporter (it is collective); only `dst_rank` (rank 0) talks to the
engines. The paths:
  tensor       POST /update_weights_from_tensor per bucket (colocated engines).
  distributed  /init_weights_update_group once (the trainer hosts a gloo group here, NCCL on
               GPU hosts through SGLang), then per bucket /update_weights_from_distributed
               announcing names/dtypes/shapes while the trainer broadcasts the tensors.
  disk         the buckets are written as one safetensors checkpoint (temp dir, then renamed),
               then POST /update_weights_from_disk.
In-flight requests (rollout.inflight_on_update): "abort" pauses with abort (they end with
finish_reason abort) and "finish" pauses in place (they keep their state and finish on the new
weights once generation continues). Either way no request decodes on a half-updated model:
the engines are paused from the first bucket to the last. The weight version is set with the
last bucket only, so an engine reporting version v holds all of v.
"""
from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_search.config.hf import Architecture
from megatron_search.weights.export import HFExporter
from megatron_search.weights.safetensors_writer import ShardedSafetensorsWriter

Mode = Literal["tensor", "distributed", "disk"]
Inflight = Literal["abort", "finish"]


@dataclass
class SyncStats:
    version: str
    bytes: int
    buckets: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


class WeightSync:
    """Pushes exported HF tensors to a list of engines (rollout.engine.Engine)."""

    def __init__(self, engines: Sequence, mode: Mode = "tensor", *, bucket_bytes: int = 512 << 20,
                 inflight: Inflight = "finish", out_dtype: Optional[torch.dtype] = None,
                 disk_dir: Optional[str | Path] = None, master_address: str = "127.0.0.1",
                 master_port: Optional[int] = None, engine_ranks: Optional[Sequence[int]] = None,
                 group_name: str = "weight_update_group", dst_rank: int = 0, world_group=None):
        if mode not in ("tensor", "distributed", "disk"):
            raise ValueError(f"weight sync mode must be tensor, distributed or disk, got {mode!r}")
        if inflight not in ("abort", "finish"):
            raise ValueError(f"inflight must be abort or finish, got {inflight!r}")
        if mode == "disk" and disk_dir is None:
            raise ValueError("weight sync mode 'disk' needs disk_dir")
        self.engines = list(engines)
        self.mode, self.inflight = mode, inflight
        self.bucket_bytes, self.out_dtype = bucket_bytes, out_dtype
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.master_address, self.master_port = master_address, master_port
        self.engine_ranks = list(engine_ranks) if engine_ranks is not None else [1] * len(self.engines)
        self.group_name, self.dst_rank, self.world_group = group_name, dst_rank, world_group
        self.version = 0
        self._group = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    # ---- public -------------------------------------------------------------------------------
    def push(self, model_chunks, arch: Architecture, groups, version: Optional[str] = None) -> SyncStats:
        """Export and deliver; collective over the training ranks. Returns the stats (all ranks)."""
        self.version += 1
        tag = str(version if version is not None else self.version)
        exporter = HFExporter(model_chunks, arch, groups, self.bucket_bytes, dst_rank=self.dst_rank,
                              out_dtype=self.out_dtype, world_group=self.world_group)
        is_dst = not dist.is_initialized() or dist.get_rank(self.world_group) == self.dst_rank
        start = time.perf_counter()
        if not is_dst:
            for _ in exporter:  # send our shards; dst does the talking
                pass
        else:
            self._run(self._deliver(exporter, tag))
        return SyncStats(tag, exporter.total_bytes, len(exporter.buckets), time.perf_counter() - start)

    def close(self) -> None:
        """Leave the update group (distributed mode) and stop the private event loop."""
        if self._group is not None and self._loop is not None:
            self._run(asyncio.gather(*(e.destroy_weights_update_group(self.group_name) for e in self.engines)))
            self._group = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    # ---- internals ----------------------------------------------------------------------------
    def _run(self, coro):
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    async def _all(self, make):
        await asyncio.gather(*(make(e) for e in self.engines))

    async def _deliver(self, exporter: HFExporter, tag: str) -> None:
        abort = self.inflight == "abort"
        await self._all(lambda e: e.pause_generation("abort" if abort else "in_place"))
        try:
            if self.mode == "disk":
                await self._deliver_disk(exporter, tag)
            else:
                if self.mode == "distributed" and self._group is None:
                    await self._open_group()
                n = len(exporter.buckets)
                for i, bucket in enumerate(exporter):
                    last = i == n - 1
                    await self._send_bucket(bucket, tag if last else None, last)
        finally:
            await self._all(lambda e: e.continue_generation())

    async def _send_bucket(self, bucket, version: Optional[str], last: bool) -> None:
        if self.mode == "tensor":
            await self._all(lambda e: e.update_weights_from_tensor(bucket, weight_version=version, flush_cache=last))
            return
        from megatron_search.rollout.weight_group import send_named_tensors

        names = [n for n, _ in bucket]
        dtypes = [str(t.dtype).replace("torch.", "") for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        engines = self._all(lambda e: e.update_weights_from_distributed(
            names, dtypes, shapes, group_name=self.group_name, weight_version=version, flush_cache=last))
        await asyncio.gather(engines, asyncio.to_thread(send_named_tensors, self._group, bucket))

    async def _open_group(self) -> None:
        from megatron_search.distributed.init import free_port
        from megatron_search.rollout.weight_group import open_gloo_group

        port = self.master_port or free_port(self.master_address)
        world = 1 + sum(self.engine_ranks)
        offsets = [1 + sum(self.engine_ranks[:i]) for i in range(len(self.engines))]
        joins = [e.init_weights_update_group(self.master_address, port, off, world, self.group_name, "gloo")
                 for e, off in zip(self.engines, offsets)]
        trainer = asyncio.to_thread(open_gloo_group, self.master_address, port, 0, world, self.group_name)
        results = await asyncio.gather(trainer, *joins)
        self._group = results[0]

    async def _deliver_disk(self, exporter: HFExporter, tag: str) -> None:
        final = self.disk_dir / f"weights_v{tag}"
        tmp = self.disk_dir / f".weights_v{tag}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes=max(self.bucket_bytes, 1))
        for bucket in exporter:
            for name, t in bucket:
                writer.add(name, t)
        writer.close()
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        await self._all(lambda e: e.update_weights_from_disk(str(final), weight_version=tag))
        for old in self.disk_dir.glob("weights_v*"):  # keep only the version the engines now serve
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
