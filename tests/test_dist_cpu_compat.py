"""The CPU compatibility layer for Megatron-Core: idempotent, a no-op with CUDA, and each redirect does
what it claims (CPU tensors for device="cuda", CPU stand-ins for streams, RNG tracker on the CPU generator)."""
from __future__ import annotations

import pytest
import torch

from megatron_search.distributed import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only redirects")


def test_no_op_when_cuda_is_available(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_compat, "_ENABLED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu_compat, "_rebind", lambda proxy: calls.append(proxy))
    monkeypatch.setattr(cpu_compat.importlib, "import_module", lambda name: calls.append(name))
    assert cpu_compat.enable_cpu_compat() is False
    assert calls == [] and cpu_compat.is_enabled() is False


def test_missing_te_gemm_name_is_defined_as_none(monkeypatch):
    # Megatron 0.16 defines moe_utils.te_general_gemm only when TE imports, yet its router reads it.
    import megatron.core.transformer.moe.moe_utils as moe_utils

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    cpu_compat.define_missing_te_gemm()
    assert moe_utils.te_general_gemm is None
    sentinel = object()
    monkeypatch.setattr(moe_utils, "te_general_gemm", sentinel, raising=False)
    cpu_compat.define_missing_te_gemm()  # a real TE function is left alone
    assert moe_utils.te_general_gemm is sentinel


def test_enabling_twice_is_harmless():
    import megatron.core.pipeline_parallel.schedules as schedules

    assert cpu_compat.enable_cpu_compat() is True
    proxy = schedules.torch
    assert cpu_compat.enable_cpu_compat() is True
    assert schedules.torch is proxy  # not wrapped a second time
    assert proxy.Tensor is torch.Tensor and proxy.nn is torch.nn and proxy.distributed is torch.distributed


def test_redirects_inside_megatron_only():
    import megatron.core.pipeline_parallel.schedules as schedules

    cpu_compat.enable_cpu_compat()
    mt = schedules.torch
    t = mt.zeros([], dtype=torch.int, device="cuda")  # as schedules.py allocates its token counter
    assert t.device.type == "cpu"
    assert mt.empty(3, device=mt.cuda.current_device()).device.type == "cpu"
    stream = mt.cuda.Stream()
    stream.wait_stream(mt.cuda.current_stream())
    with mt.cuda.stream(stream):
        pass
    mt.cuda.synchronize()
    with pytest.raises((RuntimeError, AssertionError)):  # the real torch is untouched
        torch.zeros(1, device="cuda")


def test_rng_tracker_runs_on_the_cpu_generator():
    from megatron.core.tensor_parallel import random as mrandom

    cpu_compat.enable_cpu_compat()
    tracker = mrandom.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 77)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the fork restored the outer state
    torch.manual_seed(77)
    assert torch.equal(first, torch.rand(4))  # inside the fork: the tracker's own seeded stream


def test_megatron_modules_imported_later_are_rebound():
    import sys

    import importlib

    cpu_compat.enable_cpu_compat()
    # A module nothing in the stack imports (upcycling dense -> MoE), so it loads only here.
    name = "megatron.core.transformer.moe.upcycling_utils"
    was_loaded = name in sys.modules
    module = importlib.import_module(name)
    assert was_loaded or getattr(module.torch, "_megatron_search_cpu_proxy", False)
    assert getattr(importlib.import_module("megatron.core.transformer.moe.router").torch,
                   "_megatron_search_cpu_proxy", False)


def test_cpu_grad_clipping_scales_by_max_over_total():
    p1, p2 = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    p1.grad, p2.grad = torch.tensor([3.0, 0.0, 4.0]), torch.tensor([0.0, 12.0])
    total = 13.0  # sqrt(9 + 16 + 144)
    cpu_compat._clip_grad_by_total_norm_fp32_cpu([p1, p2], max_norm=1.0, total_norm=total)
    coeff = 1.0 / (total + 1e-6)
    assert torch.allclose(p1.grad, torch.tensor([3.0, 0.0, 4.0]) * coeff)
    assert torch.allclose(p2.grad, torch.tensor([0.0, 12.0]) * coeff)
    cpu_compat._clip_grad_by_total_norm_fp32_cpu([p1], max_norm=100.0, total_norm=1.0)  # below the max: unchanged
    assert torch.allclose(p1.grad, torch.tensor([3.0, 0.0, 4.0]) * coeff)
    p3 = torch.nn.Parameter(torch.zeros(1, dtype=torch.float16))
    p3.grad = torch.zeros(1, dtype=torch.float16)
    with pytest.raises(TypeError, match="float16"):
        cpu_compat._clip_grad_by_total_norm_fp32_cpu([p3], max_norm=1.0, total_norm=2.0)


def test_cuda_type_names_only_inside_optimizer_construction():
    t = torch.zeros(2)
    with cpu_compat._cuda_type_names():
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert t.type(torch.float64).dtype == torch.float64  # conversions unchanged
    assert t.type() == "torch.FloatTensor"


def test_tensor_cuda_stays_on_cpu_only_while_the_embedding_copy_is_set_up():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    cpu_compat.enable_cpu_compat()
    assert getattr(LanguageModule.setup_embeddings_and_output_layer, "_megatron_search_cpu_compat", False)
    t = torch.zeros(2)
    with cpu_compat._tensor_cuda_stays_on_cpu():
        assert t.cuda() is t
    with pytest.raises((AssertionError, RuntimeError)):  # outside: the real method (no CUDA here)
        t.cuda()
