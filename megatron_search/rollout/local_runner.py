"""Forward passes of the local engine: an HF transformers MoE model with per-request state.

Each request owns its cache rows (`SeqState`, batch dimension 1): KV for attention layers,
conv + recurrent state for Gated DeltaNet layers. A decode step stacks the rows of all running
requests into one transformers `DynamicCache` (attention KV left-padded to the longest, with
a padding mask and each row's true position), runs ONE batched forward, and splits the cache
back. Prefill runs per request (padding would leak into the GDN recurrence). Router top-k
indices are captured by forward hooks, one row per fed token, for routing replay.

Device: the model, its cache rows and the fed ids live on the model's device (CPU by default, or
one CUDA device); logits come back to the host as fp32, where the engine samples with its
per-request CPU generators, so a seeded request draws the same tokens on any device.
"""
from __future__ import annotations

import inspect
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import transformers
from transformers import AutoConfig, DynamicCache

_ROUTER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(path: str | Path, dtype: str = "float32", seed: int = 0,
                  device: str | torch.device = "cpu") -> torch.nn.Module:
    """The HF model at `path` (a config.json directory) on `device`: safetensors weights when present,
    otherwise a seeded random initialisation on the host (the tiny test models ship only a config),
    so the same seed gives the same weights on every device."""
    path = Path(path)
    if path.is_file():
        path = path.parent
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"local engine: no config.json in {path}")
    cfg = AutoConfig.from_pretrained(str(path))
    arch = (cfg.architectures or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise ValueError(f"local engine: {path}/config.json names architecture {arch!r}, unknown to transformers")
    torch_dtype = _DTYPES[dtype]
    if any(path.glob("*.safetensors")):
        model = cls.from_pretrained(str(path), dtype=torch_dtype)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls(cfg).to(torch_dtype)
    return model.to(device).eval()


def text_config(model: torch.nn.Module):
    return model.config.get_text_config(decoder=True)


@dataclass
class SeqState:
    """Model state after feeding `tokens` (cache rows with batch dim 1, router top-k per token)."""

    tokens: list[int] = field(default_factory=list)
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    experts: list[np.ndarray] = field(default_factory=list)  # chunks of [n, L, K] int32

    def routed_experts(self, start: int = 0) -> np.ndarray:
        all_NLK = np.concatenate(self.experts, axis=0) if len(self.experts) != 1 else self.experts[0]
        self.experts = [all_NLK]
        return all_NLK[start:]

    def owned(self) -> "SeqState":
        """A copy that owns its memory. A decoded state's rows are views into the whole batch's cache
        (and its experts into the batch's router output), so keeping it would keep the batch alive:
        B times its own size (a 64-request eval grew the engine to 21 GB this way)."""
        experts = [self.routed_experts().copy()] if self.experts else []
        return SeqState(list(self.tokens), [(k.clone(), v.clone()) for k, v in self.layers], experts)


class PrefixStore:
    """LRU of sequence states for reuse by later requests (next turns, shared prompts).

    Exact entries: a stored sequence that is a strict prefix of the input is reused whole (any
    model). Block entries (attention-only models, whose KV can be cut): every `block`-token
    boundary of a stored sequence is indexed, so inputs that share only a head with it (the
    system prompt and tool list) reuse that head, cut to the boundary.
    """

    def __init__(self, max_entries: int, block: int = 0):
        self.max_entries = max_entries
        self.block = block
        self._entries: OrderedDict[tuple, SeqState] = OrderedDict()
        self._blocks: OrderedDict[tuple, SeqState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        """Bytes of the cached states (cache rows and routed experts), each storage counted once."""
        seen, total = set(), 0
        for st in list(self._entries.values()) + list(self._blocks.values()):
            for t in (x for pair in st.layers for x in pair if isinstance(x, torch.Tensor)):
                s = t.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
            total += sum(e.nbytes for e in st.experts)
        return total

    def put(self, state: SeqState) -> None:
        if self.max_entries == 0 or not state.tokens:
            return
        state = state.owned()
        key = tuple(state.tokens)
        self._entries[key] = state
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        if self.block:
            for b in range(self.block, len(key) + 1, self.block):
                self._blocks[key[:b]] = state
                self._blocks.move_to_end(key[:b])
            while len(self._blocks) > self.max_entries * 8:  # bounded like the exact entries
                self._blocks.popitem(last=False)

    def longest_prefix(self, tokens: list[int]) -> tuple[Optional[SeqState], int]:
        """(state, n): reuse the first n tokens of `state` (n < len(tokens)); (None, 0) if nothing fits."""
        best, best_n = None, 0
        for n in sorted({len(k) for k in self._entries}, reverse=True):
            if n < len(tokens):
                key = tuple(tokens[:n])
                if key in self._entries:
                    self._entries.move_to_end(key)
                    best, best_n = self._entries[key], n
                    break
        if self.block:
            b = (len(tokens) - 1) // self.block * self.block
            while b > best_n:
                state = self._blocks.get(tuple(tokens[:b]))
                if state is not None:
                    return state, b
                b -= self.block
        return best, best_n

    def clear(self) -> None:
        self._entries.clear()
        self._blocks.clear()


class ModelRunner:
    """Runs prefill and batched decode for a transformers causal LM (Qwen3-MoE, Qwen3.5-MoE)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device
        self.config = text_config(model)
        self.layer_types = self._layer_types()
        # transformers renamed forward's `past_key_values` to `cache` (5.2x; the old name warns until 5.40):
        # pass whichever this version's model takes, so older images (5.17) run the engine too
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._routers = self._find_routers()
        self._captured: dict[int, torch.Tensor] = {}
        for layer_idx, module in self._routers:
            module.register_forward_hook(self._make_hook(layer_idx))

    # -- model facts ------------------------------------------------------------------------
    def _layer_types(self) -> list[str]:
        probe = DynamicCache(config=self.model.config)
        kinds = []
        for layer in probe.layers:
            kinds.append("linear" if hasattr(layer, "conv_states") else "attention")
        return kinds

    def _find_routers(self) -> list[tuple[int, torch.nn.Module]]:
        out = []
        for name, module in self.model.named_modules():
            m = _ROUTER_NAME.search(name)
            if m and "visual" not in name and hasattr(module, "top_k"):
                out.append((int(m.group(1)), module))
        return sorted(out, key=lambda x: x[0])

    @property
    def can_crop(self) -> bool:
        """Attention-only models can cut a state to any prefix (GDN recurrent states cannot)."""
        return all(k == "attention" for k in self.layer_types)

    def crop(self, state: SeqState, n: int) -> SeqState:
        """The state after the first n tokens of `state` (attention-only models)."""
        if not self.can_crop or not 0 < n <= len(state.tokens):
            raise ValueError(f"cannot crop a state of {len(state.tokens)} tokens to {n} for layers {self.layer_types}")
        experts = [state.routed_experts()[:n]] if state.experts else []
        return SeqState(list(state.tokens[:n]), [(k[:, :, :n], v[:, :, :n]) for k, v in state.layers], experts)

    @property
    def num_moe_layers(self) -> int:
        return len(self._routers)

    @property
    def top_k(self) -> int:
        return int(self._routers[0][1].top_k) if self._routers else 0

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    def eos_token_ids(self) -> list[int]:
        eos = getattr(self.config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def _make_hook(self, layer_idx: int):
        def hook(_module, _inputs, output):
            # Routers return (logits, scores, indices); indices are [batch*seq, top_k].
            self._captured[layer_idx] = output[2].detach()
        return hook

    def _take_experts(self) -> Optional[np.ndarray]:
        if not self._routers:
            return None
        cols = [self._captured.pop(i) for i, _ in self._routers]
        return torch.stack(cols, dim=1).to(torch.int32).cpu().numpy()  # [rows, L, K]

    # -- forward passes ---------------------------------------------------------------------
    def _cache_from(self, states: list[SeqState]) -> tuple[DynamicCache, list[int]]:
        """One DynamicCache holding every state's rows; attention KV left-padded to the longest."""
        lengths = [len(s.tokens) for s in states]
        longest = max(lengths)
        pads = [longest - n for n in lengths]
        cache = DynamicCache(config=self.model.config)
        for li, (kind, layer) in enumerate(zip(self.layer_types, cache.layers)):
            a = [s.layers[li][0] for s in states]
            b = [s.layers[li][1] for s in states]
            if kind == "attention":
                if any(pads):
                    a = [torch.nn.functional.pad(t, (0, 0, p, 0)) for t, p in zip(a, pads)]
                    b = [torch.nn.functional.pad(t, (0, 0, p, 0)) for t, p in zip(b, pads)]
                layer.keys, layer.values = torch.cat(a), torch.cat(b)
                layer.device, layer.is_initialized = layer.keys.device, True
            else:
                conv, rec = torch.cat(a), torch.cat(b)
                layer.conv_states[0], layer.recurrent_states[0] = conv, rec
                layer.conv_kernel_size[0] = conv.shape[-1]
                layer.device, layer.dtype = conv.device, conv.dtype
                layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
                layer.has_previous_state[0] = True
        return cache, pads

    def _rows_of(self, cache: DynamicCache, row: int, pad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for kind, layer in zip(self.layer_types, cache.layers):
            if kind == "attention":
                out.append((layer.keys[row : row + 1, :, pad:], layer.values[row : row + 1, :, pad:]))
            else:
                out.append((layer.conv_states[0][row : row + 1], layer.recurrent_states[0][row : row + 1]))
        return out

    @torch.no_grad()
    def prefill(self, tokens: list[int], prefix: Optional[SeqState] = None) -> tuple[SeqState, torch.Tensor]:
        """Feed `tokens` after `prefix` (or from scratch); returns the new state and fp32 host logits [V]."""
        start = len(prefix.tokens) if prefix else 0
        if prefix:
            cache, _ = self._cache_from([prefix])
        else:
            cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(tokens), dtype=torch.long, device=self.device)[None]
        out = self.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        experts = self._take_experts()
        state = SeqState(
            tokens=(prefix.tokens if prefix else []) + list(tokens),
            layers=self._rows_of(cache, 0, 0),  # the forward grew `cache` in place
            experts=(list(prefix.experts) if prefix else []) + ([experts] if experts is not None else []),
        )
        return state, out.logits[0, -1].float().cpu()

    @torch.no_grad()
    def decode(self, states: list[SeqState], next_tokens: list[int]) -> tuple[list[SeqState], torch.Tensor]:
        """Feed one token per state in a single batched forward; returns new states and fp32 host logits [B, V]."""
        cache, pads = self._cache_from(states)
        longest = len(states[0].tokens) + pads[0]
        mask = torch.ones(len(states), longest + 1, dtype=torch.long)
        for r, p in enumerate(pads):
            mask[r, :p] = 0
        ids = torch.tensor(next_tokens, dtype=torch.long, device=self.device)[:, None]
        pos = torch.tensor([len(s.tokens) for s in states], dtype=torch.long, device=self.device)[:, None]
        out = self.model(
            input_ids=ids, position_ids=pos, attention_mask=mask.to(self.device) if any(pads) else None,
            use_cache=True, logits_to_keep=1, **{self._cache_kw: cache},
        )
        experts = self._take_experts()
        new_states = []
        for r, (s, tok) in enumerate(zip(states, next_tokens)):
            new_states.append(
                SeqState(
                    tokens=s.tokens + [tok],
                    layers=self._rows_of(cache, r, pads[r]),
                    experts=s.experts + ([experts[r : r + 1]] if experts is not None else []),
                )
            )
        return new_states, out.logits[:, -1].float().cpu()
