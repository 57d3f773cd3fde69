"""GRPO resume (issue 22.3): kill after step k = 2 and resume; step 3's loss, grad norm, rewards and sampler
position, and the final policy, equal an uninterrupted run's bit for bit on CPU.

The world is the learning test's (tests/_grpo_learning.py: an SFT policy answering yes/no, so every step's
groups differ and every step trains). The crash is made deterministic: the uninterrupted run checkpoints
every step; a copy of its output loses everything after step 2's checkpoint (step 3's checkpoint, the final
weights, the event log), as a kill during step 3 would leave it, and resumes with checkpoint.resume=true.
One request at a time on the engine, so its logprobs do not depend on how decode batches formed.
"""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(Path(__file__).parent))

SEED, STEPS, LR = 3, 3, 2e-3
EXACT = ["checkpoint.save_interval=1", "rollout.concurrency=1", "rollout.local.max_running_requests=1"]


def _scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    return {t: {e.step: e.value for e in ea.Scalars(t)} for t in ea.Tags()["scalars"]}


def test_grpo_resume_after_a_crash_is_bitwise(tmp_path):
    import _grpo_learning as g
    from _mp import run_spawned
    from safetensors.torch import load_file

    fx = g.build(tmp_path, seed=SEED)
    straight_args = g.grpo_overrides(fx, "straight", STEPS, LR, SEED, extra=EXACT)
    run_spawned(g.pipeline_worker, 1, fx, {"sft": g.sft_overrides(fx, 40, 3e-3, SEED), "rm": g.rm_args(fx),
                                           "grpo": [("straight", straight_args)]})
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    shutil.copytree(straight, crashed, ignore=shutil.ignore_patterns("tensorboard", "final_weights", "step_00000003",
                                                                    "residency.jsonl"))
    (crashed / "checkpoints" / "latest").write_text("step_00000002\n")
    resumed_args = g.grpo_overrides(fx, "crashed", STEPS, LR, SEED, extra=[*EXACT, "checkpoint.resume=true"])
    run_spawned(g.pipeline_worker, 1, fx, {"grpo": [("crashed", resumed_args)]})

    from test_residency import check_ledger

    check_ledger(crashed, trained=True, saved=True)  # the resumed run: start-up, load, one step, its save
    full, resumed = _scalars(straight), _scalars(crashed)
    assert sorted(full["train/loss"]) == [0, 1, 2], full["train/loss"]  # every step trained
    for tag in ("train/loss", "train/grad_norm", "train/is_weight_mean", "reward/mean", "reward/r_base",
                "rollout/response_tokens"):
        assert resumed[tag] == {2: full[tag][2]}, (tag, full[tag], resumed[tag])
    meta = [json.loads((d / "checkpoints" / "step_00000003" / "trainer.json").read_text()) for d in (straight, crashed)]
    assert meta[0]["extra"]["sampler"] == meta[1]["extra"]["sampler"] and meta[0]["iteration"] == meta[1]["iteration"] == 3
    a, b = (load_file(d / "final_weights" / "model.safetensors") for d in (straight, crashed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and the step really moved the policy (the comparison can fail)
    before = load_file(straight / "reference_weights" / "model.safetensors")
    assert any(not torch.equal(before[k], a[k]) for k in a)
