"""On-policy GRPO with token-level importance sampling (RECIPE section 3), end to end.

Per step: sample prompts from the 90/10 mix, roll out G episodes each through the search agent,
score them (r_base, preference s against the reference answer, anchored penalties, gated R),
compute group advantages, train the policy with the token-IS loss, push the new weights to the
engines. The first training rank drives the engines (train/grpo_driver.py); every rank trains, and
every rank pushes the weights it owns (train/grpo_sync.py). Colocated, the engines and the trainer
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

import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_search.models.routing_replay import moe_routers
from megatron_search.rewards.batch import compute_rewards_from_config, reward_generator
from megatron_search.rl.advantages import filtered_groups, group_advantages
from megatron_search.rl.registry import build_policy_loss
from megatron_search.rollout.launch import start_engines
from megatron_search.rollout.local import LocalEngine
from megatron_search.rollout.sglang import SGLangClient

from .batch_scatter import BatchScatter
from .grpo_colocate import ColocatedCycle
from .grpo_data import build_mix_sampler
from .grpo_driver import RolloutDriver
from .grpo_metrics import rollout_metrics
from .grpo_preference import build_preference
from .grpo_sync import build_weight_sync, save_hf_weights
from .init_weights import load_model_weights
from .metrics import MetricsWriter, format_line
from .policy_step import policy_update
from .rollout_batch import RolloutBatch, pack_rollouts
from .scoring import preference_inputs, score_rollouts
from .signals import StopRequest

REFERENCE_WEIGHTS, FINAL_WEIGHTS = "reference_weights", "final_weights"


class GRPORun:
    """Everything one GRPO run holds; `run_grpo` is the loop over it."""

    def __init__(self, cfg, ctx):
        from megatron.core import parallel_state as ps

        from .core import Trainer

        self.cfg, self.ctx = cfg, ctx
        if cfg.rollout.temperature == 0:
            raise ValueError("rollout.temperature=0 samples greedily: the G rollouts of a group would be identical "
                             "and carry no signal; GRPO needs a temperature > 0")
        self.out = Path(cfg.run.output_dir)
        self.is_driver = dist.get_rank() == 0
        # MTP (model.mtp) stays out of the RL loss, a fixed choice (docs/QWEN3_5_LAYOUT.md): the RL objective is
        # the token-IS loss on the main head; the MTP layer is frozen, still loaded and synced (the engine's draft).
        self.trainer = Trainer(cfg, ctx, total_steps=cfg.grpo.steps, train_mtp=False)
        self.dp = ps.get_data_parallel_world_size()
        self.policy_loss = build_policy_loss(cfg.grpo)
        self.stop = StopRequest()
        self.driver = self.sampler = None
        self.writer = MetricsWriter(self.out / "tensorboard", enabled=self.is_driver and cfg.logging.tensorboard)
        extra = self.trainer.resume()
        # The reward model runs in the training layout: every rank holds its shard and scores together.
        self.preference = build_preference(cfg)
        if not extra and cfg.checkpoint.load and not cfg.checkpoint.resume:
            load_model_weights(self.trainer, cfg.checkpoint.load)  # e.g. the SFT checkpoint
        if self.is_driver:
            self._build_driver(extra)
        self.resumed = bool(extra)
        urls = _broadcast([c.base_url for c in self.driver.engines] if self.is_driver else None)
        self.weight_sync = build_weight_sync(cfg, urls, self.out)
        self.colocate = ColocatedCycle(cfg, self.trainer, self.driver, self.out, self.is_driver,
                                       reward_model_chunks=self.preference.scorer.chunks)
        self.scatter = BatchScatter(moe_layers=[layer for layer, _ in moe_routers(self.trainer.model)])

    def _build_driver(self, extra: dict) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        engines = start_engines(self.cfg, self.out / "engines")
        source = self.cfg.reference_source()
        if source == "urls":
            reference = SGLangClient(self.cfg.grpo.reference_urls[0])
        elif source == "in_process":  # the frozen initial policy, in process (loads the first sync's checkpoint)
            reference = LocalEngine.from_config(self.cfg)
        else:  # rollout_engines: answered up front by the rollout engines (make_batch's first step)
            reference = None
        self.driver = RolloutDriver(self.cfg, self.out, engines, reference)
        self.sampler = build_mix_sampler(self.cfg)
        if "sampler" in extra:
            self.sampler.load_state_dict(extra["sampler"])

    # ------------------------------------------------------------------ weights
    def sync_weights(self, first: bool, final: bool = False) -> dict[str, float]:
        """Push the policy to the engines from every rank (owner-parallel, weights/delivery.py). On a fresh
        run's first sync the initial policy is also written as an HF checkpoint (<output_dir>/reference_weights)
        and loaded by the in-process reference engine; the last sync writes the final policy (final_weights)."""
        cfg = self.cfg
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
        stats = self.weight_sync.push(self.trainer.model, cfg.model.architecture, self.ctx.groups,
                                      version=str(self.trainer.iteration))
        if final:
            save_hf_weights(self.trainer.model, cfg, self.ctx.groups, self.out / FINAL_WEIGHTS, bucket)
        sent = stats.rank_sent_bytes
        mean = sum(sent) / max(len(sent), 1)
        return {"time/weight_sync_s": time.perf_counter() - t0, "weight_sync/GB": stats.bytes / 1e9,
                "weight_sync/max_rank_sent_GB": max(sent, default=0) / 1e9,
                "weight_sync/max_over_mean": max(sent, default=0) / mean if mean else 0.0}

    # ------------------------------------------------------------------ one step
    def make_batch(self, step: int) -> tuple[Optional[RolloutBatch], dict[str, float]]:
        """Every rank: rollouts (driver) -> preference scores (all ranks, the RM is sharded like the
        policy) -> rewards, advantages, packed batch (driver). None when no group carries signal."""
        cfg, m = self.cfg, {}
        col = refs = None
        triples = None
        if self.is_driver:
            if cfg.reference_source() == "rollout_engines" and not self.driver.references_frozen:
                t = time.perf_counter()
                m["references/pregenerated"] = float(self.driver.pregenerate_references(self._upcoming_prompts(),
                                                                                        fresh=not self.resumed))
                m["time/reference_pregeneration_s"] = time.perf_counter() - t
            t0 = time.perf_counter()
            col = self.driver.collect(self.sampler.take(cfg.grpo.prompts_per_step), step)
            t1 = time.perf_counter()
            refs = self.driver.reference_answers(col.items, col.samples)  # rollout k vs reference sample k
            m["time/rollout_s"], m["time/reference_s"] = t1 - t0, time.perf_counter() - t1
            m["perf/rollouts_per_s"] = len(col.rollouts) / max(t1 - t0, 1e-9)
            m["perf/rollout_tokens_per_s"] = sum(len(r.token_ids) for r in col.rollouts) / max(t1 - t0, 1e-9)
            triples = preference_inputs(col.items, col.rollouts, refs)
        self.colocate.to_scoring(step)  # the engines are idle now: their memory goes to the reward model
        t2 = time.perf_counter()
        s = self.preference.score(*_broadcast(triples))
        if not self.is_driver:
            return None, m
        verdicts, judged = self.driver.judge_rubrics(col.items, col.rollouts)
        m.update(judged)
        scores = score_rollouts(col.items, col.rollouts, col.group_ids, refs, s, cfg.reward.answer_match, verdicts)
        rewards = compute_rewards_from_config(scores, cfg.reward, reward_generator(cfg.reward.seed, step))
        adv = group_advantages(rewards.reward.float(), scores.group_ids, std_normalize=cfg.grpo.advantage_std_normalize,
                               eps=cfg.grpo.advantage_eps, unbiased=cfg.grpo.advantage_std_unbiased)
        m["time/reward_s"] = time.perf_counter() - t2
        m.update(rewards.metrics(scores))
        m.update(rollout_metrics(col, scores, rewards, adv))
        m["rollout/failed"] = float(col.failed)
        signal = _signal_groups(adv, scores.group_ids)
        dropped = filtered_groups(scores.r_base, scores.group_ids, cfg.grpo.group_filter) & signal
        m["train/zero_signal_groups"] = float((~signal).sum())
        m["train/filtered_groups"] = float(dropped.sum())
        signal &= ~dropped
        keep = [i for i, g in enumerate(col.group_ids) if signal[g]]
        if not keep:
            return None, m
        unit = self.dp * cfg.grpo.micro_batch_size * cfg.grpo.updates_per_batch
        pad_id = self.driver.encoder.tokenizer.pad_id
        batch = pack_rollouts([col.rollouts[i] for i in keep], adv[keep].tolist(), pad_id=pad_id,
                              pad_multiple=cfg.parallel.sequence_multiple,
                              with_routed_experts=cfg.grpo.routing_replay or cfg.grpo.routing_agreement)
        padding = -len(keep) % unit
        batch = batch.pad_rows(padding, pad_id=pad_id)
        m["train/padding_rollouts"] = float(padding)
        return batch, m

    def _upcoming_prompts(self) -> list:
        """Every prompt the rest of the run will draw (a copy of the sampler walks ahead; the real one is untouched)."""
        import copy

        ahead = copy.deepcopy(self.sampler)
        steps = self.cfg.grpo.steps - self.trainer.iteration
        return [item for _ in range(steps) for item in ahead.take(self.cfg.grpo.prompts_per_step)]

    def close_sync(self) -> None:
        self.weight_sync.close()  # it owns this rank's engine clients

    def train_on(self, local: RolloutBatch) -> dict[str, float]:
        """The policy step on this data-parallel replica's slice (BatchScatter)."""
        if self.colocate.trainer_offloaded:
            raise RuntimeError("GRPO: the trainer's state is offloaded (colocated rollout phase); reload it first")

        t0 = time.perf_counter()
        lr = self.trainer.apply_lr()
        history = policy_update(self.trainer.ddp, self.trainer.optimizer, local, policy_loss=self.policy_loss,
                                aggregation=self.cfg.grpo.loss_aggregation,
                                micro_batch_size=self.cfg.grpo.micro_batch_size,
                                updates=self.cfg.grpo.updates_per_batch, replay=self.cfg.grpo.routing_replay,
                                temperature=training_temperature(self.cfg.rollout))
        self.trainer.iteration += 1
        dt = time.perf_counter() - t0
        out = {f"train/{k}": v for k, v in (history[-1] if history else {}).items()}
        if len(history) > 1:  # several updates: also the first one's drift from pi_old (0 there: pi_theta is pi_old)
            out.update({f"train/first_update/{k}": v for k, v in history[0].items() if k.startswith("policy_")})
        out["train/lr"] = lr
        out["time/train_s"] = dt
        out["perf/train_tokens_per_s"] = float(local.mask_BS.sum()) * self.dp / max(dt, 1e-9)  # DP slices: even
        return out


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
    box = [obj]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=src)
    return box[0]


