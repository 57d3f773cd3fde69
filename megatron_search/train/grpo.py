"""On-policy GRPO with token-level importance sampling (RECIPE section 3), end to end.

Per step: sample prompts from the 90/10 mix, roll out G episodes each through the search agent,
score them (r_base, preference s against the reference answer, anchored penalties, gated R),
compute group advantages, train the policy with the token-IS loss, push the new weights to the
engines. The first training rank drives the engines (train/grpo_driver.py); every rank trains, and
every rank pushes the weights it owns (train/grpo_sync.py). The run's state and each named step
live in train/grpo_run.py; this module is the loop. Colocated, the engines and the trainer
take turns on the memory (train/grpo_colocate.py); each data-parallel replica receives only its
slice of the batch (train/batch_scatter.py).

Groups that carry no signal (every rollout got the same reward, so every advantage is 0; this
includes groups whose rollouts all failed) are left out of the training batch: they would add
nothing to the gradient but would count in the sequence-mean denominator. `grpo.group_filter`
can leave out more groups by their correctness (none by default). The batch is then filled up to
a multiple of (DP x micro-batch x updates_per_batch) rows with padding rows (mask 0: no loss, not
counted in any denominator), so no rollout with signal is dropped; the counts are logged
(train/zero_signal_groups, train/filtered_groups, train/padding_rollouts). A step with no signal
at all takes no optimizer step but still advances the step counter.
"""
from __future__ import annotations

from megatron_search.distributed import init_distributed

from .grpo_run import GRPORun, training_temperature

__all__ = ["GRPORun", "run_grpo", "training_temperature"]


def run_grpo(cfg) -> dict[str, float]:
    """The GRPO loop (RECIPE 3); returns the last step's metrics."""
    ctx = init_distributed(cfg, stage="grpo")                # config.stage_problems at the real world size
    run = GRPORun(cfg, ctx)
    try:
        run.push_weights()                                     # the initial policy to the engines
        while not run.finished():
            step = run.begin_step()
            rollouts = run.rollouts(step) if run.is_driver else None         # G per prompt + reference answers
            run.check_capacity(step)                                          # too many lost: checkpoint, stop
            if run.stopped_after_rollouts(step):                              # a stop signal: the step's start saved
                break
            s = run.preference_scores(step, rollouts)                         # the reward model, every rank
            batch = None
            if run.is_driver:
                scores, rewards = run.rewards(step, rollouts, s)              # r_base x s - penalties
                advantages = run.advantages(scores, rewards)                  # group-relative
                batch = run.filter_and_pack(rollouts, scores, rewards, advantages)
            run.train(step, run.scatter(batch))                               # token-IS update (or a skipped step)
            run.save_if_due(step)                                             # while the engines hold no memory
            run.push_weights(step)                                            # every rank sends what it owns
            run.end_step(step)                                                # eval when due, log
        run.finish()
        return run.metrics
    finally:
        run.close()
        ctx.teardown()
