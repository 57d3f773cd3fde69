"""The GRPO prompt source: the 90/10 mix of RECIPE 4.3 over the configured datasets.

Prompts get the production system prompt (the one SFT trajectories and evaluation use) unless the
item brings its own system message, so RL samples the policy in the format it was warmed up on."""
from __future__ import annotations

from megatron_search.data.hf_datasets import iter_rows
from megatron_search.data.jsonl import DataError
from megatron_search.data.mix import MixItem, MixSampler, qa_item, rubric_item
from megatron_search.data.records import read_records
from megatron_search.data.sft import SYSTEM_PROMPT


def with_system_prompt(item: MixItem) -> MixItem:
    if item.messages and item.messages[0].get("role") == "system":
        return item
    item.messages = [{"role": "system", "content": SYSTEM_PROMPT}, *item.messages]
    return item


def build_eval_items(cfg) -> list[MixItem]:
    """The held-out QA prompts GRPO evaluates every grpo.eval_interval steps: the first grpo.eval_prompts
    records of data.qa_path in split grpo.eval_split, with the production system prompt. (That data.qa_path is
    set is a config check, config.stage_problems.)"""
    d, g = cfg.data, cfg.grpo
    recs = list(read_records(d.qa_path))
    items = [with_system_prompt(qa_item(r)) for r in recs if r.split == g.eval_split][: g.eval_prompts]
    if not items:
        raise ValueError(f"grpo.eval_split: no record of split {g.eval_split!r} in {d.qa_path} "
                         f"(splits there: {sorted({r.split for r in recs})})")
    return items


def build_mix_sampler(d) -> MixSampler:
    """A MixSampler over data.qa_path (QA records) and data.rubric_path (rubric rows), weighted by
    data.mix. Every dataset the mix weighs must have at least one train item (that it has a path is a config
    check, config.stage_problems). Paths are files or folders read through `datasets` (data/hf_datasets.py).
    `d`: the DataConfig."""
    paths = {"qa": d.qa_path, "rubric": d.rubric_path}
    datasets = {}
    for name, weight in d.mix.items():
        if weight <= 0:
            continue
        if name == "qa":
            items = [qa_item(r) for r in read_records(d.qa_path) if r.split == "train"]
        else:
            items = [rubric_item(r) for r in _rubric_rows(d.rubric_path) if r.get("split", "train") == "train"]
        if not items:
            raise ValueError(f"data.{name}_path: no train items in {paths[name]}")
        datasets[name] = [with_system_prompt(it) for it in items]
    weights = {k: v for k, v in d.mix.items() if k in datasets}
    return MixSampler(datasets, weights, seed=d.seed)


def _rubric_rows(path) -> list[dict]:
    """Rubric rows of a file or folder; an unreadable row is a DataError naming file:line."""
    out = []
    for row in iter_rows(path):
        if row.error:
            raise DataError(f"{row.where}: {row.error}")
        out.append(row.data)
    return out
