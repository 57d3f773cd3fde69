"""HF <-> Megatron-Core parameter mapping: one table per architecture, applied by one routine.

A `Rule` says, for one kind of parameter: the Megatron name pattern(s) (alternatives cover the
local and Transformer Engine specs), the HF name pattern(s), the layout transform between the
*full* (unsharded, TP=1) Megatron tensor and the HF tensors, and how Megatron shards that tensor
over tensor parallelism (`TPLayout`). Patterns use `{L}` for the global layer index and `{E}` for
the global expert index. Everything here is a pure function of tensors and plain data; gathering
shards across ranks lives in `megatron_search.weights`.

Shape legend: H hidden, G query groups, Q query heads per group, D head dim, I expert FFN size.

Transforms (`kind`):
  copy        identity
  vocab       identity, with Megatron's padded vocabulary rows dropped (to HF) / zero-filled (to mcore)
  norm        RMSNorm gain; shifts by 1 where HF and Megatron disagree on zero-centred gamma
  qkv         Megatron [G*(Q+2)*D, H] interleaved per group (q.., k, v) <-> HF q, k, v
  gated_qkv   Megatron [G*(2Q+2)*D, H] per group (q.., gate.., k, v) <-> HF q_proj rows per head
              [q_h; gate_h] (Qwen3.5 attention output gate), k, v
  concat      Megatron tensor is the HF tensors stacked along dim 0 (fc1 = [gate; up], GDN in_proj)

MTP (Qwen3.5, `Mapping(..., mtp=True)` when the model builds its MTP block): HF `mtp.fc` is
Megatron's `eh_proj` (same input order, [norm_e(embedding of token t+1), norm_h(hidden_t)], both
column-parallel over TP), `mtp.pre_fc_norm_{embedding,hidden}` are `enorm` / `hnorm`, `mtp.norm` is
`final_layernorm` (all zero-centred 1 + w), and `mtp.layers.0.*` is a gated-attention MoE decoder
layer named like the main layers (its experts per-expert). The MTP head reuses the main embedding
and output layer, so nothing else maps. With MTP off, HF `mtp.*` is carried through (passthrough).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional, Sequence

import torch

from megatron_search.config.hf import Architecture


class MappingError(ValueError):
    """A tensor that does not fit the mapping (unknown name, wrong shape, missing piece)."""


@dataclass(frozen=True)
class TPLayout:
    """How Megatron shards one parameter over its tensor-parallel group.

    dim None: replicated. Otherwise shards are contiguous slices along `dim`, except when
    `sections` is given: then the full tensor is several sections stacked on `dim` and every rank
    holds its slice of each section, in order (fc1 of a GLU: [gate_r; up_r]; GDN in_proj).
    """

    dim: Optional[int] = None
    sections: Optional[Callable[["MappingContext"], list[int]]] = None

    def shard(self, full: torch.Tensor, rank: int, size: int, ctx: "MappingContext") -> torch.Tensor:
        if self.dim is None or size == 1:
            return full
        parts = [full] if self.sections is None else list(torch.split(full, self.sections(ctx), self.dim))
        out = []
        for p in parts:
            if p.shape[self.dim] % size:
                raise MappingError(f"dimension {p.shape[self.dim]} is not divisible by TP={size}")
            out.append(torch.chunk(p, size, self.dim)[rank])
        return out[0] if len(out) == 1 else torch.cat(out, self.dim)

    def gather(self, shards: Sequence[torch.Tensor], ctx: "MappingContext",
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The full tensor from its TP shards (written into `out` when given: no fresh allocation)."""
        if self.dim is None or len(shards) == 1:
            if out is None:
                return shards[0]
            return out.copy_(shards[0])
        if self.sections is None:
            return torch.cat(list(shards), self.dim, out=out)
        size = len(shards)
        local = [s // size for s in self.sections(ctx)]
        pieces = [torch.split(s, local, self.dim) for s in shards]
        return torch.cat([pieces[r][i] for i in range(len(local)) for r in range(size)], self.dim, out=out)


REPLICATED = TPLayout()
COLUMN = TPLayout(0)
ROW = TPLayout(1)


@dataclass(frozen=True)
class MappingContext:
    """Numbers the transforms need: the architecture plus Megatron-side build facts."""

    arch: Architecture
    padded_vocab_size: int

    @property
    def q_per_group(self) -> int:
        return self.arch.num_attention_heads // self.arch.num_key_value_heads

    def gdn_qk_dim(self) -> int:
        return self.arch.linear_num_key_heads * self.arch.linear_key_head_dim

    def gdn_v_dim(self) -> int:
        return self.arch.linear_num_value_heads * self.arch.linear_value_head_dim


def _glu_sections(ctx: MappingContext, inter: int) -> list[int]:
    return [inter, inter]


def _gdn_in_sections(ctx: MappingContext) -> list[int]:
    qk, v, nv = ctx.gdn_qk_dim(), ctx.gdn_v_dim(), ctx.arch.linear_num_value_heads
    return [qk, qk, v, v, nv, nv]


def _gdn_conv_sections(ctx: MappingContext) -> list[int]:
    return [ctx.gdn_qk_dim(), ctx.gdn_qk_dim(), ctx.gdn_v_dim()]


EXPERT_FC1 = TPLayout(0, lambda ctx: _glu_sections(ctx, ctx.arch.moe_ffn_hidden_size))
SHARED_FC1 = TPLayout(0, lambda ctx: _glu_sections(ctx, ctx.arch.shared_expert_intermediate_size))
GDN_IN = TPLayout(0, _gdn_in_sections)
GDN_CONV = TPLayout(0, _gdn_conv_sections)


@dataclass(frozen=True)
class Rule:
    mcore: tuple[str, ...]
    hf: tuple[str, ...]
    kind: str = "copy"
    tp: TPLayout = REPLICATED
    expert: bool = False  # sharded over expert-TP instead of TP
    hf_one_plus: bool = False  # norm only: HF applies x * (1 + w)

    @cached_property
    def regexes(self) -> tuple[re.Pattern, ...]:
        return tuple(_compile(p) for p in self.mcore)


def _compile(pattern: str) -> re.Pattern:
    rx = re.escape(pattern)
    for key in "LEM":
        rx = rx.replace(r"\{" + key + r"\}", rf"(?P<{key}>\d+)")
    return re.compile(rx + "$")


@dataclass(frozen=True)
class Match:
    """A Megatron parameter name resolved against a table: the rule and its HF names."""

    rule: Rule
    mcore_name: str
    hf_names: tuple[str, ...]
    layer: Optional[int]  # global decoder layer; MTP layer k counts as num_layers + k (export order)
    expert: Optional[int]


def _layer_rules(L: str, H: str, arch: Architecture, linear_attention: bool) -> list[Rule]:
    """One decoder layer: Megatron prefix `L`, HF prefix `H`; GDN rules only when `linear_attention`."""
    gated = arch.model_type == "qwen3_5_moe"
    rules = [
        Rule(
            (L + "input_layernorm.weight", L + "self_attention.linear_qkv.layer_norm_weight",
             L + "self_attention.in_proj.layer_norm_weight"),
            (H + "input_layernorm.weight",), "norm", hf_one_plus=gated,
        ),
        Rule(
            (L + "self_attention.linear_qkv.weight",),
            tuple(H + f"self_attn.{x}_proj.weight" for x in "qkv"), "gated_qkv" if gated else "qkv", COLUMN,
        ),
        Rule((L + "self_attention.linear_proj.weight",), (H + "self_attn.o_proj.weight",), tp=ROW),
        Rule((L + "self_attention.q_layernorm.weight",), (H + "self_attn.q_norm.weight",), "norm", hf_one_plus=gated),
        Rule((L + "self_attention.k_layernorm.weight",), (H + "self_attn.k_norm.weight",), "norm", hf_one_plus=gated),
        Rule(
            (L + "pre_mlp_layernorm.weight", L + "mlp.linear_fc1.layer_norm_weight"),
            (H + "post_attention_layernorm.weight",), "norm", hf_one_plus=gated,
        ),
        Rule((L + "mlp.router.weight",), (H + "mlp.gate.weight",)),
        Rule(
            (L + "mlp.experts.local_experts.{E}.linear_fc1.weight", L + "mlp.experts.linear_fc1.weight{E}"),
            (H + "mlp.experts.{E}.gate_proj.weight", H + "mlp.experts.{E}.up_proj.weight"),
            "concat", EXPERT_FC1, expert=True,
        ),
        Rule(
            (L + "mlp.experts.local_experts.{E}.linear_fc2.weight", L + "mlp.experts.linear_fc2.weight{E}"),
            (H + "mlp.experts.{E}.down_proj.weight",), tp=ROW, expert=True,
        ),
    ]
    if arch.shared_expert_intermediate_size:
        rules += [
            Rule(
                (L + "mlp.shared_experts.linear_fc1.weight",),
                (H + "mlp.shared_expert.gate_proj.weight", H + "mlp.shared_expert.up_proj.weight"),
                "concat", SHARED_FC1,
            ),
            Rule((L + "mlp.shared_experts.linear_fc2.weight",), (H + "mlp.shared_expert.down_proj.weight",), tp=ROW),
            Rule((L + "mlp.shared_experts.gate_weight",), (H + "mlp.shared_expert_gate.weight",)),
        ]
    if arch.is_hybrid and linear_attention:
        G = H + "linear_attn."
        rules += [
            Rule(
                (L + "self_attention.in_proj.weight",),
                (G + "in_proj_qkv.weight", G + "in_proj_z.weight", G + "in_proj_b.weight", G + "in_proj_a.weight"),
                "concat", GDN_IN,
            ),
            Rule((L + "self_attention.conv1d.weight",), (G + "conv1d.weight",), tp=GDN_CONV),
            Rule((L + "self_attention.A_log",), (G + "A_log",), tp=COLUMN),
            Rule((L + "self_attention.dt_bias",), (G + "dt_bias",), tp=COLUMN),
            # The GDN output norm is a plain gated RMSNorm in HF (gain initialised to ones).
            Rule((L + "self_attention.out_norm.weight",), (G + "norm.weight",), "norm", hf_one_plus=False),
            Rule((L + "self_attention.out_proj.weight",), (G + "out_proj.weight",), tp=ROW),
        ]
    return rules


def hf_prefix(arch: Architecture) -> str:
    return "model.language_model." if arch.model_type == "qwen3_5_moe" else "model."


# HF tensors the Megatron language model does not hold; conversion carries them through unchanged.
PASSTHROUGH_PREFIXES = {"qwen3_moe": (), "qwen3_5_moe": ("model.visual.", "mtp.")}
MTP_PREFIX = "mtp."


def _mtp_rules(arch: Architecture) -> list[Rule]:
    """Qwen3.5's MTP module (one layer: HF keeps a single fc / pre-fc norms / norm set)."""
    M = "mtp.layers.{M}."
    return [
        Rule((M + "enorm.weight",), ("mtp.pre_fc_norm_embedding.weight",), "norm", hf_one_plus=True),
        Rule((M + "hnorm.weight",), ("mtp.pre_fc_norm_hidden.weight",), "norm", hf_one_plus=True),
        # Both sides take [embedding; hidden] as input columns; the output rows shard over TP.
        Rule((M + "eh_proj.weight",), ("mtp.fc.weight",), tp=COLUMN),
        *_layer_rules(M + "transformer_layer.", "mtp.layers.{M}.", arch, linear_attention=False),
        Rule((M + "final_layernorm.weight",), ("mtp.norm.weight",), "norm", hf_one_plus=True),
    ]


def check_mtp_supported(arch: Architecture) -> None:
    """Raise MappingError unless the architecture's MTP module can be mapped (Qwen3.5, one layer)."""
    if arch.model_type != "qwen3_5_moe" or arch.mtp_num_layers == 0:
        raise MappingError(f"{arch.model_type}: the config has no MTP layers (mtp_num_hidden_layers=0)")
    if arch.mtp_num_layers != 1:
        raise MappingError(
            f"mtp_num_hidden_layers={arch.mtp_num_layers}: Qwen3.5 checkpoints hold one fc / pre-fc norm / norm set "
            f"for their MTP module, which maps onto exactly one Megatron MTP layer"
        )


def table(arch: Architecture, mtp: bool = False) -> list[Rule]:
    """The mapping table of one architecture (with the MTP rules when `mtp`)."""
    P = hf_prefix(arch)
    gated = arch.model_type == "qwen3_5_moe"
    rules = [
        Rule(("embedding.word_embeddings.weight",), (P + "embed_tokens.weight",), "vocab", COLUMN),
        *_layer_rules("decoder.layers.{L}.", P + "layers.{L}.", arch, linear_attention=True),
        Rule(("decoder.final_layernorm.weight",), (P + "norm.weight",), "norm", hf_one_plus=gated),
    ]
    if mtp:
        check_mtp_supported(arch)
        rules += _mtp_rules(arch)
    return rules + [Rule(("output_layer.weight",), ("lm_head.weight",), "vocab", COLUMN)]


class Mapping:
    """The table of one architecture plus the transforms, in both directions.

    `mtp`: the Megatron model builds its MTP block, so HF `mtp.*` is mapped instead of carried through.
    """

    def __init__(self, arch: Architecture, padded_vocab_size: Optional[int] = None, mtp: bool = False):
        self.arch = arch
        self.mtp = mtp
        self.ctx = MappingContext(arch, padded_vocab_size or arch.vocab_size)
        self.rules = table(arch, mtp)
        self.passthrough = tuple(p for p in PASSTHROUGH_PREFIXES.get(arch.model_type, ())
                                 if not (mtp and p == MTP_PREFIX))

    def match(self, mcore_name: str) -> Match:
        for rule in self.rules:
            for rx in rule.regexes:
                m = rx.match(mcore_name)
                if m:
                    g = m.groupdict()
                    L, E, M = g.get("L"), g.get("E"), g.get("M")
                    names = tuple(h.format(L=L, E=E, M=M) for h in rule.hf)
                    layer = int(L) if L is not None else (self.arch.num_layers + int(M) if M is not None else None)
                    return Match(rule, mcore_name, names, layer, None if E is None else int(E))
        hint = ""
        if mcore_name.startswith(MTP_PREFIX) and not self.mtp:
            hint = " (an MTP parameter: the mapping was built without mtp=True)"
        raise MappingError(f"Megatron parameter {mcore_name!r} has no rule in the {self.arch.model_type} mapping "
                           f"table{hint}")

    def is_passthrough(self, hf_name: str) -> bool:
        return any(hf_name.startswith(p) for p in self.passthrough)

    # ---- transforms -------------------------------------------------------------------------
    def to_hf(self, m: Match, full: torch.Tensor, mcore_zero_centered: bool = False) -> list[tuple[str, torch.Tensor]]:
        """Full Megatron tensor -> HF (name, tensor) pairs."""
        kind, a = m.rule.kind, self.arch
        if kind == "copy":
            outs = [full]
        elif kind == "vocab":
            outs = [full[: a.vocab_size]]
        elif kind == "norm":
            outs = [_shift(full, int(mcore_zero_centered) - int(m.rule.hf_one_plus))]
        elif kind == "concat":
            outs = list(torch.split(full, self._concat_sizes(m), 0))
        elif kind in ("qkv", "gated_qkv"):
            outs = self._split_qkv(m, full, gated=kind == "gated_qkv")
        else:  # pragma: no cover - table is static
            raise MappingError(f"unknown transform {kind!r}")
        return [(n, t.contiguous()) for n, t in zip(m.hf_names, outs)]

    def to_mcore(self, m: Match, hf: Sequence[torch.Tensor], mcore_zero_centered: bool = False,
                 full_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """HF tensors (in `m.hf_names` order) -> the full Megatron tensor (`full_shape` sets padded vocab rows)."""
        kind = m.rule.kind
        if kind == "copy":
            return hf[0]
        if kind == "vocab":
            rows = full_shape[0] if full_shape is not None else self.ctx.padded_vocab_size
            pad = rows - hf[0].shape[0]
            if pad < 0:
                raise MappingError(f"{m.hf_names[0]}: {hf[0].shape[0]} rows exceed the padded vocabulary {rows}")
            return torch.cat([hf[0], hf[0].new_zeros(pad, *hf[0].shape[1:])]) if pad else hf[0]
        if kind == "norm":
            return _shift(hf[0], int(m.rule.hf_one_plus) - int(mcore_zero_centered))
        if kind == "concat":
            return torch.cat(list(hf), 0)
        if kind in ("qkv", "gated_qkv"):
            return self._merge_qkv(m, hf, gated=kind == "gated_qkv")
        raise MappingError(f"unknown transform {kind!r}")  # pragma: no cover

    def expected_hf_shapes(self, m: Match, full_shape: Sequence[int]) -> list[tuple[int, ...]]:
        """HF shapes implied by a full Megatron shape (for checks before any data moves)."""
        return [tuple(t.shape) for _, t in self.to_hf(m, torch.empty(full_shape, device="meta"))]

    def _concat_sizes(self, m: Match) -> list[int]:
        a = self.arch
        if m.rule.tp is GDN_IN:  # in_proj = [qkv; z; b; a]
            qk, v, nv = self.ctx.gdn_qk_dim(), self.ctx.gdn_v_dim(), a.linear_num_value_heads
            return [2 * qk + v, v, nv, nv]
        inter = a.moe_ffn_hidden_size if m.rule.expert else a.shared_expert_intermediate_size
        return [inter, inter]

    def _split_qkv(self, m: Match, full: torch.Tensor, gated: bool) -> list[torch.Tensor]:
        a, Q = self.arch, self.ctx.q_per_group
        G, D = a.num_key_value_heads, a.head_dim
        per = (2 * Q if gated else Q) + 2
        if full.shape[0] != G * per * D:
            raise MappingError(f"{m.mcore_name}: {full.shape[0]} rows, expected {G * per * D} "
                               f"({G} groups x {per} heads x {D})")
        x = full.reshape(G, per, D, *full.shape[1:])
        q = x[:, :Q]
        k, v = x[:, per - 2], x[:, per - 1]
        if gated:
            gate = x[:, Q:2 * Q]
            # HF q_proj: for every query head h, rows [q_h; gate_h].
            q = torch.stack([q, gate], dim=2)
        return [q.reshape(-1, *full.shape[1:]), k.reshape(-1, *full.shape[1:]), v.reshape(-1, *full.shape[1:])]

    def _merge_qkv(self, m: Match, hf: Sequence[torch.Tensor], gated: bool) -> torch.Tensor:
        a, Q = self.arch, self.ctx.q_per_group
        G, D = a.num_key_value_heads, a.head_dim
        q, k, v = hf
        rest = q.shape[1:]
        want_q = G * Q * D * (2 if gated else 1)
        for name, t, rows in zip(m.hf_names, (q, k, v), (want_q, G * D, G * D)):
            if t.shape[0] != rows:
                raise MappingError(f"{name}: shape {tuple(t.shape)}, expected {rows} rows")
        if gated:
            qg = q.reshape(G, Q, 2, D, *rest)
            parts = [qg[:, :, 0], qg[:, :, 1]]
        else:
            parts = [q.reshape(G, Q, D, *rest)]
        parts += [k.reshape(G, 1, D, *rest), v.reshape(G, 1, D, *rest)]
        return torch.cat(parts, dim=1).reshape(-1, *rest)


def _shift(t: torch.Tensor, delta: int) -> torch.Tensor:
    return t if delta == 0 else t + delta
