"""Policy losses registered by name, so a config string selects one (`grpo.is_level`).

Every registered loss has the signature
    loss_fn(logp_train, logp_infer, advantages, mask, *, logp_old=None, **scalars) -> (loss, metrics)
with tensors [B, T] (advantages [B]) and explicit scalar keyword arguments.
"""
from __future__ import annotations

import functools
from typing import Callable

from torch import Tensor

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]

_POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: make `fn` available as get_policy_loss(name). Names are unique."""

    def deco(fn: PolicyLoss) -> PolicyLoss:
        if name in _POLICY_LOSSES and _POLICY_LOSSES[name] is not fn:
            raise ValueError(f"policy loss {name!r} is already registered ({_POLICY_LOSSES[name].__qualname__})")
        _POLICY_LOSSES[name] = fn
        return fn

    return deco


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss registered under `name`; KeyError listing the known names otherwise."""
    try:
        return _POLICY_LOSSES[name]
    except KeyError:
        raise KeyError(f"unknown policy loss {name!r}; registered: {sorted(_POLICY_LOSSES)}") from None


def policy_loss_names() -> list[str]:
    return sorted(_POLICY_LOSSES)


def build_policy_loss(grpo) -> PolicyLoss:
    """The loss chosen by a GRPOConfig (`is_level`), with its scalars bound from the config.

    The caller passes `logp_old` only when a rollout batch is split into several optimizer
    steps (grpo.updates_per_batch > 1); without it the clip range has no effect.
    """
    fn = get_policy_loss(f"{grpo.is_level}_is")
    return functools.partial(
        fn,
        is_cap=grpo.is_cap,
        clip_eps_low=grpo.clip_eps_low,
        clip_eps_high=grpo.clip_eps_high,
        aggregation=grpo.loss_aggregation,
        norm_tokens=grpo.loss_norm_tokens,
        check_values=grpo.check_loss_values,
    )
