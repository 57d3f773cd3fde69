"""Multi-process equivalence harness: the same weights give the same loss and global grad norm
at 1 process and on 2 gloo processes with TP=2 (sequence parallel), EP=2, PP=2 (1F1B) and PP=2 with
2 virtual stages (interleaved 1F1B), and on 4 processes with TP=2 x ETP=1 x EP=2 (the 397B config's
pattern: experts unsharded while attention is TP-split), TP=2 x PP=2 and EP=2 x PP=2.

Flow: a 1-process spawn builds each architecture's model, saves its full weights, exports them to HF
names (sha256 per tensor) and records (loss, grad norm) of one Megatron optimizer step on a fixed
batch; then a 2-process and a 4-process spawn run every architecture x layout in turn, loading the
full weights resharded by slicing (models/reshard.py), exporting them through the exporter (each HF
tensor's sha256 must equal the 1-process export's) and recording the same two numbers plus the worst
per-parameter error of gradients and of the optimizer update against the reference (sliced the same
way). Add an architecture with one line in ARCHITECTURES.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHITECTURES = {
    "tiny_qwen3_moe": "configs/models/tiny_qwen3_moe",
    "tiny_qwen3_5_moe": "configs/models/tiny_qwen3_5_moe",
}
LAYOUTS = {
    "tp2_sp": ["parallel.tp=2", "parallel.etp=2", "parallel.sequence_parallel=true"],
    "ep2": ["parallel.ep=2"],
    "pp2": ["parallel.pp=2"],
    "pp2_vpp2": ["parallel.pp=2", "parallel.vpp=2"],  # interleaved 1F1B, one layer per model chunk
    "ep2_distopt": ["parallel.ep=2", "parallel.distributed_optimizer=true"],  # reduce-scatter + param all-gather
}
# 4 processes: DP=2 beside TP=2 with experts whole on each of EP=2 ranks (expert DP=2); PP=2 beside TP=2;
# PP=2 beside EP=2 (expert DP=1 per stage).
LAYOUTS_4 = {
    "tp2_etp1_ep2": ["parallel.tp=2", "parallel.etp=1", "parallel.ep=2", "parallel.sequence_parallel=true"],
    "tp2_pp2": ["parallel.tp=2", "parallel.etp=2", "parallel.pp=2", "parallel.sequence_parallel=true"],
    "ep2_pp2": ["parallel.ep=2", "parallel.pp=2"],
}
WORLDS = {2: LAYOUTS, 4: LAYOUTS_4}
GLOBAL_BATCH, SEQ_LEN = 4, 16
MICRO_BATCH = {"reference": 4, "tp2_sp": 2, "ep2": 1, "pp2": 1, "pp2_vpp2": 1, "ep2_distopt": 1,
               "tp2_etp1_ep2": 1, "tp2_pp2": 1, "ep2_pp2": 1}
DATA_SEED = 1234
# Adam's first step is g / (|g| + eps): with the usual tiny eps it is sign-like and would hide a
# gradient of the wrong size. With eps >> |g| it is ~ lr * g / eps, smooth in g, so comparing updates
# checks the optimizer path (incl. the distributed optimizer's shards; it only supports Adam) elementwise.
# A large lr keeps updates far above the fp32 rounding of the weights (p_after - p_before).
ADAM_LR, ADAM_EPS = 100.0, 1.0


def _config(arch: str, layout: list[str], world: int):
    from megatron_search.config import load_config

    return load_config(None, [f"model.hf_config={ARCHITECTURES[arch]}", f"parallel.world_size={world}",
                              "parallel.distributed_optimizer=false", *layout])


def _batch():
    from megatron_search.trainer.step import Batch

    g = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(0, 2048, (GLOBAL_BATCH, SEQ_LEN + 1), generator=g)
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def _grads(ddp_chunks) -> list[dict[str, torch.Tensor]]:
    """Per model chunk, each parameter's reduced fp32 gradient after the step (identically clipped everywhere)."""
    return [{n.removeprefix("module."): p.main_grad.detach().clone() for n, p in m.named_parameters()}
            for m in ddp_chunks]


def _params(chunks) -> list[dict[str, torch.Tensor]]:
    return [{n: p.detach().clone() for n, p in c.named_parameters()} for c in chunks]


def _worst_error(cfg, chunks, ours: list[dict], ref_full: dict, groups) -> tuple[float, str]:
    """Largest |ours - reference shard| / max|reference tensor| over this rank's parameters.

    Much stricter than the global norm: a gradient missing another rank's contribution
    (a wrong reduction group) barely moves the norm but shows here.
    """
    from megatron_search.models import reshard
    from megatron_search.models.provider import architecture_module

    tp_slice = getattr(architecture_module(cfg)[0], "tp_slice", None)
    worst, where = 0.0, ""
    for v, chunk in enumerate(chunks):
        ref_local = reshard.shard_full_state(chunk, ref_full, chunk.config, groups,
                                             vp_stage=v if cfg.parallel.vpp else None, tp_slice=tp_slice)
        for local, _ in chunk.named_parameters():
            ref = ref_local[local]
            err = float((ours[v][local] - ref).abs().max()) / (float(ref.abs().max()) + 1e-12)
            if err > worst:
                worst, where = err, f"chunk {v}: {local}"
    return worst, where


