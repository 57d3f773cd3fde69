"""Push the trainer's weights into rollout engines, owner-parallel: every training rank sends what it owns.

    sync = WeightSync(urls_or_engines, mode="tensor" | "distributed" | "disk",
                      rank_node=[...], engine_node=[...] or None, bucket_bytes=512 << 20)
    stats = sync.push(model_chunks, arch, groups, version)   # on every training rank, every GRPO step

The send plan (weights/send_plan.py) names, for every parameter and destination, the rank that
assembles and sends it; `HFExporter` moves the TP shards to those ranks round by round. Then:
  colocated (engine_node given)   engine i is fed only by the training ranks on its node
                                  (CUDA IPC handles open only there): POST /update_weights_from_tensor.
  disaggregated (engine_node None) every engine gets every byte: with mode "distributed" each sending
                                  rank hosts its own broadcast group with every engine (one
                                  /init_weights_update_group per sender, NCCL on GPUs) and broadcasts
                                  its buckets; mode "tensor" posts each bucket to each engine (the CPU
                                  engine's portable payload; SGLang's IPC payload cannot cross nodes).
  disk (either)                   each sender writes its buckets as safetensors files into one
                                  directory per destination; the engine loads it with
                                  /update_weights_from_disk.
Order, per engine (its controller is the lowest rank that feeds it), in the sequence SGLang 0.5.23
accepts:
  pause_generation(abort | retract)   rollout.inflight_on_update=abort ends in-flight requests;
                                      finish retracts them (their KV is freed, they re-prefill on the
                                      new weights after continue), so the engine is idle for the flush
  begin_weight_update                 tensor and distributed updates are refused outside a session
  every rank's buckets, no version    then a barrier over the training ranks
  update_weight_version, flush_cache  by the controller once every rank is done (an engine reporting
                                      version v holds all of v); the flush succeeds because nothing
                                      runs (an in-place pause would hold running requests, and SGLang
                                      refuses the flush then); disk: the load carries the version
  end_weight_update, continue_generation
Engines that are down (rollout/engine/health.py) are left out of a push: `push(..., live={engine: incarnation})`
names the ones to reach, the same on every rank. A broadcast group spans exactly the live engines, and is
opened again when that set changes or one of them is a new process (a restarted engine knows no group).
"""
from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_search.config.hf import Architecture
from megatron_search.distributed import collectives as coll
from megatron_search.distributed.init import free_port
from megatron_search.rollout.engine.base import EngineError
from megatron_search.rollout.sglang.weight_group import FLAT, close_weight_group, open_weight_group, send_flat_bucket
from megatron_search.weights.export import HFExporter, StagedRounds, StagingBuffers
from megatron_search.weights.send_plan import Destination, LinkCosts, colocated_destinations, disaggregated_destination

Mode = Literal["tensor", "distributed", "disk"]
Inflight = Literal["abort", "finish"]


@dataclass
class SyncStats:
    version: str
    bytes: int  # HF bytes of the model (one copy)
    buckets: int  # rounds
    seconds: float
    sent_bytes: int = 0  # what this rank put on its links (engine-bound x fanout + shards to other senders)
    rank_sent_bytes: list[int] = field(default_factory=list)  # the plan's figure for every rank
    peak_extra_bytes: int = 0  # this rank's largest round (assembled + pulled shards), from the plan
    in_place_bytes: int = 0  # what this rank broadcast from where its parameters lie (no staging copy)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


