"""SFT batches: chat examples -> token ids with an assistant-only loss mask -> packed [B, S] rows.

Input rows (JSONL, the format data/sft.py writes): {"id", "messages", "tools"?, "loss_roles"?}.
A conversation is rendered with the model's chat format (chat/format.py) and tokenised
the way a rollout produces it: every text up to and including an assistant generation prefix
(`<|im_start|>assistant\\n`, plus `<think>\\n` in think="open" mode) is one prompt segment
(loss 0), and each assistant body through its `<|im_end|>` is one generated segment (loss 1,
so the model learns to stop). Segments are tokenised separately, exactly as the agent loop
joins prompt ids and generated ids (token in, token out), so SFT trains on the token
sequences the policy later sees. Prompts, tool responses and headers carry no loss (RECIPE 2).

Datasets are JSONL files (or parquet / Arrow / Hub-layout or save_to_disk folders) read through Hugging
Face `datasets` into memory-mapped Arrow (data/hf_datasets.py): rows are parsed when drawn, not held.
Batches: datasets are mixed by weight with data/mix.py's deterministic, resumable sampler;
examples are packed greedily into rows of seq_length + 1 tokens (packing=True; attention then
spans neighbouring examples, as in plain GPT packing: GDN in Megatron 0.16 has no packed-sequence
support) or one example per row (packing=False), padded with <|endoftext|> and loss 0. An example
longer than a row is truncated (counted). With sft.trim_padding each batch is then cut to its
longest row (rounded up to the sequence-parallel multiple), so short rows cost no padding compute
beyond the batch's longest. The sampler state is the data position a checkpoint saves.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megatron_search.chat.format import IM_END, IM_START, ChatFormat
from megatron_search.chat.tokenizer import ChatTokenizer, load_tokenizer
from megatron_search.data.hf_datasets import row_table
from megatron_search.data.jsonl import DataError
from megatron_search.data.mix import MixSampler
from megatron_search.trainer.step import Batch

from .rollout_batch import round_up

ASSISTANT_HEADER = f"{IM_START}assistant\n"


@dataclass
class TokenizedExample:
    """ids[i] is a training target when mask[i] == 1."""

    ids: list[int]
    mask: list[int]


def chat_format_for(model) -> ChatFormat:
    """The chat format of a ModelConfig's chat_style (default think mode of that style)."""
    return ChatFormat(model.chat_style)


def tokenizer_for(model) -> ChatTokenizer:
    """A ModelConfig's tokenizer, loaded and checked against the model's vocabulary."""
    spec = model.tokenizer
    tok = load_tokenizer(spec)
    vocab = model.architecture.vocab_size
    if tok.vocab_size > vocab:
        raise DataError(f"model.tokenizer {spec!r} has {tok.vocab_size} ids but the model has only {vocab} embeddings "
                        "(the tiny models need the demo BPE: model.tokenizer=<path of its tokenizer.json>)")
    return tok


def segment_conversation(fmt: ChatFormat, messages: list[dict], tools: Optional[list[dict]], where: str
                         ) -> list[tuple[str, int]]:
    """The rendered conversation cut into (text, loss) segments; see the module docstring."""
    text = fmt.render(messages, tools)
    prefix = fmt.generation_prefix()
    n_assistant = sum(1 for m in messages if m.get("role") == "assistant")
    segments, pos, found = [], 0, 0
    while True:
        start = text.find(ASSISTANT_HEADER, pos)
        if start < 0:
            break
        body = start + len(ASSISTANT_HEADER)
        if text.startswith(prefix, start):
            body = start + len(prefix)
        end = text.find(IM_END, body)
        if end < 0:
            raise DataError(f"{where}: assistant turn without {IM_END} in the rendering")
        end += len(IM_END)
        segments.append((text[pos:body], 0))
        segments.append((text[body:end], 1))
        pos, found = end, found + 1
    if found != n_assistant:
        raise DataError(f"{where}: {n_assistant} assistant message(s) but {found} assistant turn(s) in the rendering "
                        f"(does a message contain {ASSISTANT_HEADER!r}?)")
    if pos < len(text):
        segments.append((text[pos:], 0))
    return segments


