"""Gated delta rule in plain torch: the CPU stand-in for fla's GPU kernels.

Gated DeltaNet (Qwen3.5's linear-attention layers) keeps, per value head, a state S of shape
[K, V] and for every token t does (g_t is a log decay <= 0, beta_t in (0, 1)):

    S   <- exp(g_t) * S                               decay
    d_t  = beta_t * (v_t - S^T k_t)                   delta-rule correction
    S   <- S + k_t d_t^T                              write
    o_t  = S^T (q_t * scale)                          read, scale = K ** -0.5 by default

`recurrent_gated_delta_rule` is that loop verbatim: the definition. `chunk_gated_delta_rule`
computes the same thing in chunks of C tokens for training: inside a chunk the deltas solve one
unit lower-triangular system (the WY form), and only the [K, V] state crosses chunk boundaries,
so the Python loop runs T / C times instead of T times.

Both follow the calling convention of fla's `chunk_gated_delta_rule`, which Megatron-Core's
GatedDeltaNet calls: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; `initial_state`
[N, HV, K, V]; returns (o [B, T, HV, V], final state or None). HV may be a multiple of H: each
q/k head then serves HV // H consecutive value heads (grouped value attention, as in HF).
`cu_seqlens` (B == 1, packed sequences) restarts the state at every boundary.
What is dropped from fla: kernel fusion, the `head_first` layout, and chunk-local
state checkpointing (autograd stores the per-chunk states instead).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_SIZE = 64
L2NORM_EPS = 1e-6  # fla's l2norm default; HF Qwen3.5 uses the same value


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) along `dim` (fla's formula)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    b, t, h, _ = q.shape
    if v.dim() != 4 or v.shape[:2] != (b, t):
        raise ValueError(f"v must be [B, T, HV, V] with B, T = {b}, {t}; got {tuple(v.shape)}")
    hv = v.shape[2]
    if hv % h:
        raise ValueError(f"value heads ({hv}) must be a multiple of query/key heads ({h})")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, hv):
            raise ValueError(f"{name} must be [B, T, HV] = {(b, t, hv)}; got {tuple(x.shape)}")
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"cu_seqlens needs batch size 1 (packed sequences); got B = {b}")
        if cu_seqlens.dim() != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != t:
            raise ValueError(f"cu_seqlens must be 1-D, start at 0 and end at T = {t}")
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing")
    if initial_state is not None:
        n = b if cu_seqlens is None else cu_seqlens.numel() - 1
        want = (n, hv, k.shape[-1], v.shape[-1])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be [N, HV, K, V] = {want}; got {tuple(initial_state.shape)}")


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """To head-major compute layout [B, HV, T, *] in fp32 (fp64 stays fp64), q/k normed and scaled."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    heads_per_key = v.shape[2] // q.shape[2]
    q, k, v, g, beta = (x.to(compute) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if heads_per_key > 1:
        q = q.repeat_interleave(heads_per_key, dim=2)
        k = k.repeat_interleave(heads_per_key, dim=2)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q = q * scale
    return [x.transpose(1, 2) for x in (q, k, v, g, beta)]


def _segments(t: int, cu_seqlens: Optional[torch.Tensor]) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, t)]
    bounds = [int(x) for x in cu_seqlens]
    return list(zip(bounds[:-1], bounds[1:]))


def _run(core, q, k, v, g, beta, scale, initial_state, output_final_state,
         use_qk_l2norm_in_kernel, cu_seqlens, **core_kwargs):
    """Shared driver: layout, per-sequence loop for packed input, dtype round trip."""
    _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens)
    out_dtype = v.dtype
    q_, k_, v_, g_, b_ = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    outs, finals = [], []
    for i, (start, end) in enumerate(_segments(q.shape[1], cu_seqlens)):
        if cu_seqlens is None:
            state0 = None if initial_state is None else initial_state.to(q_.dtype)
        else:
            state0 = None if initial_state is None else initial_state[i : i + 1].to(q_.dtype)
        o, s = core(*(x[:, :, start:end] for x in (q_, k_, v_, g_, b_)), state0, **core_kwargs)
        outs.append(o)
        finals.append(s)
    o = torch.cat(outs, dim=2).transpose(1, 2).to(out_dtype)
    final = torch.cat(finals, dim=0) if output_final_state else None
    return o, final


