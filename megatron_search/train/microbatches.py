"""Micro-batches of one rank's GRPO rows: sorted by length, each cut to its own longest row.

The rollout batch is padded to its longest transcript (up to rollout.max_total_tokens), and most rows are far
shorter. Attention is causal, so the positions after a row's last trained token change nothing in its loss:
each micro-batch is cut to the last trained position of its longest row, rounded up to
parallel.sequence_multiple (sequence parallelism splits the sequence by TP). Rows are sorted by that length
first, so rows of similar length share a micro-batch (as slime's dynamic batch size and verl's padding
removal avoid computing on padding).

Grouping, per optimizer step:
- `rows_per_mb` rows per micro-batch (grpo.micro_batch_size): the same count on every rank;
- a token budget (grpo.max_tokens_per_micro_batch): as many rows as keep rows x width within it, a longer row
  alone. Ranks of one expert-parallel group exchange tokens in every micro-batch, so all data-parallel ranks
  must run the same number of them: the caller agrees on the largest count (`agree`) and `plan_groups` splits
  this rank's largest micro-batches to reach it; where rows run out, inert micro-batches (one row, no trained
  token) make up the rest. Under pipeline parallelism a budget keeps at least `min_count` micro-batches
  (4 x PP, as far as rows allow): 1F1B idles each stage for PP - 1 of m + PP - 1 slots, so packing 16 rows
  into 3 micro-batches at PP 4 would idle half the pipeline.

Pure functions of the mask and plain lists; policy_step.py builds the RolloutBatch slices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .rollout_batch import RolloutBatch, round_up


@dataclass(frozen=True)
class Batching:
    """How one rank's rows become micro-batches (the grpo and parallel config fields)."""

    rows: int = 1  # grpo.micro_batch_size
    max_tokens: Optional[int] = None  # grpo.max_tokens_per_micro_batch: a token budget instead of a row count
    multiple: int = 1  # parallel.sequence_multiple
    trim: bool = True  # grpo.trim_padding: cut each micro-batch to its longest row
    min_count: int = 1  # with a budget: at least this many micro-batches per step, rows allowing (4 x PP)


def trained_lengths(mask_BS: torch.Tensor) -> list[int]:
    """Per row, the positions up to and including its last trained token (0: a row with none). Host tensors:
    batches stay on the host until the forward step, so this reads no device."""
    s = mask_BS.shape[-1]
    pos = torch.arange(1, s + 1, dtype=torch.long)
    return ((mask_BS > 0).long() * pos).amax(-1).tolist() if s else [0] * mask_BS.shape[0]


def width_of(group: list[int], lengths: list[int], multiple: int, full: int) -> int:
    """Positions a micro-batch of these rows needs: its longest row rounded up to `multiple` (at least one
    multiple), never more than the batch's own width `full`."""
    longest = max((lengths[i] for i in group), default=0)
    return min(full, round_up(max(longest, 1), multiple))


def group_rows(lengths: list[int], rows_per_mb: int, max_tokens: Optional[int], multiple: int,
               full: int) -> list[list[int]]:
    """Row indices of each micro-batch, longest rows first. Without a budget, `rows_per_mb` rows each (the
    row count must divide); with one, consecutive sorted rows while rows x width <= max_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if max_tokens is None:
        if len(order) % rows_per_mb:
            raise ValueError(f"{len(order)} rollouts on this rank are not a multiple of "
                             f"grpo.micro_batch_size={rows_per_mb}")
        return [order[i:i + rows_per_mb] for i in range(0, len(order), rows_per_mb)]
    groups: list[list[int]] = []
    for i in order:
        # sorted longest first: the first row of a group sets its width
        if groups and (len(groups[-1]) + 1) * width_of(groups[-1], lengths, multiple, full) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def split_to(groups: list[list[int]], count: int, lengths: list[int], multiple: int, full: int) -> list[list[int]]:
    """`groups` split until there are `count` of them (or every group is one row): the costliest group of two or
    more rows (rows x width) is halved each time, its longer half first."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [j for j, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            break
        j = max(splittable, key=lambda j: (len(groups[j]) * width_of(groups[j], lengths, multiple, full), -j))
        g = groups[j]
        groups[j:j + 1] = [g[:len(g) // 2], g[len(g) // 2:]]
    return groups


def plan_groups(lengths: list[int], rows_per_mb: int, max_tokens: Optional[int], multiple: int, full: int,
                agree: Optional[Callable[[int], int]] = None, min_count: int = 1) -> tuple[list[list[int]], int]:
    """Row groups of one optimizer step and how many inert micro-batches to add. With a budget, at least
    min(min_count, rows) groups, and `agree(n)` returns the largest n over the data-parallel ranks (every rank
    calls it, once per optimizer step)."""
    groups = group_rows(lengths, rows_per_mb, max_tokens, multiple, full)
    if max_tokens is None:
        return groups, 0
    count = max(len(groups), min(min_count, len(lengths)))
    if agree is not None:
        count = agree(count)
    groups = split_to(groups, count, lengths, multiple, full)
    return groups, count - len(groups)


def build_microbatches(part: RolloutBatch, groups: list[list[int]], inert: int, multiple: int,
                       trim: bool) -> list[RolloutBatch]:
    """The RolloutBatch of each group (its rows, cut to their width when `trim`), then `inert` one-row
    micro-batches that train nothing (a copy of the shortest width, mask and advantage 0)."""
    full = part.tokens_BS.shape[1]
    lengths = trained_lengths(part.mask_BS)
    out = []
    for g in groups:
        mb = part.select(g)
        out.append(mb.cut(width_of(g, lengths, multiple, full)) if trim else mb)
    for _ in range(inert):
        out.append(part.select([0]).cut(min(full, multiple) if trim else full).inert())
    return out


def padding_counts(mbs: list[RolloutBatch], full: int) -> list[float]:
    """[positions computed (rows x width summed over micro-batches), positions if every row were padded to the
    batch's longest (`full`), positions up to each row's last trained token]."""
    computed = sum(mb.size * mb.tokens_BS.shape[1] for mb in mbs)
    padded = sum(mb.size for mb in mbs) * full
    needed = sum(sum(trained_lengths(mb.mask_BS)) for mb in mbs)
    return [float(computed), float(padded), float(needed)]


def padding_metrics(counts: list[float], micro_batches: int, dp: int) -> dict[str, float]:
    """Metrics of `padding_counts` summed over the data-parallel ranks: positions per micro-batch, and what the
    micro-batches computed against padding every row to the batch's longest (1.0 without trim_padding)."""
    computed, padded, needed = counts
    return {"positions_per_micro_batch": computed / max(micro_batches * dp, 1),
            "positions_vs_longest": computed / max(padded, 1.0),
            "positions_needed_vs_longest": needed / max(padded, 1.0),
            "micro_batches": float(micro_batches)}
