"""GRPO policy losses with importance sampling against the inference engine (RECIPE section 3).

Legend: B rollouts (sequences) x T tokens. `mask` [B, T] marks the tokens the policy generated;
prompt, tool-response and padding tokens have mask 0 and never count (their logprobs may hold
anything, even NaN: they are never read). sg(.) is stop-gradient.

    logp_train [B, T]  log pi_theta of each token, recomputed by the training engine (with grad)
    logp_infer [B, T]  log mu_infer, reported by the inference engine when it sampled the token
    logp_old   [B, T]  optional log pi_old: the training engine's logprobs under the weights that
                       generated the batch, computed once before the first of several optimizer
                       steps on one batch (grpo.updates_per_batch > 1)
    advantages [B]     A_i, shared by every token of rollout i

Token-level form (`token_is`, the recipe's default), per masked token t of rollout i:

    w_t   = sg( pi_old / mu_infer ),  truncated to min(w_t, C) when a cap C is set  (IS weight)
    rho_t = pi_theta / sg(pi_old)                                                   (PPO ratio)
    o_t   = w_t * min( rho_t * A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_i )

Without logp_old, pi_old := sg(pi_theta): rho_t = 1 in value, no clipping applies, and
o_t = w_t * exp(logp_train - sg(logp_train)) * A_i. Its value is min(r_t, C) * A_i and its
gradient min(r_t, C) * A_i * grad log pi_theta, with r_t = pi_theta / mu_infer; with no cap this
is exactly the recipe's r_t(theta) * A_i with the gradient flowing through pi_train only.

Sequence-level form (`sequence_is`, GSPO-style): the same expression with every ratio replaced
by its geometric mean over the rollout's masked tokens,

    w_i = sg( exp(mean_t log(pi_old / mu)) ) (truncated at C),   rho_i = exp(mean_t log(pi_theta / sg(pi_old)))
    o_i = w_i * min(rho_i * A_i, clip(rho_i, 1 - eps_low, 1 + eps_high) * A_i),

broadcast to every masked token of rollout i.

The loss is -aggregate(o):
    seq_mean_token_mean:  1/N_seq * sum_i 1/|o_i| * sum_t o_t   (the recipe's objective)
    token_mean:           1/N_tok * sum_{i,t} o_t
    seq_mean_token_sum_norm: 1/N_seq * sum_i 1/L_norm * sum_t o_t   (Dr. GRPO: a constant L_norm,
                          `norm_tokens`, default the padded width T, so long rollouts are not down-weighted)
N_seq counts the rollouts with at least one masked token and N_tok the masked tokens, unless a
`denominator` is passed (for gradient accumulation over micro-batches: pass the global count).

Metrics (detached 0-d tensors): over masked tokens (token level) or rollouts (sequence level),
is_weight_mean/min/max of the untruncated IS weight w, is_truncated_frac (w > C),
clip_frac (the clipped branch is strictly smaller, so the token gets no gradient); and always
over masked tokens, the train-inference mismatch with d_t = log pi_ref - log mu_infer
(pi_ref = pi_old when given, else pi_theta; samples come from mu):
    mismatch_kl_k1 = mean_t(-d_t),   mismatch_kl_k3 = mean_t(exp(d_t) - 1 - d_t),
both estimators of KL(mu_infer || pi_ref) (k3 is non-negative per token). With logp_old, also the
drift of the policy from pi_old over masked tokens, with q_t = log pi_theta - log pi_old:
    policy_kl_k1 = mean_t(-q_t),   policy_kl_k3 = mean_t(exp(q_t) - 1 - q_t),   policy_log_ratio_abs_max = max_t |q_t|,
estimators of KL(pi_old || pi_theta) on tokens sampled from mu ~ pi_old; all three are exactly 0 on
the first of several updates, where pi_theta is pi_old. Also num_tokens, num_sequences.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
from torch import Tensor

from .registry import register_policy_loss

Aggregation = Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"]
AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")


def _bool_mask(mask: Tensor, shape: torch.Size, check_values: bool) -> Tensor:
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not match logp_train {tuple(shape)}")
    if mask.dtype == torch.bool:
        return mask
    if check_values and not ((mask == 0) | (mask == 1)).all():
        raise ValueError("mask: values must be 0 or 1 (or a bool tensor)")
    return mask != 0


def _check_logp(name: str, x: Tensor, shape: torch.Size, mask: Tensor, check_values: bool) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.shape != shape:
        raise ValueError(f"{name}: shape {tuple(x.shape)} does not match logp_train {tuple(shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating tensor, got {x.dtype}")
    if not check_values:
        return x
    bad = (mask & ~torch.isfinite(x)).nonzero()
    if bad.numel():
        raise ValueError(f"{name}: NaN/inf at {bad.shape[0]} loss token(s), first at (row, col) {tuple(bad[0].tolist())}")
    return x


def _validate(
    logp_train, logp_infer, advantages, mask, logp_old, is_cap, clip_eps_low, clip_eps_high, aggregation, norm_tokens,
    check_values,
):
    """Shapes, dtypes and settings always (no device work); with `check_values` also the tensors' values (0/1 mask,
    finite logprobs and advantages, a non-empty mask): host syncs, about one per check, so the trainer runs them
    only with grpo.check_loss_values."""
    if not isinstance(logp_train, Tensor) or logp_train.dim() != 2:
        raise ValueError(f"logp_train: expected a [B, T] tensor, got {getattr(logp_train, 'shape', type(logp_train))}")
    shape = logp_train.shape
    m = _bool_mask(mask, shape, check_values)
    _check_logp("logp_train", logp_train, shape, m, check_values)
    _check_logp("logp_infer", logp_infer, shape, m, check_values)
    if logp_old is not None:
        _check_logp("logp_old", logp_old, shape, m, check_values)
    if not isinstance(advantages, Tensor) or advantages.shape != shape[:1]:
        raise ValueError(
            f"advantages: expected shape ({shape[0]},) (one per rollout), got {tuple(getattr(advantages, 'shape', ()))}"
        )
    if check_values and not torch.isfinite(advantages).all():
        raise ValueError("advantages: NaN/inf values")
    if is_cap is not None and not is_cap > 0:
        raise ValueError(f"is_cap: must be > 0 or None, got {is_cap}")
    if clip_eps_low < 0 or clip_eps_high < 0 or clip_eps_low >= 1:
        raise ValueError(f"clip range: need 0 <= eps_low < 1 and eps_high >= 0, got {clip_eps_low}, {clip_eps_high}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation: {aggregation!r} is not one of {AGGREGATIONS}")
    if norm_tokens is not None and not norm_tokens > 0:
        raise ValueError(f"norm_tokens: must be > 0 or None, got {norm_tokens}")
    if check_values and not m.any():
        raise ValueError("mask: selects no tokens, the loss is undefined (drop empty micro-batches)")
    return m


def _upcast(logp_train: Tensor, logp_infer: Tensor, advantages: Tensor, logp_old: Optional[Tensor]):
    """Ratios and exp() in at least fp32: bf16 logprobs would make exp(d) ~1e-2 coarse."""
    dt = torch.promote_types(logp_train.dtype, torch.float32)
    return (
        logp_train.to(dt),
        logp_infer.to(dt),
        advantages.to(dt),
        None if logp_old is None else logp_old.to(dt),
    )


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    aggregation: Aggregation,
    denominator: Optional[float] = None,
    norm_tokens: Optional[int] = None,
) -> Tensor:
    """Reduce per-token objective values [B, T] (0 off the mask) to a scalar (see module docstring)."""
    if aggregation == "token_mean":
        n = mask.sum() if denominator is None else denominator
        return per_token.sum() / n
    n_tok = mask.sum(-1)
    if aggregation == "seq_mean_token_sum_norm":
        per_seq = per_token.sum(-1) / (mask.shape[-1] if norm_tokens is None else norm_tokens)
    else:
        per_seq = per_token.sum(-1) / n_tok.clamp(min=1)
    n = (n_tok > 0).sum() if denominator is None else denominator
    return per_seq.sum() / n


def _surrogate(w: Tensor, log_rho: Optional[Tensor], rho_plain: Tensor, adv: Tensor, eps_low: float, eps_high: float):
    """w * min(rho A, clip(rho) A); without pi_old (log_rho None) w * rho_plain * A, never clipped."""
    if log_rho is None:
        return w * rho_plain * adv, torch.zeros_like(w, dtype=torch.bool)
    rho = torch.exp(log_rho)
    unclipped = rho * adv
    clipped = torch.clamp(rho, 1.0 - eps_low, 1.0 + eps_high) * adv
    return w * torch.minimum(unclipped, clipped), clipped.detach() < unclipped.detach()


# Metrics are masked reductions, never boolean indexing (x[m]): that is a host sync and a data-dependent shape.
def _mean(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp(min=1)


def _max(x: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, x, torch.full_like(x, -torch.inf)).max()


def _stats(prefix: str, x: Tensor, m: Tensor) -> dict[str, Tensor]:
    x = x.detach()
    return {f"{prefix}_mean": _mean(x, m), f"{prefix}_min": -_max(-x, m), f"{prefix}_max": _max(x, m)}


def _mismatch(logp_ref: Tensor, logp_infer: Tensor, m: Tensor) -> dict[str, Tensor]:
    d = logp_ref.detach() - logp_infer.detach()  # 0 off the mask (both were where()d)
    return {"mismatch_kl_k1": _mean(-d, m), "mismatch_kl_k3": _mean(torch.exp(d) - 1.0 - d, m)}


def _policy_drift(lp: Tensor, lp_old: Tensor, m: Tensor) -> dict[str, Tensor]:
    q = lp.detach() - lp_old.detach()
    return {"policy_kl_k1": _mean(-q, m), "policy_kl_k3": _mean(torch.exp(q) - 1.0 - q, m),
            "policy_log_ratio_abs_max": _max(q.abs(), m)}


def _masked_inputs(logp_train, logp_infer, advantages, mask, logp_old, is_cap, clip_eps_low, clip_eps_high,
                   aggregation, norm_tokens, check_values):
    """Validated, upcast inputs with off-mask positions zeroed: (mask, log pi_theta, log mu (detached),
    log pi_ref = pi_old or sg(pi_theta), advantages, a zero scalar). where() comes before any
    arithmetic, so off-mask garbage (NaN, -inf) never reaches values or gradients."""
    m = _validate(
        logp_train, logp_infer, advantages, mask, logp_old, is_cap, clip_eps_low, clip_eps_high, aggregation, norm_tokens,
        check_values,
    )
    logp_train, logp_infer, advantages, logp_old = _upcast(logp_train, logp_infer, advantages, logp_old)
    zero = torch.zeros((), dtype=logp_train.dtype, device=logp_train.device)
    lp = torch.where(m, logp_train, zero)
    lp_infer = torch.where(m, logp_infer.detach(), zero)
    lp_ref = lp.detach() if logp_old is None else torch.where(m, logp_old.detach(), zero)
    return m, lp, lp_infer, lp_ref, advantages, zero


@register_policy_loss("token_is")
def token_is_loss(
    logp_train: Tensor,
    logp_infer: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    logp_old: Optional[Tensor] = None,
    is_cap: Optional[float] = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    aggregation: Aggregation = "seq_mean_token_mean",
    denominator: Optional[float] = None,
    norm_tokens: Optional[int] = None,
    check_values: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level IS policy loss (module docstring); returns (loss, metrics)."""
    m, lp, lp_infer, lp_ref, advantages, zero = _masked_inputs(
        logp_train, logp_infer, advantages, mask, logp_old, is_cap, clip_eps_low, clip_eps_high, aggregation, norm_tokens,
        check_values,
    )
    w = torch.exp(lp_ref - lp_infer)
    w_used = w if is_cap is None else torch.clamp(w, max=is_cap)
    log_rho = None if logp_old is None else lp - lp_ref
    rho_plain = torch.exp(lp - lp.detach())
    obj, clipped = _surrogate(w_used, log_rho, rho_plain, advantages.detach()[:, None], clip_eps_low, clip_eps_high)
    obj = torch.where(m, obj, zero)
    loss = -aggregate(obj, m, aggregation, denominator, norm_tokens)
    metrics = _stats("is_weight", w, m)
    metrics["is_truncated_frac"] = _mean((w > is_cap).to(lp.dtype), m) if is_cap is not None else zero.clone()
    metrics["clip_frac"] = _mean(clipped.to(lp.dtype), m)
    metrics.update(_mismatch(lp_ref, lp_infer, m))
    if logp_old is not None:
        metrics.update(_policy_drift(lp, lp_ref, m))
    metrics["num_tokens"] = m.sum().to(lp.dtype)
    metrics["num_sequences"] = m.any(-1).sum().to(lp.dtype)
    return loss, metrics


