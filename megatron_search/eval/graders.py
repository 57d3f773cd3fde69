"""Answer grading: normalised matchers and LLM judges (SimpleQA, FRAMES and Facts Open protocols).

Every graded example gets the three matcher scores (rewards/answer.py: exact match, gold
substring, token F1), one grade, CORRECT / INCORRECT / NOT_ATTEMPTED, and the protocol that gave it
(`Grade.protocol`, kept in each result row so the report can say how a set was graded):

- `MatchGrader` (no LLM): no final answer, or an answer that declines (a phrase of
  prompts/abstention_phrases_v1.txt in the normalised answer, and no gold match) -> NOT_ATTEMPTED;
  else CORRECT iff the configured matcher (substring or exact) matches.
- `LLMJudgeGrader`: the benchmark's judge through the OpenAI-compatible client
  (data/llm_client.py), prompts in prompts/ (versioned files), chosen by benchmark name
  (`protocols`, default {"frames": "frames", "facts": "facts"}; any other set: SimpleQA).
  * simpleqa: the SimpleQA grades, "Grade: ..." (or simple-evals' letters A/B/C).
  * frames: the FRAMES autorater answers TRUE/FALSE (TRUE -> CORRECT; FALSE -> NOT_ATTEMPTED when
    the answer declines as above, else INCORRECT).
  * facts: Facts Open, most likely the public split of FACTS Search (Google DeepMind FACTS Benchmark
    Suite, 2025-12-09; arXiv 2512.10791). Taken from the public sources: automated judge models score
    each response, and the published figure is accuracy, correct / all examples (the FACTS score
    averages accuracy over sets). Ours, because the FACTS Search judge prompt was not
    available: prompts/facts_search_judge_v1.txt, written for a search agent's whole (possibly long,
    cited) response; every part of a several-part reference answer required; a hedged or declined
    response is NOT_ATTEMPTED (it counts as not correct in the accuracy, as in FACTS); "Verdict: ...".
    FACTS aggregates several judge models; this grader asks one (eval.judge_model). docs/EVAL.md.
  No final answer is NOT_ATTEMPTED without asking the judge.

Malformed judge replies (documented rule): a reply that names no grade, or names conflicting
grades, is never a crash; it grades the example INCORRECT (so it can never raise accuracy) and
is counted in `judge_malformed`, with the reply kept in the results file. An unreachable judge
(LLMError after retries) does raise: silently grading everything INCORRECT would be a wrong answer;
the results written so far are kept and a re-run resumes.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from megatron_search.data.llm_client import LLMClient
from megatron_search.rewards.answer import exact_match, normalize_answer, substring_match, token_f1

from .prompts import load_prompt

GRADES = ("CORRECT", "INCORRECT", "NOT_ATTEMPTED")
JUDGE_PROMPTS = {"simpleqa": "simpleqa_judge_v1", "frames": "frames_judge_v1", "facts": "facts_search_judge_v1"}
DEFAULT_PROTOCOLS = {"frames": "frames", "facts": "facts"}  # benchmark name -> protocol; others: simpleqa
_SIMPLEQA_LETTERS = {"A": "CORRECT", "B": "INCORRECT", "C": "NOT_ATTEMPTED"}  # simple-evals' letter replies
_GRADE_WORD = r"(NOT[ _-]ATTEMPTED|INCORRECT|CORRECT)"


@dataclass
class Grade:
    grade: str  # one of GRADES
    exact: bool
    substring: bool
    f1: float
    judge: Optional[str] = None  # the judge's parsed verdict (a grade, TRUE/FALSE) or None
    judge_malformed: bool = False
    judge_reply: Optional[str] = None
    protocol: Optional[str] = None  # simpleqa | frames | facts (LLM judges), substring | exact (matchers)

    def to_dict(self) -> dict:
        return asdict(self)


def _abstention_phrases() -> list[str]:
    return [normalize_answer(l) for l in load_prompt("abstention_phrases_v1").splitlines() if l.strip()]


_PHRASES: list[str] = []


def is_abstention(prediction: Optional[str]) -> bool:
    """True when the answer is missing or declines (a phrase of prompts/abstention_phrases_v1.txt)."""
    if prediction is None or not prediction.strip():
        return True
    if not _PHRASES:
        _PHRASES.extend(_abstention_phrases())
    p = f" {normalize_answer(prediction)} "
    return any(f" {ph} " in p for ph in _PHRASES)


def match_scores(prediction: Optional[str], golds: Sequence[str]) -> tuple[bool, bool, float]:
    """(exact, substring, token F1) of a prediction (None = no answer) against the gold aliases."""
    if prediction is None:
        return False, False, 0.0
    return exact_match(prediction, list(golds)), substring_match(prediction, list(golds)), token_f1(prediction, list(golds))


def _parse_grade(reply: str, label: str) -> Optional[str]:
    """The grade of the last "<label>: ..." line, else the single grade word named; None if none or conflicting."""
    text = reply.upper()
    labelled = re.findall(label + r"\s*:\s*\**\s*" + _GRADE_WORD + r"\b", text)
    found = labelled[-1:] if labelled else re.findall(r"\b" + _GRADE_WORD + r"\b", text)
    grades = {re.sub(r"[ _-]", "_", g) for g in found}
    return grades.pop() if len(grades) == 1 else None


def parse_simpleqa_grade(reply: str) -> Optional[str]:
    """CORRECT / INCORRECT / NOT_ATTEMPTED from a judge reply; None when it names none or conflicting ones."""
    if reply.strip().upper() in _SIMPLEQA_LETTERS:
        return _SIMPLEQA_LETTERS[reply.strip().upper()]
    return _parse_grade(reply, "GRADE")


def parse_facts_verdict(reply: str) -> Optional[str]:
    """CORRECT / INCORRECT / NOT_ATTEMPTED from a Facts Open judge reply (the last "Verdict:" line, else a single
    grade word); None when malformed."""
    return _parse_grade(reply, "VERDICT")


def parse_frames_decision(reply: str) -> Optional[bool]:
    """TRUE/FALSE from an autorater reply (the last "Decision:" line, else a single bare word); None if malformed."""
    text = reply.upper()
    labelled = re.findall(r"DECISION\s*:\s*\**\s*(TRUE|FALSE)\b", text)
    found = set(labelled[-1:] if labelled else re.findall(r"\b(TRUE|FALSE)\b", text))
    return (found.pop() == "TRUE") if len(found) == 1 else None


class MatchGrader:
    """Grades without an LLM (see module docstring)."""

    name = "match"

    def __init__(self, mode: str = "substring"):
        if mode not in ("substring", "exact"):
            raise ValueError(f"MatchGrader: mode must be 'substring' or 'exact', got {mode!r}")
        self.mode = mode
        self.name = mode

    async def grade(self, benchmark: str, question: str, golds: Sequence[str], prediction: Optional[str]) -> Grade:
        ex, sub, f1 = match_scores(prediction, golds)
        hit = ex if self.mode == "exact" else sub
        grade = "CORRECT" if hit else ("NOT_ATTEMPTED" if is_abstention(prediction) else "INCORRECT")
        return Grade(grade, ex, sub, f1, protocol=self.mode)


class LLMJudgeGrader:
    """The benchmark's LLM judge over an `LLMClient` (temperature 0; replies cached by the client)."""

    name = "llm"

    def __init__(self, client, max_tokens: int = 512, protocols: Optional[dict[str, str]] = None):
        self.client = client
        self.max_tokens = max_tokens
        self.templates = {k: load_prompt(v) for k, v in JUDGE_PROMPTS.items()}
        self.protocols = dict(DEFAULT_PROTOCOLS if protocols is None else protocols)
        bad = sorted(set(self.protocols.values()) - set(JUDGE_PROMPTS))
        if bad:
            raise ValueError(f"LLMJudgeGrader: unknown protocol(s) {bad}; known: {sorted(JUDGE_PROMPTS)}")

    def protocol(self, benchmark: str) -> str:
        """The protocol grading `benchmark` (a set renamed from "facts" needs its name in `protocols`)."""
        return self.protocols.get(benchmark, "simpleqa")

    async def grade(self, benchmark: str, question: str, golds: Sequence[str], prediction: Optional[str]) -> Grade:
        ex, sub, f1 = match_scores(prediction, golds)
        proto = self.protocol(benchmark)
        if prediction is None or not prediction.strip():
            return Grade("NOT_ATTEMPTED", ex, sub, f1, protocol=proto)
        prompt = self.templates[proto].format(question=question, gold=" | ".join(golds), prediction=prediction)
        reply = (await self.client.chat([{"role": "user", "content": prompt}], temperature=0.0,
                                        max_tokens=self.max_tokens)).text
        if proto == "frames":
            decision = parse_frames_decision(reply)
            if decision is None:
                return Grade("INCORRECT", ex, sub, f1, None, True, reply, proto)
            grade = "CORRECT" if decision else ("NOT_ATTEMPTED" if is_abstention(prediction) else "INCORRECT")
            return Grade(grade, ex, sub, f1, "TRUE" if decision else "FALSE", False, reply, proto)
        verdict = (parse_facts_verdict if proto == "facts" else parse_simpleqa_grade)(reply)
        if verdict is None:
            return Grade("INCORRECT", ex, sub, f1, None, True, reply, proto)
        return Grade(verdict, ex, sub, f1, verdict, False, reply, proto)


