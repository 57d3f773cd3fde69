"""GRPO visibly learns (issue 21), through the real loop: the local engine server over SGLang's HTTP API, the
agent loop, the gated reward, the token-IS loss with pi_old (grpo.updates_per_batch=2), Megatron's step and
the weight sync every step.

A tiny Qwen3-MoE is SFT-trained from scratch to answer "yes" or "no", 50/50, to questions whose correct answer
is always "yes" (tests/_grpo_learning.py), so GRPO can only sharpen a choice the policy already makes half the
time, and that choice carries over to questions it never saw. GRPO must raise the "yes" rate on held-out
questions from about 50% to at least 85%; a control run at learning rate 0 with the same seeds must stay
within sampling noise. The same two runs carry two exact checks: the first of the two updates per batch
sees pi_theta == pi_old (drift exactly 0), and at step 0 the IS weight pi_old / mu_infer is 1 within the
train-inference mismatch tolerance. A sign error, stale engine weights or a broken IS ratio fails one of these.
"""
import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(Path(__file__).parent))

SEED = 3
GRPO_STEPS = 12
GRPO_LR = 2e-3
SFT_STEPS, SFT_LR = 40, 3e-3
# Per-token bound on |log(pi_old / mu_infer)| for Megatron and the transformers engine on the same fp32
# weights (measured here: ~2e-6); a misaligned, stale or mis-tempered logprob is off by 1e-2 and more.
MISMATCH_TOL = 1e-3


def binomial_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.25 / n) / n)  # floor: a rate at 0 or 1 still has sampling noise


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every TensorBoard scalar of a run: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    return {t: {e.step: e.value for e in ea.Scalars(t)} for t in ea.Tags()["scalars"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """SFT -> reward model -> GRPO and its lr = 0 control (one spawned process), then the held-out rates of
    the SFT policy (GRPO's initial weights), the GRPO policy and the control's final policy."""
    import _grpo_learning as g
    from _mp import run_spawned

    root = tmp_path_factory.mktemp("grpo_learns")
    fx = g.build(root, seed=SEED)
    plan = {"sft": g.sft_overrides(fx, SFT_STEPS, SFT_LR, SEED), "rm": g.rm_args(fx), "threads": 2,
            "grpo": [(name, g.grpo_overrides(fx, name, GRPO_STEPS, lr, SEED)) for name, lr in
                     (("grpo", GRPO_LR), ("control", 0.0))]}
    run_spawned(g.pipeline_worker, 1, fx, plan)
    rates = {"sft": g.rewarded_rate(fx, root / "grpo" / "reference_weights", seed=SEED),
             "grpo": g.rewarded_rate(fx, root / "grpo" / "final_weights", seed=SEED),
             "control": g.rewarded_rate(fx, root / "control" / "final_weights", seed=SEED)}
    print("held-out rewarded rates:", {k: round(v["rewarded"], 3) for k, v in rates.items()})
    return {"root": root, "rates": rates, "grpo": scalars(root / "grpo"), "control": scalars(root / "control")}


def test_grpo_raises_the_rewarded_rate_on_held_out_questions(runs):
    sft, grpo = runs["rates"]["sft"], runs["rates"]["grpo"]
    assert 0.3 <= sft["rewarded"] <= 0.7, sft  # the SFT policy makes the rewarded choice about half the time
    assert grpo["rewarded"] >= 0.85, (sft, grpo)
    # on the training prompts too, from the engine's own samples: the last half of the run against the control's
    half = range(GRPO_STEPS // 2, GRPO_STEPS)
    learned = sum(runs["grpo"]["reward/r_base"][s] for s in half) / len(half)
    control = sum(runs["control"]["reward/r_base"][s] for s in half) / len(half)
    assert learned >= control + 0.25, (learned, control)


def test_lr0_control_stays_within_noise(runs):
    """Same seeds, learning rate 0: every step runs (rollouts, reward, loss, optimizer, sync), nothing moves."""
    import _grpo_learning as g
    import torch
    from safetensors.torch import load_file

    sft, control = runs["rates"]["sft"], runs["rates"]["control"]
    assert abs(control["rewarded"] - sft["rewarded"]) <= 3 * binomial_se(sft["rewarded"], sft["n"]), (sft, control)
    r_base = runs["control"]["reward/r_base"]
    assert len(r_base) == GRPO_STEPS
    first = [r_base[s] for s in range(GRPO_STEPS // 2)]
    last = [r_base[s] for s in range(GRPO_STEPS // 2, GRPO_STEPS)]
    n_half = len(last) * g.PROMPTS_PER_STEP * g.GROUP_SIZE  # rollouts
    p = sum(first + last) / GRPO_STEPS
    assert abs(sum(last) / len(last) - sum(first) / len(first)) <= 3 * math.sqrt(2) * binomial_se(p, n_half), r_base
    assert runs["control"]["train/lr"] and all(v == 0.0 for v in runs["control"]["train/lr"].values())
    before = load_file(runs["root"] / "control" / "reference_weights" / "model.safetensors")
    after = load_file(runs["root"] / "control" / "final_weights" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def trained_steps(m: dict) -> list[int]:
    """Steps that took an optimizer step (a step whose groups all got one reward has no signal and no update)."""
    return sorted(m["train/loss"])


def first_update(m: dict, tag: str) -> dict[int, float]:
    """The first update's value of a policy-drift metric per trained step: logged under train/first_update/ when
    both updates ran; a step whose second half held only padding took one update, logged as train/<tag>."""
    out = dict(m[f"train/{tag}"])
    out.update(m.get(f"train/first_update/{tag}", {}))
    return out


@pytest.mark.parametrize("run", ["grpo", "control"])
def test_first_of_two_updates_sees_pi_old_exactly(runs, run):
    m = runs[run]
    steps = trained_steps(m)
    assert len(steps) >= GRPO_STEPS // 2, steps
    for tag in ("policy_kl_k1", "policy_kl_k3", "policy_log_ratio_abs_max"):
        values = first_update(m, tag)
        assert sorted(values) == steps and all(v == 0.0 for v in values.values()), (tag, values)
    two = sorted(m.get("train/first_update/policy_kl_k3", {}))
    assert len(two) >= GRPO_STEPS // 4, two  # both updates ran on most trained steps
    moved = [m["train/policy_log_ratio_abs_max"][s] for s in two]  # the second update's drift
    if run == "grpo":  # the metric sees a moved policy: after the first update pi_theta != pi_old
        assert max(moved) > 1e-3, moved
    else:
        assert all(v == 0.0 for v in moved), moved


@pytest.mark.parametrize("run", ["grpo", "control"])
def test_is_ratio_is_one_at_step_0_and_after_every_sync(runs, run):
    """w = pi_old / mu_infer per token. At step 0 the engine holds the SFT weights the first sync pushed, later
    the weights of every update: a stale engine would drift away from the trainer from step 1 on."""
    m = runs[run]
    steps = trained_steps(m)
    assert len(steps) >= GRPO_STEPS // 2, steps
    assert steps[0] == 0 and abs(m["train/is_weight_mean"][0] - 1.0) <= MISMATCH_TOL, m["train/is_weight_mean"]
    for s in steps:
        lo, hi = m["train/is_weight_min"][s], m["train/is_weight_max"][s]
        assert math.exp(-MISMATCH_TOL) <= lo <= hi <= math.exp(MISMATCH_TOL), (s, lo, hi)