@register_policy_loss("sequence_is")
def sequence_is_loss(
    logp_train: Tensor,
    logp_infer: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    logp_old: Optional[Tensor] = None,
    is_cap: Optional[float] = None,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    aggregation: Aggregation = "seq_mean_token_mean",
    denominator: Optional[float] = None,
    norm_tokens: Optional[int] = None,
    check_values: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence-level (GSPO-style, geometric-mean) IS policy loss (module docstring); returns (loss, metrics)."""
    m, lp, lp_infer, lp_ref, advantages, zero = _masked_inputs(
        logp_train, logp_infer, advantages, mask, logp_old, is_cap, clip_eps_low, clip_eps_high, aggregation, norm_tokens,
        check_values,
    )
    n_tok = m.sum(-1).clamp(min=1).to(lp.dtype)
    seq = m.any(-1)

    def seq_mean(x: Tensor) -> Tensor:
        return x.sum(-1) / n_tok

    w = torch.exp(seq_mean(lp_ref - lp_infer))
    w_used = w if is_cap is None else torch.clamp(w, max=is_cap)
    log_rho = None if logp_old is None else seq_mean(lp - lp_ref)
    rho_plain = torch.exp(seq_mean(lp - lp.detach()))
    obj_seq, clipped = _surrogate(w_used, log_rho, rho_plain, advantages.detach(), clip_eps_low, clip_eps_high)
    obj = torch.where(m, obj_seq[:, None].expand_as(lp), zero)
    loss = -aggregate(obj, m, aggregation, denominator, norm_tokens)
    metrics = _stats("is_weight", w, seq)
    metrics["is_truncated_frac"] = _mean((w > is_cap).to(lp.dtype), seq) if is_cap is not None else zero.clone()
    metrics["clip_frac"] = _mean(clipped.to(lp.dtype), seq)
    metrics.update(_mismatch(lp_ref, lp_infer, m))
    if logp_old is not None:
        metrics.update(_policy_drift(lp, lp_ref, m))
    metrics["num_tokens"] = m.sum().to(lp.dtype)
    metrics["num_sequences"] = seq.sum().to(lp.dtype)
    return loss, metrics
