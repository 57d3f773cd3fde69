"""QA correctness (r_base for verifiable questions): answer normalisation and three matchers.

normalize_answer follows the convention of search-agent QA peers (SQuAD-style), made
Unicode-aware because answers come in many languages:
  1. case-fold (str.casefold: a stronger lower-case, "Straße" -> "strasse");
  2. delete punctuation: every character of a Unicode punctuation category (P*), so
     "U.S." -> "us" and "rock-and-roll" -> "rockandroll" (deleted, not replaced by a space,
     as in SQuAD);
  3. drop the English articles a / an / the as whole words;
  4. collapse runs of whitespace to one space and strip the ends.

Matchers (prediction vs one gold answer or a list of aliases; any alias matching counts):
  exact_match      normalised strings equal;
  substring_match  the normalised gold occurs in the normalised prediction on word boundaries
                   (" gold " in " pred "), so "paris" matches "it is paris france" but "cat"
                   does not match "concatenate";
  token_f1         SQuAD token F1 over normalised words (max over aliases); when either side
                   has no words, 1.0 if both are empty, else 0.0.
A gold answer that normalises to the empty string (e.g. "The.") would match everything under
substring_match, so it is rejected with a ValueError: that is bad data, not a correct answer.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Literal, Sequence, Union

from megatron_search.text import normalize_answer

Golds = Union[str, Sequence[str]]


def _normalized_golds(gold: Golds) -> list[str]:
    golds = [gold] if isinstance(gold, str) else list(gold)
    if not golds:
        raise ValueError("gold: no reference answer given")
    out = []
    for g in golds:
        n = normalize_answer(g)
        if not n:
            raise ValueError(f"gold: reference answer {g!r} is empty after normalisation")
        out.append(n)
    return out


def exact_match(prediction: str, gold: Golds) -> bool:
    p = normalize_answer(prediction)
    return any(p == g for g in _normalized_golds(gold))


def substring_match(prediction: str, gold: Golds) -> bool:
    p = f" {normalize_answer(prediction)} "
    return any(f" {g} " in p for g in _normalized_golds(gold))


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, gold: Golds) -> float:
    p = normalize_answer(prediction).split()
    return max(_f1(p, g.split()) for g in _normalized_golds(gold))


MatchMode = Literal["exact", "substring"]


def qa_reward(prediction: str | None, gold: Golds, mode: MatchMode = "substring") -> int:
    """r_base of a QA rollout in {0, 1}; a rollout without a final answer (None) scores 0."""
    if mode not in ("exact", "substring"):
        raise ValueError(f"answer_match: {mode!r} is not 'exact' or 'substring'")
    if prediction is None:
        _normalized_golds(gold)  # still reject bad gold data
        return 0
    match = exact_match if mode == "exact" else substring_match
    return int(match(prediction, gold))


def rubric_reward(passed: Iterable[bool]) -> int:
    """r_base of a rubric-chat rollout: 1 iff every rubric passes. No rubrics is bad data."""
    results = list(passed)
    if not results:
        raise ValueError("rubrics: empty rubric set, r_base is undefined")
    for i, r in enumerate(results):
        if not isinstance(r, bool):
            raise TypeError(f"rubrics: result {i} is {type(r).__name__} {r!r}, expected bool")
    return int(all(results))
