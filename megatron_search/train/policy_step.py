"""One GRPO optimizer step on Megatron: logits -> fused token logprobs -> token-IS policy loss.

The forward step asks the model for logits (no labels), computes log pi_train of the sampled
tokens with the fused (vocab-parallel under TP) logprob kernel, and hands them to the policy
loss of rl/losses.py together with the engine's logprobs, the advantages and the mask.

Normalisation is exact for any micro-batching and data parallelism: every micro-batch passes
the GLOBAL count (sequences with a trained token, or trained tokens for token_mean) as the
loss denominator, and its loss is multiplied by (micro-batches x DP size) to undo Megatron's
mean over micro-batches and DDP's mean over data-parallel ranks.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_search.kernels.logprob import token_logprobs

from megatron_search.distributed import collectives as coll
from megatron_search.distributed.stages import is_last_stage, rank_in, size_of
from megatron_search.models.routing_replay import ExpertRecorder, RoutingReplay, recorded_agreement
from megatron_search.models.wrappers import unwrap

from .microbatches import Batching, build_microbatches, padding_counts, padding_metrics, plan_groups, trained_lengths
from .rollout_batch import RolloutBatch


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def global_denominator(mbs: list[RolloutBatch], aggregation: str, dp_group) -> float:
    """Global count the aggregation divides by (trained tokens, or sequences with one) over one optimizer
    step's micro-batches, summed over data-parallel ranks."""
    if aggregation == "token_mean":
        local = sum(float(mb.mask_BS.sum()) for mb in mbs)
    else:
        local = sum(float((mb.mask_BS.sum(-1) > 0).sum()) for mb in mbs)
    total = torch.tensor(local, dtype=torch.float64)
    if dist.is_initialized():
        coll.all_reduce(total, group=dp_group)
    return float(total)


def make_forward_step(policy_loss: Callable, aggregation: str, denominator: float, scale: float, tp_group,
                      logp_old_mbs: Optional[list[torch.Tensor]] = None, capture: Optional[list] = None,
                      replay=None, agreement=None, temperature: float = 1.0, check_values: bool = True,
                      norm_tokens: Optional[int] = None, forward_only: bool = False):
    """forward_step_func for megatron.core.pipeline_parallel's schedules.

    `check_values`: the fused logprob checks the targets' range (host syncs; grpo.check_loss_values).
    `norm_tokens`: seq_mean_token_sum_norm's constant, fixed for the whole batch (a micro-batch's own width
    is cut to its longest row, train/microbatches.py).

    `temperature`: the logits are divided by it before the log-softmax, so log pi_train is of the
    distribution the engine sampled from and reported (logits / T); 1.0 leaves them untouched.

    With `capture` (forward-only passes), the detached log pi of every micro-batch is appended to it
    and the loss is zero: used to compute pi_old before several optimizer steps on one batch.
    With `replay` (RoutingReplay) the engine's experts are forced; with `agreement` (tp_rank, tp_size,
    sequence_parallel, global layer of each expert column) the experts this forward chose are compared with the engine's
    (metric routing_agreement: 1.0 under replay, the natural train/inference agreement without).
    """
    counter = {"i": 0}

    def forward_step(data_iterator, model):
        mb: RolloutBatch = next(data_iterator).to(_model_device(model))  # batches live on the host until here
        i = counter["i"]
        counter["i"] += 1
        s = mb.tokens_BS.shape[1]
        position_ids = torch.arange(s, device=mb.tokens_BS.device).unsqueeze(0).expand_as(mb.tokens_BS)
        if replay is not None:  # route every token to the experts the engine used for it, recomputation included
            replay.set_targets(mb.routed_experts_BSLK, backward=capture is None and not forward_only)
        agree = None
        if agreement is not None:
            with ExpertRecorder([model]) as rec:
                logits = model(mb.tokens_BS, position_ids, None)
            tp_rank, tp_size, sp, layers = agreement
            agree = recorded_agreement(rec, mb.routed_experts_BSLK, tp_rank=tp_rank, tp_size=tp_size,
                                       sequence_parallel=sp, moe_layers=layers)
        else:
            logits = model(mb.tokens_BS, position_ids, None)
        if replay is not None:
            replay.forward_done()

        def loss_func(output: torch.Tensor):
            # The logits are read by nothing after this loss, so their gradient is written into their
            # own storage (no second [B, S, V] buffer: 2 GB at 4k tokens x 248k vocab in bf16). For the
            # same reason they are scaled in place: autograd keeps no copy of a tensor divided by a scalar.
            if temperature != 1.0:
                output = output.div_(temperature)
            out = token_logprobs(output, mb.targets_BS, group=tp_group, inplace_backward=capture is None,
                                 check_values=check_values, with_entropy=capture is None)
            if capture is not None:
                capture.append(out.logp.detach().float())
                zero = output.sum() * 0.0
                return zero, {}
            if not bool(mb.mask_BS.any()):
                # Only padding rows (the batch is padded to DP x micro-batches x updates): nothing to learn, but
                # every rank still runs backward for DDP's reduction. Its share of the global loss is 0; the
                # per-token statistics are undefined here and left out of their means (reduce_metrics).
                return output.sum() * 0.0, {"loss": torch.zeros((), dtype=torch.float32, device=output.device)}
            logp_old = None if logp_old_mbs is None else logp_old_mbs[i]
            extra = {"norm_tokens": norm_tokens} if norm_tokens is not None else {}
            loss, metrics = policy_loss(out.logp, mb.logp_infer_BS, mb.advantages_B, mb.mask_BS,
                                        logp_old=logp_old, denominator=denominator, **extra)
            metrics = {k: v.detach().float() for k, v in metrics.items()}
            # the policy's entropy at the sampling temperature over the trained tokens (the same fused pass)
            mask = mb.mask_BS.to(out.entropy.dtype)
            metrics["entropy"] = ((out.entropy.detach() * mask).sum() / mask.sum()).float()
            # loss * scale averaged over every micro-batch and DP rank is the global objective.
            metrics["loss"] = (loss * scale).detach().float()
            if agree is not None:
                metrics["routing_agreement"] = torch.tensor(agree)
            return loss * scale, metrics

        return logits, loss_func

    return forward_step


