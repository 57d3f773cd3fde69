"""MoE routing replay: force the rollout engine's expert choices in the Megatron forward/backward.

The engine reports, per token and MoE layer, the top-k experts it used (`routed_experts`, shape
[T, L, K], SGLang's layout; the agent loop stores them aligned to the token ids). Megatron-Core
0.16.1 can replay them: with `moe_enable_routing_replay=True` every TopKRouter owns a
`RouterReplay`; in REPLAY_FORWARD it takes the given indices instead of its own top-k (the gate
probabilities are still its own, so gradients flow), and each target is also queued for
REPLAY_BACKWARD, which activation recomputation uses. This module addresses the routers of the
given model chunks directly (not Megatron's process-global instance list, which also holds
routers of models built earlier), in global layer order, and slices each layer's targets to the
tokens the router sees on this rank (sequence parallel splits the sequence over TP).

Under activation recomputation the router runs again inside backward, possibly several forwards
later (1F1B keeps up to PP micro-batches in flight; interleaving more). Megatron-Core 0.16.1 never
switches a router to REPLAY_BACKWARD itself, so a recomputed forward would route by its own top-k
and the gradient would be of other experts than the forward's. Here every training forward queues
its targets on the routers that recompute (full recompute, or selective with the "moe" module),
and as soon as the forward returns those routers switch to REPLAY_BACKWARD: a recomputation pops
the oldest queued targets, which are its own micro-batch's, since backward runs micro-batches in
forward order on each model chunk. After a schedule every queue must be empty (check_drained).

Token order inside Megatron is [S, B] (sequence-major); experts come in as [B, S, L, K].
`ExpertRecorder` hooks the routers' outputs to read back which experts a forward really used,
which gives the agreement metric when replay is off.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megatron_search.models.wrappers import unwrap


def enable_routing_replay(config) -> None:
    """Switch routing replay on in a TransformerConfig before the model is built."""
    config.moe_enable_routing_replay = True


def moe_routers(model_chunks: Sequence[torch.nn.Module]) -> list[tuple[int, torch.nn.Module]]:
    """(global 0-based layer index, router) for every MoE layer of this rank, in layer order."""
    out = []
    for chunk in model_chunks:
        model = unwrap(chunk)
        for layer in model.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is not None:
                out.append((layer.layer_number - 1, router))
    return sorted(out, key=lambda x: x[0])


def _local_tokens(experts_BSK: torch.Tensor, tp_rank: int, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    """[B, S, K] -> [S_local * B, K] in the router's token order.

    Rows with a negative id (padding, or the last token the engine never fed) get experts
    0..K-1: any valid routing will do, those positions are masked out of the loss.
    """
    experts_BSK = experts_BSK.to(torch.int64)
    pad = (experts_BSK < 0).any(-1, keepdim=True)
    filler = torch.arange(experts_BSK.shape[-1], dtype=torch.int64, device=experts_BSK.device).expand_as(experts_BSK)
    experts_BSK = torch.where(pad, filler, experts_BSK)
    s_major = experts_BSK.transpose(0, 1)  # [S, B, K]
    if sequence_parallel and tp_size > 1:
        s_major = torch.chunk(s_major, tp_size, dim=0)[tp_rank]
    return s_major.reshape(-1, s_major.shape[-1]).to(torch.int64).contiguous()


def recomputes_router(config, layer_in_chunk: int) -> bool:
    """Whether activation recomputation re-runs the router of this layer (its index within the chunk)."""
    if config.recompute_granularity == "full":
        if config.recompute_method == "block":  # only the first recompute_num_layers layers of each chunk
            return layer_in_chunk < (config.recompute_num_layers or 0)
        return True  # uniform: every layer, in groups of recompute_num_layers
    if config.recompute_granularity == "selective":
        return "moe" in (config.recompute_modules or ())
    return False


class RoutingReplay:
    """Set / clear replay targets on the routers of `model_chunks` (this rank's layers)."""

    def __init__(self, model_chunks, moe_layers: Sequence[int], *, tp_rank: int = 0, tp_size: int = 1,
                 sequence_parallel: bool = False):
        """`moe_layers`: global layer index of every column L of the experts tensor (all MoE layers)."""
        self.routers = moe_routers(model_chunks)
        missing = [l for l, r in self.routers if r.router_replay is None]
        if missing:
            raise RuntimeError(
                f"routing replay: routers of layers {missing} have no RouterReplay; build the model with "
                "moe_enable_routing_replay=True (grpo.routing_replay)"
            )
        self.column = {layer: i for i, layer in enumerate(moe_layers)}
        absent = [l for l, _ in self.routers if l not in self.column]
        if absent:
            raise ValueError(f"routing replay: MoE layers {absent} of this rank are not in moe_layers {list(moe_layers)}")
        self.tp_rank, self.tp_size, self.sp = tp_rank, tp_size, sequence_parallel
        self.recomputed = {layer for layer, idx, cfg in _router_positions(model_chunks) if recomputes_router(cfg, idx)}

    def set_targets(self, experts_BSLK: torch.Tensor, *, backward: bool = True) -> None:
        """Replay these experts in the next forward; with `backward` (a forward whose backward follows)
        also queue them for the recomputation of that forward inside backward."""
        if experts_BSLK.dim() != 4 or experts_BSLK.shape[2] != len(self.column):
            raise ValueError(f"routing replay: experts must be [B, S, {len(self.column)}, K], got "
                             f"{list(experts_BSLK.shape)}")
        for layer, router in self.routers:
            target = _local_tokens(experts_BSLK[:, :, self.column[layer]], self.tp_rank, self.tp_size, self.sp)
            if target.shape[1] != router.topk:
                raise ValueError(f"routing replay: layer {layer} routes top-{router.topk}, targets have {target.shape[1]}")
            rr = router.router_replay
            rr.target_topk_idx = target
            if backward and layer in self.recomputed:
                rr.replay_backward_list.append(target)
            rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def forward_done(self) -> None:
        """The forward returned: a router that runs again before the next set_targets is recomputing
        inside backward, and replays the oldest queued targets."""
        for layer, router in self.routers:
            if layer in self.recomputed:
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def check_drained(self) -> None:
        """After a forward-backward schedule: every queued target was replayed by a recomputation."""
        left = {layer: len(r.router_replay.replay_backward_list) for layer, r in self.routers
                if r.router_replay.replay_backward_list}
        if left:
            raise RuntimeError(f"routing replay: targets queued for recomputation were never replayed "
                               f"(layer: micro-batches left {left}); the recompute settings and the routers disagree")

    def clear(self) -> None:
        """Back to normal routing."""
        for _, router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


def _router_positions(model_chunks):
    """(global layer, index within its chunk, TransformerConfig) of every MoE router of this rank."""
    for chunk in model_chunks:
        model = unwrap(chunk)
        for i, layer in enumerate(model.decoder.layers):
            if getattr(getattr(layer, "mlp", None), "router", None) is not None:
                yield layer.layer_number - 1, i, layer.config


class ExpertRecorder:
    """Context manager recording the experts each router of `model_chunks` actually chose.

    `experts()` returns {global layer: [tokens (router order), K] int64, sorted per token}.
    """

    def __init__(self, model_chunks):
        self.routers = moe_routers(model_chunks)
        self.seen: dict[int, list[torch.Tensor]] = {}
        self._handles: list = []

    def __enter__(self) -> "ExpertRecorder":
        for layer, router in self.routers:
            self._handles.append(router.register_forward_hook(self._hook(layer, router.topk)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, layer: int, k: int):
        def hook(module, args, output):
            routing_map = output[1]  # [tokens, E] bool: the experts each token is sent to
            idx = routing_map.nonzero()[:, 1].reshape(routing_map.shape[0], k)
            self.seen.setdefault(layer, []).append(idx.detach().clone())
        return hook

    def experts(self) -> dict[int, torch.Tensor]:
        return {layer: torch.cat(v) for layer, v in self.seen.items()}


def agreement_rate(a_NLK: torch.Tensor, b_NLK: torch.Tensor, valid_N: Optional[torch.Tensor] = None) -> float:
    """Fraction of (token, layer) pairs whose top-k expert *sets* are equal (order ignored)."""
    if a_NLK.shape != b_NLK.shape:
        raise ValueError(f"agreement_rate: shapes differ {list(a_NLK.shape)} vs {list(b_NLK.shape)}")
    same = (a_NLK.sort(-1).values == b_NLK.sort(-1).values).all(-1)  # [N, L]
    if valid_N is not None:
        same = same[valid_N.bool()]
    return float(same.float().mean()) if same.numel() else 1.0


def recorded_agreement(recorder: ExpertRecorder, experts_BSLK: torch.Tensor, *, tp_rank: int = 0, tp_size: int = 1,
                       sequence_parallel: bool = False, moe_layers: Optional[Sequence[int]] = None) -> float:
    """Agreement between the experts a forward chose (`recorder`, one forward) and the engine's
    `experts_BSLK` (column i = global layer moe_layers[i]; default column L = layer L), over this
    rank's non-padding tokens and MoE layers."""
    column = {layer: i for i, layer in enumerate(moe_layers if moe_layers is not None else range(experts_BSLK.shape[2]))}
    seen = recorder.experts()
    valid_SB = (experts_BSLK[:, :, 0, 0] >= 0).transpose(0, 1)
    if sequence_parallel and tp_size > 1:
        valid_SB = torch.chunk(valid_SB, tp_size, dim=0)[tp_rank]
    valid = valid_SB.reshape(-1)
    ours, theirs = [], []
    for layer, chosen in sorted(seen.items()):
        ours.append(chosen)
        theirs.append(_local_tokens(experts_BSLK[:, :, column[layer]], tp_rank, tp_size, sequence_parallel))
    if not ours:
        return 1.0
    return agreement_rate(torch.stack(ours, 1), torch.stack(theirs, 1), valid)
