"""Forward passes of the local engine: an HF transformers MoE model over a persistent batched cache.

`RunningBatch` holds the running requests' model state in batched tensors that live from step to
step, one row per request: K/V for attention layers (each row right-padded to the buffer width,
its own length masking the rest), conv + recurrent state for Gated DeltaNet layers. A decode step
writes each row's new K/V at that row's own column and runs ONE forward for all rows; nothing is
stacked or split. Joining requests are prefilled together into fresh rows (left-padded: padding
writes into a sink column no one reads, and the GDN layers see it zeroed, so their state stays
exactly zero through it); GDN rows that continue a cached prefix are prefilled only with rows
of the same new length, unpadded, since padding would decay their state. A leaving row is
replaced by the last row (compaction).
Router top-k indices are captured by forward hooks, one row per fed token, for routing replay.

`SeqState` is one sequence's state with batch dimension 1, owned: what the prefix store keeps
(finished sequences, shared prompt heads) and what a joining request starts from.

Device: the model, the batch's tensors and the fed ids live on the model's device (CPU by default,
or one CUDA device); logits come back to the host as fp32, where the engine samples with its
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
from transformers.cache_utils import DynamicLayer

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

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def put(self, state: SeqState, owned: bool = False) -> None:
        """Keep `state` (copied unless `owned`: the caller hands over memory nothing else references)."""
        if self.max_entries == 0 or not state.tokens:
            return
        state = state if owned else state.owned()
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
        self.hybrid = "linear" in self.layer_types
        self.state_shapes = self._probe_state_shapes()

    def _probe_state_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype, tuple[int, ...], torch.dtype]]:
        """Per layer, the (shape, dtype) of its two state tensors for one row, read off a 2-token forward:
        attention K and V ([H, 0, D]: the sequence axis is sized by the batch), GDN conv and recurrent state.
        Read from transformers' own cache so every version's layouts and state dtypes are what it makes."""
        cache = DynamicCache(config=self.model.config)
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        with torch.no_grad():
            self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        self._captured.clear()
        out = []
        for kind, layer in zip(self.layer_types, cache.layers):
            if kind == "attention":
                k, v = layer.keys, layer.values
                out.append(((k.shape[1], 0, k.shape[3]), k.dtype, (v.shape[1], 0, v.shape[3]), v.dtype))
            else:
                c, r = layer.conv_states[0], layer.recurrent_states[0]
                out.append((tuple(c.shape[1:]), c.dtype, tuple(r.shape[1:]), r.dtype))
        return out

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

    @torch.no_grad()
    def prefill(self, tokens: list[int], prefix: Optional[SeqState] = None) -> tuple[SeqState, torch.Tensor]:
        """Feed `tokens` after `prefix` (or from scratch) as one sequence; returns its owned state and fp32 host
        logits [V]. (The engine admits through `RunningBatch.admit`; this is the same path for one sequence.)"""
        batch = RunningBatch(self, max_rows=1)
        owner = object()
        logits = batch.admit([(list(prefix.tokens if prefix else []) + list(tokens), prefix, [owner])])
        return batch.export(owner), logits[0]

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
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask, cache) -> torch.Tensor:
        """One cached forward; fp32 host logits of each row's last position [rows, V]."""
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True, logits_to_keep=1,
                         **{self._cache_kw: cache})
        return out.logits[:, -1].float().cpu()


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class _RowsKV(DynamicLayer):
    """One attention layer's view of the batch during one forward. `update` writes the fed tokens' K/V into the
    persistent buffers at their columns (`cols` [rows, q]; padding goes to the sink column) and hands attention the
    buffers up to `width` columns, which the forward's mask cuts to each row's own length."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, cols: torch.Tensor, width: int):
        super().__init__()
        self.keys, self.values, self._cols, self._width = keys, values, cols, width
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        for buf, new in ((self.keys, key_states), (self.values, value_states)):
            buf.scatter_(2, self._cols[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3]), new)
        return self.keys[:, :, : self._width], self.values[:, :, : self._width]

    def get_seq_length(self) -> int:
        """Columns before this forward's tokens (what transformers sizes a mask it builds itself by: an unmasked
        decode step, every row as long as the others)."""
        return max(0, self._width - self._cols.shape[1])


class RunningBatch:
    """The running requests' model state in persistent batched tensors; row i belongs to `owners[i]`.

    Per attention layer K and V [R, H, C + 1, D]: row i's first `lengths[i]` columns are its tokens, the rest is
    masked, column C is a sink that padding writes into and nothing reads. Per GDN layer conv [R, conv_dim, k] and
    recurrent [R, H, Dk, Dv] state. Rows 0..n-1 are in use (a leaving row is replaced by the last one), so every
    forward runs on a contiguous slice, in place. Capacity grows by doubling (rows up to `max_rows`, columns up
    to the context length, never allocated up front) and shrinks in `fit` once use falls to a quarter; an empty
    batch holds no tensors. Buffers start zeroed, so masked columns hold finite values (masking adds -inf).
    """

    MIN_ROWS, MIN_COLS = 4, 64

    def __init__(self, runner: ModelRunner, max_rows: int, max_prefill_tokens: int = 8192):
        self.runner = runner
        self.max_rows = max(1, int(max_rows))
        self.max_prefill_tokens = max(1, int(max_prefill_tokens))
        self.owners: list = []
        self.lengths: list[int] = []  # tokens fed per row (the cache columns in use)
        self.tokens: list[list[int]] = []
        self.experts: list[list[np.ndarray]] = []  # per row, chunks of [n, L, K] int32
        self.bufs: list[list[torch.Tensor]] = []  # per layer [K, V] or [conv, recurrent]
        self.cap_rows = self.cap_cols = 0
        self.forwards = 0  # model forwards run (prefill groups + decode steps), for tests and benches

    def __len__(self) -> int:
        return len(self.owners)

    def __contains__(self, owner) -> bool:
        return any(o is owner for o in self.owners)

    def _row(self, owner) -> int:
        for i, o in enumerate(self.owners):
            if o is owner:
                return i
        raise KeyError("request has no row in the running batch")

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for pair in self.bufs for t in pair)

    # -- memory ------------------------------------------------------------------------------
    def _alloc(self, rows: int, cols: int) -> None:
        """Fresh zeroed buffers of `rows` x `cols` (+ sink), the live rows and columns copied over."""
        n, live = len(self.owners), max(self.lengths, default=0)
        dev, new = self.runner.device, []
        for li, (kind, (sa, da, sb, db)) in enumerate(zip(self.runner.layer_types, self.runner.state_shapes)):
            if kind == "attention":
                a = torch.zeros((rows, sa[0], cols + 1, sa[2]), dtype=da, device=dev)
                b = torch.zeros((rows, sb[0], cols + 1, sb[2]), dtype=db, device=dev)
                if self.bufs and n:
                    a[:n, :, :live] = self.bufs[li][0][:n, :, :live]
                    b[:n, :, :live] = self.bufs[li][1][:n, :, :live]
            else:
                a = torch.zeros((rows, *sa), dtype=da, device=dev)
                b = torch.zeros((rows, *sb), dtype=db, device=dev)
                if self.bufs and n:
                    a[:n], b[:n] = self.bufs[li][0][:n], self.bufs[li][1][:n]
            new.append([a, b])
        self.bufs, self.cap_rows, self.cap_cols = new, rows, cols

    def _reserve(self, rows: int, cols: int) -> None:
        """Room for `rows` rows of `cols` columns; grows to the next power of two, capped by max_rows and the
        context length (a larger need than those caps still gets exactly what it needs)."""
        if rows <= self.cap_rows and cols <= self.cap_cols:
            return
        new_rows = self.cap_rows if rows <= self.cap_rows else max(rows, min(self.max_rows, max(self.MIN_ROWS, _pow2(rows))))
        new_cols = self.cap_cols if cols <= self.cap_cols else max(cols, min(self.runner.max_positions,
                                                                            max(self.MIN_COLS, _pow2(cols))))
        self._alloc(new_rows, new_cols)

    def fit(self) -> None:
        """Give memory back once rows or columns in use fall to a quarter of the capacity (all of it when empty)."""
        n = len(self.owners)
        if n == 0:
            self.clear()
            return
        need = max(self.lengths) + 1
        rows = max(self.MIN_ROWS, _pow2(n)) if n * 4 <= self.cap_rows and self.cap_rows > self.MIN_ROWS else self.cap_rows
        cols = max(self.MIN_COLS, _pow2(need)) if need * 4 <= self.cap_cols and self.cap_cols > self.MIN_COLS else self.cap_cols
        if (rows, cols) != (self.cap_rows, self.cap_cols):
            self._alloc(rows, cols)

    def clear(self) -> None:
        """Drop every row and free the tensors."""
        self.owners, self.lengths, self.tokens, self.experts = [], [], [], []
        self.bufs, self.cap_rows, self.cap_cols = [], 0, 0

    # -- rows --------------------------------------------------------------------------------
    def _seat(self, owner, state: Optional[SeqState]) -> int:
        """Put `owner` in the next row, starting from `state` (its cache rows are copied in) or from nothing."""
        r = len(self.owners)
        c = len(state.tokens) if state is not None else 0
        for li, kind in enumerate(self.runner.layer_types):
            a, b = self.bufs[li]
            if kind == "attention":
                if c:
                    k, v = state.layers[li]
                    a[r, :, :c], b[r, :, :c] = k[0], v[0]
            elif state is not None:
                conv, rec = state.layers[li]
                a[r], b[r] = conv[0], rec[0]
            else:
                a[r].zero_()
                b[r].zero_()
        self.owners.append(owner)
        self.lengths.append(c)
        self.tokens.append(list(state.tokens) if state is not None else [])
        self.experts.append(list(state.experts) if state is not None else [])
        return r

    def _copy_row(self, src: int, dst: int) -> None:
        n = self.lengths[src]
        for kind, (a, b) in zip(self.runner.layer_types, self.bufs):
            if kind == "attention":
                a[dst, :, :n], b[dst, :, :n] = a[src, :, :n], b[src, :, :n]
            else:
                a[dst], b[dst] = a[src], b[src]

    def _fork(self, src: int, owner) -> None:
        """A new row for `owner` holding a copy of row `src` (members of a GRPO group after their shared prefill)."""
        r = len(self.owners)
        self._copy_row(src, r)
        self.owners.append(owner)
        self.lengths.append(self.lengths[src])
        self.tokens.append(list(self.tokens[src]))
        self.experts.append(list(self.experts[src]))  # chunks are never written to: sharing them is safe

    def remove(self, owner) -> None:
        """Free `owner`'s row: the last row moves into it, so rows stay contiguous."""
        r, last = self._row(owner), len(self.owners) - 1
        if r != last:
            self._copy_row(last, r)
            for lst in (self.owners, self.lengths, self.tokens, self.experts):
                lst[r] = lst[last]
        for lst in (self.owners, self.lengths, self.tokens, self.experts):
            lst.pop()
        if not self.owners:
            self.clear()

    def routed_experts(self, owner, start: int = 0) -> np.ndarray:
        """[fed tokens - start, L, K] router top-k of `owner`'s row (one row per fed token)."""
        r = self._row(owner)
        chunks = self.experts[r]
        if len(chunks) != 1:
            chunks = self.experts[r] = [np.concatenate(chunks, axis=0)]
        return chunks[0][start:]

    def export(self, owner) -> SeqState:
        """An owned copy of `owner`'s state (for the prefix store)."""
        r = self._row(owner)
        n = self.lengths[r]
        layers = []
        for kind, (a, b) in zip(self.runner.layer_types, self.bufs):
            if kind == "attention":
                layers.append((a[r : r + 1, :, :n].clone(), b[r : r + 1, :, :n].clone()))
            else:
                layers.append((a[r : r + 1].clone(), b[r : r + 1].clone()))
        experts = [np.concatenate(self.experts[r], axis=0)] if self.experts[r] else []
        return SeqState(list(self.tokens[r]), layers, experts)

    # -- forwards ----------------------------------------------------------------------------
    def admit(self, entries: list[tuple[list[int], Optional[SeqState], list]]) -> torch.Tensor:
        """Prefill new rows. Each entry is (target tokens, prefix state whose tokens are a strict prefix of the
        target, or None; owners): the target is fed once, into the first owner's row, and the other owners get
        copies of that row. Entries are prefilled together, longest first, up to `max_prefill_tokens` padded
        tokens per forward; on a hybrid model entries that continue a prefix go together only when their new
        tokens are equally many, unpadded (see the module docstring). Returns fp32 host logits after each
        entry's target [entries, V]."""
        if not entries:
            return torch.empty(0, int(self.runner.config.vocab_size))
        new_len = [len(t) - (len(p.tokens) if p is not None else 0) for t, p, _ in entries]
        for (t, p, owners), k in zip(entries, new_len):
            if k < 1 or (p is not None and list(t[: len(p.tokens)]) != list(p.tokens)) or not owners:
                raise ValueError("admit: every entry needs owners and a prefix that is a strict prefix of its target")
        order = sorted(range(len(entries)), key=lambda i: -new_len[i])

        def pack(indices: list[int], equal: bool) -> list[list[int]]:
            out: list[list[int]] = []
            for i in indices:  # longest first: a group's first entry sets its padded length
                g = out[-1] if out else None
                if (g is not None and new_len[g[0]] * (len(g) + 1) <= self.max_prefill_tokens
                        and (not equal or new_len[g[0]] == new_len[i])):
                    g.append(i)
                else:
                    out.append([i])
            return out

        continuing = {i for i in order if self.runner.hybrid and entries[i][1] is not None}
        groups = pack([i for i in order if i not in continuing], False) + pack([i for i in order if i in continuing], True)
        self._reserve(len(self.owners) + sum(len(o) for _, _, o in entries), max(len(t) for t, _, _ in entries))
        logits: list[Optional[torch.Tensor]] = [None] * len(entries)
        for g in groups:
            r0 = len(self.owners)
            for i in g:
                self._seat(entries[i][2][0], entries[i][1])
            out = self._forward(r0, [list(entries[i][0][self.lengths[r0 + j]:]) for j, i in enumerate(g)])
            for j, i in enumerate(g):
                logits[i] = out[j]
        for _, _, owners in entries:  # after every forward, so each group's rows were contiguous
            src = self._row(owners[0])
            for o in owners[1:]:
                self._fork(src, o)
        return torch.stack(logits)

    def decode(self, next_tokens: list[int]) -> torch.Tensor:
        """Feed one token per row (in row order) in one forward; fp32 host logits [rows, V]."""
        if len(next_tokens) != len(self.owners):
            raise ValueError(f"decode: {len(next_tokens)} tokens for {len(self.owners)} rows")
        self._reserve(len(self.owners), max(self.lengths) + 1)
        return self._forward(0, [[t] for t in next_tokens])

    @torch.no_grad()
    def _forward(self, r0: int, new: list[list[int]]) -> torch.Tensor:
        """Feed `new[j]` to row r0 + j after its cached columns, all rows in one forward, left-padded."""
        runner, m = self.runner, len(new)
        q = max(len(t) for t in new)
        starts = self.lengths[r0 : r0 + m]
        width = max(s + len(t) for s, t in zip(starts, new))
        padded = any(len(t) != q for t in new)
        if q == 1:
            ids = torch.tensor(new, dtype=torch.long)
            pos = torch.tensor(starts, dtype=torch.long)[:, None]
            cols = pos
        else:
            sink = self.cap_cols
            ids = torch.tensor([[0] * (q - len(t)) + t for t in new], dtype=torch.long)
            pos = torch.tensor([[0] * (q - len(t)) + list(range(s, s + len(t))) for s, t in zip(starts, new)],
                               dtype=torch.long)
            cols = torch.tensor([[sink] * (q - len(t)) + list(range(s, s + len(t))) for s, t in zip(starts, new)],
                                dtype=torch.long)
        dev = runner.device
        if q == 1 and min(starts) == max(starts):
            attn_mask = None  # every row's columns are all of [0, width)
        else:  # query at position p sees columns <= p; padding queries (p = 0) see column 0 only, so stay finite
            attn_mask = (torch.arange(width)[None, None, :] <= pos[:, :, None])[:, None].to(dev)
        if runner.hybrid:
            gdn_mask = (cols != self.cap_cols).to(device=dev, dtype=runner.model.dtype) if padded else None
            mask = {"full_attention": attn_mask, "linear_attention": gdn_mask}
        else:
            mask = attn_mask
        cache = DynamicCache(config=runner.model.config)
        cols_dev = cols.to(dev)
        views = []
        for li, kind in enumerate(runner.layer_types):
            a, b = self.bufs[li][0][r0 : r0 + m], self.bufs[li][1][r0 : r0 + m]
            views.append((a, b))
            if kind == "attention":
                cache.layers[li] = _RowsKV(a, b, cols_dev, width)
            else:
                layer = cache.layers[li]
                layer.conv_states[0], layer.recurrent_states[0] = a, b
                layer.conv_kernel_size[0] = a.shape[-1]
                layer.device, layer.dtype = a.device, a.dtype
                layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
                layer.has_previous_state[0] = True  # zeroed rows are exactly a fresh state
        logits = runner.forward(ids.to(dev), pos.to(dev), mask, cache)
        for kind, layer, (a, b) in zip(runner.layer_types, cache.layers, views):
            if kind != "attention":  # transformers updates these in place; copy if a version ever replaces them
                if layer.conv_states[0].data_ptr() != a.data_ptr():
                    a.copy_(layer.conv_states[0])
                if layer.recurrent_states[0].data_ptr() != b.data_ptr():
                    b.copy_(layer.recurrent_states[0])
        experts = runner._take_experts()  # [m * q, L, K]
        if experts is not None:
            if q == 1:
                for j in range(m):
                    self.experts[r0 + j].append(experts[j : j + 1])
            else:
                per = experts.reshape(m, q, *experts.shape[1:])
                for j, t in enumerate(new):
                    self.experts[r0 + j].append(per[j, q - len(t):].copy())
        for j, t in enumerate(new):
            self.lengths[r0 + j] += len(t)
            self.tokens[r0 + j].extend(t)
        self.forwards += 1
        return logits
