"""SFT warm-up (RECIPE 2): next-token loss on assistant tokens of chat examples, on Megatron-Core.

    for each step: global batch from the weighted mix (train/sft_data.py) -> this DP rank's rows
                   -> Trainer.step (pipeline schedule, grad clip, LR schedule) -> TensorBoard
                   -> checkpoint every save_interval steps, at the end, and on SIGTERM/SIGUSR1

Every rank builds the same global batch from the same seed and keeps its DP share, so no data
moves between ranks. A preemption signal sets a flag; the ranks agree on it after the step
(all-reduce), save a checkpoint with the data position and return cleanly. With
checkpoint.resume=true the run continues from the latest checkpoint exactly where it stopped.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_search.chat.tokenizer import ChatEncoder
from megatron_search.data.jsonl import append_jsonl, read_jsonl
from megatron_search.distributed import collectives as coll, init_distributed
from megatron_search.trainer.core import Trainer
from megatron_search.trainer.metrics import MetricsWriter, format_line
from megatron_search.trainer.signals import StopRequest

from .initial_weights import load_initial_weights
from .sft_data import SFTBatcher, chat_format_for, load_sft_datasets, tokenizer_for
from .skill_check import SkillCheck

log = logging.getLogger(__name__)
TB_TAGS = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "step_time_s": "time/step_s",
}


def build_batcher(cfg):
    s = cfg.sft
    return SFTBatcher(load_sft_datasets(s.datasets), s.datasets, tokenizer_for(cfg.model), chat_format_for(cfg.model),
                      s.seq_length, s.global_batch_size, s.packing, cfg.run.seed,
                      trim_multiple=cfg.parallel.sequence_multiple if s.trim_padding else None)


def _agree_stop(requested: bool) -> bool:
    """True on every rank when any rank got a stop signal (ranks see signals at different times)."""
    flag = torch.tensor([1 if requested else 0], dtype=torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        coll.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def build_skill_check(cfg):
    """The sft.skill_check of this run (None when unset), with the run's tokenizer and chat format."""
    if not cfg.sft.skill_check.path:
        return None
    return SkillCheck(cfg, ChatEncoder(tokenizer_for(cfg.model), chat_format_for(cfg.model)))


def _agreed_min(value: float) -> float:
    """The smallest of every rank's `value`: the ranks decide to stop together."""
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        coll.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def _skill_reached_at(log_path: Path) -> int:
    """The step at which an earlier run of this output_dir reached its skill threshold (0: never)."""
    if not log_path.exists():
        return 0
    reached = [r["iteration"] for r in read_jsonl(log_path) if r.get("reached")]
    return reached[-1] if reached else 0


def run_sft(cfg, env=None, on_step: Optional[Callable[[int, dict], None]] = None,
            on_start: Optional[Callable[[object], None]] = None) -> dict:
    """Train cfg.sft.steps steps (or until a stop signal); returns a summary.

    `env`: the process placement (distributed.env.DistEnv; default: read torchrun/Slurm variables).
    `on_start(trainer)` runs once the model is built (and resumed); `on_step(iteration, metrics)`
    after each step; both on every rank (progress hooks, tests).
    Summary: {"iterations": [...], "losses": [...], "grad_norms": [...], "stopped": bool,
    "checkpoint": path of the last checkpoint written (or None), "truncated": examples cut, "rank",
    "skill_checks": [{"iteration", "accuracy", "reached", "misses": the first few {"expected", "got"}}],
    "skill_reached": set when sft.skill_check ended the run (checkpoint saved; the checks are also in
    <output_dir>/skill_checks.jsonl)}.
    """
    ctx = init_distributed(cfg, env=env, stage="sft")  # batch sizes against the real data-parallel size
    stop = StopRequest()
    writer = None
    try:
        batcher = build_batcher(cfg)
        trainer = Trainer(cfg, ctx, total_steps=cfg.sft.steps)
        extra = trainer.resume()
        if extra:
            batcher.load_state_dict(extra["data"])
        elif trainer.resumed_from is None:  # a fresh start
            load_initial_weights(trainer, cfg, ctx.groups)  # the pretrained model, or a previous SFT stage
        if on_start is not None:
            on_start(trainer)
        out = Path(cfg.run.output_dir)
        writer = MetricsWriter.for_run(cfg, out, ctx.is_main)
        summary = {"iterations": [], "losses": [], "grad_norms": [], "stopped": False, "checkpoint": None,
                   "rank": ctx.rank, "skill_checks": []}
        check = build_skill_check(cfg)
        checks_log = out / "skill_checks.jsonl"
        if check is not None and _skill_reached_at(checks_log) == trainer.iteration > 0:
            return {**summary, "skill_reached": True}  # a resumed run whose skill was reached: nothing to do
        bar = tqdm(total=cfg.sft.steps, initial=trainer.iteration, desc="sft", unit="step",
                   disable=not (ctx.is_main and cfg.logging.progress_bars))
        saved_at = None
        while trainer.iteration < cfg.sft.steps:
            m = trainer.step(trainer.dp_slice(batcher.next_batch()))
            it = trainer.iteration
            summary["iterations"].append(it)
            summary["losses"].append(m["loss"])
            summary["grad_norms"].append(m["grad_norm"])
            if it % cfg.logging.log_interval == 0:
                values = {tag: m[k] for k, tag in TB_TAGS.items()}
                if "mtp_loss" in m:  # model.mtp: the MTP head's own cross entropy (token t+2)
                    values["train/mtp_loss"] = m["mtp_loss"]
                values["train/consumed_tokens"] = trainer.consumed_tokens
                writer.scalars(it, values)
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{m['lr']:.2e}")
            if on_step is not None:
                on_step(it, m)
            reached = False
            if check is not None and (check.due(it) or it == cfg.sft.steps):  # the cap's step is always checked
                acc, misses = check.grade(trainer.model[0])
                acc = _agreed_min(acc)
                reached = acc >= cfg.sft.skill_check.threshold
                summary["skill_checks"].append({"iteration": it, "accuracy": acc, "reached": reached, "misses": misses})
                writer.scalars(it, {"train/skill_check_accuracy": acc})
                if ctx.is_main:
                    append_jsonl(checks_log, summary["skill_checks"][-1])
                    bar.write(f"skill check at step {it}: {100 * acc:.1f}% exact "
                              f"(threshold {100 * cfg.sft.skill_check.threshold:.0f}%)" + ("; done" if reached else ""))
            stopping = _agree_stop(stop.requested)
            if trainer.should_save() or stopping or reached or it == cfg.sft.steps:
                summary["checkpoint"] = str(trainer.save(extra={"data": batcher.state_dict()}))
                saved_at = it
            if reached:
                summary["skill_reached"] = True
                break
            if stopping:
                summary["stopped"] = True
                if ctx.is_main:
                    bar.write(f"stop signal received: saved step {saved_at}, exiting")
                break
        bar.close()
        if ctx.is_main and summary["losses"]:
            log.info(format_line(trainer.iteration, {"loss": summary["losses"][-1]}, ["loss"]))
        summary["truncated"] = batcher.truncated
        return summary
    finally:
        if writer is not None:
            writer.close()
        stop.restore()
        ctx.teardown()
