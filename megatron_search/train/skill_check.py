"""sft.skill_check: does the model under training answer held-out examples exactly, greedily?

A curriculum stage that exists to teach one skill (the demo's copy and reading warm-ups) checks that
skill instead of trusting a fixed step count: every `every` steps the model decodes the held-out
prompts greedily on its own device, and the share answered exactly decides whether the stage is done.
The decode is a plain loop of full forwards (no KV cache): the check sets are a few dozen short
prompts, and the forward is the training model itself, so nothing is converted or copied.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megatron_search.data.jsonl import read_jsonl


@torch.no_grad()
def greedy_decode(model, prompts: Sequence[Sequence[int]], stop_ids: Sequence[int], max_new_tokens: int,
                  pad_id: int, early_exit: bool = True) -> list[list[int]]:
    """Greedy continuations of `prompts` by a Megatron GPT model called as model(tokens, position_ids, None)
    (causal). Rows are right-padded, so each row's next token is read at its own last position. A row stops
    at a stop id (kept out of its output). With early_exit=False every call runs `max_new_tokens` forwards,
    so ranks that must meet in each forward (expert parallelism) take the same number of them."""
    device = next(model.parameters()).device
    rows = [list(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in rows]
    done = [not p for p in rows]
    stops = set(stop_ids)
    for _ in range(max_new_tokens):
        active = [i for i, d in enumerate(done) if not d] or ([0] if not early_exit and rows else [])
        if not active:
            break
        lengths = torch.tensor([len(rows[i]) for i in active])
        tokens = torch.full((len(active), int(lengths.max())), pad_id, dtype=torch.long)
        for j, i in enumerate(active):
            tokens[j, :len(rows[i])] = torch.tensor(rows[i])
        tokens = tokens.to(device)
        positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
        logits = model(tokens, positions, None)
        nxt = logits[torch.arange(len(active), device=device), (lengths - 1).to(device)].argmax(-1).tolist()
        for i, tok in zip(active, nxt):
            if done[i]:
                continue
            if tok in stops:
                done[i] = True
                continue
            rows[i].append(tok)
            outs[i].append(tok)
    return outs


class SkillCheck:
    """The held-out examples of one sft.skill_check, encoded once; `grade(model)` decodes and grades them."""

    def __init__(self, cfg, encoder):
        sc = cfg.sft.skill_check
        self.cfg = sc
        self.encoder = encoder
        self.early_exit = cfg.parallel.ep == 1
        self.prompts, self.expected = [], []
        for i, ex in enumerate(read_jsonl(sc.path)):
            if i >= sc.max_examples:
                break
            msgs = ex.get("messages") or []
            if not msgs or msgs[-1].get("role") != "assistant" or not isinstance(msgs[-1].get("content"), str):
                raise ValueError(f"{sc.path} (row {i + 1}): a skill-check example ends with the expected assistant "
                                 "message")
            self.prompts.append(encoder.prompt_ids(msgs[:-1], ex.get("tools") or None))
            self.expected.append(msgs[-1]["content"].strip())
        if not self.prompts:
            raise ValueError(f"sft.skill_check.path {sc.path}: no examples")

    def due(self, iteration: int) -> bool:
        return iteration >= self.cfg.min_steps and iteration % self.cfg.every == 0

    def answers(self, model) -> list[str]:
        tok = self.encoder.tokenizer
        was_training = model.training
        model.eval()
        try:
            outs = greedy_decode(model, self.prompts, self.encoder.stop_ids, self.cfg.max_new_tokens, tok.pad_id,
                                 early_exit=self.early_exit)
        finally:
            model.train(was_training)
        return [self.encoder.parse_turn(o).content for o in outs]

    def grade(self, model, show: int = 3) -> tuple[float, list[dict]]:
        """(share answered exactly, the first `show` misses as {"expected", "got"}): the misses say what the
        skill lacks (an empty "got" is a turn without text, e.g. another tool call instead of the answer)."""
        got = self.answers(model)
        misses = [{"expected": e, "got": a} for a, e in zip(got, self.expected) if a != e]
        return (len(got) - len(misses)) / len(got), misses[:show]
