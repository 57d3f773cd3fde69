"""Train the preference reward model with the symmetric Bradley-Terry loss (RECIPE 5.1).

    trainer = RMTrainer(cfg, ctx)              # policy backbone (+ rm.init_from) and a value head
    result = train_rm(trainer, train_pairs, eval_pairs, encoder, pad_id)

Every step takes `rm.global_batch_pairs` pairs (each two rows, see rm/scorer.py), the same on
every rank, and slices them over data parallelism; the order is a seeded permutation per epoch,
a pure function of the step, so a resumed run sees the same pairs as an uninterrupted one.
Logged to TensorBoard: rm/loss, rm/accuracy, rm/margin (training batch), rm/grad_norm, rm/lr and
rm/eval_{loss,accuracy,margin} on the held-out pairs. Checkpoints: the trainer core's complete
run state (trainer/core.py) every checkpoint.save_interval steps and at the end.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Optional, Sequence

import torch
from tqdm import tqdm

from megatron_search.distributed import collectives as coll

from megatron_search.rewards.bradley_terry import debiased_delta, symmetric_bt_loss
from megatron_search.trainer.checkpoint import MODEL_OPTIM, read_trainer_meta
from megatron_search.trainer.core import Trainer, checkpoint_root
from megatron_search.trainer.init_weights import resolve_checkpoint
from megatron_search.trainer.metrics import MetricsWriter, format_line
from megatron_search.trainer.sharded_state import load_model
from megatron_search.trainer.signals import StopRequest
from megatron_search.trainer.step import make_optimizer, wrap_ddp

from .data import PreferencePair
from .model import build_reward_model_chunks, init_from_policy, values_at
from .sbs import evaluate_pairs
from .scorer import PairEncoder, RMScorer, make_batch, pair_deltas


class RMTrainer(Trainer):
    """The trainer core (DDP, optimizer, LR schedule, checkpoints) around reward-model chunks."""

    def __init__(self, cfg, ctx, total_steps: Optional[int] = None):
        total_steps = total_steps or cfg.rm.steps
        if total_steps < 1:
            raise ValueError(f"RMTrainer: total_steps must be >= 1, got {total_steps}")
        self.cfg, self.ctx, self.total_steps = cfg, ctx, total_steps
        self.model = build_reward_model_chunks(cfg, ctx.groups)
        self.init_note = "random init"
        if cfg.rm.init_from:
            self.init_note = init_from_policy(self.model, cfg, cfg.rm.init_from, ctx.groups)
        self.ddp = wrap_ddp(cfg, self.model, self.model[0].config)
        self.optimizer = make_optimizer(cfg, self.ddp)
        self.iteration = 0
        self.consumed_tokens = 0
        self.root = checkpoint_root(cfg)


def rm_checkpoint(path: str | Path, kind: Optional[str] = None) -> tuple[Path, dict]:
    """(step dir, trainer.json) of the RM checkpoint at or under `path`, checked before any model is built.

    `kind`: the scorer kind the caller will use; a checkpoint trained as the other kind is an error
    (a pointwise head read as a pairwise Delta, or vice versa, gives meaningless scores)."""
    try:
        ckpt = resolve_checkpoint(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"rm.load: no complete RM checkpoint at or under {path}") from None
    meta = read_trainer_meta(ckpt)
    trained = meta.get("extra", {}).get("kind")
    if kind is not None and trained is not None and trained != kind:
        raise ValueError(f"rm.load: {ckpt} is a {trained} reward model but reward.scorer={kind}; "
                         f"set reward.scorer={trained}")
    return ckpt, meta


def load_rm_weights(chunks: list, path: str | Path, kind: Optional[str] = None) -> Path:
    """Load a trained RM checkpoint's model weights (not the optimizer) into `chunks`; returns the step dir."""
    ckpt, meta = rm_checkpoint(path, kind)
    if meta["num_chunks"] != len(chunks):
        raise ValueError(f"rm.load: {ckpt} has {meta['num_chunks']} model chunk(s), this layout builds {len(chunks)}")
    load_model(chunks, ckpt / MODEL_OPTIM)
    return ckpt


def step_pairs(n: int, global_pairs: int, step: int, seed: int) -> list[int]:
    """Indices of the pairs of `step`: positions [step*G, (step+1)*G) of the per-epoch permutations."""
    out = []
    for pos in range(step * global_pairs, (step + 1) * global_pairs):
        epoch, k = divmod(pos, n)
        perm = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        out.append(perm[k])
    return out


