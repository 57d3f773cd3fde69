"""Make Megatron-Core (0.16.1 and newer) run forward + backward on CPU under gloo.

Switched on only when `torch.cuda.is_available()` is False; on a GPU machine `enable_cpu_compat()`
returns False and changes nothing. Calling it again is harmless (idempotent).

Megatron-Core assumes CUDA in a handful of places (FACTS.md lists what a tiny MoE GPTModel hits).
Rather than editing call sites one by one, each loaded `megatron.core.*` module gets its own
`torch` name rebound to a thin copy of the torch module (`_CpuTorch`) whose only differences are:

* `torch.cuda` is `_CudaOnCpu`: `current_device()` answers the CPU device (Megatron passes it
  as `device=` when allocating activations, buffers and gathered tensors); `Stream`,
  `current_stream`, `default_stream` and `stream(...)` are no-op stand-ins (overlap streams in
  the shared-expert, DDP and dispatcher code only order work on a GPU; CPU ops are already
  ordered); `synchronize` / `empty_cache` are no-ops (pipeline p2p calls synchronize after
  batched isend/irecv, gloo's waits already block); the CUDA RNG calls (`get_rng_state`,
  `set_rng_state`, `manual_seed`) act on the CPU generator, which is what the model-parallel
  RNG tracker must drive on CPU.
* Factory functions (`zeros`, `empty`, `tensor`, ...) map a hard-coded `device="cuda"` to CPU
  (schedules' token counters, the grad scaler, clip_grads buffers, attention masks).

Every other attribute is the real torch object, so tensors, autograd and torch.distributed are
untouched. Two functions are replaced outright: the tracker's `_get/_set_cuda_rng_state` (they
reach into `torch.cuda.default_generators`), and `moe_utils.te_general_gemm`, which is left
undefined when Transformer Engine is missing although the router still tests it against None,
and the optimizer's `clip_grad_by_total_norm_fp32`, which asserts that gradients are CUDA tensors.
The bf16/fp16 and distributed optimizers' constructors run with CUDA-spelled `Tensor.type()` names
(they dispatch on those strings). `LanguageModule.setup_embeddings_and_output_layer` runs with
`Tensor.cuda()` answering the CPU tensor itself: with PP > 1 it moves the duplicated word
embedding of the last stage (tied output layer, or the MTP block's embedding) to CUDA before the
all-reduce that copies the first stage's values into it.

Modules loaded when `enable_cpu_compat()` runs are rebound at once (it first imports the modules a
training step uses); Megatron modules imported later are rebound as they load, by a small import
hook (`_RebindOnImport`). Call it before building models (init_distributed does).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import logging
import sys
import types
from typing import Any

import torch

_ENABLED = False
_CPU = torch.device("cpu")

# Megatron modules a GPTModel forward/backward, the schedules and the optimizer touch.
_MODULES_TO_LOAD = (
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
)
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "as_tensor")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # bare ints mean cuda:<i>


def _cpu_factory(fn):
    def wrapped(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        return fn(*args, **kwargs)

    wrapped.__name__ = getattr(fn, "__name__", "factory")
    wrapped.__doc__ = fn.__doc__
    return wrapped


class _NoStream:
    """Stands in for torch.cuda.Stream/Event: CPU work is already executed in program order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other):  # every stand-in is "the" stream, as on a single-stream device
        return isinstance(other, _NoStream)

    __hash__ = object.__hash__


_THE_STREAM = _NoStream()


def _noop(*args, **kwargs):
    return None


class _CudaRandomOnCpu(types.SimpleNamespace):
    pass


def _make_cuda_shim() -> types.ModuleType:
    real = torch.cuda
    shim = types.ModuleType("torch.cuda")

    def __getattr__(name: str):  # everything not redirected stays the real torch.cuda object
        return getattr(real, name)

    shim.__getattr__ = __getattr__
    shim.is_available = lambda: False
    shim.current_device = lambda: _CPU
    shim.device_count = lambda: 0
    shim.Stream = _NoStream
    shim.Event = _NoStream
    shim.current_stream = lambda *a, **k: _THE_STREAM
    shim.default_stream = lambda *a, **k: _THE_STREAM
    shim.stream = lambda *a, **k: contextlib.nullcontext()
    shim.synchronize = _noop
    shim.empty_cache = _noop
    shim.get_rng_state = lambda *a, **k: torch.get_rng_state()
    shim.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    shim.manual_seed = lambda seed: torch.manual_seed(seed)
    shim.manual_seed_all = lambda seed: torch.manual_seed(seed)
    shim.random = _CudaRandomOnCpu(
        get_rng_state=shim.get_rng_state, set_rng_state=shim.set_rng_state, manual_seed=shim.manual_seed
    )
    shim.memory_allocated = lambda *a, **k: 0
    shim.max_memory_allocated = lambda *a, **k: 0
    shim.memory_reserved = lambda *a, **k: 0
    shim.nvtx = types.SimpleNamespace(range_push=_noop, range_pop=_noop, mark=_noop)
    return shim


def _make_torch_proxy() -> types.ModuleType:
    proxy = types.ModuleType("torch")
    proxy.__dict__.update({k: v for k, v in torch.__dict__.items() if not k.startswith("__")})
    proxy.__getattr__ = lambda name: getattr(torch, name)  # lazily loaded torch submodules
    proxy.cuda = _make_cuda_shim()
    for name in _FACTORIES:
        setattr(proxy, name, _cpu_factory(getattr(torch, name)))
    proxy._megatron_search_cpu_proxy = True
    return proxy