def build_grader(eval_cfg):
    """The grader `eval.grader` names (an LLM judge needs eval.judge_base_url)."""
    if eval_cfg.grader in ("substring", "exact"):
        return MatchGrader(eval_cfg.grader)
    if not eval_cfg.judge_base_url:
        raise ValueError("eval.grader=llm needs eval.judge_base_url (an OpenAI-compatible endpoint)")
    client = LLMClient(eval_cfg.judge_base_url, eval_cfg.judge_model, eval_cfg.judge_api_key_env,
                       cache_dir=eval_cfg.judge_cache_dir)
    return LLMJudgeGrader(client, eval_cfg.judge_max_tokens)


def simpleqa_summary(grades: Sequence[str]) -> dict:
    """SimpleQA aggregate: correct, incorrect, not_attempted (fractions of all), accuracy given attempted, F1.

    F1 is the harmonic mean of `correct` and `accuracy_given_attempted` (0 when both are 0).
    """
    n = len(grades)
    if n == 0:
        return {"n": 0, "correct": 0.0, "incorrect": 0.0, "not_attempted": 0.0, "accuracy_given_attempted": 0.0,
                "f1": 0.0}
    bad = [g for g in grades if g not in GRADES]
    if bad:
        raise ValueError(f"simpleqa_summary: unknown grade(s) {sorted(set(bad))}")
    c, i, na = (sum(g == k for g in grades) for k in GRADES)
    correct = c / n
    aga = c / (c + i) if c + i else 0.0
    f1 = 2 * correct * aga / (correct + aga) if correct + aga else 0.0
    return {"n": n, "correct": correct, "incorrect": i / n, "not_attempted": na / n,
            "accuracy_given_attempted": aga, "f1": f1}