def pairs_batch(pairs: Sequence[PreferencePair], encoder: PairEncoder, pad_id: int, seq_multiple: int):
    rows, labels = [], []
    for p in pairs:
        rows.extend(encoder.pair_rows(p.messages, p.answer_a, p.answer_b))
        labels.extend([p.label, p.label])
    return make_batch(rows, pad_id, labels, seq_multiple=seq_multiple)


def _loss_fn(kind, sink: list):
    def loss_fn(output, batch):
        v = values_at(output, batch.last_index)
        d_ab, d_ba = pair_deltas(kind, v)
        r = batch.pair_label[0::2].to(v.dtype)
        loss = symmetric_bt_loss(d_ab, d_ba, r).mean()
        signed = debiased_delta(d_ab, d_ba).detach() * (2.0 * r - 1.0)
        sink.append(torch.stack([(signed > 0).double().sum(), signed.double().sum(),
                                 torch.tensor(float(r.numel()), dtype=torch.float64)]))
        return loss, {"loss": loss.detach().clone()}

    return loss_fn


def _global_sums(parts: list, groups) -> torch.Tensor:
    """[correct, margin sum, pairs] summed over microbatches, DP ranks and (zeros off the last stage) PP."""
    t = torch.stack(parts).sum(0) if parts else torch.zeros(3, dtype=torch.float64)
    coll.all_reduce(t, group=groups.dp)
    coll.all_reduce(t, group=groups.pp)
    return t


def train_rm(trainer: RMTrainer, train_pairs: Sequence[PreferencePair], eval_pairs: Sequence[PreferencePair],
             encoder: PairEncoder, pad_id: int, progress: bool = True, log=print) -> dict:
    """Run (or resume) RM training to trainer.total_steps; returns the final metrics."""
    cfg, rm = trainer.cfg, trainer.cfg.rm
    if not train_pairs:
        raise ValueError("rm train: no training pairs")
    seq_multiple = cfg.parallel.tp if cfg.parallel.sequence_parallel else 1
    scorer = RMScorer(trainer.model, encoder, pad_id, 2 * rm.score_batch_pairs, seq_multiple, groups=trainer.ctx.groups)
    trainer.resume()
    main = trainer.ctx.is_main
    writer = MetricsWriter.for_run(cfg, cfg.run.output_dir, main)
    stop = StopRequest()
    result: dict = {"init": trainer.init_note}
    try:
        bar = tqdm(total=trainer.total_steps, initial=trainer.iteration, desc="rm train",
                   disable=not (progress and cfg.logging.progress_bars and main))
        while trainer.iteration < trainer.total_steps:
            idx = step_pairs(len(train_pairs), rm.global_batch_pairs, trainer.iteration, rm.seed)
            batch = pairs_batch([train_pairs[i] for i in idx], encoder, pad_id, seq_multiple)
            sink: list = []
            m = trainer.step(trainer.dp_slice(batch), _loss_fn(encoder.kind, sink), 2 * rm.micro_batch_pairs)
            correct, margin, n = _global_sums(sink, trainer.ctx.groups).tolist()
            scalars = {"rm/loss": m["loss"], "rm/accuracy": correct / n, "rm/margin": margin / n,
                       "rm/grad_norm": m["grad_norm"], "rm/lr": m["lr"]}
            it = trainer.iteration
            if eval_pairs and ((rm.eval_interval and it % rm.eval_interval == 0) or it == trainer.total_steps):
                ev = evaluate_pairs(scorer, eval_pairs)
                scalars.update({f"rm/eval_{k}": ev[k] for k in ("loss", "accuracy", "margin")})
                result["eval"] = ev
            writer.scalars(it, scalars)
            if main and it % cfg.logging.log_interval == 0 and not progress:
                log(format_line(it, scalars, list(scalars)))
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{correct / n:.2f}")
            bar.update(1)
            result["train"] = scalars
            if trainer.should_save() or it == trainer.total_steps or stop.requested:
                result["checkpoint"] = str(trainer.save(extra={"kind": encoder.kind}))
            if stop.requested:
                result["stopped_by_signal"] = stop.signum
                break
        bar.close()
    finally:
        stop.restore()
        writer.close()
    return result