def _export_sha256(cfg, chunks, groups) -> dict[str, str] | None:
    """sha256 of every HF tensor the exporter assembles on rank 0 (None elsewhere), dtype and shape included."""
    import hashlib

    import torch.distributed as dist

    from megatron_search.weights.export import export_hf_weights

    out = {}
    for bucket in export_hf_weights(chunks, cfg.model.architecture, 1 << 20, groups):
        for name, t in bucket:
            h = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode())
            h.update(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
            out[name] = h.hexdigest()
    return out if dist.get_rank() == 0 else None


def _linear_adam(cfg, ddp_chunks):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    return get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=ADAM_LR, adam_eps=ADAM_EPS, weight_decay=0.0,
                        clip_grad=cfg.optim.clip_grad, use_distributed_optimizer=cfg.parallel.distributed_optimizer),
        ddp_chunks,
    )


def _one_step(cfg, groups, full_state: dict | None, micro_batch: int, ref: dict | None = None):
    """Export, then one optimizer step; returns (loss/grad-norm/error metrics, what the reference saves or None)."""
    from megatron_search.trainer.step import data_parallel_slice, train_step, wrap_ddp
    from megatron_search.models import reshard
    from megatron_search.models.provider import architecture_module, build_model_chunks

    chunks = build_model_chunks(cfg, groups)
    saved = None
    if full_state is None:
        saved = reshard.full_state(chunks[0])
    else:
        module = architecture_module(cfg)[0]
        for v, chunk in enumerate(chunks):
            reshard.load_full_state(chunk, full_state, chunk.config, groups, vp_stage=v if cfg.parallel.vpp else None,
                                    tp_slice=getattr(module, "tp_slice", None))
    exported = _export_sha256(cfg, chunks, groups)
    before = _params(chunks)
    ddp = wrap_ddp(cfg, chunks, chunks[0].config)
    batch = data_parallel_slice(_batch(), groups)
    loss, grad_norm = train_step(ddp, _linear_adam(cfg, ddp), batch, micro_batch, groups)
    result = {"loss": loss, "grad_norm": grad_norm}
    update = [{n: p - b[n] for n, p in after.items()} for after, b in zip(_params(chunks), before)]
    if ref is None:  # the 1-process model is a single chunk
        return result, {"weights": saved, "grads": _grads(ddp)[0], "update": update[0], "export": exported}
    if not cfg.parallel.distributed_optimizer:  # the distributed optimizer keeps only its grad shard reduced
        result["grad_max_rel_err"], result["grad_worst_param"] = _worst_error(cfg, chunks, _grads(ddp), ref["grads"],
                                                                              groups)
    result["update_max_rel_err"], result["update_worst_param"] = _worst_error(cfg, chunks, update, ref["update"],
                                                                              groups)
    if exported is not None:  # rank 0: HF tensors that differ from the 1-process export, or are missing / extra
        names = set(exported) | set(ref["export"])
        result["export_tensors"] = len(exported)
        result["export_mismatches"] = sorted(n for n in names if exported.get(n) != ref["export"].get(n))
    return result, None


def reference_worker(rank: int, world: int, port: int, archs: list[str], out: str) -> None:
    """1 process, per architecture: build, save full weights, one step."""
    from megatron_search.distributed import DistEnv, init_distributed

    for arch in archs:
        cfg = _config(arch, [], 1)
        ctx = init_distributed(cfg, env=DistEnv(0, 1, 0, "127.0.0.1", port, "single"))
        result, saved = _one_step(cfg, ctx.groups, None, MICRO_BATCH["reference"])
        result["export_tensors"] = len(saved["export"])
        torch.save(saved, Path(out) / f"{arch}_full.pt")
        (Path(out) / f"{arch}_reference.json").write_text(json.dumps(result))
        ctx.teardown()


def layouts_worker(rank: int, world: int, port: int, archs: list[str], out: str) -> None:
    """`world` processes: every architecture x layout of WORLDS[world] on one process group, same weights and batch."""
    import torch.distributed as dist

    from megatron_search.distributed import DistEnv, init_distributed

    env = DistEnv(rank, world, rank, "127.0.0.1", port, "torchrun")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for arch in archs:
        saved = torch.load(Path(out) / f"{arch}_full.pt")
        results = {}
        for name, overrides in WORLDS[world].items():
            cfg = _config(arch, overrides, world)
            ctx = init_distributed(cfg, env=env)  # reuses the group, re-creates Megatron's groups
            results[name], _ = _one_step(cfg, ctx.groups, saved["weights"], MICRO_BATCH[name], saved)
            ctx.teardown()
        (Path(out) / f"{arch}_layouts{world}_rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_architectures(archs: list[str], out: Path) -> dict:
    """Reference + all layouts for each arch (three spawns in all, to pay Megatron's import once each).

    Returns {arch: {'reference': {...}, 'layouts': {layout: [rank0 {...}, rank1 {...}, ...]}}}.
    """
    from _mp import run_spawned

    out.mkdir(parents=True, exist_ok=True)
    run_spawned(reference_worker, 1, list(archs), str(out))
    for world in WORLDS:
        run_spawned(layouts_worker, world, list(archs), str(out))
    results = {}
    for arch in archs:
        layouts: dict[str, list[dict]] = {}
        for world in WORLDS:
            per_rank = [json.loads((out / f"{arch}_layouts{world}_rank{r}.json").read_text()) for r in range(world)]
            for name in WORLDS[world]:
                layouts[name] = [ranks[name] for ranks in per_rank]
        results[arch] = {"reference": json.loads((out / f"{arch}_reference.json").read_text()), "layouts": layouts}
    return results
