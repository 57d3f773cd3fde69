"""Exact resume and crash-safe checkpoints at 1 process, plus TensorBoard tags of an SFT run.

Run A trains 4 steps straight. Run B trains the same config, gets SIGUSR1 after step 2 (the real
signal path: flag -> checkpoint -> clean return). A save of step 3 then crashes half-written; the
step-2 checkpoint must stay the latest and loadable. Run C resumes from it and trains steps 3-4:
their losses must equal run A's bit for bit (same weights, Adam state, RNG, data position, LR).
"""
from __future__ import annotations

import os
import signal

import pytest
import torch

from _sft_helpers import sft_config, write_dataset

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_search.train.sft import run_sft

    root = tmp_path_factory.mktemp("resume")
    data = {write_dataset(root / "a.jsonl", range(0, 5)): 0.7, write_dataset(root / "b.jsonl", range(5, 9)): 0.3}
    common = ["sft.steps=4", "optim.lr_schedule=cosine", "optim.warmup_steps=1", "optim.min_lr=1e-4"]
    (root / "A").mkdir()
    (root / "B").mkdir()
    straight = run_sft(sft_config(root / "A", data, common))

    def stop_after_two(it, metrics):
        if it == 2:
            os.kill(os.getpid(), signal.SIGUSR1)

    cfg_b = sft_config(root / "B", data, common)
    stopped = run_sft(cfg_b, on_step=stop_after_two)
    crash = _crash_while_saving_step_3(cfg_b)
    resumed = run_sft(sft_config(root / "B", data, [*common, "checkpoint.resume=true"]))
    return {"root": root, "straight": straight, "stopped": stopped, "crash": crash, "resumed": resumed}


class InjectedCrash(RuntimeError):
    pass


def _crash_while_saving_step_3(cfg) -> dict:
    """Load the step-2 checkpoint, train step 3, and crash in the middle of writing its checkpoint."""
    from megatron_search.distributed import init_distributed
    from megatron_search.trainer.checkpoint import save_run, write_run_state
    from megatron_search.trainer.checkpoint_dir import latest_checkpoint
    from megatron_search.trainer.core import Trainer
    from megatron_search.train.sft import build_batcher

    def crashing_write(trainer, directory, extra):
        write_run_state(trainer, directory, extra)  # every file written...
        raise InjectedCrash("disk full")  # ...but the save never completes

    ctx = init_distributed(cfg)
    try:
        trainer = Trainer(cfg, ctx, total_steps=cfg.sft.steps)
        root = trainer.root
        batcher = build_batcher(cfg)
        batcher.load_state_dict(trainer.load(latest_checkpoint(root))["data"])
        trainer.step(trainer.dp_slice(batcher.next_batch()))
        with pytest.raises(InjectedCrash):
            save_run(trainer, root, {"data": batcher.state_dict()}, write=crashing_write)
        leftovers = sorted(p.name for p in root.iterdir() if ".tmp-" in p.name)
        latest = latest_checkpoint(root)
        fresh = Trainer(cfg, ctx, total_steps=cfg.sft.steps)
        fresh.load(latest)
        same = all(torch.equal(a, b) for a, b in zip(fresh.model[0].state_dict().values(),
                                                      trainer.model[0].state_dict().values()))
        return {"leftovers": leftovers, "latest": latest.name, "loaded_iteration": fresh.iteration,
                "equal_to_step3_weights": same}
    finally:
        ctx.teardown()


def test_resume_after_signal_is_bitwise_exact(runs):
    a, b, c = runs["straight"], runs["stopped"], runs["resumed"]
    assert a["iterations"] == [1, 2, 3, 4] and not a["stopped"]
    assert b["stopped"] and b["iterations"] == [1, 2] and b["checkpoint"].endswith("step_00000002")
    assert c["iterations"] == [3, 4]
    f64 = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731 - exact copies of the Python floats
    assert torch.equal(f64(b["losses"]), f64(a["losses"][:2]))
    assert torch.equal(f64(c["losses"]), f64(a["losses"][2:]))
    assert torch.equal(f64(c["grad_norms"]), f64(a["grad_norms"][2:]))
    assert len(set(a["losses"])) == 4  # the steps saw different batches: equality is not trivial


def test_crash_while_saving_keeps_previous_checkpoint_loadable(runs):
    crash = runs["crash"]
    assert crash["latest"] == "step_00000002"
    assert len(crash["leftovers"]) == 1 and crash["leftovers"][0].startswith("step_00000003.tmp-")
    assert crash["loaded_iteration"] == 2
    assert not crash["equal_to_step3_weights"]  # it really is the older state that loaded
    # The resumed run published later checkpoints and cleared the crashed save's leftovers.
    names = sorted(p.name for p in (runs["root"] / "B" / "ckpt").iterdir())
    assert names == ["latest", "step_00000002", "step_00000004"]


def test_tensorboard_scalars_after_a_run(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_search.train.sft import TB_TAGS

    acc = EventAccumulator(str(runs["root"] / "A" / "run" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert set(TB_TAGS.values()) | {"train/consumed_tokens"} <= tags
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert losses == pytest.approx(runs["straight"]["losses"], rel=1e-6)  # event files store float32
    lrs = [e.value for e in acc.Scalars("train/lr")]
    assert lrs[0] == pytest.approx(3e-3) and lrs[-1] == pytest.approx(1e-4)  # warmup 1 step, cosine to min_lr