def _get_rng_state_cpu(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state_cpu(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor';
    same operation (scale fp32 grads in place by max_norm / total_norm when < 1) with a dtype check."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            if grad.dtype not in (torch.float32, torch.bfloat16) or (not use_decoupled_grad and grad.dtype != torch.float32):
                raise TypeError(f"clip_grad_by_total_norm_fp32: gradient of dtype {grad.dtype}, expected float32")
            grads.append(grad.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


@contextlib.contextmanager
def _cuda_type_names():
    """Megatron's optimizers choose fp16/bf16/fp32 handling by comparing `param.type()` with
    'torch.cuda.*Tensor' strings (and raise for anything else). While their constructors run,
    CPU tensors answer with the CUDA spelling of the same dtype; conversions (`type(dtype)`) are
    untouched and the real method is restored afterwards."""
    original = torch.Tensor.type

    def type_name(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_name
    try:
        yield
    finally:
        torch.Tensor.type = original


def _construct_with_cuda_type_names(cls: type) -> None:
    original = cls.__init__
    if getattr(original, "_megatron_search_cpu_compat", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        with _cuda_type_names():
            original(self, *args, **kwargs)

    __init__._megatron_search_cpu_compat = True
    cls.__init__ = __init__


@contextlib.contextmanager
def _tensor_cuda_stays_on_cpu():
    """`Tensor.cuda()` returns the (CPU) tensor unchanged while the block runs; restored afterwards."""
    original = torch.Tensor.cuda

    def stay(self, device=None, non_blocking=False, memory_format=torch.preserve_format):  # noqa: ARG001
        return self

    torch.Tensor.cuda = stay
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _run_with_tensor_cuda_on_cpu(cls: type, method: str) -> None:
    original = getattr(cls, method, None)
    if original is None or getattr(original, "_megatron_search_cpu_compat", False):
        return

    @functools.wraps(original)
    def wrapped(self, *args, **kwargs):
        with _tensor_cuda_stays_on_cpu():
            return original(self, *args, **kwargs)

    wrapped._megatron_search_cpu_compat = True
    setattr(cls, method, wrapped)


class _DropCpuRngWarning(logging.Filter):
    # On CPU the "CUDA" RNG *is* the CPU generator, so the tracker's check that forked code left the
    # CPU RNG alone always fires; the fork still restores the state correctly.
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _rebind(proxy: types.ModuleType) -> int:
    count = 0
    for name, mod in list(sys.modules.items()):
        if (name == "megatron.core" or name.startswith("megatron.core.")) and mod is not None:
            if getattr(mod, "torch", None) is torch:
                mod.torch = proxy
                count += 1
    return count


class _RebindOnImport(importlib.abc.MetaPathFinder):
    """Rebinds `torch` in megatron.core modules imported after enable_cpu_compat() (lazy imports)."""

    def __init__(self, proxy: types.ModuleType):
        self.proxy = proxy

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("megatron.core."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RebindingLoader(spec.loader, self.proxy)
                return spec
        return None


class _RebindingLoader(importlib.abc.Loader):
    def __init__(self, inner, proxy: types.ModuleType):
        self.inner, self.proxy = inner, proxy

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        if getattr(module, "torch", None) is torch:
            module.torch = self.proxy

    def __getattr__(self, name):  # get_source, is_package, ... of the real loader
        return getattr(self.inner, name)


def define_missing_te_gemm() -> None:
    """Megatron-Core 0.16's MoE router reads `moe_utils.te_general_gemm`, a name it defines only when
    Transformer Engine imports: without TE every router forward raises NameError, on CPU and on GPU
    alike (seen on an H200 without TE). Define it as None, the value its own check expects."""
    try:
        moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    except ImportError:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def enable_cpu_compat() -> bool:
    """Redirect Megatron-Core's CUDA-only calls to CPU. Returns True when active (CPU only)."""
    global _ENABLED
    if torch.cuda.is_available():
        return False  # GPU machine: Megatron runs unmodified (distributed/init.py defines the TE name)
    if _ENABLED:
        return True
    for name in _MODULES_TO_LOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # a newer Megatron may move a module; patch what exists
            continue
    define_missing_te_gemm()
    proxy = _make_torch_proxy()
    _rebind(proxy)
    sys.meta_path.insert(0, _RebindOnImport(proxy))
    random = sys.modules.get("megatron.core.tensor_parallel.random")
    if random is not None:
        for attr, fn in (("_get_cuda_rng_state", _get_rng_state_cpu), ("_set_cuda_rng_state", _set_rng_state_cpu)):
            if hasattr(random, attr):
                setattr(random, attr, fn)
        logging.getLogger(random.__name__).addFilter(_DropCpuRngWarning())
    for modname, clsname in (("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params"),
                             ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer")):
        cls = getattr(sys.modules.get(modname), clsname, None)
        if cls is not None:
            _construct_with_cuda_type_names(cls)
    language_module = sys.modules.get("megatron.core.models.common.language_module.language_module")
    if language_module is not None and hasattr(language_module, "LanguageModule"):
        _run_with_tensor_cuda_on_cpu(language_module.LanguageModule, "setup_embeddings_and_output_layer")
    for modname in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        mod = sys.modules.get(modname)
        if mod is not None and hasattr(mod, "clip_grad_by_total_norm_fp32"):
            mod.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
    _ENABLED = True
    return True


def rebind_new_modules() -> int:
    """Rebind Megatron modules imported after enable_cpu_compat(); returns how many changed."""
    if not _ENABLED:
        return 0
    proxy = next(
        (m.torch for n, m in sys.modules.items() if n.startswith("megatron.core.")
         and getattr(getattr(m, "torch", None), "_megatron_search_cpu_proxy", False)),
        None,
    )
    return _rebind(proxy) if proxy is not None else 0


def is_enabled() -> bool:
    return _ENABLED