def _zero_state(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    b, h, _, dk = q.shape
    return q.new_zeros(b, h, dk, v.shape[-1])


def _recurrent_core(q, k, v, g, beta, state):
    """Token loop on [B, H, T, *] tensors; returns (o [B, H, T, V], final state)."""
    s = _zero_state(q, v) if state is None else state
    outs = []
    for t in range(q.shape[2]):
        s = s * g[:, :, t].exp()[..., None, None]
        kv_mem = torch.einsum("bhk,bhkv->bhv", k[:, :, t], s)
        delta = beta[:, :, t, None] * (v[:, :, t] - kv_mem)
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], s))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o, s


def _chunk_core(q, k, v, g, beta, state, chunk_size: int):
    """Chunked (WY) form on [B, H, T, *] tensors; same result as `_recurrent_core`.

    Within a chunk, with G_i the cumulative log decay from the chunk start:
        d_i + sum_{j<i} beta_i e^{G_i - G_j} (k_i.k_j) d_j = beta_i v_i - beta_i e^{G_i} k_i^T S0
    i.e. (I + A) D = beta V - (beta e^G K) S0 with A strictly lower triangular, so
    D = U - W S0 where U, W come from one unit-triangular solve per chunk (batched over chunks).
    Then o_i = e^{G_i} q_i^T S0 + sum_{j<=i} e^{G_i - G_j} (q_i.k_j) d_j and
    S_end = e^{G_C} S0 + sum_j e^{G_C - G_j} k_j d_j^T.
    """
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    if t == 0:  # an empty packed sequence passes its state through
        return v.new_zeros(v.shape), (_zero_state(q, v) if state is None else state)
    c = chunk_size
    pad = (-t) % c
    if pad:
        # Padded tokens have k = 0, beta = 0 and g = 0: they neither write nor decay the state.
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)

    cum = g.cumsum(dim=-1)  # G_i, [B, H, N, C]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # e^{G_i - G_j} on and below the diagonal; the masked entries would overflow, so mask before exp.
    diff = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf"))
    decay = diff.exp()  # [B, H, N, C, C]

    kk = k @ k.transpose(-1, -2)
    a = (beta[..., :, None] * decay * kk).tril(-1)
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    system = eye + a
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * cum.exp()[..., None] * k], dim=-1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = sol[..., :dv], sol[..., dv:]  # D = U - W S0

    qk = (q @ k.transpose(-1, -2)) * decay  # includes the diagonal j == i
    q_decayed = q * cum.exp()[..., None]
    last = cum[..., -1:]  # G_C, [B, H, N, 1]
    k_to_end = k * (last - cum).exp()[..., None]
    chunk_decay = last.exp()[..., None]  # [B, H, N, 1, 1]

    s = _zero_state(q[:, :, 0], v[:, :, 0]) if state is None else state
    outs = []
    for i in range(n):
        d = u[:, :, i] - w[:, :, i] @ s
        outs.append(q_decayed[:, :, i] @ s + qk[:, :, i] @ d)
        s = chunk_decay[:, :, i] * s + k_to_end[:, :, i].transpose(-1, -2) @ d
    o = torch.stack(outs, dim=2).reshape(b, h, n * c, dv)[:, :, :t]
    return o, s


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,

):
    """Token-by-token gated delta rule: the definition (slow; tests and decoding)."""
    return _run(_recurrent_core, q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,

):
    """Chunked gated delta rule for training: same values as the recurrence, O(T / C) Python steps."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    return _run(_chunk_core, q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens, chunk_size=chunk_size)
