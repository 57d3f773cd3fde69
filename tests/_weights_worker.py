"""Rank body of the weights tests (2 gloo processes): every multi-process check in one spawn.

Per architecture, on the same 2 processes, with the model re-built for each layout:
  TP=2 (+SP), EP=2, PP=2: load the HF checkpoint, logits of a fixed batch, export every tensor;
  TP=2: save a Megatron distributed checkpoint; PP=2: load it and export to safetensors;
  TP=2: push to a local engine on rank 0 through the tensor and disk paths, greedy generation
  after each; routing replay of the engine's experts (and of arbitrary forced experts);
  bad inputs (missing / extra tensor, shape mismatch, bucket too small).
Rank 0 returns plain numbers and token lists; the tests compare them with references the
parent computed from the HF model itself.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUTS = {"tp2": (2, 1, 1), "ep2": (1, 1, 2), "pp2": (1, 2, 1)}
SEQ, BATCH = 16, 2


def _cfg(arch_dir: str, tp: int, pp: int, ep: int):
    from megatron_search.config.loader import load_config

    ov = [f"model.hf_config={arch_dir}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}",
          f"parallel.etp={tp if ep == 1 else 1}", "parallel.world_size=2"]
    if tp > 1:
        ov.append("parallel.sequence_parallel=true")
    return load_config(None, ov)


def _build(cfg, replay: bool = False):
    from megatron_search.distributed.init import init_distributed
    from megatron_search.models.provider import build_model, transformer_config_from_hf
    from megatron_search.models.routing_replay import enable_routing_replay

    ctx = init_distributed(cfg)
    config = transformer_config_from_hf(cfg)
    if replay:
        enable_routing_replay(config)
    return ctx, [build_model(cfg, ctx.groups, config=config)]


@torch.no_grad()
def _logits(ctx, chunks, ids: torch.Tensor, tp: int, pp: int):
    """Full-vocab logits [B, S, V] on the last stage's TP rank 0 (None elsewhere); manual 2-stage PP."""
    m = chunks[0].eval()
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    if pp > 1:
        peer = 1 - dist.get_rank()
        if ctx.pp_rank == 0:
            dist.send(m(ids, pos, None).contiguous(), dst=peer)
            return None
        hidden = torch.empty(ids.shape[1], ids.shape[0], m.config.hidden_size)
        dist.recv(hidden, src=peer)
        m.set_input_tensor(hidden)
    out = m(ids, pos, None)
    if tp > 1:
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=ctx.groups.tp)
        out = torch.cat(parts, -1)
    return out if ctx.tp_rank == 0 else None


def _export_mismatches(chunks, arch, groups, source, bucket_bytes: int):
    from megatron_search.weights.export import export_hf_weights

    names, bad = [], []
    for bucket in export_hf_weights(chunks, arch, bucket_bytes, groups):
        for name, t in bucket:
            names.append(name)
            ref = source.get(name)
            if ref.dtype != t.dtype or ref.shape != t.shape or not torch.equal(ref, t):
                bad.append(name)
    return names, bad


def _error_text(fn) -> str:
    try:
        fn()
    except Exception as e:  # the test asserts on the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _bad_inputs(ctx, chunks, arch, source_dir: str) -> dict:
    from megatron_search.weights.export import export_hf_weights
    from megatron_search.weights.hf_source import HFTensorSource
    from megatron_search.weights.load import load_hf_into_model

    good = HFTensorSource.from_dir(source_dir)
    sd = {n: good.get(n) for n in sorted(good.names())}
    victim = next(n for n in sd if "self_attn.o_proj" in n or "linear_attn.out_proj" in n)
    missing = dict(sd)
    del missing[victim]
    extra = dict(sd, **{"model.layers.99.mlp.gate.weight": torch.zeros(4, 64)})
    wrong = dict(sd, **{victim: torch.zeros(sd[victim].shape[0] + 1, sd[victim].shape[1])})
    out = {"victim": victim}
    for key, d in (("missing", missing), ("extra", extra), ("shape", wrong)):
        src = HFTensorSource.from_state_dict(d, where=f"{key}-checkpoint")
        out[key] = _error_text(lambda src=src: load_hf_into_model(chunks, arch, src, ctx.groups))
    out["bucket"] = _error_text(lambda: list(export_hf_weights(chunks, arch, 1024, ctx.groups)))
    return out


