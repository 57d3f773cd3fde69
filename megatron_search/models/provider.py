"""Build Megatron-Core models from a Hugging Face config.json (the provider API others import).

    transformer_config_from_hf(cfg) -> TransformerConfig
    build_model(cfg, groups, pre_process=None, post_process=None, vp_stage=None) -> GPTModel for this rank
    build_model_chunks(cfg, groups, routing_replay=False) -> [GPTModel per virtual pipeline stage]

Architectures register in ARCHITECTURES (model_type -> module). An architecture module provides
`transformer_config_kwargs(cfg, hf, where, use_te)`, `gpt_model_kwargs(hf, where)` and
`layer_spec(config, use_te, vp_stage, pp_rank)`, and optionally `config_class` (a TransformerConfig
subclass) and `model_class` (a GPTModel subclass; default GPTModel, or `models.mtp.MTPGPTModel`
when the config builds MTP layers). Model parallel state must be initialised first
(`megatron_search.distributed.init_distributed`).
"""
from __future__ import annotations

import importlib
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from megatron_search.config.hf import load_hf_config
from megatron_search.distributed import cpu_compat
from megatron_search.distributed.stages import chunk_stage_flags, rank_in, require_model_parallel

from .mtp import MTPGPTModel
from .provider_common import ProviderError, fusion_settings, log_fusions, variable_seq_lengths
from .specs import use_transformer_engine

ARCHITECTURES: dict[str, str] = {
    "qwen3_moe": "megatron_search.models.qwen3_moe",
    "qwen3_5_moe": "megatron_search.models.qwen3_5",
}


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Language-model fields (multimodal configs nest them under text_config)."""
    inner = hf.get("text_config")
    return {**inner, "model_type": hf.get("model_type")} if isinstance(inner, dict) else hf


def architecture_module(cfg):
    """(module, raw HF config, where) for cfg.model.hf_config."""
    path = cfg.model.resolved_hf_config()
    raw = load_hf_config(path)
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ProviderError(f"{path}: model_type {model_type!r} has no Megatron provider ({sorted(ARCHITECTURES)})")
    return importlib.import_module(ARCHITECTURES[model_type]), raw, str(path)


def transformer_config_from_hf(cfg, routing_replay: bool = False, variable_shapes: bool = False):
    """Megatron TransformerConfig for cfg.model (architecture from the HF config.json, layout from cfg.parallel).
    `routing_replay` (RECIPE 3, GRPO's grpo.routing_replay): every router gets a RouterReplay that can force the
    engine's experts. `variable_shapes` (GRPO's micro-batches, train/microbatches.py): under PP the stages send
    each activation's shape first (variable_seq_lengths: a blocking handshake per send, so only where the shapes
    vary); Megatron refuses it with the allgather dispatcher, where policy_step then agrees one width per step."""
    module, raw, where = architecture_module(cfg)
    use_te = use_transformer_engine(cfg.model.transformer_impl, cfg.model.require_te)
    kwargs = module.transformer_config_kwargs(cfg, text_config(raw), where, use_te)
    kwargs["moe_enable_routing_replay"] = routing_replay
    kwargs["variable_seq_lengths"] = variable_seq_lengths(variable_shapes, cfg.parallel.pp,
                                                          kwargs.get("moe_token_dispatcher_type"))
    return getattr(module, "config_class", TransformerConfig)(**kwargs)


def build_model(cfg, groups, pre_process: bool | None = None, post_process: bool | None = None,
                vp_stage: int | None = None, config=None):
    """The GPTModel (chunk) this rank holds in `groups` (DistContext.groups); pre/post process follow its
    pipeline stage when None."""
    require_model_parallel("build_model")
    module, raw, where = architecture_module(cfg)
    hf = text_config(raw)
    use_te = use_transformer_engine(cfg.model.transformer_impl, cfg.model.require_te)
    config = config if config is not None else transformer_config_from_hf(cfg)
    if cfg.parallel.vpp is not None and vp_stage is None:
        raise ValueError("build_model: parallel.vpp is set, pass vp_stage (or use build_model_chunks)")
    first, last = chunk_stage_flags(groups, vp_stage, cfg.parallel.vpp)
    pre_process = first if pre_process is None else pre_process
    post_process = last if post_process is None else post_process
    spec = module.layer_spec(config, use_te, vp_stage, rank_in(groups.pp))
    model_cls = getattr(module, "model_class", None)
    if model_cls is None:
        # With MTP layers: Megatron's behaviour with labels, main-head logits without (models/mtp.py).
        model_cls = MTPGPTModel if config.mtp_num_layers else GPTModel
    extra = {}
    if hasattr(module, "mtp_block_spec"):  # multi-token prediction (None when off or not on this stage)
        extra["mtp_block_spec"] = module.mtp_block_spec(config, use_te, vp_stage)
    cpu_compat.rebind_new_modules()  # architecture modules may import more of Megatron
    model = model_cls(
        config=config,
        transformer_layer_spec=spec,
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        **module.gpt_model_kwargs(hf, where),
        **extra,
    )
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    return model


def build_model_chunks(cfg, groups, routing_replay: bool = False, variable_shapes: bool = False) -> list:
    """One model chunk per virtual pipeline stage of this rank (a single chunk without VPP); `routing_replay`,
    `variable_shapes`: see transformer_config_from_hf."""
    config = transformer_config_from_hf(cfg, routing_replay, variable_shapes)
    log_fusions(*fusion_settings(cfg.model.fusions, torch.cuda.is_available()))
    if cfg.parallel.vpp is None:
        return [build_model(cfg, groups, config=config)]
    return [build_model(cfg, groups, vp_stage=v, config=config) for v in range(cfg.parallel.vpp)]


_PARAM_SYNC = "_megatron_search_param_sync"


def attach_param_sync(chunk, sync) -> None:
    """Give a model chunk the call that makes its parameters current (trainer/step.wrap_ddp under
    parallel.overlap_param_gather: its DDP's start_param_sync(force_sync=True)); kept out of the module tree."""
    chunk.__dict__[_PARAM_SYNC] = sync


def sync_params(chunks) -> None:
    """Make every parameter current after optimizer.step() under parallel.overlap_param_gather (a no-op without it).

    The distributed optimizer updates only this rank's shard; with the overlapped gather the other shards arrive
    during the next forward (DDP's forward pre-hooks), so a reader outside a forward (checkpoint save, weight
    export) would see the previous step's values. Megatron-LM forces the gather before its saves and after the last
    step (training.py force_param_sync: start_param_sync(force_sync=True), which waits for a gather in flight or
    runs a synchronous one); so do the trainer's save and the exporter. Collective over each chunk's data-parallel
    group: call it on every rank. Takes the chunks wrap_ddp wrapped or their DDP wrappers."""
    for chunk in chunks:
        sync = getattr(chunk, "module", chunk).__dict__.get(_PARAM_SYNC)
        if sync is not None:
            sync()