def split_microbatches(batch: RolloutBatch, micro_batch_size: int) -> list[RolloutBatch]:
    """`micro_batch_size` rows each, in order, at the batch's width (no sorting, no cut)."""
    n = batch.size
    if n % micro_batch_size:
        raise ValueError(f"{n} rollouts on this rank are not a multiple of grpo.micro_batch_size={micro_batch_size}")
    return [batch.slice(i, i + micro_batch_size) for i in range(0, n, micro_batch_size)]


def shape_rule(model_config, dp: int) -> str:
    """What Megatron allows micro-batch shapes to do here:
    'free'     each its own rows and width;
    'agreed'   micro-batch j has one width on every data-parallel rank: the allgather dispatcher gathers equal
               shapes over the expert-parallel group (whose ranks are DP ranks), and refuses variable lengths;
    'uniform'  one width per optimizer step (and agreed): pipeline stages exchange activations of one fixed
               shape unless variable_seq_lengths is set, which Megatron refuses with the allgather dispatcher."""
    moe = bool(getattr(model_config, "num_moe_experts", None))
    gathered = moe and model_config.moe_token_dispatcher_type == "allgather" and \
        model_config.expert_model_parallel_size > 1 and dp > 1
    if model_config.pipeline_model_parallel_size > 1 and not model_config.variable_seq_lengths:
        return "uniform"
    return "agreed" if gathered else "free"


def plan_microbatches(batch: RolloutBatch, updates: int, batching: Batching, rule: str,
                      dp_group) -> list[list[RolloutBatch]]:
    """This rank's micro-batches of each optimizer step (train/microbatches.py), shaped as `rule` allows. Every
    data-parallel rank runs the same number per step; under 'agreed'/'uniform' the widths are agreed too."""
    if batch.size % updates:
        raise ValueError(f"{batch.size} rollouts per rank do not split into grpo.updates_per_batch={updates} steps")
    if batching.max_tokens is not None and rule != "free":
        raise ValueError("grpo.max_tokens_per_micro_batch: micro-batches of varying rows need Megatron's variable "
                         "shapes, which it refuses with the allgather MoE dispatcher (model.moe_token_dispatcher: "
                         "use alltoall or flex on GPU) and, under PP, without variable_seq_lengths")
    agree = (lambda n: int(_agreed_max(torch.tensor([n]), dp_group)[0])) if size_of(dp_group) > 1 else None
    per, full = batch.size // updates, batch.tokens_BS.shape[1]
    steps = []
    for u in range(updates):
        part = batch.slice(u * per, (u + 1) * per)
        lengths = trained_lengths(part.mask_BS)
        groups, inert = plan_groups(lengths, batching.rows, batching.max_tokens, batching.multiple, full, agree,
                                    batching.min_count)
        mbs = build_microbatches(part, groups, inert, batching.multiple, batching.trim)
        if batching.trim and rule != "free":
            widths = torch.tensor([mb.tokens_BS.shape[1] for mb in mbs])
            if rule == "uniform":
                widths = widths.max().expand(len(mbs)).clone()
            if size_of(dp_group) > 1:
                widths = _agreed_max(widths, dp_group)
            mbs = [_at_width(mb, part, g, w) for mb, g, w in zip(mbs, groups + [None] * inert, widths.tolist())]
        steps.append(mbs)
    return steps


