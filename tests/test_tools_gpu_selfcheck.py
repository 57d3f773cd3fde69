"""tools/gpu_selfcheck.py stays runnable: its CPU dry run (small shapes, Triton interpreter) passes every
check (the fla one skips: it needs CUDA), the train check included (SFT + GRPO of both tiny models,
conversion, every delivery mode; both of its sides on CPU), and it finds megatron_search.kernels in an
uninstalled checkout."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "gpu_selfcheck.py"


def test_cpu_dry_run_passes_every_check(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the tool sets it itself in dry-run mode
    cmd = [sys.executable, str(TOOL), "--cpu-dry-run", "--train", "--out", str(tmp_path),
           "--pytest-files", "tests/test_kernels_group_advantage.py"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    status = {c["check"]: c["status"] for c in summary["checks"]}
    assert status == {"kernels": "PASS", "gdn": "SKIP", "models": "PASS", "pytest": "PASS", "train": "PASS"}, out[-8000:]
    assert "needs CUDA" in next(c["error"] for c in summary["checks"] if c["check"] == "gdn")
    items = {i["label"]: i for c in summary["checks"] for i in c["items"]}
    # the comparisons really ran (figures recorded, each within its tolerance)
    for label in ("logprob.logp", "logprob.grad_bf16", "linear.grad_weight_bf16", "group_advantage.per_token",
                  "chunk_fla_bfloat16_T70.o", "tiny_qwen3_moe.logits_vs_hf", "tiny_qwen3_5_moe.logits_vs_hf"):
        assert items[label]["ok"], items[label]
    assert items["tiny_qwen3_5_moe.kernels"]["megatron_gdn"] == "torch"
    assert items["pytest"]["passed"] >= 1
    # train: every stage ran for both architectures and was compared (device side vs the CPU reference)
    train = next(c for c in summary["checks"] if c["check"] == "train")
    assert all(i["ok"] for i in train["items"] if "ok" in i), [i for i in train["items"] if not i.get("ok", True)]
    assert items["sides"]["device"] == items["sides"]["reference"] == "cpu"
    for arch in ("tiny_qwen3_moe", "tiny_qwen3_5_moe"):
        for label in ("sft.step1.loss", "sft.step2.grad_norm", "convert.logits_vs_transformers",
                      "convert.round_trip_tensors_differ", "delivery.tensor.params_mismatched",
                      "delivery.distributed.params_mismatched", "delivery.disk.params_mismatched",
                      "delivery.disk.wrong_version", "delivery.greedy_tokens_vs_transformers", "grpo.step2.reward_mean", "grpo.step2.response_tokens", "grpo.device.engine_vs_trainer_k3",
                      "grpo.final_weights"):
            assert items[f"{arch}.{label}"]["ok"], (arch, label, items.get(f"{arch}.{label}"))
        assert items[f"{arch}.sft"]["loss"][1] < items[f"{arch}.sft"]["loss"][0]  # SFT learned something
        assert items[f"{arch}.grpo"]["updated_steps"] >= 1  # the policy step ran, not only rollouts
        updated = [i for label, i in items.items() if label.startswith(f"{arch}.grpo.step") and label.endswith("grad_norm")]
        assert updated and all(i["ok"] for i in updated)
        assert items[f"{arch}.delivery"]["params"] > 40 and items[f"{arch}.delivery"]["buckets"] > 1


def test_finds_kernels_package_without_install():
    # -S: no site-packages .pth files (no editable-install finder); only the tools folder and torch's on the path
    path = str(Path(torch.__file__).resolve().parents[1])
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import gpu_selfcheck as g\n"
            "try:\n    import megatron_search.kernels\n    print('before: found')\n"
            "except ImportError:\n    print('before: missing')\n"
            "g.use_checkout(); import megatron_search.kernels as k\n"
            "from megatron_search.kernels import group_advantage\nprint(k.__file__); print(group_advantage.__file__)")
    proc = subprocess.run([sys.executable, "-S", "-c", code, str(REPO / "tools")], env=dict(os.environ, PYTHONPATH=path),
                          capture_output=True, text=True, timeout=120, cwd=REPO / "tools")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "before: missing", proc.stdout  # the checkout, not an installed copy, was found
    assert lines[-2:] == [str(REPO / "megatron_search" / "kernels" / "__init__.py"), str(REPO / "kernels" / "group_advantage.py")]
