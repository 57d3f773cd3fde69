"""One GRPO run's state and its named steps; `train/grpo.py`'s `run_grpo` is the loop over them.

`GRPORun(cfg, ctx)` is the builder: trainer (resumed or initialised from an SFT checkpoint), reward
model, the first rank's rollout driver (engines, agents, reference answers, rubric judge), weight
sync, colocated turns, batch scatter, metrics writer. Each step method does one thing and says
where it runs:
  every rank    begin_step, check_capacity, preference_scores, scatter, train, push_weights, end_step, finish
  driver only   rollouts, rewards, advantages, filter_and_pack, evaluate (the first rank owns the
                engines; the others get None and do not call them)
Per-step metrics gather in `metrics` and are written by end_step.
"""
from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_search.distributed import collectives as coll
from megatron_search.distributed.init import host_group
from megatron_search.distributed.stages import size_of
from megatron_search.models.routing_replay import moe_routers
from megatron_search.plan.residency import (
    ENGINE_KV_CACHE,
    ENGINE_WEIGHTS,
    EXPORT_BUCKETS,
    POLICY_ACTIVATIONS,
    RM_ACTIVATIONS,
    Ledger,
)
from megatron_search.rewards.batch import RewardBreakdown, RolloutScores, compute_rewards_from_config, reward_generator
from megatron_search.rewards.preference import ReferenceAnswer
from megatron_search.rl.advantages import filtered_groups, group_advantages
from megatron_search.rl.registry import build_policy_loss
from megatron_search.rollout.launch import start_engines
from megatron_search.rollout.local.engine import LocalEngine
from megatron_search.rollout.sglang.client import SGLangClient
from megatron_search.rollout.vllm.client import VLLMClient
from megatron_search.trainer.core import Trainer
from megatron_search.trainer.metrics import MetricsWriter, format_line, format_progress
from megatron_search.trainer.signals import StopRequest

from .batch_scatter import BatchScatter
from .grpo_colocate import ColocatedCycle, paused_release
from .grpo_data import build_eval_items, build_mix_sampler
from .grpo_driver import Collected, RolloutDriver
from .grpo_metrics import rollout_metrics
from .grpo_preference import build_preference
from .initial_weights import load_initial_weights
from .grpo_sync import build_weight_sync, save_hf_weights
from .microbatches import Batching
from .policy_step import forward_metrics, policy_update
from .rollout_batch import RolloutBatch, pack_rollouts
from .scoring import preference_inputs, score_rollouts

REFERENCE_WEIGHTS, FINAL_WEIGHTS = "reference_weights", "final_weights"
LOGGED = ["reward/mean", "reward/r_base", "reward/tool_calls", "train/loss", "train/grad_norm", "train/entropy",
          "train/mismatch_kl_k3", "perf/rollout_tokens_per_s", "time/rollout_s", "time/train_s"]


@dataclass
class StepRollouts:
    """The driver's rollouts of one step and the reference answer each is compared with."""

    collected: Collected
    references: list[ReferenceAnswer]