def run_grpo(cfg) -> dict[str, float]:
    """The GRPO loop; returns the last step's metrics."""
    from megatron_search.distributed import init_distributed

    ctx = init_distributed(cfg)
    run = GRPORun(cfg, ctx)
    last: dict[str, float] = {}
    try:
        sync = run.sync_weights(first=True)
        while run.trainer.iteration < cfg.grpo.steps and not run.stop.requested:
            step = run.trainer.iteration
            run.colocate.to_rollout(step)
            batch, metrics = run.make_batch(step)
            batch, scattered = run.scatter.scatter(batch)
            metrics.update(scattered)
            if batch is not None:
                run.colocate.to_train(step)
                metrics.update(run.train_on(batch))
            else:
                run.trainer.iteration += 1  # no signal: no update, but the step is spent
            run.colocate.to_sync(step)
            sync = run.sync_weights(first=False, final=run.trainer.iteration >= cfg.grpo.steps)
            run.colocate.after_sync(step)
            metrics.update(sync)
            metrics.update(run.colocate.metrics)
            last = metrics
            if run.is_driver:
                run.writer.scalars(step, metrics)
                if step % cfg.logging.log_interval == 0:
                    print(format_line(step, metrics, ["reward/mean", "reward/r_base", "reward/tool_calls",
                                                      "train/loss", "train/grad_norm", "train/mismatch_kl_k3",
                                                      "time/rollout_s", "time/train_s"]), flush=True)
            if run.trainer.should_save():
                run.colocate.ensure_resident()  # gradients and optimizer state left for the push
                run.trainer.save(extra=_broadcast(_driver_extra(run)))
        run.colocate.ensure_resident()
        if run.stop.requested:
            run.trainer.save(extra=_broadcast(_driver_extra(run)))
            if run.is_driver:
                print(f"grpo: signal {run.stop.signum}: checkpoint saved at step {run.trainer.iteration}", flush=True)
    finally:
        run.writer.close()
        run.close_sync()
        if run.driver is not None:
            run.driver.close()
        run.stop.restore()
        ctx.teardown()
    return last


def _driver_extra(run: GRPORun) -> dict:
    return {"sampler": run.sampler.state_dict()} if run.is_driver else {}