def _agreed_max(t: torch.Tensor, dp_group) -> torch.Tensor:
    t = t.to(torch.int64)
    if dist.is_initialized():
        coll.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
    return t


def _at_width(mb: RolloutBatch, part: RolloutBatch, rows: Optional[list[int]], width: int) -> RolloutBatch:
    """Micro-batch `mb` (of `rows` of `part`; None: an inert one) at an agreed `width`, at least its own."""
    if mb.tokens_BS.shape[1] == width:
        return mb
    return part.select(rows).cut(width) if rows is not None else part.select([0]).cut(width).inert()


def run_schedule(chunks: list, forward_step, mbs: list[RolloutBatch], forward_only: bool) -> list[dict]:
    iterators = iter(mbs) if len(chunks) == 1 else [iter(mbs) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(mbs),
        seq_length=mbs[0].tokens_BS.shape[1],
        micro_batch_size=mbs[0].size,
        forward_only=forward_only,
    )


def reduce_metrics(per_mb: list[dict], pp_group, dp_group, is_last_stage: bool) -> dict[str, float]:
    """Metrics of the last pipeline stage's micro-batches, reduced over data-parallel ranks and shared
    with every stage: `*_min` keys by min, `*_max` by max, the rest by mean over the micro-batches that
    report the key (a padding-only micro-batch reports only its zero loss)."""
    keys = sorted({k for d in per_mb for k in d}) if is_last_stage else []
    if dist.is_initialized():  # every rank must agree on the keys: non-last stages have none, and a DP rank
        for group in (pp_group, dp_group):  # whose micro-batches are all padding has only "loss"
            gathered: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, keys, group=group)
            keys = sorted({k for ks in gathered for k in ks})
    inf = float("inf")
    k_n = len(keys)
    mean = torch.zeros(2 * k_n, dtype=torch.float64)  # sums, then how many micro-batches reported each key
    lo = torch.full((k_n,), inf, dtype=torch.float64)
    hi = torch.full((k_n,), -inf, dtype=torch.float64)
    if is_last_stage:
        for d in per_mb:
            for j, k in enumerate(keys):
                if k not in d:  # a padding-only micro-batch reports its loss (0) and nothing else
                    continue
                v = float(d[k])
                mean[j] += v
                mean[k_n + j] += 1
                lo[j], hi[j] = min(lo[j], v), max(hi[j], v)
    if dist.is_initialized():
        for group in (dp_group, pp_group):
            coll.all_reduce(mean, group=group)
            coll.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
            coll.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    out = {}
    for j, k in enumerate(keys):
        n = max(float(mean[k_n + j]), 1.0)
        out[k] = float(lo[j]) if k.endswith("_min") else float(hi[j]) if k.endswith("_max") else float(mean[j]) / n
    return out


def policy_update(chunks: list, optimizer, batch: RolloutBatch, *, groups, policy_loss: Callable, aggregation: str,
                  batching: Batching, updates: int = 1, replay: bool = True, temperature: float = 1.0,
                  check_values: bool = True, norm_tokens: Optional[int] = None) -> list[dict[str, float]]:
    """`updates` optimizer steps on this data-parallel rank's share of a rollout batch (`groups`: this rank's
    process groups, DistContext.groups), in micro-batches as `batching` says (train/microbatches.py).

    With updates > 1 the batch is split into that many equal parts (one optimizer step each) and
    pi_old is the policy before the first step (computed once, forward only), so PPO clipping
    applies from the second part on; with updates == 1 the loss is the plain token-IS objective.
    `temperature` scales the logits as the engine's sampling did (make_forward_step). `norm_tokens`:
    seq_mean_token_sum_norm's constant (grpo.loss_norm_tokens); None = the batch's padded width, as before any
    micro-batch is cut. Returns one metrics dict per optimizer step (identical on every rank).
    """
    tp_group = groups.tp if size_of(groups.tp) > 1 else None
    dp_group, pp_group = groups.dp, groups.pp
    dp = size_of(groups.dp)
    last = is_last_stage(groups)
    config = unwrap(chunks[0]).config
    steps = plan_microbatches(batch, updates, batching, shape_rule(config, dp), dp_group)
    replay_ctl = agreement = None
    if batch.routed_experts_BSLK is not None:
        where = (rank_in(groups.tp), size_of(groups.tp), config.sequence_parallel)
        layers = batch.moe_layers()  # the global layer of each expert column (this rank's stage, BatchScatter)
        if replay:
            replay_ctl = RoutingReplay(chunks, layers, tp_rank=where[0], tp_size=where[1], sequence_parallel=where[2])
        agreement = (*where, layers)
    loss = dict(policy_loss=policy_loss, aggregation=aggregation, tp_group=tp_group, temperature=temperature,
                check_values=check_values, norm_tokens=norm_tokens or batch.tokens_BS.shape[1])
    try:
        history = _updates(chunks, optimizer, steps, loss, replay_ctl, agreement, dp_group, pp_group, dp, last)
    finally:
        if replay_ctl is not None:
            replay_ctl.clear()
    flat = [mb for mbs in steps for mb in mbs]
    counts = torch.tensor(padding_counts(flat, batch.tokens_BS.shape[1]), dtype=torch.float64)
    if dist.is_initialized() and dp > 1:
        coll.all_reduce(counts, group=dp_group)
    stats = padding_metrics(counts.tolist(), len(flat), dp)
    for h in history:
        h.update(stats)
    return history


