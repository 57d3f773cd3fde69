"""Pointwise and pairwise scorers on the reward model, batched (RECIPE 5.1).

Texts (chat format of the policy, so the RM reads what the policy writes):
    pointwise  render(context + [assistant: answer])                      -> score s(x, y)
    pairwise   render(context + [assistant: PAIR_TEMPLATE(first, second)]) -> Delta(x, first, second)
The value is read at the last token (<|im_end|> of the answer turn). Over-long texts keep their
last `max_length` tokens (the end carries the answers).

Row layout of a batch of pairs (training and scoring): rows 2i and 2i+1 belong to pair i;
pointwise: (x, a), (x, b); pairwise: (x, a, b), (x, b, a). Deltas and the symmetric loss come
from rewards/bradley_terry.py through `pair_deltas`.

Exact antisymmetry: `RMScorer` scores each distinct text once, in a canonical (sorted) order, so
the rows of a request and of the same request with every pair swapped are the same forward
passes; P_bar(x, a, b) + P_bar(x, b, a) == 1 then holds bit for bit (bradley_terry computes
P_bar so that p(z) + p(-z) == 1 exactly).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from megatron_search.distributed import collectives as coll
from megatron_search.distributed.stages import is_last_stage, last_stage_rank, size_of
from megatron_search.trainer.step import Batch, forward_backward
from megatron_search.rewards.bradley_terry import ScorerKind, debiased_delta, preference_probability, scorer_deltas

from .model import values_at

PAIR_TEMPLATE = "[Answer 1]\n{first}\n\n[Answer 2]\n{second}"


class PairEncoder:
    """Token ids of the scored texts for one (tokenizer, chat format)."""

    def __init__(self, tokenizer, fmt, kind: ScorerKind, max_length: int):
        if kind not in ("pointwise", "pairwise"):
            raise ValueError(f"scorer kind: {kind!r} is not 'pointwise' or 'pairwise'")
        self.tokenizer, self.fmt, self.kind, self.max_length = tokenizer, fmt, kind, max_length

    def text(self, messages: Sequence[dict], first: str, second: str | None = None) -> str:
        content = first if self.kind == "pointwise" else PAIR_TEMPLATE.format(first=first, second=second)
        # drop the newline after <|im_end|>: the value is read at the end-of-turn token
        return self.fmt.render(list(messages) + [{"role": "assistant", "content": content}]).rstrip("\n")

    def ids(self, messages: Sequence[dict], first: str, second: str | None = None) -> tuple[int, ...]:
        ids = self.tokenizer.encode(self.text(messages, first, second))
        return tuple(ids[-self.max_length:])

    def pair_rows(self, messages: Sequence[dict], a: str, b: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The two rows of one pair (see the module docstring)."""
        if self.kind == "pointwise":
            return self.ids(messages, a), self.ids(messages, b)
        return self.ids(messages, a, b), self.ids(messages, b, a)


@dataclass
class RMBatch(Batch):
    """Padded rows [B, S] (labels unused by the RM; loss_mask = real tokens), the index of each row's
    last token [B] and each row's pair label [B] (1: the pair's answer a is preferred)."""

    last_index: Tensor | None = None
    pair_label: Tensor | None = None

    def slice(self, start: int, stop: int) -> "RMBatch":
        if start % 2 or stop % 2:
            raise ValueError(f"RMBatch.slice({start}, {stop}): would split a pair (rows 2i, 2i+1)")
        b = super().slice(start, stop)
        return RMBatch(b.tokens, b.labels, b.loss_mask, self.last_index[start:stop], self.pair_label[start:stop])


def make_batch(rows: Sequence[Sequence[int]], pad_id: int, labels: Sequence[float] | None = None,
               seq_multiple: int = 1, min_length: int = 0) -> RMBatch:
    """Right-padded batch of token rows; S rounds up to a multiple of seq_multiple (SP needs S % TP == 0)."""
    if not rows:
        raise ValueError("make_batch: no rows")
    lengths = [len(r) for r in rows]
    if min(lengths) == 0:
        raise ValueError("make_batch: an empty row (nothing to score)")
    s = max(max(lengths), min_length)
    s = -(-s // seq_multiple) * seq_multiple
    tokens = torch.full((len(rows), s), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), s), dtype=torch.float32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1.0
    last = torch.as_tensor(lengths, dtype=torch.long) - 1
    lab = torch.zeros(len(rows)) if labels is None else torch.as_tensor(labels, dtype=torch.float32)
    return RMBatch(tokens, tokens.clone(), mask, last, lab)


def pair_deltas(kind: ScorerKind, values: Tensor) -> tuple[Tensor, Tensor]:
    """(Delta(x, a, b), Delta(x, b, a)) per pair from the last-token values [2P] of paired rows."""
    if values.shape[0] % 2:
        raise ValueError(f"pair_deltas: {values.shape[0]} rows is not a whole number of pairs")
    even = torch.arange(0, values.shape[0], 2)
    odd = even + 1
    if kind == "pointwise":
        return scorer_deltas(kind, lambda _x, rows: values[rows], None, even, odd)
    return scorer_deltas(kind, lambda _x, first, _second: values[first], None, even, odd)


