"""Aggregates over result rows: the budget curve and the deployment metrics (RECIPE 8).

- budget curve: per (model, benchmark, b): accuracy (= fraction CORRECT of all examples, the figure FRAMES
  and FACTS publish), the SimpleQA summary (not attempted = declined or hedged),
  mean exact/substring/F1, mean tool calls, mean tokens in/out, and the grading protocols of its rows;
- abstention: on the set whose evidence documents were withheld from the index
  (`withhold_evidence`), the fraction of episodes whose final answer declines (grade
  NOT_ATTEMPTED with an answer); higher is better; `no_answer` (no final answer at all) and
  `answered_wrong` are reported beside it;
- language mismatch: fraction of answers whose language (lingua) differs from the question's,
  among pairs where both languages are determined (texts shorter than eval.min_language_chars or
  below eval.language_min_confidence are undetermined and counted apart);
- broken tool calls: per class, broken calls / all calls, plus the fraction of episodes with any
  broken call; the tool_choice=none variant reports the fraction of episodes that called anyway;
- sbs: the reward model's mean P_bar(candidate answer, baseline answer) over the same prompts
  (rm/sbs.py), pairs taken from two models' results.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional, Sequence

from lingua import Language, LanguageDetectorBuilder

from megatron_search.rewards.answer import normalize_answer
from megatron_search.rm.sbs import sbs
from megatron_search.search.tool import BROKEN_KINDS

from .benchmarks import EvalExample
from .graders import simpleqa_summary


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def summarize(rows: Sequence[dict]) -> dict:
    """Accuracy, SimpleQA summary, matchers, tool calls and tokens of a group of results."""
    s = simpleqa_summary([r["grade"] for r in rows])
    return {
        **s, "accuracy": s["correct"],
        "exact": _mean([float(r["exact"]) for r in rows]), "substring": _mean([float(r["substring"]) for r in rows]),
        "token_f1": _mean([r["f1"] for r in rows]),
        "mean_tool_calls": _mean([r["tool_calls"] for r in rows]),
        "mean_effective_calls": _mean([r["tool_calls"] - r.get("failed_calls", 0) for r in rows]),
        "mean_tokens_in": _mean([r["tokens_in"] for r in rows]), "mean_tokens_out": _mean([r["tokens_out"] for r in rows]),
        "judge_malformed": sum(bool(r.get("judge_malformed")) for r in rows),
        # how the rows were graded; "unrecorded" marks rows written before results kept it (a resumed old run)
        "protocols": sorted({r.get("protocol") or "unrecorded" for r in rows}),
    }


def paired_accuracy_difference(candidate: Sequence[dict], baseline: Sequence[dict]) -> dict:
    """Accuracy of `candidate` minus `baseline` over the questions both answered, paired by question
    id: each question's accuracy is the mean over its samples, the difference is averaged over
    questions, and `stderr` is the standard error of that mean (sample std of the per-question
    differences / sqrt(questions); 0 for fewer than two questions). Pairing removes the spread
    between easy and hard questions that two independent accuracies would carry."""
    def per_question(rows: Sequence[dict]) -> dict[str, float]:
        hits: dict[str, list[float]] = defaultdict(list)
        for r in rows:
            hits[r["id"]].append(float(r["grade"] == "CORRECT"))
        return {q: _mean(v) for q, v in hits.items()}

    a, b = per_question(candidate), per_question(baseline)
    common = sorted(set(a) & set(b))
    diffs = [a[q] - b[q] for q in common]
    n = len(diffs)
    mean = _mean(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    return {"difference": mean, "stderr": (var / n) ** 0.5 if n > 1 else 0.0, "questions": n}


def group(rows: Iterable[dict], *fields: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        out[tuple(r[f] for f in fields)].append(r)
    return dict(sorted(out.items(), key=lambda kv: tuple(str(k) if k is None else k for k in kv[0])))


def budget_curve(rows: Iterable[dict]) -> dict[str, dict[str, dict[int, dict]]]:
    """{model: {benchmark: {b: summarize(...)}}} over the "budget" variant."""
    out: dict = defaultdict(dict)
    for (model, bench, b), g in group((r for r in rows if r["variant"] == "budget"), "model", "benchmark", "budget").items():
        out[model].setdefault(bench, {})[b] = summarize(g)
    return dict(out)


def broken_tool_calls(rows: Sequence[dict]) -> dict:
    """Per-class broken-call rates over all calls, and the fraction of episodes with a broken call."""
    calls = sum(r["tool_calls"] for r in rows)
    per = {k: sum(r["broken"].get(k, 0) for r in rows) for k in BROKEN_KINDS}
    return {"episodes": len(rows), "calls": calls,
            "rate_per_call": {k: (v / calls if calls else 0.0) for k, v in per.items()},
            "count": per, "broken_total_rate": (sum(per.values()) / calls if calls else 0.0),
            "episodes_with_broken": _mean([float(sum(r["broken"].values()) > 0) for r in rows])}


def tool_choice_none_rate(rows: Sequence[dict]) -> dict:
    """tool_choice=none episodes: fraction that still called a tool, and those calls per episode."""
    return {"episodes": len(rows), "episodes_calling": _mean([float(r["tool_calls"] > 0) for r in rows]),
            "calls_per_episode": _mean([r["tool_calls"] for r in rows])}


def abstention(rows: Sequence[dict]) -> dict:
    """Evidence-withheld episodes: declined, no final answer at all, answered wrong, answered right anyway.

    Only an answer that declines counts as abstention (grade NOT_ATTEMPTED with a final answer);
    an episode that ended without one (length or turn limit) is `no_answer`, not a decline.
    """
    n = len(rows)
    declined = [r["grade"] == "NOT_ATTEMPTED" and r["prediction"] is not None for r in rows]
    return {"episodes": n, "abstention_rate": _mean([float(d) for d in declined]),
            "no_answer": _mean([float(r["prediction"] is None) for r in rows]),
            "answered_wrong": _mean([float(r["grade"] == "INCORRECT") for r in rows]),
            "answered_right": _mean([float(r["grade"] == "CORRECT") for r in rows])}


class LanguageID:
    """lingua over a fixed language list; `detect(text)` -> ISO 639-1 code or None when undetermined."""

    def __init__(self, languages: Sequence[str], min_chars: int = 20, min_confidence: float = 0.5):
        try:
            langs = [getattr(Language, name.upper()) for name in languages]
        except AttributeError as e:
            raise ValueError(f"eval.languages: {e.args[0]} (use lingua Language names, e.g. ENGLISH)") from None
        if len(langs) < 2:
            raise ValueError("eval.languages: need at least two languages to tell apart")
        self.detector = LanguageDetectorBuilder.from_languages(*langs).build()
        self.min_chars = min_chars
        self.min_confidence = min_confidence

    def detect(self, text: Optional[str]) -> Optional[str]:
        if text is None or len(text.strip()) < self.min_chars:
            return None
        best = self.detector.compute_language_confidence_values(text)
        if not best or best[0].value < self.min_confidence:
            return None
        return best[0].language.iso_code_639_1.name.lower()


def language_mismatch(rows: Sequence[dict], lid: LanguageID) -> dict:
    """Fraction of determined (question, answer) pairs whose languages differ."""
    determined = mismatched = 0
    for r in rows:
        q, a = lid.detect(r["question"]), lid.detect(r["prediction"])
        if q is None or a is None:
            continue
        determined += 1
        mismatched += q != a
    return {"episodes": len(rows), "determined": determined, "undetermined": len(rows) - determined,
            "mismatch_rate": mismatched / determined if determined else 0.0}


def withhold_evidence(docs: Iterable[dict], examples: Sequence[EvalExample]) -> tuple[list[dict], list[str]]:
    """The corpus minus every document that could support an answer: (kept docs, withheld doc ids).

    A document is evidence for an example when its URL is one of the example's evidence links
    (metadata `wikipedia_links` / `urls`) or its normalised title+text contains a normalised gold
    answer on word boundaries (so the answer cannot be read off any search result).
    """
    urls = set()
    golds = set()
    for e in examples:
        for k in ("wikipedia_links", "urls"):
            v = e.metadata.get(k)
            if isinstance(v, list):
                urls.update(str(u) for u in v)
        golds.update(g for g in (normalize_answer(a) for a in e.answers) if g)
    kept, withheld = [], []
    for d in docs:
        text = f" {normalize_answer(d.get('title', '') + ' ' + d.get('text', ''))} "
        if d.get("url") in urls or any(f" {g} " in text for g in golds):
            withheld.append(d["id"])
        else:
            kept.append(d)
    if not kept:
        raise ValueError("withhold_evidence: every document is evidence for some example; nothing left to search")
    return kept, withheld


def sbs_rows(rows: Sequence[dict], candidate: str, baseline: str, variant: str = "budget",
             budget: Optional[int] = None) -> list[dict]:
    """{context, candidate, baseline} for every example both models answered (same set, variant, b).

    A missing final answer is the empty string (as in the GRPO preference score).
    """
    def index(model: str) -> dict:
        return {(r["benchmark"], r["id"], r.get("sample", 0)): r for r in rows
                if r["model"] == model and r["variant"] == variant and r["budget"] == budget}

    cand, base = index(candidate), index(baseline)
    out = []
    for key in sorted(set(cand) & set(base)):
        c, b = cand[key], base[key]
        out.append({"context": [{"role": "user", "content": c["question"]}], "candidate": c["prediction"] or "",
                    "baseline": b["prediction"] or "", "benchmark": key[0], "id": key[1]})
    return out


def sbs_metric(scorer, pairs: Sequence[dict]) -> dict:
    """rm/sbs.py's sbs (mean P_bar, win/tie/loss) of candidate vs baseline answers with a reward-model scorer."""
    return sbs(scorer, [p["context"] for p in pairs], [p["candidate"] for p in pairs], [p["baseline"] for p in pairs])