def forward_metrics(chunks: list, batch: RolloutBatch, *, groups, policy_loss: Callable, aggregation: str,
                    batching: Batching, replay: bool = True, temperature: float = 1.0,
                    check_values: bool = True) -> dict[str, float]:
    """The loss's metrics of this rank's share of `batch` from a forward pass alone (no gradient, no optimizer step;
    identical on every rank): the train-inference mismatch of rollouts that train nothing, for grpo.max_mismatch_kl
    on a step without signal. With routed experts and `replay` the engine's experts are forced, as in the first
    update of a step that trains, so both measure the same quantity."""
    tp_group = groups.tp if size_of(groups.tp) > 1 else None
    config = unwrap(chunks[0]).config
    (mbs,) = plan_microbatches(batch, 1, batching, shape_rule(config, size_of(groups.dp)), groups.dp)
    replay_ctl = None
    if batch.routed_experts_BSLK is not None and replay:
        replay_ctl = RoutingReplay(chunks, batch.moe_layers(), tp_rank=rank_in(groups.tp), tp_size=size_of(groups.tp),
                                   sequence_parallel=config.sequence_parallel)
    fs = make_forward_step(policy_loss, aggregation, denominator=1.0, scale=1.0, tp_group=tp_group, replay=replay_ctl,
                           temperature=temperature, check_values=check_values, norm_tokens=batch.tokens_BS.shape[1],
                           forward_only=True)
    try:
        with torch.no_grad():
            out = run_schedule(chunks, fs, mbs, forward_only=True)
    finally:
        if replay_ctl is not None:
            replay_ctl.clear()
    return reduce_metrics(out, groups.pp, groups.dp, is_last_stage(groups))


def _updates(chunks, optimizer, steps: list[list[RolloutBatch]], loss: dict, replay, agreement, dp_group, pp_group,
             dp, last) -> list[dict[str, float]]:
    logp_old: Optional[list[list[torch.Tensor]]] = None
    if len(steps) > 1:
        logp_old = []
        for mbs in steps:  # pi_old of every step's micro-batches, before the first update
            captured: list[torch.Tensor] = []
            fs = make_forward_step(denominator=1.0, scale=1.0, capture=captured, replay=replay, **loss)
            with torch.no_grad():
                run_schedule(chunks, fs, mbs, forward_only=True)
            # pi_old is only read by the loss, on the last pipeline stage; the other stages hold zeros they never read.
            logp_old.append(captured if last else [torch.zeros_like(mb.logp_infer_BS) for mb in mbs])
    history = []
    for u, mbs in enumerate(steps):
        denom = global_denominator(mbs, loss["aggregation"], dp_group)
        if denom == 0:
            continue  # no trained token anywhere in this part: nothing to learn from
        old = None if logp_old is None else logp_old[u]
        fs = make_forward_step(denominator=denom, scale=float(len(mbs) * dp), logp_old_mbs=old, replay=replay,
                               agreement=agreement, **loss)
        for m in chunks:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        out = run_schedule(chunks, fs, mbs, forward_only=False)
        if replay is not None:
            replay.check_drained()
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise FloatingPointError("optimizer step skipped: non-finite gradients")
        metrics = reduce_metrics(out, pp_group, dp_group, last)
        metrics["grad_norm"] = float(grad_norm)
        history.append(metrics)
    return history
