"""One Megatron training step on any layout: DDP wrapping, the optimizer, forward/backward.

The smallest complete path through Megatron-Core that a trainer needs: model chunks wrapped in
Megatron DDP (gradient buffers, DP/EP grad reduction, TP/SP norm-grad all-reduce via
finalize_model_grads), Megatron's optimizer (global grad norm across TP/PP/EP, clipping), and the
pipeline schedule from `get_forward_backward_func` (1F1B when PP > 1). The loss is a callable
on the model output so SFT / GRPO losses plug in; the default is token-mean cross entropy.

Each DP rank gets its slice of the global batch; microbatches are equal-sized so the mean of
per-microbatch means is the global token mean.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megatron_search.distributed import collectives as coll
from megatron_search.distributed.stages import is_last_stage, rank_in, size_of
from megatron_search.models.provider import attach_param_sync


@dataclass
class Batch:
    """Token ids [B, S] and next-token labels [B, S]; optional loss mask [B, S] (1 = counted)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor | None = None

    def slice(self, start: int, stop: int) -> "Batch":
        mask = None if self.loss_mask is None else self.loss_mask[start:stop]
        return Batch(self.tokens[start:stop], self.labels[start:stop], mask)

    def to(self, device) -> "Batch":
        """The same batch (of the same class: subclasses add fields) with every tensor on `device`."""
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=True) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)


def wrap_ddp(cfg, chunks: list, config) -> list:
    """Megatron DDP around each chunk and the TransformerConfig hooks the schedules call.

    parallel.overlap_grad_reduce / overlap_param_gather as Megatron-LM's training loop wires them: the schedules
    start each chunk's grad reduction (grad_sync_func) in pipeline order, and under VPP its parameter gather
    (param_sync_func, align_param_gather); without VPP each bucket's forward hook starts the next gather. With overlap_param_gather the
    parameters are stale after optimizer.step() until the next forward gathers them: every reader outside a
    forward (checkpoint save, weight export) calls models.provider.sync_params first."""
    p = cfg.parallel
    overlap_gather = bool(p.overlap_param_gather) and distributed_optimizer_enabled(p)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bool(p.overlap_grad_reduce),
        overlap_param_gather=overlap_gather,
        # aligned gathers are dispatched by the interleaved schedule only (param_sync_func); without VPP each
        # bucket's forward hook must start the next one, as Megatron-LM's arguments.py sets it
        align_param_gather=overlap_gather and p.vpp is not None,
        use_distributed_optimizer=distributed_optimizer_enabled(p),
        check_for_nan_in_grad=True,
    )
    wrapped = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]
    one = len(wrapped) == 1
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = wrapped[0].no_sync if one else [m.no_sync for m in wrapped]
    if ddp_config.overlap_grad_reduce:
        config.grad_sync_func = wrapped[0].start_grad_sync if one else [m.start_grad_sync for m in wrapped]
    if overlap_gather and ddp_config.align_param_gather:
        config.param_sync_func = wrapped[0].start_param_sync if one else [m.start_param_sync for m in wrapped]
    if overlap_gather:
        for chunk, ddp in zip(chunks, wrapped):
            attach_param_sync(chunk, partial(ddp.start_param_sync, force_sync=True))
    return wrapped


def distributed_optimizer_enabled(parallel) -> bool:
    """A ParallelConfig's distributed_optimizer switch."""
    return bool(parallel.distributed_optimizer)


def make_optimizer(cfg, ddp_chunks: list):
    """Megatron Adam from cfg.optim (separate expert / dense groups, grad clipping, fp32 master if bf16)."""
    o, m = cfg.optim, cfg.model
    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=m.params_dtype == "bfloat16",
        fp16=m.params_dtype == "float16",
        params_dtype=getattr(torch, m.params_dtype),
        use_distributed_optimizer=distributed_optimizer_enabled(cfg.parallel),
        overlap_param_gather=bool(cfg.parallel.overlap_param_gather) and distributed_optimizer_enabled(cfg.parallel),
    )
    return get_megatron_optimizer(ocfg, ddp_chunks)