def _delivery_and_replay(ctx, chunks, arch, arch_dir: str, prompt: list[int], work: Path, new_tokens: int) -> dict:
    """Rank 0 hosts a local engine; both ranks export. Returns generations and replay agreement."""
    from megatron_search.models.routing_replay import ExpertRecorder, RoutingReplay, agreement_rate
    from megatron_search.weights.delivery import WeightSync

    rank0 = dist.get_rank() == 0
    out: dict = {}
    engine = loop = None
    if rank0:
        from megatron_search.rollout.local.engine import LocalEngine
        from megatron_search.rollout.engine.types import GenerateRequest, SamplingParams

        engine = LocalEngine(arch_dir)
        loop = asyncio.new_event_loop()

        def generate():
            req = GenerateRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0),
                                  return_routed_experts=True)
            return loop.run_until_complete(engine.generate(req))

    for mode in ("tensor", "disk"):  # in-process engine: no broadcast group (see test_weights_roundtrip)
        if rank0:
            with torch.no_grad():  # scramble the engine so each path has to deliver everything
                for p in engine.runner.model.parameters():
                    p.add_(torch.randn_like(p))
        # the engine lives in rank 0's process: only rank 0 can feed it (rank 1 sends its shards to rank 0)
        sync = WeightSync([engine] if rank0 else [None], mode=mode, bucket_bytes=600 << 10,
                          disk_dir=work / f"disk_{mode}", inflight="abort" if mode == "disk" else "finish",
                          senders=[0])
        if rank0:
            sync._loop = loop
        stats = sync.push(chunks, arch, ctx.groups, version=f"{mode}-1")
        if rank0:
            res = generate()
            out[mode] = {"ids": res.output_ids, "version": res.weight_version, "buckets": stats.buckets}
            out["experts"] = torch.as_tensor(res.routed_experts_NLK)
    # A load that fails on the controlling rank (rank 0: the engine refuses the weights) raises WeightLoadError on
    # every rank, with rank 0's reason: rank 1 is not left waiting in the push's last collective.
    from megatron_search.rollout.engine.base import EngineError
    from megatron_search.weights.delivery import WeightLoadError

    sync = WeightSync([engine] if rank0 else [None], mode="disk", bucket_bytes=600 << 10, disk_dir=work / "disk_fail",
                      inflight="abort", senders=[0])
    if rank0:
        sync._loop = loop
        loads = engine.update_weights_from_disk

        async def refuse(*args, **kwargs):
            raise EngineError("refused by the test")
        engine.update_weights_from_disk = refuse
    try:
        sync.push(chunks, arch, ctx.groups, version="fail-1")
        failure = None
    except WeightLoadError as e:
        failure = str(e)
    assert failure is not None and "rank 0: EngineError: refused by the test" in failure, failure
    if rank0:
        engine.update_weights_from_disk = loads
        assert not engine._paused  # generation was continued after the failed load
    # Routing replay on the full sequence prompt + generation (the engine's last token never ran).
    seq = torch.tensor([prompt + out["tensor"]["ids"]] if rank0 else [[0] * (len(prompt) + new_tokens)])
    dist.broadcast(seq, src=0)
    T, K = seq.shape[1], arch.moe_top_k
    experts = out.get("experts", torch.zeros(T - 1, arch.num_layers, K, dtype=torch.int64)).to(torch.int64)
    dist.broadcast(experts, src=0)
    padded = torch.cat([experts, experts[-1:]], 0)[None]  # [1, T, L, K]
    forced = (padded + 1) % arch.num_experts  # arbitrary but valid: a routing the model would not pick
    replay = RoutingReplay(chunks, list(range(arch.num_layers)), tp_rank=ctx.tp_rank, tp_size=2, sequence_parallel=True)

    def used_experts(targets):
        if targets is not None:
            replay.set_targets(targets)
        with ExpertRecorder(chunks) as rec:
            _logits(ctx, chunks, seq, 2, 1)
        replay.clear()
        local = torch.stack([rec.experts()[l] for l in range(arch.num_layers)], 1)  # [T/2, L, K]
        parts = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(parts, local, group=ctx.groups.tp)
        return torch.cat(parts, 0)  # sequence order (B = 1)

    off = used_experts(None)
    on = used_experts(padded)
    forced_used = used_experts(forced)
    if rank0:
        out["agree_off"] = agreement_rate(off[: T - 1], experts)
        out["agree_on"] = agreement_rate(on[: T - 1], experts)
        out["agree_forced"] = agreement_rate(forced_used, forced[0])
        loop.run_until_complete(engine.close())
        loop.close()
        del out["experts"]
    return out


def main(work: str, arch_names: list[str], prompt: list[int], new_tokens: int) -> dict:
    from megatron_search.weights.checkpoint import hf_to_mcore, mcore_to_hf
    from megatron_search.weights.hf_source import HFTensorSource

    torch.set_num_threads(1)
    work_p = Path(work)
    results: dict = {}
    ids = torch.load(work_p / "ids.pt")
    for name in arch_names:
        arch_dir = str(work_p / name)
        source = HFTensorSource.from_dir(arch_dir)
        r: dict = {"logits": {}, "export": {}}
        for lay, (tp, pp, ep) in LAYOUTS.items():
            cfg = _cfg(arch_dir, tp, pp, ep)
            ctx, chunks = _build(cfg, replay=lay == "tp2")
            arch = cfg.model.architecture
            from megatron_search.weights.load import load_hf_into_model

            load_hf_into_model(chunks, arch, source, ctx.groups)
            logits = _logits(ctx, chunks, ids, tp, pp)
            if logits is not None:
                r["logits"][lay] = logits
            r["export"][lay] = _export_mismatches(chunks, arch, ctx.groups, source, 1 << 20)
            if lay == "tp2":
                hf_to_mcore(cfg, arch_dir, work_p / f"{name}_mcore", ctx.groups, progress=False)
                r["delivery"] = _delivery_and_replay(ctx, chunks, arch, arch_dir, prompt, work_p / name, new_tokens)
                r["bad"] = _bad_inputs(ctx, chunks, arch, arch_dir)
            if lay == "pp2":
                mcore_to_hf(cfg, work_p / f"{name}_mcore", work_p / f"{name}_back", ctx.groups,
                            bucket_bytes=1 << 20, progress=False)
        results[name] = r
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return results