# ---------------------------------------------------------------------------------- forward
def forward_values(chunks: list, batch: RMBatch, micro_batch_rows: int, groups) -> Tensor:
    """Last-token values [B] of every row, forward only; the same tensor on every rank.

    Runs Megatron's schedule (so PP works), gathers the last stage's values and broadcasts them
    over the pipeline group of `groups`. Rows are padded with copies of the last row to whole microbatches.
    """
    n = batch.tokens.shape[0]
    mbs = max(2, micro_batch_rows - micro_batch_rows % 2)
    pad = (-n) % mbs
    if pad:
        rep = lambda t: torch.cat([t, t[-1:].expand(pad, *t.shape[1:])])  # noqa: E731
        batch = RMBatch(rep(batch.tokens), rep(batch.labels), rep(batch.loss_mask), rep(batch.last_index),
                        rep(batch.pair_label))
    total = batch.tokens.shape[0]
    num_mb = total // mbs

    def collect(output, batch):
        v = values_at(output, batch.last_index)
        return v.sum() * 0.0, {"values": v.detach()}

    training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        with torch.no_grad():
            out = forward_backward(chunks, [batch.slice(i * mbs, (i + 1) * mbs) for i in range(num_mb)], num_mb,
                                   batch.tokens.shape[1], mbs, loss_fn=collect, forward_only=True)
    finally:
        for c, t in zip(chunks, training):
            c.train(t)
    values = torch.zeros(total, dtype=torch.float32)
    if is_last_stage(groups):
        values = torch.cat([d["values"].float().cpu() for d in out])
    if size_of(groups.pp) > 1:  # placed on the group's device by the helper
        coll.broadcast(values, src=last_stage_rank(groups), group=groups.pp)
    return values[:n]


class RMScorer:
    """Batched P_bar / Delta on a reward model (every rank of the model's layout calls it together)."""

    def __init__(self, chunks: list, encoder: PairEncoder, pad_id: int, batch_rows: int, seq_multiple: int = 1,
                 *, groups):
        self.chunks, self.encoder, self.pad_id = chunks, encoder, pad_id
        self.batch_rows, self.seq_multiple, self.groups = batch_rows, seq_multiple, groups

    @property
    def kind(self) -> ScorerKind:
        return self.encoder.kind

    def _values(self, rows: list[tuple[int, ...]]) -> dict[tuple[int, ...], float]:
        """Value of each distinct row; distinct rows are scored in sorted order (module docstring)."""
        unique = sorted(set(rows))
        out: dict[tuple[int, ...], Tensor] = {}
        for i in range(0, len(unique), self.batch_rows):
            part = unique[i:i + self.batch_rows]
            v = forward_values(self.chunks, make_batch(part, self.pad_id, seq_multiple=self.seq_multiple),
                               self.batch_rows, self.groups)
            out.update(zip(part, v))
        return out

    def _checked(self, contexts, a, b) -> None:
        if not (len(contexts) == len(a) == len(b)):
            raise ValueError(f"scorer: {len(contexts)} contexts, {len(a)} and {len(b)} answers")
        for i, (x, ya, yb) in enumerate(zip(contexts, a, b)):
            if not isinstance(ya, str) or not isinstance(yb, str):
                raise ValueError(f"scorer: pair {i}: answers must be strings")
            if not x:
                raise ValueError(f"scorer: pair {i}: empty context (no chat messages)")

    def _lookup(self, contexts, a, b):
        self._checked(contexts, a, b)
        enc = self.encoder
        if self.kind == "pointwise":
            keys = {(i, w): enc.ids(x, y) for i, x in enumerate(contexts) for w, y in (("a", a[i]), ("b", b[i]))}
        else:
            keys = {(i, w): enc.ids(x, *ys) for i, x in enumerate(contexts)
                    for w, ys in (("a", (a[i], b[i])), ("b", (b[i], a[i])))}
        values = self._values(list(keys.values()))
        return {k: values[r] for k, r in keys.items()}

    def deltas(self, contexts: Sequence, a: Sequence[str], b: Sequence[str]) -> tuple[Tensor, Tensor]:
        """(Delta(x, a, b), Delta(x, b, a)) per pair."""
        if not contexts:
            return torch.zeros(0), torch.zeros(0)
        v = self._lookup(contexts, a, b)
        idx = list(range(len(contexts)))
        if self.kind == "pointwise":
            score = lambda _x, side: torch.stack([v[(i, side)] for i in idx])  # noqa: E731
            return scorer_deltas("pointwise", score, None, "a", "b")
        pair = lambda _x, first, _second: torch.stack([v[(i, first)] for i in idx])  # noqa: E731
        return scorer_deltas("pairwise", pair, None, "a", "b")

    def p_bar(self, contexts: Sequence, a: Sequence[str], b: Sequence[str]) -> Tensor:
        """P_bar(x, a, b): probability that a beats b, position-independent, in [0, 1]."""
        if not contexts:
            return torch.zeros(0)
        return preference_probability(debiased_delta(*self.deltas(contexts, a, b)))