class GRPORun:
    """Everything one GRPO run holds, and the steps of the loop (see the module docstring)."""

    def __init__(self, cfg, ctx):
        self.cfg, self.ctx = cfg, ctx
        self.out = Path(cfg.run.output_dir)
        self.is_driver = dist.get_rank() == 0
        self.driver = self.sampler = None
        # who holds device memory at each moment, on the driver's GPU (plan/residency.py; the planner prices it)
        self.ledger = Ledger(self.out / "residency.jsonl" if self.is_driver else None)
        released = self._start_engines()  # colocated: started and released before anything else takes the GPU
        # MTP (model.mtp) stays out of the RL loss, a fixed choice (docs/QWEN3_5_LAYOUT.md): the RL objective is
        # the token-IS loss on the main head; the MTP layer is frozen, still loaded and synced (the engine's draft).
        self.trainer = Trainer(cfg, ctx, total_steps=cfg.grpo.steps, train_mtp=False,
                               routing_replay=cfg.grpo.routing_replay, variable_shapes=True)
        self.dp = size_of(ctx.groups.dp)
        self.policy_loss = build_policy_loss(cfg.grpo)
        self.batching = Batching(rows=cfg.grpo.micro_batch_size, max_tokens=cfg.grpo.max_tokens_per_micro_batch,
                                 multiple=cfg.parallel.sequence_multiple, trim=cfg.grpo.trim_padding,
                                 min_count=4 * cfg.parallel.pp if cfg.parallel.pp > 1 else 1)
        self.stop = StopRequest()
        self.stopping = False  # a stop signal on any rank, agreed by finished()
        self._started: Optional[tuple[float, int]] = None  # (clock, step) of this run's first step
        self.capacity_error: Optional[str] = None  # driver: this step lost more than rollout.health allows
        self.check_only = False  # driver: this step's batch only checks the served weights (filter_and_pack)
        self._sampler_at_step_start: dict = {}
        self.eval_items: list = []
        self.metrics: dict[str, float] = {}
        self.writer = MetricsWriter.for_run(cfg, self.out, self.is_driver)
        extra = self.trainer.resume()
        # The reward model runs in the training layout: every rank holds its shard and scores together.
        self.preference = build_preference(cfg, ctx.groups)
        if self.trainer.resumed_from is None:  # a fresh start
            load_initial_weights(self.trainer, cfg, ctx.groups)  # the SFT checkpoint, or the pretrained model
        if self.is_driver:
            self._restore_driver(extra)
        self.resumed = bool(extra)
        urls = _broadcast([c.base_url for c in self.driver.engines] if self.is_driver else None)
        self.weight_sync = build_weight_sync(cfg, urls, self.out)
        self.colocate = ColocatedCycle(cfg, self.trainer, self.driver, self.out, self.is_driver,
                                       reward_model_chunks=self.preference.scorer.chunks, ledger=self.ledger,
                                       released=released)
        self.ledger.moment("start: trainer built")
        moe_layers = [layer for layer, _ in moe_routers(self.trainer.model)]
        self.scatter_batch = BatchScatter(ctx.groups, moe_layers=moe_layers)

    def _start_engines(self) -> dict[int, int]:
        """The driver starts (or connects to) the engines; colocated, they release their memory at once and every
        rank waits for that before building anything on the GPU (slime's order: an engine started by slurm/lib.sh
        holds mem_fraction_static of every GPU, and the trainer beside it would not fit). Returns the released
        engines ({engine: incarnation}; their memory comes back at the first push)."""
        colocated = self.cfg.rollout.mode == "colocated"
        released: dict[int, int] = {}
        if self.is_driver:
            self._build_driver()
            if colocated:
                self.ledger.arrive(ENGINE_WEIGHTS, ENGINE_KV_CACHE)
            self.ledger.moment("start: engines up")
            if colocated:
                released = self._release_at_start()
                self.ledger.moment("start: engines released")
        if colocated:
            coll.barrier(group=host_group())  # host group, long timeout: engines may take minutes to answer
        return released

    def _release_at_start(self) -> dict[int, int]:
        h = self.driver.health
        serving = {i: h.incarnation[i] for i in h.serving()}

        async def release():
            return await asyncio.gather(*(paused_release(self.driver.engines[i], ["weights", "kv_cache"])
                                          for i in serving))

        self.driver.run(release())  # an engine that cannot release at start-up stops the run: nothing has trained
        self.ledger.leave(ENGINE_WEIGHTS, ENGINE_KV_CACHE)
        return serving

    def _build_driver(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        engines = start_engines(self.cfg, self.out / "engines",
                                routed_experts=self.cfg.grpo.wants_routed_experts())
        source = self.cfg.reference_source()
        if source == "urls":
            reference = SGLangClient(self.cfg.grpo.reference_urls[0])
            if self.cfg.rollout.engine == "vllm":  # reference URLs speak the API of rollout.engine
                reference = VLLMClient(self.cfg.grpo.reference_urls[0], self.cfg.rollout.vllm.request_timeout_s)
        elif source == "in_process":  # the frozen initial policy, in process (loads the first sync's checkpoint)
            reference = LocalEngine.from_config(self.cfg)
        else:  # rollout_engines: answered up front by the rollout engines (the first step's rollouts)
            reference = None
        self.driver = RolloutDriver(self.cfg, self.out, engines, reference)

    def _restore_driver(self, extra: dict) -> None:
        """The driver's data state, once the trainer's checkpoint (if any) has been read."""
        self.sampler = build_mix_sampler(self.cfg.data)
        if "sampler" in extra:
            self.sampler.load_state_dict(extra["sampler"])
        if self.cfg.grpo.eval_interval:
            self.eval_items = build_eval_items(self.cfg)

    # ------------------------------------------------------------------ every rank
    def finished(self) -> bool:
        """The last step done, or a stop signal on any rank (agreed: ranks see a signal at different moments, and
        one rank saving while another starts a step would mismatch their collectives)."""
        self.stopping = _any_rank(self.stop.requested)
        return self.trainer.iteration >= self.cfg.grpo.steps or self.stopping

    def begin_step(self) -> int:
        """The step about to run (the trainer's iteration); colocated: the trainer leaves, the engines generate."""
        step = self.trainer.iteration
        if self._started is None:  # the console's elapsed time and ETA count from this run's first step
            self._started = (time.perf_counter(), step)
        self.metrics = {}
        self.colocate.to_rollout(step)
        return step

    def check_capacity(self, step: int) -> None:
        """Stop the run when the step lost more than rollout.health.max_lost_capacity (the driver's verdict, on every
        rank): a checkpoint of the step's start (the policy untouched, the sampler before this step's prompts, so a
        resumed run redoes the step) and an error naming the losses."""
        error = _broadcast(self.capacity_error if self.is_driver else None)
        if error is None:
            return
        if self.is_driver:
            self.writer.scalars(step, self.metrics)
        path = self._checkpoint({"sampler": self._sampler_at_step_start} if self.is_driver else {})
        raise LostCapacityError(f"{error}. Checkpoint of step {step}'s start: {path}; bring the engines back (or raise "
                                f"rollout.health.max_lost_capacity) and resume (checkpoint.resume=true)")

    def stopped_after_rollouts(self, step: int) -> bool:
        """A stop signal on any rank during the rollouts (the longest phase; Slurm's notice is shorter than a step):
        a checkpoint of the step's start (the policy untouched, the sampler before this step's prompts, so the
        resumed run redoes the step) and True: the loop ends here instead of after the step."""
        if not _any_rank(self.stop.requested):
            return False
        path = self._checkpoint({"sampler": self._sampler_at_step_start} if self.is_driver else {})
        if self.is_driver:
            print(f"grpo: stop signal during step {step}'s rollouts: checkpoint of the step's start saved at {path}",
                  flush=True)
        return True

    def preference_scores(self, step: int, ro: Optional[StepRollouts]) -> torch.Tensor:
        """s of every rollout against its reference answer, on the reward model's ranks (all of them: it is
        sharded like the policy); colocated: the engines release their memory first."""
        self.colocate.to_scoring(step)
        t0 = time.perf_counter()
        triples = preference_inputs(ro.collected.items, ro.collected.rollouts, ro.references) if ro else None
        self.ledger.arrive(RM_ACTIVATIONS)
        self.ledger.moment("scoring", step)
        s = self.preference.score(*_broadcast(triples))
        self.ledger.leave(RM_ACTIVATIONS)
        self.metrics["time/preference_s"] = time.perf_counter() - t0
        return s

    def scatter(self, batch: Optional[RolloutBatch]) -> Optional[RolloutBatch]:
        """This rank's share of the driver's batch (its DP slice, its stage's routed experts); None: no signal."""
        local, stats = self.scatter_batch.scatter(batch)
        self.metrics.update(stats)
        return local

    def train(self, step: int, local: Optional[RolloutBatch]) -> None:
        """The policy update on this replica's slice; the trainer advances its iteration (also without signal). A step
        without signal under grpo.max_mismatch_kl gets the rollouts (advantage 0) for a forward pass that checks the
        served weights, and no update."""
        check_only = _broadcast(self.check_only if self.is_driver else None)
        if local is None:
            self.trainer.skip_step()
            return
        self.colocate.to_train(step)
        if self.colocate.trainer_offloaded:
            raise RuntimeError("GRPO: the trainer's state is offloaded (colocated rollout phase); reload it first")
        if check_only:
            g = self.cfg.grpo
            metrics = forward_metrics(self.trainer.ddp, local, groups=self.ctx.groups, policy_loss=self.policy_loss,
                                      aggregation=g.loss_aggregation, batching=self.batching,
                                      replay=g.routing_replay, temperature=training_temperature(self.cfg.rollout),
                                      check_values=g.check_loss_values)
            self._check_served_weights(step, metrics)
            self.metrics["train/mismatch_kl_k3"] = metrics.get("mismatch_kl_k3", float("nan"))
            self.trainer.skip_step()
            return
        g = self.cfg.grpo
        t0 = time.perf_counter()
        self.ledger.arrive(POLICY_ACTIVATIONS)
        self.ledger.moment("train", step)
        history, lr = self.trainer.policy_step(lambda ddp, optimizer: policy_update(
            ddp, optimizer, local, groups=self.ctx.groups, policy_loss=self.policy_loss,
            aggregation=g.loss_aggregation, batching=self.batching, updates=g.updates_per_batch,
            replay=g.routing_replay, temperature=training_temperature(self.cfg.rollout),
            check_values=g.check_loss_values, norm_tokens=g.loss_norm_tokens))
        dt = time.perf_counter() - t0
        self.ledger.leave(POLICY_ACTIVATIONS)
        self._check_served_weights(step, history[0] if history else {})
        m = self.metrics
        m.update({f"train/{k}": v for k, v in (history[-1] if history else {}).items()})
        if len(history) > 1:  # several updates: also the first one's drift from pi_old (0 there: pi_theta is pi_old)
            m.update({f"train/first_update/{k}": v for k, v in history[0].items() if k.startswith("policy_")})
        m["train/lr"] = lr
        m["time/train_s"] = dt
        m["perf/train_tokens_per_s"] = float(local.mask_BS.sum()) * self.dp / max(dt, 1e-9)  # DP slices: even

    def _check_served_weights(self, step: int, first: dict) -> None:
        """grpo.max_mismatch_kl: the first update's mismatch KL compares the trainer's logprobs of this step's rollouts
        with the engine's, i.e. the weights served after the last push with the weights pushed. Every rank holds the
        same reduced value, so every rank stops alike (before a checkpoint can record the step)."""
        limit, k3 = self.cfg.grpo.max_mismatch_kl, first.get("mismatch_kl_k3")
        if limit is not None and k3 is not None and k3 > limit:
            raise RuntimeError(
                f"grpo step {step}: the engines' logprobs of the rollouts differ from the trainer's by mismatch KL "
                f"{k3:.3g} > grpo.max_mismatch_kl {limit:g}: the engines do not serve the pushed weights (a weight "
                f"update that did not take: check the engine's reload, e.g. vLLM's CPU build needs "
                f"megatron_search.rollout.vllm.launcher) or their numerics are far from the trainer's")

    def save_if_due(self, step: int) -> None:
        """A checkpoint when due and after the last step, as SFT does (every rank), taken right after the update:
        colocated, the engines hold no memory then and the trainer's state is resident, so the two never share
        the GPU for a save (the engines get their memory back at the push)."""
        if self.trainer.should_save() or self.trainer.iteration >= self.cfg.grpo.steps:
            self._checkpoint(self._driver_state())  # a step without signal left the state offloaded

    def push_weights(self, step: Optional[int] = None) -> None:
        """Push the policy to the engines from every rank (owner-parallel, weights/delivery.py). Before the
        first step (`step` None) a fresh run also writes the initial policy as an HF checkpoint
        (<output_dir>/reference_weights) for the in-process reference engine; after the last step the final
        policy is written too (final_weights). Colocated: the engines' weight memory comes back first."""
        cfg, first = self.cfg, step is None
        self.colocate.to_sync(step)  # the first push too: the engines were released at start-up
        t0 = time.perf_counter()
        bucket = cfg.weight_bucket_bytes()
        in_process_reference = cfg.reference_source() == "in_process"
        ref_dir = self.out / REFERENCE_WEIGHTS
        if first and in_process_reference and not self.resumed:
            save_hf_weights(self.trainer.model, cfg, self.ctx.groups, ref_dir, bucket)
        if first and in_process_reference and self.is_driver:
            if not (ref_dir / "config.json").is_file():
                raise FileNotFoundError(f"resume: the reference weights {ref_dir} are missing")
            self.driver.run(self.driver.reference_engine.update_weights_from_disk(str(ref_dir), "reference"))
        # engines down since the last update come back first (restarted or waited for); the push reaches every live one
        live = _broadcast(self.driver.recover_engines() if self.is_driver else None)
        self.colocate.adopt_restarted(live, step)
        self.ledger.arrive(EXPORT_BUCKETS)
        self.ledger.moment("push", step)
        stats = self.weight_sync.push(self.trainer.model, cfg.model.architecture, self.ctx.groups,
                                      version=str(self.trainer.iteration), live=live)
        self.ledger.leave(EXPORT_BUCKETS)
        if self.is_driver:
            self.driver.engines_synced(live)
            if not first:  # before the first step the counts wait for step 0's (metrics start at begin_step)
                self._engine_metrics()
        if not first and self.trainer.iteration >= cfg.grpo.steps:
            save_hf_weights(self.trainer.model, cfg, self.ctx.groups, self.out / FINAL_WEIGHTS, bucket)
        sent = stats.rank_sent_bytes
        mean = sum(sent) / max(len(sent), 1)
        self.metrics.update({"time/weight_sync_s": time.perf_counter() - t0, "weight_sync/GB": stats.bytes / 1e9,
                             "weight_sync/max_rank_sent_GB": max(sent, default=0) / 1e9,
                             "weight_sync/max_over_mean": max(sent, default=0) / mean if mean else 0.0})
        self.colocate.after_sync(step)
        if not first:
            self.metrics.update(self.colocate.metrics)

    def end_step(self, step: int) -> None:
        """Held-out evaluation when due (driver), the step's metrics (driver)."""
        g = self.cfg.grpo
        due = g.eval_interval and ((step + 1) % g.eval_interval == 0 or self.trainer.iteration >= g.steps)
        if self.is_driver and due:
            self.metrics.update(self.evaluate())
        if self.is_driver:
            self.writer.scalars(step, self.metrics)
            if step % self.cfg.logging.log_interval == 0:
                t0, first = self._started
                head = format_progress(step + 1, self.cfg.grpo.steps, time.perf_counter() - t0, step + 1 - first)
                print(format_line(step, self.metrics, LOGGED, head=head), flush=True)

    def finish(self) -> None:
        """On a stop signal, a checkpoint of where the run stopped (colocated: the engines release their memory
        first, then the trainer's state comes back)."""
        if self.stopping:  # agreed in finished(): every rank saves, whichever got the signal
            self._checkpoint(self._driver_state())
            if self.is_driver:
                print(f"grpo: stop signal: checkpoint saved at step {self.trainer.iteration}", flush=True)

    def _checkpoint(self, extra: dict) -> Path:
        """Save on every rank (`extra`: the driver's, broadcast); colocated, the engines release first and the
        trainer's state comes back: a save never shares the GPU with an engine."""
        self.colocate.to_checkpoint()
        self.ledger.moment("checkpoint save", self.trainer.iteration)
        return self.trainer.save(extra=_broadcast(extra))

    def close(self) -> None:
        try:
            self.writer.close()
            self.weight_sync.close()  # it owns this rank's engine clients
            if self.driver is not None:
                self.driver.close()
        finally:
            self.stop.restore()

    # ------------------------------------------------------------------ driver only
    def rollouts(self, step: int) -> StepRollouts:
        """G rollouts for each of the step's prompts and the reference answer each is compared with."""
        cfg, m = self.cfg, self.metrics
        if cfg.reference_source() == "rollout_engines" and not self.driver.references_frozen:
            t = time.perf_counter()
            m["references/pregenerated"] = float(self.driver.pregenerate_references(self._upcoming_prompts(),
                                                                                    fresh=not self.resumed))
            m["time/reference_pregeneration_s"] = time.perf_counter() - t
        t0 = time.perf_counter()
        self._sampler_at_step_start = self.sampler.state_dict()
        col = self.driver.collect(self.sampler.take(cfg.grpo.prompts_per_step), step)
        t1 = time.perf_counter()
        refs = self.driver.reference_answers(col.items, col.samples) if col.rollouts else []  # rollout k vs sample k
        m["time/rollout_s"], m["time/reference_s"] = t1 - t0, time.perf_counter() - t1
        m["perf/rollouts_per_s"] = len(col.rollouts) / max(t1 - t0, 1e-9)
        m["perf/rollout_tokens_per_s"] = sum(len(r.token_ids) for r in col.rollouts) / max(t1 - t0, 1e-9)
        m["rollout/count"] = float(len(col.rollouts))
        m["rollout/failed"] = m["rollout/lost"] = float(col.failed)
        m["rollout/retried"] = float(col.retried)
        self._engine_metrics()
        self.capacity_error = self._lost_capacity(step, col)
        return StepRollouts(col, refs)

    def _engine_metrics(self) -> None:
        """Engine events since the last call added to this step's (rollouts and the weight update both report)."""
        for k, v in self.driver.health.take_counts().items():
            self.metrics[k] = self.metrics.get(k, 0.0) + v
        self.metrics.update(self.driver.health.gauges())

    def _lost_capacity(self, step: int, col: Collected) -> Optional[str]:
        """Why this step must stop the run (rollout.health.max_lost_capacity), or None."""
        total = len(col.rollouts) + col.failed
        rollouts, engines = col.failed / max(total, 1), self.driver.health.lost_share()
        self.metrics["rollout/lost_capacity"] = max(rollouts, engines)
        limit = self.cfg.rollout.health.max_lost_capacity
        if col.rollouts and max(rollouts, engines) <= limit:
            return None
        return (f"GRPO step {step}: lost capacity over rollout.health.max_lost_capacity={limit:g}: {col.failed} of "
                f"{total} rollouts lost ({col.retried} retried), {len(self.driver.health.unrecovered)} of "
                f"{len(self.driver.health)} engines down after recovery ({_engine_reasons(self.driver.health)})")

    def rewards(self, step: int, ro: StepRollouts, s: torch.Tensor) -> tuple[RolloutScores, RewardBreakdown]:
        """r_base (answer match; rubrics: mechanical checks and the judge), the anchored penalties, gated R."""
        cfg, col = self.cfg, ro.collected
        t0 = time.perf_counter()
        verdicts, judged = self.driver.judge_rubrics(col.items, col.rollouts)
        self.metrics.update(judged)
        scores = score_rollouts(col.items, col.rollouts, col.group_ids, ro.references, s, cfg.reward.answer_match,
                                verdicts)
        rewards = compute_rewards_from_config(scores, cfg.reward, reward_generator(cfg.reward.seed, step))
        self.metrics["time/reward_s"] = time.perf_counter() - t0
        self.metrics.update(rewards.metrics(scores))
        return scores, rewards

    def advantages(self, scores: RolloutScores, rewards: RewardBreakdown) -> torch.Tensor:
        """Group-relative advantages of R (the fused group-advantage kernel)."""
        g = self.cfg.grpo
        return group_advantages(rewards.reward.float(), scores.group_ids, std_normalize=g.advantage_std_normalize,
                                eps=g.advantage_eps, unbiased=g.advantage_std_unbiased)

    def filter_and_pack(self, ro: StepRollouts, scores: RolloutScores, rewards: RewardBreakdown,
                        adv: torch.Tensor) -> Optional[RolloutBatch]:
        """The training batch: groups with signal that grpo.group_filter keeps, packed and padded with inert rows
        to whole (DP x micro-batch x updates) units; None when no group is left."""
        cfg, col, m = self.cfg, ro.collected, self.metrics
        m.update(rollout_metrics(col, scores, rewards, adv))
        signal = _signal_groups(adv, scores.group_ids)
        dropped = filtered_groups(scores.r_base, scores.group_ids, cfg.grpo.group_filter) & signal
        m["train/zero_signal_groups"] = float((~signal).sum())
        m["train/filtered_groups"] = float(dropped.sum())
        signal &= ~dropped
        keep = [i for i, g in enumerate(col.group_ids) if signal[g]]
        self.check_only = not keep and cfg.grpo.max_mismatch_kl is not None and bool(col.rollouts)
        if self.check_only:  # nothing to train, but the served weights are still checked: every rollout, advantage 0
            keep, adv = list(range(len(col.rollouts))), torch.zeros_like(adv)
        if not keep:
            return None
        unit = self.dp * cfg.grpo.micro_batch_size * cfg.grpo.updates_per_batch
        pad_id = self.driver.encoder.tokenizer.pad_id
        batch = pack_rollouts([col.rollouts[i] for i in keep], adv[keep].tolist(), pad_id=pad_id,
                              pad_multiple=cfg.parallel.sequence_multiple,
                              with_routed_experts=cfg.grpo.wants_routed_experts())
        padding = -len(keep) % unit
        m["train/padding_rollouts"] = float(padding)
        return batch.pad_rows(padding, pad_id=pad_id)

    def evaluate(self) -> dict[str, float]:
        """The just-pushed policy on the held-out prompts (grpo.eval_*), on the rollout engines."""
        t0 = time.perf_counter()
        out = self.driver.evaluate(self.eval_items)
        out["time/eval_s"] = time.perf_counter() - t0
        return out

    def _upcoming_prompts(self) -> list:
        """Every prompt the rest of the run will draw (a copy of the sampler walks ahead; the real one is untouched)."""
        ahead = copy.deepcopy(self.sampler)
        steps = self.cfg.grpo.steps - self.trainer.iteration
        return [item for _ in range(steps) for item in ahead.take(self.cfg.grpo.prompts_per_step)]

    def _driver_state(self) -> dict:
        return {"sampler": self.sampler.state_dict()} if self.is_driver else {}


class LostCapacityError(RuntimeError):
    """The run lost more rollouts or engines than rollout.health.max_lost_capacity allows (a checkpoint was saved)."""


def _engine_reasons(health) -> str:
    down = [f"engine {i}: {health.reason[i] or 'down'}" for i in sorted(health.unrecovered)]
    return "; ".join(down) if down else "none"


def training_temperature(rollout_cfg) -> float:
    """The temperature log pi_train is computed at: the engine's sampling temperature, because the
    engine reports logprobs of logits / T (so the IS ratio compares one distribution); 1.0 when the
    engine reports raw-logit logprobs (rollout.return_original_logprob)."""
    return 1.0 if rollout_cfg.return_original_logprob else rollout_cfg.temperature


def _signal_groups(adv: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    k = int(group_ids.max()) + 1
    nonzero = torch.zeros(k, dtype=torch.bool)
    nonzero.index_put_((group_ids,), adv != 0, accumulate=True)
    return nonzero


def _broadcast(obj, src: int = 0):
    """`obj` from rank `src` on every rank, over the host group: the other ranks wait here, off the GPU, while
    the driver works alone (rollouts, rewards, evaluation)."""
    box = [obj]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=src, group=host_group())
    return box[0]


def _any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on any (a MAX over the host group)."""
    t = torch.tensor([int(flag)], dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        coll.all_reduce(t, op=dist.ReduceOp.MAX, group=host_group())
    return bool(t.item())
