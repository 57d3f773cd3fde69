"""Run every Triton-parametrised kernel test under the Triton interpreter, in a subprocess.

TRITON_INTERPRET=1 must be set before Triton decorates the kernels, and must not leak into the
rest of the suite (other packages' Triton code would silently switch to the interpreter), so the
cases marked [triton] in the test_kernels_* files run in a child pytest with the variable set.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
FILES = ["test_kernels_logprob.py", "test_kernels_linear_logprob.py", "test_kernels_group_advantage.py"]
MIN_TRITON_CASES = 11  # 5 logprob + 2 linear + 4 group-advantage cases; fewer means cases went missing


def test_triton_kernels_match_float64_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton", *(str(HERE / f) for f in FILES)]
    proc = subprocess.run(cmd, cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    passed = re.search(r"(\d+) passed", output)
    assert passed and int(passed.group(1)) >= MIN_TRITON_CASES, output[-3000:]
