"""`megatron-search smoke` end to end under torchrun (2 gloo processes, PP=2 through 1F1B): the
torchrun environment path, model build per stage, DDP, optimizer; the loss must fall."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from megatron_search.distributed import free_port

pytestmark = pytest.mark.multiprocess


def test_smoke_under_torchrun_pp2():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "megatron_search.cli", "smoke", "configs/tiny_cpu.yaml",
           "parallel.pp=2", "--steps", "3"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)", out.stdout, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "world=2 tp=1 pp=2" in out.stdout and "loss fell" in out.stdout


def test_smoke_bf16_one_process():
    # Megatron's mixed-precision optimizer (fp32 main params) on CPU via the compat layer.
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "megatron_search.cli", "smoke", "configs/tiny_cpu.yaml",
           "model.params_dtype=bfloat16", "--steps", "2"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "loss fell" in out.stdout
