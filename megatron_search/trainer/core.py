"""The trainer core shared by SFT and GRPO: model, DDP, optimizer, LR schedule, one step, save/load.

    ctx = init_distributed(cfg)                      # megatron_search.distributed
    trainer = Trainer(cfg, ctx, total_steps=cfg.sft.steps)
    extra = trainer.resume()                         # {} on a fresh run; else the `extra` saved last
    while trainer.iteration < total_steps:
        batch = trainer.dp_slice(global_batch)       # this DP rank's share (a step.Batch)
        m = trainer.step(batch, loss_fn, micro_batch_size)
        # m: {"loss", "grad_norm", "lr", "tokens", "step_time_s", "tokens_per_s"} (same on every rank),
        #    plus "mtp_loss" (the unscaled MTP cross entropy) with model.mtp
        if trainer.should_save(): trainer.save(extra={"sampler": ...})

API (kept stable for train/sft.py and train/grpo.py):
- `Trainer(cfg, ctx, total_steps, train_mtp=True, routing_replay=False, variable_shapes=False)`: builds this rank's model chunks (models/provider.py),
  wraps them in Megatron DDP and builds Megatron's optimizer (distributed optimizer where Megatron
  supports it: on GPU; gloo lacks reduce_scatter) -- all through trainer/step.py. With
  model.mtp on, `train_mtp=False` (GRPO) freezes the MTP layer before the DDP wrap: no gradients,
  no optimizer state, weights kept exactly as loaded (models/mtp.py).
  `trainer.model` = unwrapped chunks, `trainer.ddp` = DDP chunks, `trainer.optimizer`.
- `step(batch, loss_fn=token_mean_ce, micro_batch_size=None)`: sets the LR for this step
  (trainer/lr.py, a pure function of `iteration`), runs Megatron's pipeline schedule over
  microbatches of `batch` and one optimizer step (grad clipping by cfg.optim.clip_grad).
  `loss_fn(output, batch) -> (loss, {"loss": detached})` gets the model output for one
  microbatch: with labels, GPTModel returns per-token cross entropy [B, S] (= -log p(label)),
  so a policy-gradient loss reads the token log-probs as `-output`. A `batch` may be any
  step.Batch subclass that slices its extra per-sequence tensors in `slice()`.
  Returned `tokens` = global count of loss tokens (loss_mask sum, or every label).
- `save(extra=None) -> Path`: a complete checkpoint of the run (trainer/checkpoint.py): Megatron
  distributed checkpoint of model + optimizer, RNG states of every rank, iteration, consumed
  tokens, the LR schedule's parameters, `extra` (JSON: the data sampler's position, ...) and
  the resolved config. Atomic and keep-last-N through trainer/checkpoint_dir.py.
- `load(path) -> extra` / `resume() -> extra`: restore all of it (resume: from the latest
  checkpoint under the checkpoint root when cfg.checkpoint.resume, else {}).
- `should_save()`: iteration is a multiple of cfg.checkpoint.save_interval.
- `apply_lr() -> lr`: set the LR of the current iteration (for loops that call the optimizer
  themselves, e.g. several GRPO updates per batch; `step` calls it).
- Weights only from a checkpoint: `trainer/sharded_state.load_model(trainer.model, ckpt / "model_optim")`.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import torch

from megatron_search.config.loader import ConfigError
from megatron_search.config.model import resolve_repo_path, weights_format
from megatron_search.config.schema import training_problems
from megatron_search.distributed import collectives as coll
from megatron_search.models.mtp import freeze_mtp
from megatron_search.models.provider import build_model_chunks, sync_params
from megatron_search.trainer.step import (
    Batch,
    data_parallel_slice,
    make_optimizer,
    mtp_loss_of_step,
    token_mean_ce,
    train_step,
    wrap_ddp,
)

from .checkpoint import load_run, save_run
from .checkpoint_dir import latest_checkpoint
from .lr import lr_from_config


def checkpoint_root(cfg) -> Path:
    """cfg.checkpoint.dir, or <run.output_dir>/checkpoints."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run.output_dir) / "checkpoints"