def tokenize_example(row: dict, tokenizer: ChatTokenizer, fmt: ChatFormat, where: str) -> TokenizedExample:
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    roles = row.get("loss_roles", ["assistant"])
    if roles != ["assistant"]:
        raise DataError(f"{where}: loss_roles {roles!r}: only ['assistant'] is supported (RECIPE 2)")
    if not any(m.get("role") == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message, nothing to train on")
    ids: list[int] = []
    mask: list[int] = []
    for seg_text, loss in segment_conversation(fmt, messages, row.get("tools"), where):
        seg = tokenizer.encode(seg_text)
        ids.extend(seg)
        mask.extend([loss] * len(seg))
    return TokenizedExample(ids, mask)


class SFTRows(Sequence):
    """One SFT dataset as a random-access sequence of rows, each tagged with `_where` (path:id, or
    path:#n for rows without an id). The rows stay in memory-mapped Arrow (data/hf_datasets.RowTable)
    and are parsed when the mix sampler draws them, so a set need not fit in memory."""

    def __init__(self, path: str, split: Optional[str] = None):
        self.path = path
        self.table = row_table(path, split)

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = i + len(self) if i < 0 else i
        row = dict(self.table[n])
        rid = row.get("id")
        row["_where"] = f"{self.path}:{rid if rid is not None else '#' + str(n + 1)}"
        return row


def load_sft_datasets(paths: dict[str, float]) -> dict[str, SFTRows]:
    """Every dataset of cfg.sft.datasets (a JSONL / parquet / Arrow file, or a folder in the Hub's layout or
    saved with save_to_disk, read through `datasets`) as random-access rows tagged with their file:id.
    Every row is read once here, so a malformed line fails now, naming its file and line."""
    if not paths:
        raise DataError("sft.datasets is empty: give at least one JSONL path with a weight (sft.datasets={path: w})")
    out = {}
    for path in paths:
        if not Path(path).exists():
            raise DataError(f"sft.datasets: no such file or folder {path}")
        rows = SFTRows(path)
        if not len(rows):
            raise DataError(f"sft.datasets: {path} has no rows")
        out[path] = rows
    return out


def location_free_names(paths: list[str]) -> dict[str, str]:
    """{path: name} with the shortest trailing path parts that tell the datasets apart ("sft_tool.jsonl",
    or "a/train.jsonl" beside "b/train.jsonl"). The mix sampler's shuffles are keyed by dataset name,
    so naming by full path made the data order, and with it the trained model, depend on where the
    run's files live (two demo runs in different directories differed from the first step)."""
    parts = {p: Path(p).parts for p in paths}
    for k in range(1, max((len(v) for v in parts.values()), default=1) + 1):
        names = {p: "/".join(v[-k:]) for p, v in parts.items()}
        if len(set(names.values())) == len(names):
            return names
    raise DataError(f"sft.datasets: the same file is listed twice: {sorted(paths)}")


class SFTBatcher:
    """Global SFT batches [global_batch_size, seq_length] from a weighted mix of datasets.

    Deterministic given the seed and the datasets' names (location_free_names: not where they are);
    `state_dict()` (JSON) is the position to save and restore.
    """

    def __init__(self, datasets: dict[str, list[dict]], weights: dict[str, float], tokenizer: ChatTokenizer,
                 fmt: ChatFormat, seq_length: int, global_batch_size: int, packing: bool, seed: int,
                 trim_multiple: Optional[int] = None):
        self.names = location_free_names(list(datasets))
        self.sampler = MixSampler({self.names[p]: rows for p, rows in datasets.items()},
                                  {self.names.get(p, p): w for p, w in weights.items()}, seed=seed)
        self.tokenizer, self.fmt = tokenizer, fmt
        self.seq_length, self.rows, self.packing = seq_length, global_batch_size, packing
        if trim_multiple is not None and (trim_multiple < 1 or seq_length % trim_multiple):
            raise ValueError(f"trim_multiple={trim_multiple} must be >= 1 and divide seq_length={seq_length}")
        self.trim_multiple = trim_multiple
        self.pad_id = tokenizer.pad_id
        self.truncated = 0  # examples cut to one row since the start (or resume)
        self._cache: dict[str, TokenizedExample] = {}

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        sampler = dict(state["sampler"])
        if set(sampler["counts"]) == set(self.names):  # saved before datasets were named location-free
            sampler = {**sampler, **{k: {self.names[p]: v for p, v in sampler[k].items()} for k in ("counts", "credit")}}
        self.sampler.load_state_dict(sampler)

    def _example(self, row: dict) -> TokenizedExample:
        key = row["_where"]
        if key not in self._cache:
            ex = tokenize_example(row, self.tokenizer, self.fmt, key)
            width = self.seq_length + 1
            if len(ex.ids) > width:
                if not any(ex.mask[1:width]):
                    raise DataError(f"{key}: no assistant token within sft.seq_length={self.seq_length} (the first "
                                    f"is token {ex.mask.index(1)} of {len(ex.ids)}); raise sft.seq_length")
                self.truncated += 1
                ex = TokenizedExample(ex.ids[:width], ex.mask[:width])
            self._cache[key] = ex
        return self._cache[key]

    def next_batch(self) -> Batch:
        """The next global batch: tokens/labels [rows, width], loss_mask over labels. width is
        seq_length, or with trim_multiple the longest row's targets rounded up to that multiple: the
        columns cut are padding in every row (loss 0, and causal attention never lets a real token
        see them), so the cross-entropy is the same for less compute (the MoE load-balancing loss
        just stops counting padding tokens)."""
        width = self.seq_length + 1
        rows: list[tuple[list[int], list[int]]] = []
        cur_ids: list[int] = []
        cur_mask: list[int] = []
        while True:
            snapshot = self.sampler.state_dict()
            ex = self._example(self.sampler.next())
            if cur_ids and (not self.packing or len(cur_ids) + len(ex.ids) > width):
                rows.append((cur_ids, cur_mask))
                cur_ids, cur_mask = [], []
                if len(rows) == self.rows:
                    self.sampler.load_state_dict(snapshot)  # un-draw: this example opens the next batch
                    break
            cur_ids, cur_mask = cur_ids + ex.ids, cur_mask + ex.mask
        if self.trim_multiple is not None:
            targets = max(len(row_ids) for row_ids, _ in rows) - 1
            width = min(width, round_up(targets, self.trim_multiple) + 1)
        ids = torch.full((self.rows, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((self.rows, width), dtype=torch.float32)
        for r, (row_ids, row_mask) in enumerate(rows):
            ids[r, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
            mask[r, : len(row_mask)] = torch.tensor(row_mask, dtype=torch.float32)
        return Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), mask[:, 1:].contiguous())
