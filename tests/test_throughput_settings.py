"""Throughput settings (docs/ARCHITECTURE.md, "Throughput settings"): Megatron's fusions, the MoE router dtype,
permute fusion and flex dispatcher, require_te, and the DDP overlaps, as config fields.

Unit tier: what each field turns into (TransformerConfig flags, the refusals at model build, the GPU configs'
values), with the prerequisites played by injected probes. Multiprocess tier (2 gloo ranks, DP=2, the distributed
optimizer): overlap_grad_reduce gives the gradients of the non-overlapped run, bitwise, and really launches the
reductions during the backward; under overlap_param_gather the parameters are stale after the step (the other
rank's shard), yet the weight export (both HFExporter paths) and a checkpoint save read the updated parameters,
and the next step's forward gathers them itself.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_search.config import load_config
from megatron_search.config.loader import ConfigError
from megatron_search.models.provider_common import (
    FUSIONS,
    ProviderError,
    flex_problems,
    fusion_settings,
    log_fusions,
    permute_fusion_problems,
)

TINY = "configs/models/tiny_qwen3_moe"
GPU_CONFIGS = ["configs/qwen3_5_397b_a17b_grpo.yaml", "configs/qwen3_5_397b_a17b_sft.yaml",
               "configs/qwen3_5_122b_a10b_grpo.yaml", "configs/qwen3_5_122b_a10b_sft.yaml",
               "configs/qwen3_30b_a3b_grpo.yaml", "configs/qwen3_30b_a3b_sft.yaml"]


# ---------------------------------------------------------------- fusions
def test_fusions_off_and_on_cpu_are_all_false():
    for choice, on_gpu in (("off", True), ("off", False), ("auto", False)):
        on, why = fusion_settings(choice, on_gpu, lambda: True, lambda: True)
        assert on == {f: False for f in FUSIONS} and set(why) == set(FUSIONS)
    assert fusion_settings("auto", False)[1]["apply_rope_fusion"].startswith("no GPU")


def test_auto_on_a_gpu_turns_on_exactly_the_fusions_whose_prerequisites_hold():
    everything, _ = fusion_settings("auto", True, lambda: True, lambda: True)
    assert everything == {"gradient_accumulation_fusion": True, "bias_activation_fusion": True,
                          "bias_dropout_fusion": True, "masked_softmax_fusion": False, "apply_rope_fusion": True,
                          "persist_layer_norm": False}
    bare, why = fusion_settings("auto", True, lambda: False, lambda: False)  # a GPU without apex or TE
    assert bare == {"gradient_accumulation_fusion": False, "bias_activation_fusion": True,
                    "bias_dropout_fusion": True, "masked_softmax_fusion": False, "apply_rope_fusion": False,
                    "persist_layer_norm": False}
    assert "fused_weight_gradient_mlp_cuda" in why["gradient_accumulation_fusion"]
    assert "TE >= 1.4" in why["apply_rope_fusion"] and "RMSNorm" in why["persist_layer_norm"]
    line = log_fusions(bare, why)
    assert line.startswith("fusions on: bias_activation_fusion, bias_dropout_fusion; off: gradient_accumulation_fusion")


def test_the_transformer_config_carries_the_fields_on_cpu():
    from megatron_search.models.provider import transformer_config_from_hf

    c = transformer_config_from_hf(load_config(None, [f"model.hf_config={TINY}", "model.moe_router_dtype=fp32"]))
    assert c.moe_router_dtype == "fp32" and c.moe_permute_fusion is False
    assert not any(getattr(c, f) for f in FUSIONS)  # auto on CPU: none
    assert transformer_config_from_hf(load_config(None, [f"model.hf_config={TINY}"])).moe_router_dtype is None


# ---------------------------------------------------------------- MoE dispatch
def test_permute_fusion_without_te_is_refused_at_model_build_naming_the_field():
    from megatron_search.models.provider import transformer_config_from_hf

    cfg = load_config(None, [f"model.hf_config={TINY}", "model.moe_permute_fusion=true"])  # loads on CPU
    with pytest.raises(ProviderError, match="model.moe_permute_fusion: needs Transformer Engine >= 2.1"):
        transformer_config_from_hf(cfg)
    assert permute_fusion_problems(cfg.model, lambda: True) == []


def test_flex_needs_its_backend_and_tp_x_ep_above_one():
    one = load_config(None, [f"model.hf_config={TINY}", "model.moe_token_dispatcher=flex"])
    two = load_config(None, [f"model.hf_config={TINY}", "model.moe_token_dispatcher=flex", "parallel.ep=2",
                             "model.moe_flex_dispatcher_backend=hybridep"])
    assert flex_problems(two.model, two.parallel, lambda backend: backend == "hybridep") == []
    assert flex_problems(one.model, one.parallel, lambda backend: True) == [
        "model.moe_token_dispatcher: flex needs ETP x EP > 1 (Megatron's MoEFlexTokenDispatcher), got ETP=1 EP=1; "
        "use alltoall"]
    (missing,) = flex_problems(two.model, two.parallel, lambda backend: backend == "deepep")
    assert "moe_flex_dispatcher_backend='hybridep' needs deep_ep with HybridEPBuffer" in missing


def test_flex_on_cpu_is_refused_at_model_build():
    from megatron_search.models.provider import transformer_config_from_hf

    with pytest.raises(ProviderError, match="'flex' needs CUDA"):
        transformer_config_from_hf(load_config(None, [f"model.hf_config={TINY}", "model.moe_token_dispatcher=flex"]))


# ---------------------------------------------------------------- require_te
def test_require_te_refuses_the_local_fallback_at_model_build_not_at_load():
    from megatron_search.models.provider import transformer_config_from_hf

    cfg = load_config(None, [f"model.hf_config={TINY}", "model.require_te=true"])
    with pytest.raises(RuntimeError, match=r"model.require_te: true needs Transformer Engine and a GPU \(found: "
                                           r"transformer_engine not importable, no GPU\)"):
        transformer_config_from_hf(cfg)
    with pytest.raises(ConfigError, match="model.require_te: true asks for Transformer Engine specs"):
        load_config(None, ["model.require_te=true", "model.transformer_impl=local"])


# ---------------------------------------------------------------- parallel overlaps: config
def test_overlap_param_gather_needs_the_distributed_optimizer_and_overlapped_grad_reduce():
    with pytest.raises(ConfigError, match="needs parallel.overlap_grad_reduce=true"):
        load_config(None, ["parallel.overlap_param_gather=true"])
    with pytest.raises(ConfigError, match="set parallel.distributed_optimizer=true"):
        load_config(None, ["parallel.overlap_param_gather=true", "parallel.overlap_grad_reduce=true",
                           "parallel.distributed_optimizer=false"])
    assert load_config(None, ["parallel.overlap_param_gather=true", "parallel.overlap_grad_reduce=true"])


@pytest.mark.parametrize("path", GPU_CONFIGS)
def test_gpu_configs_take_the_peers_settings(path):
    cfg = load_config(path, ["parallel.world_size=null"])  # CPU: loads, nothing is built
    m, p = cfg.model, cfg.parallel
    assert (m.fusions, m.require_te, m.moe_router_dtype, m.moe_permute_fusion) == ("auto", True, "fp32", True)
    assert m.moe_token_dispatcher == "auto" and p.overlap_grad_reduce
    # GRPO exports the weights right after every step, which forces the gather there: no overlap to gain
    assert p.overlap_param_gather == path.endswith("_sft.yaml")


# ---------------------------------------------------------------- parallel overlaps: 2 gloo ranks
OVERLAPS = {
    "plain": [],
    "grad": ["parallel.overlap_grad_reduce=true"],
    "gather": ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"],
}


def _batch(trainer, seed: int):
    from megatron_search.trainer.step import Batch

    t = torch.randint(0, 2048, (4, 17), generator=torch.Generator().manual_seed(seed))
    return trainer.dp_slice(Batch(t[:, :-1].contiguous(), t[:, 1:].contiguous()))


def _params(chunks) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}


def _overlap_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from megatron_search.distributed import DistEnv, init_distributed
    from megatron_search.trainer.core import Trainer
    from megatron_search.trainer.sharded_state import load_model
    from megatron_search.weights.export import HFExporter, StagingBuffers

    env = DistEnv(rank, world, rank, "127.0.0.1", port, "torchrun")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res = {}
    for name, overrides in OVERLAPS.items():
        for optimizer in ("distributed", "replicated"):
            if name == "gather" and optimizer == "replicated":
                continue
            cfg = load_config(None, ["parallel.world_size=2", f"parallel.distributed_optimizer="
                                     f"{str(optimizer == 'distributed').lower()}", "optim.lr=1e-2",
                                     f"checkpoint.dir={out}/ck_{name}_{optimizer}", *overrides])
            ctx = init_distributed(cfg, env=env)
            torch.manual_seed(0)
            tr = Trainer(cfg, ctx, total_steps=4)
            r = {}
            launched = []
            finalize = tr.model[0].config.finalize_model_grads_func

            def finalize_and_look(*args, **kwargs):  # was a reduction in flight before the schedule's finalize?
                launched.append(any(g.grad_reduce_handle is not None for m in tr.ddp
                                    for g in m.bucket_groups + m.expert_parallel_bucket_groups))
                return finalize(*args, **kwargs)

            tr.model[0].config.finalize_model_grads_func = finalize_and_look
            m1 = tr.step(_batch(tr, 1), micro_batch_size=1)
            m2 = tr.step(_batch(tr, 2), micro_batch_size=1)  # the first batch only learns the buckets' contents
            r["launched_in_backward"] = launched
            r["metrics"] = [(m1["loss"], m1["grad_norm"]), (m2["loss"], m2["grad_norm"])]
            r["grads"] = {n: p.main_grad.detach().clone() for n, p in tr.ddp[0].named_parameters()}
            if optimizer == "distributed":
                r["after_step"] = _params(tr.model)  # stale under overlap_param_gather: nothing gathered yet
                staged = HFExporter(tr.model, cfg.model.architecture, ctx.groups, 64 << 20)
                r["export_staged"] = {n: t.clone() for rnd in staged.rounds(StagingBuffers(torch.device("cpu")))
                                      for bucket in rnd.values() for n, t in bucket}
                r["after_export"] = _params(tr.model)
                m3 = tr.step(_batch(tr, 3), micro_batch_size=1)  # its forward gathers the step's update itself
                r["metrics"].append((m3["loss"], m3["grad_norm"]))
                r["export_plain"] = {n: t.clone() for bucket in HFExporter(tr.model, cfg.model.architecture,
                                                                          ctx.groups, 64 << 20) for n, t in bucket}
                tr.step(_batch(tr, 4), micro_batch_size=1)
                r["before_save"] = _params(tr.model)
                path = tr.save()
                fresh = Trainer(cfg, ctx, total_steps=4)  # the saved weights alone, into new chunks
                load_model(fresh.model, path / "model_optim")
                r["saved"] = _params(fresh.model)
                r["after_save"] = _params(tr.model)
            res[f"{name}_{optimizer}"] = r
            ctx.teardown()
    torch.save(res, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def overlap_runs(tmp_path_factory):
    from _mp import run_spawned

    out = tmp_path_factory.mktemp("overlap")
    run_spawned(_overlap_worker, 2, str(out), timeout_s=600)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.multiprocess
def test_overlap_grad_reduce_gives_the_gradients_of_the_plain_run(overlap_runs):
    for ranks in overlap_runs:
        for optimizer in ("replicated", "distributed"):
            plain, grad = ranks[f"plain_{optimizer}"], ranks[f"grad_{optimizer}"]
            assert not any(plain["launched_in_backward"])
            assert grad["launched_in_backward"][:2] == [False, True]  # step 2: the buckets went out during backward
            assert grad["metrics"][:2] == plain["metrics"][:2]
            assert _equal(grad["grads"], plain["grads"])
        # the replicated optimizer's buffers hold the all-reduced gradient: both ranks the same
    assert _equal(overlap_runs[0]["grad_replicated"]["grads"], overlap_runs[1]["grad_replicated"]["grads"])


@pytest.mark.multiprocess
def test_overlap_param_gather_reads_updated_parameters_in_export_and_save(overlap_runs):
    for ranks in overlap_runs:
        plain, gather = ranks["plain_distributed"], ranks["gather_distributed"]
        assert gather["metrics"] == plain["metrics"]  # three steps: each forward saw the previous update
        stale = [n for n in plain["after_step"] if not torch.equal(gather["after_step"][n], plain["after_step"][n])]
        assert stale, "the overlapped run's parameters were current before any gather: the test would prove nothing"
        assert _equal(gather["after_export"], plain["after_step"])
        assert _equal(gather["saved"], plain["before_save"]) and _equal(gather["after_save"], plain["before_save"])
    plain0, gather0 = overlap_runs[0]["plain_distributed"], overlap_runs[0]["gather_distributed"]
    assert plain0["export_staged"] and _equal(gather0["export_staged"], plain0["export_staged"])
    assert plain0["export_plain"] and _equal(gather0["export_plain"], plain0["export_plain"])


def test_variable_shapes_only_where_asked_and_megatron_allows_them():
    # GRPO's trainer asks (its micro-batches vary); SFT and the reward model keep fixed shapes and no handshake.
    # (alltoall refuses to build on CPU, so the rule is checked as the function the provider calls)
    from megatron_search.models.provider import transformer_config_from_hf
    from megatron_search.models.provider_common import variable_seq_lengths

    assert variable_seq_lengths(True, 2, "alltoall") and variable_seq_lengths(True, 4, "flex")
    assert not variable_seq_lengths(False, 2, "alltoall") and not variable_seq_lengths(True, 1, "alltoall")
    assert not variable_seq_lengths(True, 2, "allgather")  # Megatron refuses variable_seq_lengths with allgather
    cfg = load_config(None, [f"model.hf_config={TINY}", "parallel.pp=2"])  # CPU: allgather
    assert transformer_config_from_hf(cfg, variable_shapes=True).variable_seq_lengths is False