class Trainer:
    """Megatron model + optimizer + schedule for one run; see the module docstring for the API."""

    def __init__(self, cfg, ctx, total_steps: int, train_mtp: bool = True, routing_replay: bool = False,
                 variable_shapes: bool = False):
        if total_steps < 1:
            raise ValueError(f"Trainer: total_steps must be >= 1, got {total_steps}")
        problems = training_problems(cfg)  # also checked when the config is loaded for a stage
        if problems:
            raise ConfigError(problems, "Trainer")
        self.cfg, self.ctx, self.total_steps = cfg, ctx, total_steps
        self.model = build_model_chunks(cfg, ctx.groups, routing_replay, variable_shapes)
        self.train_mtp = train_mtp
        if not train_mtp:
            freeze_mtp(self.model)
        self.ddp = wrap_ddp(cfg, self.model, self.model[0].config)
        self.optimizer = make_optimizer(cfg, self.ddp)
        self.iteration = 0  # optimizer steps taken so far (the next step uses the LR of `iteration`)
        self.consumed_tokens = 0  # global loss tokens trained on so far
        self.root = checkpoint_root(cfg)
        self.resumed_from: Optional[Path] = None  # the checkpoint resume() loaded, if any

    # ------------------------------------------------------------------ stepping
    @property
    def current_lr(self) -> float:
        return lr_from_config(self.cfg.optim, self.iteration, self.total_steps)

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    def apply_lr(self) -> float:
        """Set the optimizer's LR for the step about to run (`iteration`) and return it.

        `step` does this itself; loops that drive the optimizer on their own (several updates per
        batch) call it before their updates."""
        lr = self.current_lr
        self._set_lr(lr)
        return lr

    def policy_step(self, update: Callable[[list, object], list[dict]]) -> tuple[list[dict], float]:
        """One training step driven by `update(ddp_chunks, optimizer)` (GRPO's policy update: one or several
        optimizer updates on one batch): this iteration's LR is set first, the iteration advances after.
        Returns (what `update` returned, the LR)."""
        lr = self.apply_lr()
        history = update(self.ddp, self.optimizer)
        self.iteration += 1
        return history, lr

    def skip_step(self) -> None:
        """A step that trains nothing (GRPO: no group carried signal) still counts: the iteration advances."""
        self.iteration += 1

    def dp_slice(self, global_batch: Batch) -> Batch:
        """This data-parallel rank's contiguous share of a global batch."""
        return data_parallel_slice(global_batch, self.ctx.groups)

    def _global_loss_tokens(self, batch: Batch) -> int:
        n = batch.labels.numel() if batch.loss_mask is None else batch.loss_mask.sum()
        t = torch.tensor(float(n), dtype=torch.float64)
        coll.all_reduce(t, group=self.ctx.groups.dp)
        return int(t.item())

    def step(self, batch: Batch, loss_fn: Callable = token_mean_ce, micro_batch_size: Optional[int] = None) -> dict:
        """One optimizer step on this DP rank's `batch`; returns global metrics (same on every rank)."""
        mbs = micro_batch_size or self.cfg.sft.micro_batch_size
        lr = self.apply_lr()
        t0 = time.perf_counter()
        loss, grad_norm = train_step(self.ddp, self.optimizer, batch, mbs, self.ctx.groups, loss_fn)
        tokens = self._global_loss_tokens(batch)
        dt = time.perf_counter() - t0
        self.iteration += 1
        self.consumed_tokens += tokens
        out = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens, "step_time_s": dt,
               "tokens_per_s": tokens / dt if dt > 0 else 0.0}
        if self.model[0].config.mtp_num_layers:  # model.mtp: what Megatron added (x mtp_loss_scaling_factor)
            out["mtp_loss"] = mtp_loss_of_step(batch.tokens.shape[0] // mbs, self.ctx.groups)
        return out

    # ------------------------------------------------------------------ checkpoints
    def should_save(self) -> bool:
        return self.iteration > 0 and self.iteration % self.cfg.checkpoint.save_interval == 0

    def save(self, extra: Optional[dict] = None, root: Optional[Path] = None) -> Path:
        """Checkpoint the complete run state as step_<iteration> under the checkpoint root (parallel.overlap_param_gather:
        the parameters are gathered first, models.provider.sync_params)."""
        sync_params(self.ddp)
        return save_run(self, Path(root) if root else self.root, extra or {})

    def load(self, path: Path) -> dict:
        """Restore everything `save` wrote from checkpoint directory `path`; returns its `extra`."""
        return load_run(self, Path(path))

    def resume(self) -> dict:
        """When cfg.checkpoint.resume: load the run's own latest checkpoint (under the root) when it has one,
        else cfg.checkpoint.load. The run's own progress wins: a GRPO run initialised from an SFT checkpoint
        (checkpoint.load) and requeued with checkpoint.resume=true continues from its own last step, never
        from the SFT checkpoint's iteration.

        Returns the saved `extra` ({} when starting fresh, also on the first start of a run whose initial
        weights are not a run checkpoint: the caller loads those). Raises when resume is asked for but no
        checkpoint exists, so a typo in the path never silently restarts from scratch.
        """
        ck = self.cfg.checkpoint
        if not ck.resume:
            return {}
        own = latest_checkpoint(self.root) if self.root.is_dir() else None
        start = self.cfg.initial_weights_source()
        continue_load = bool(ck.load) and weights_format(resolve_repo_path(ck.load)) == "run"
        if own is None and start is not None and not continue_load:
            return {}  # a first start from model.path's weights (HF, converted, or another run's: the model only)
        source = self.root if own is not None or not ck.load else Path(ck.load)
        path = own or (source if (source / "trainer.json").is_file() else latest_checkpoint(source))
        if path is None:
            raise FileNotFoundError(f"checkpoint.resume: no complete checkpoint under {source}")
        extra = self.load(path)
        self.resumed_from = path
        return extra