def token_mean_ce(output: torch.Tensor, batch: Batch):
    """GPTModel with labels returns per-token CE [B, S]; average over counted tokens."""
    losses = output.float()
    if batch.loss_mask is None:
        loss = losses.mean()
    else:
        mask = batch.loss_mask.float()
        loss = (losses * mask).sum() / mask.sum().clamp(min=1.0)
    # clone: the schedule divides the returned loss in place by the number of microbatches.
    return loss, {"loss": loss.detach().clone()}


def forward_backward(
    chunks: list,
    microbatches: Iterable[Batch],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    loss_fn: Callable = token_mean_ce,
    forward_only: bool = False,
) -> list[dict]:
    """Run Megatron's schedule over the microbatches; returns the last stage's loss dicts."""
    def forward_step(data_iterator, model):
        b: Batch = next(data_iterator).to(next(model.parameters()).device)  # host until here
        s = b.tokens.shape[1]
        position_ids = torch.arange(s, device=b.tokens.device).unsqueeze(0).expand_as(b.tokens)
        extra = {}
        if getattr(getattr(model, "config", None), "mtp_num_layers", None):
            # Megatron's MTP loss reads loss_mask (rolled by one): the MTP head trains on the tokens the
            # main loss counts, not on prompts and padding (its default is every token).
            extra["loss_mask"] = b.loss_mask
        output = model(b.tokens, position_ids, None, labels=b.labels, **extra)
        return output, partial(loss_fn, batch=b)

    items = list(microbatches)
    iterators = iter(items) if len(chunks) == 1 else [iter(items) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def train_step(ddp_chunks: list, optimizer, batch: Batch, micro_batch_size: int, groups,
               loss_fn: Callable = token_mean_ce) -> tuple[float, float]:
    """One optimizer step on this DP rank's `batch`; returns (global mean loss, global grad norm).

    The loss is averaged over microbatches, then over the DP ranks of `groups` (identical on every rank).
    """
    for m in ddp_chunks:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    n = batch.tokens.shape[0]
    if n % micro_batch_size:
        raise ValueError(f"train_step: batch of {n} sequences is not a multiple of micro_batch_size={micro_batch_size}")
    num_mb = n // micro_batch_size
    mbs = [batch.slice(i * micro_batch_size, (i + 1) * micro_batch_size) for i in range(num_mb)]
    out = forward_backward(ddp_chunks, mbs, num_mb, batch.tokens.shape[1], micro_batch_size, loss_fn)
    ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise FloatingPointError("optimizer step skipped (non-finite gradients)")
    loss = torch.zeros((), dtype=torch.float64)
    if is_last_stage(groups):
        loss += sum(float(d["loss"]) for d in out) / num_mb
    # Every rank reports the same value: average over DP on the last stage, then share across PP.
    coll.all_reduce(loss, group=groups.dp)
    loss /= size_of(groups.dp)
    coll.all_reduce(loss, group=groups.pp)
    return float(loss), float(grad_norm)


def mtp_loss_of_step(num_microbatches: int, groups) -> float:
    """The MTP loss of the training forwards since the last call (Megatron's MTP loss tracker: masked
    token-mean cross entropy of token t+2 per micro-batch, first MTP layer), averaged over micro-batches
    and DP ranks and the same on every rank; the tracker is cleared. 0.0 when no MTP forward ran."""
    tracker = MTPLossLoggingHelper.tracker
    loss = torch.zeros((), dtype=torch.float64)
    if "values" in tracker:
        loss += float(tracker["values"][0]) / num_microbatches
        tracker["values"].zero_()
    coll.all_reduce(loss, group=groups.dp)
    loss /= size_of(groups.dp)
    coll.all_reduce(loss, group=groups.pp)  # only the last stage holds it
    return float(loss)


def data_parallel_slice(batch: Batch, groups) -> Batch:
    """This DP rank's contiguous share of a global batch (same on every TP/PP/CP rank of it)."""
    dp, r = size_of(groups.dp), rank_in(groups.dp)
    n = batch.tokens.shape[0]
    if n % dp:
        raise ValueError(f"global batch of {n} sequences is not divisible by data-parallel size {dp}")
    per = n // dp
    return batch.slice(r * per, (r + 1) * per)
