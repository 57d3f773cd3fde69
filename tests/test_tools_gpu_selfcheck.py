"""tools/gpu_selfcheck.py stays runnable: its CPU dry run (small shapes, Triton interpreter) passes every
check (the fla one skips: it needs CUDA), and it finds megatron_search.kernels in an uninstalled checkout."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "gpu_selfcheck.py"


def test_cpu_dry_run_passes_every_check(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the tool sets it itself in dry-run mode
    cmd = [sys.executable, str(TOOL), "--cpu-dry-run", "--out", str(tmp_path),
           "--pytest-files", "tests/test_kernels_group_advantage.py"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    status = {c["check"]: c["status"] for c in summary["checks"]}
    assert status == {"kernels": "PASS", "gdn": "SKIP", "models": "PASS", "pytest": "PASS"}, out[-6000:]
    assert "needs CUDA" in next(c["error"] for c in summary["checks"] if c["check"] == "gdn")
    items = {i["label"]: i for c in summary["checks"] for i in c["items"]}
    # the comparisons really ran (figures recorded, each within its tolerance)
    for label in ("logprob.logp", "logprob.grad_bf16", "linear.grad_weight_bf16", "group_advantage.per_token",
                  "chunk_fla_bfloat16_T70.o", "tiny_qwen3_moe.logits_vs_hf", "tiny_qwen3_5_moe.logits_vs_hf"):
        assert items[label]["ok"], items[label]
    assert items["tiny_qwen3_5_moe.kernels"]["megatron_gdn"] == "torch"
    assert items["pytest"]["passed"] >= 1


def test_finds_kernels_package_without_install():
    # -S: no site-packages .pth files (no editable-install finder); only the repo and torch's folder on the path
    path = os.pathsep.join([str(REPO), str(Path(torch.__file__).resolve().parents[1])])
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import gpu_selfcheck as g\n"
            "try:\n    import megatron_search.kernels\n    print('before: found')\n"
            "except ImportError:\n    print('before: missing')\n"
            "g.install_kernels_alias(); import megatron_search.kernels as k\n"
            "from megatron_search.kernels.group_advantage import fused_group_advantages\nprint(k.__file__)")
    proc = subprocess.run([sys.executable, "-S", "-c", code, str(REPO / "tools")], env=dict(os.environ, PYTHONPATH=path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "before: missing", proc.stdout  # the alias, not an installed copy, found it
    assert lines[-1] == str(REPO / "kernels" / "__init__.py")