class WeightSync:
    """Owner-parallel weight delivery to a list of engines (rollout.engine.Engine, same order on every rank)."""

    def __init__(self, engines: Sequence, mode: Mode = "tensor", *, bucket_bytes: int = 512 << 20,
                 inflight: Inflight = "finish", out_dtype: Optional[torch.dtype] = None,
                 disk_dir: Optional[str | Path] = None, sender_address: str = "127.0.0.1",
                 engine_ranks: Optional[Sequence[int]] = None, group_name: str = "weight_update_group",
                 rank_node: Optional[Sequence[int]] = None, engine_node: Optional[Sequence[int]] = None,
                 world_group=None, backend: str = "gloo", senders: Optional[Sequence[int]] = None,
                 owns_engines: bool = False, link_costs: Optional[LinkCosts] = None,
                 in_place_min_bytes: int = 16 << 20, skip_prefixes: tuple[str, ...] = ()):
        """`skip_prefixes`: Megatron parameter names never pushed (GRPO: "mtp.", train/grpo_sync.py)."""
        if mode not in ("tensor", "distributed", "disk"):
            raise ValueError(f"weight sync mode must be tensor, distributed or disk, got {mode!r}")
        if inflight not in ("abort", "finish"):
            raise ValueError(f"inflight must be abort or finish, got {inflight!r}")
        if mode == "disk" and disk_dir is None:
            raise ValueError("weight sync mode 'disk' needs disk_dir")
        if mode == "distributed" and engine_node is not None:
            raise ValueError("weight sync mode 'distributed' broadcasts to every engine (disaggregated); colocated "
                             "engines take mode 'tensor' from their own node's ranks")
        self.engines = list(engines)
        self.owns_engines = owns_engines  # close() closes the clients too
        self.mode, self.inflight = mode, inflight
        self.bucket_bytes, self.out_dtype = bucket_bytes, out_dtype
        # distributed mode: a run of parameters lying back to back (Megatron DDP's buffers) of at least this
        # many bytes is broadcast from where it lies, not copied into the staging buffer first
        self.in_place_min_bytes = in_place_min_bytes
        self.skip_prefixes = tuple(skip_prefixes)
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.sender_address, self.backend = sender_address, backend
        self.engine_ranks = list(engine_ranks) if engine_ranks is not None else [1] * len(self.engines)
        self.group_name, self.world_group = group_name, world_group
        self.rank = dist.get_rank(world_group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(world_group) if dist.is_initialized() else 1
        self.rank_node = list(rank_node) if rank_node is not None else [0] * self.world
        if len(self.rank_node) != self.world:
            raise ValueError(f"rank_node has {len(self.rank_node)} entries for a world of {self.world}")
        self.engine_node = list(engine_node) if engine_node is not None else None
        if self.engine_node is not None and len(self.engine_node) != len(self.engines):
            raise ValueError(f"engine_node has {len(self.engine_node)} entries for {len(self.engines)} engines")
        self.destinations = destinations_for(self.rank_node, self.engine_node, len(self.engines), mode != "tensor",
                                             senders)
        # what the send plan balances (the planner prices the same plan with the same costs)
        self.link_costs = link_costs or LinkCosts(delivery="nvlink" if self.engine_node is not None else "nic")
        self.version = 0
        self._group = None  # this rank's broadcast group (distributed mode, opened on first use)
        self._moves = None  # the export's own copy of the training world (shard moves, opened on first use)
        self._staging: Optional[StagingBuffers] = None  # this rank's flat buckets (kept between pushes if disaggregated)
        self._live: dict[int, int] = {i: 0 for i in range(len(self.engines))}  # engine -> incarnation, this push
        self._members: dict[int, int] = {}  # the engines (and incarnations) this rank's group spans
        self._files_written = 0  # disk mode: this rank's files in the version being written
        self._open_sessions: list = []  # engines this rank opened a weight-update session on
        self._exporter: Optional[HFExporter] = None
        self._exporter_key: tuple = ()
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    # ---- public -------------------------------------------------------------------------------
    def push(self, model_chunks, arch: Architecture, groups, version: Optional[str] = None,
             live: Optional[Mapping[int, int]] = None) -> SyncStats:
        """Export and deliver; collective over the training ranks. Returns this rank's stats. `live`: {engine
        index: incarnation} of the engines to reach (default: all, incarnation 0); the others are down."""
        self._set_live(live)
        self.version += 1
        self._files_written = 0
        tag = str(version if version is not None else self.version)
        start = time.perf_counter()
        exporter = self._exporter_for(model_chunks, arch, groups)
        plan = exporter.plan
        controlled = [d for d, dest in enumerate(self.destinations) if min(dest.ranks) == self.rank]
        self._run(self._control(controlled, "pause"))
        try:
            if self.mode == "distributed":
                self._open_groups(plan)
            if self.mode == "disk":  # what a crashed push of the same version left would be loaded too
                for d in controlled:
                    shutil.rmtree(self._disk_paths(d, tag)[0], ignore_errors=True)
            self._barrier()  # before any sender writes
            self._deliver_rounds(exporter, tag)
            self._barrier()
            failure = None
            try:
                for d in controlled:
                    self._run(self._finish(d, tag))
            except EngineError as e:  # held until every rank knows: the others would wait in the barrier below
                failure = f"{type(e).__name__}: {e}"
        finally:
            self._run(self._control(controlled, "continue"))
        self._raise_if_any_failed(failure, tag)
        sent = plan.sent_bytes()
        return SyncStats(tag, exporter.total_bytes, len(plan.rounds), time.perf_counter() - start,
                         sent[self.rank], sent, plan.peak_extra_bytes()[self.rank],
                         exporter.in_place_bytes_per_push)

    def close(self) -> None:
        """Leave this rank's broadcast group (distributed mode), close owned clients, stop the event loop."""
        if self._staging is not None:
            self._staging.release()

        async def leave():
            await self._leave_group(list(self._members))
            if self.owns_engines:
                await asyncio.gather(*(e.close() for e in self.engines if e is not None))

        self._run(leave())
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def _set_live(self, live: Optional[Mapping[int, int]]) -> None:
        """This push's engines; a broadcast group that no longer spans exactly them (same processes) is left."""
        live = {i: 0 for i in range(len(self.engines))} if live is None else {int(i): int(n) for i, n in live.items()}
        bad = sorted(i for i in live if not 0 <= i < len(self.engines))
        if bad:
            raise ValueError(f"weight sync: live engines {bad} out of range for {len(self.engines)} engines")
        self._live = live
        if self._group is not None and self._members != live:
            kept = [i for i, n in self._members.items() if live.get(i) == n]  # the same process: it holds the group
            self._run(self._leave_group(kept))

    async def _leave_group(self, engines: Sequence[int]) -> None:
        """Close this rank's broadcast group, on these engines (those still running the process that joined it)."""
        group, self._group, self._members = self._group, None, {}
        if group is None:
            return

        name = self._my_group_name()
        await asyncio.gather(*(self.engines[i].destroy_weights_update_group(name) for i in engines))
        close_weight_group(group)

    # ---- plan helpers -------------------------------------------------------------------------
    def _exporter_for(self, model_chunks, arch, groups) -> HFExporter:
        """The plan depends only on the layout, so one exporter serves every push of the same model
        (its parameters are updated in place; colocated offload keeps the same storages)."""
        key = tuple(id(c) for c in model_chunks)
        if self._exporter is None or self._exporter_key != key:
            self._exporter = HFExporter(model_chunks, arch, groups, self.bucket_bytes, out_dtype=self.out_dtype,
                                        world_group=self.world_group, destinations=self.destinations,
                                        rank_node=self.rank_node, link_costs=self.link_costs,
                                        in_place_min_bytes=self.in_place_min_bytes if self.mode == "distributed"
                                        else None, skip_prefixes=self.skip_prefixes)
            self._exporter_key = key
        return self._exporter

    def _deliver_rounds(self, exporter: HFExporter, tag: str) -> None:
        """Every round's buckets, pipelined: the engines are kept busy while the senders prepare.

        Buckets are assembled straight into this rank's staging buffer (HFExporter: FlatBucket, the bytes of
        SGLang's flattened bucket; in broadcast mode, runs of parameters lying back to back in DDP's buffer are
        sent from there instead: PartedBucket), and each round's shard moves travel on a process group of their own
        while the previous round is delivered (StagedRounds). A rank prepares its next round as soon as its
        own turn in this round is over, while the senders after it deliver, so the engine is not left idle
        while a sender gathers and copies; a rank with nothing to send in a round prepares at its start."""
        plan = exporter.plan
        if self._staging is None:
            self._staging = StagingBuffers(exporter.device)
        staged = StagedRounds(exporter, self._staging, self._moves_group())
        n = len(plan.rounds)
        try:
            ready = staged.take(0) if n else {}
            for k in range(n):
                mine, ready = ready, None
                senders = sorted(plan.rounds[k]) if self.mode == "distributed" else [self.rank]
                if self.rank not in senders:
                    ready = staged.take(k + 1) if k + 1 < n else {}
                for s in senders:
                    if s == self.rank:
                        for d, bucket in mine.items():
                            self._run(self._deliver(d, bucket, tag))
                    if self.mode == "distributed":
                        self._barrier()  # the next sender's turn (see _turns)
                    if s == self.rank:
                        del mine
                        ready = staged.take(k + 1) if k + 1 < n else {}
        finally:
            staged.close()
            if self.engine_node is not None:  # colocated: the trainer's memory goes back to training
                self._staging.release()

    def _moves_group(self):
        """A copy of the training world for the export's shard moves (opened on first use, collectively), so
        the next round's moves never queue behind this round's turn barriers."""
        if self._moves is None and dist.is_initialized() and self.world > 1:
            ranks = dist.get_process_group_ranks(self.world_group) if self.world_group is not None else None
            self._moves = dist.new_group(ranks, backend=dist.get_backend(self.world_group),
                                         use_local_synchronization=self.world_group is not None)
            coll.barrier(group=self._moves)  # NCCL: every rank's first call on a communicator must be collective
        return self._moves if self._moves is not None else self.world_group

    def _turns(self, senders):
        """Yield once when this rank may deliver. Broadcast groups take turns, one sender at a time in rank
        order: an engine serves weight requests one by one, so two senders whose groups both span two
        engines would each hold one engine waiting for the other. The engines' own links stay the bound.
        HTTP tensor posts and disk writes have no such coupling and all go at once."""
        if self.mode != "distributed":
            yield
            return
        for s in sorted(senders):
            if s == self.rank:
                yield
            self._barrier()

    def _open_groups(self, plan) -> None:
        """Every sending rank hosts its broadcast group with every engine, opened one at a time (see _turns)."""
        senders = sorted({s for rnd in plan.rounds for s in rnd})
        for _ in self._turns(senders):
            if self._group is None:
                self._run(self._open_group())

    def _my_group_name(self) -> str:
        return f"{self.group_name}_r{self.rank}"

    def _raise_if_any_failed(self, failure: Optional[str], tag: str) -> None:
        """The push's end on every rank alike: a load that failed on a controlling rank (an engine refused or
        failed its weights) raises WeightLoadError on every rank (one flag all-reduced, then the messages), in
        place of the final barrier, so no rank waits in a collective the others left."""
        failed = torch.tensor([0.0 if failure is None else 1.0], dtype=torch.float64)
        if dist.is_initialized() and self.world > 1:
            coll.all_reduce(failed, group=self.world_group)
        if not failed.item():
            return
        messages = [failure]
        if dist.is_initialized() and self.world > 1:
            messages = [None] * self.world
            dist.all_gather_object(messages, failure, group=self.world_group)
        why = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
        raise WeightLoadError(f"weight push v{tag}: the engines did not load it ({why})")

    def _barrier(self) -> None:
        if dist.is_initialized() and self.world > 1:
            coll.barrier(group=self.world_group)

    # ---- engine calls -------------------------------------------------------------------------
    def _run(self, coro):
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    def _engines_of(self, d: int) -> list:
        out = [self.engines[i] for i in self.destinations[d].engines if i in self._live]
        if any(e is None for e in out):
            raise RuntimeError(f"weight sync: rank {self.rank} must feed {self.destinations[d].name} but holds no "
                               f"client for it (pass senders= to keep it off that destination)")
        return out

    async def _control(self, dests: Sequence[int], what: str) -> None:
        """pause: pause, then open the update session; continue: close the session (if open), then continue."""
        engines = [e for d in dests for e in self._engines_of(d)]
        session = self.mode != "disk"  # SGLang loads from disk without a session
        if what == "pause":
            mode = "abort" if self.inflight == "abort" else "retract"
            await asyncio.gather(*(e.pause_generation(mode) for e in engines))
            if session:
                await asyncio.gather(*(e.begin_weight_update() for e in engines))
                self._open_sessions = list(engines)
        else:
            open_ = self._open_sessions
            self._open_sessions = []
            try:
                await asyncio.gather(*(e.end_weight_update() for e in open_))
            finally:
                await asyncio.gather(*(e.continue_generation() for e in engines))

    async def _deliver(self, d: int, bucket, tag: str) -> None:
        """One bucket of this rank's into destination d's engines, without a version and without a flush."""
        if not bucket:
            return
        engines = self._engines_of(d)
        if self.mode == "disk":
            self._write_disk(d, bucket, tag)
        elif self.mode == "tensor":
            await asyncio.gather(*(e.update_weights_from_tensor(bucket, weight_version=None, flush_cache=False)
                                   for e in engines))
        else:
            device = "cuda" if self.backend == "nccl" else "cpu"  # NCCL broadcasts from the GPU
            # one broadcast per flattened bucket (SGLang's flattened_bucket), not one per tensor; a round whose
            # parameters partly lie back to back goes as those runs (read where they lie) and the staged rest
            for part in getattr(bucket, "parts", None) or [bucket]:
                names = [n for n, _ in part]
                dtypes = [str(t.dtype).replace("torch.", "") for _, t in part]
                shapes = [list(t.shape) for _, t in part]
                calls = asyncio.gather(*(e.update_weights_from_distributed(
                    names, dtypes, shapes, group_name=self._my_group_name(), weight_version=None, flush_cache=False,
                    load_format=FLAT) for e in engines))
                await asyncio.gather(calls, asyncio.to_thread(send_flat_bucket, self._group, part, device))

    async def _finish(self, d: int, tag: str) -> None:
        """Controller, after every rank delivered: the version (and the flush), or the disk load with it."""
        engines = self._engines_of(d)
        if self.mode == "disk":
            await self._load_disk(d, tag)
            return
        # abort_all_requests=False: retracted requests wait in the queue and must survive
        await asyncio.gather(*(e.update_weight_version(tag, abort_all_requests=False) for e in engines))
        await asyncio.gather(*(e.flush_cache() for e in engines))  # idle: paused with abort or retract

    async def _open_group(self) -> None:
        """This rank hosts a broadcast group with every engine: rank 0 here, engines from rank 1 on."""

        port = free_port(self.sender_address)
        members = sorted(self._live)
        world = 1 + sum(self.engine_ranks[i] for i in members)
        offsets = [1 + sum(self.engine_ranks[j] for j in members[:k]) for k in range(len(members))]
        name = self._my_group_name()
        joins = [self.engines[i].init_weights_update_group(self.sender_address, port, off, world, name, self.backend)
                 for i, off in zip(members, offsets)]
        trainer = asyncio.to_thread(open_weight_group, self.sender_address, port, 0, world, name, self.backend)
        results = await asyncio.gather(trainer, *joins)
        self._group = results[0]
        self._members = dict(self._live)

    def _disk_paths(self, d: int, tag: str) -> tuple[Path, Path]:
        base = self.disk_dir / self.destinations[d].name
        return base / f".weights_v{tag}.tmp", base / f"weights_v{tag}"

    def _write_disk(self, d: int, bucket, tag: str) -> None:
        """Each sender writes its own files into the version's directory (renamed whole by the controller)."""

        tmp, _ = self._disk_paths(d, tag)
        tmp.mkdir(parents=True, exist_ok=True)
        self._files_written += 1
        path = tmp / f"model-r{self.rank:05d}-{self._files_written:05d}.safetensors"
        save_file({n: t.detach().contiguous().cpu() for n, t in bucket}, str(path.with_suffix(".part")),
                  metadata={"format": "pt"})
        path.with_suffix(".part").rename(path)

    async def _load_disk(self, d: int, tag: str) -> None:
        tmp, final = self._disk_paths(d, tag)
        tmp.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        self._files_written = 0
        await asyncio.gather(*(e.update_weights_from_disk(str(final), weight_version=tag) for e in self._engines_of(d)))
        for old in final.parent.glob("weights_v*"):  # keep only the version the engines now serve
            if old != final:
                shutil.rmtree(old, ignore_errors=True)


class WeightLoadError(RuntimeError):
    """A push whose weights an engine refused or failed to load, raised on every rank (WeightSync.push)."""


def destinations_for(rank_node: Sequence[int], engine_node: Optional[Sequence[int]], n_engines: int,
                     broadcast: bool, senders: Optional[Sequence[int]] = None) -> list[Destination]:
    """The destinations a WeightSync with these arguments plans for (the planner prices the same list).
    `senders` restricts which ranks may send (an in-process engine is reachable from its own rank only)."""
    if engine_node is not None:
        out = colocated_destinations(rank_node, engine_node)
    else:
        out = disaggregated_destination(len(rank_node), n_engines, broadcast)
    if senders is not None:
        allowed = set(senders)
        out = [Destination(d.name, d.engines, tuple(r for r in d.ranks if r in allowed), d.fanout) for d in out]
    return out
