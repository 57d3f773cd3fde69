"""Rubric data for general chat (RECIPE 4.2): generation with the precedence order, a validator for
what is mechanically checkable, an LLM judge, and the pass@4 calibration filter.

    conversation -> (reference, rubrics) by an LLM [skipped when the row brings its rubrics]
      -> validator drops non-atomic / subjective / empty rubrics (prompt dropped if none remain)
      -> 4 independent policy samples -> judge grades each against every rubric
      -> keep the prompt only when 1..3 of the 4 samples pass all rubrics

Every dropped prompt records its stage and reason. All LLM calls go through LLMClient, so a re-run
is served from the cache. `RubricJudge` is the judge of both the calibration and GRPO's rubric reward
(reward.rubric_judge): one versioned prompt, mechanical checks first, one call per response for
the rubrics they cannot decide.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Optional

from tqdm import tqdm

from .jsonl import DataError
from .llm_client import LLMClient, LLMError, LLMOutputError
from .prompts import load_lines, load_prompt
from .rubric_checks import check_rubric

PRECEDENCE = ("explicit", "internal", "essential")
_CHECK_VERBS = re.compile(r"\b(is|are|was|were|has|have|contains?|uses?|includes?|mentions?|gives?|states?|"
                          r"lists?|names?|ends?|starts?|begins?|says?|does|do|provides?|answers?|avoids?|keeps?)\b")
_QUOTED = re.compile(r"\"[^\"]*\"|'[^']*'|“[^”]*”")


@dataclass
class Rubric:
    text: str
    kind: str  # one of PRECEDENCE


@dataclass
class RubricItem:
    id: str
    messages: list[dict]
    rubrics: list[Rubric] = field(default_factory=list)
    reference: Optional[str] = None
    samples: list[str] = field(default_factory=list)
    verdicts: list[list[bool]] = field(default_factory=list)  # per sample, per rubric
    rejected_rubrics: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"id": self.id, "messages": self.messages, "reference": self.reference,
                "rubrics": [r.text for r in self.rubrics], "rubric_kinds": [r.kind for r in self.rubrics],
                "pass_at_k": sum(all(v) for v in self.verdicts) if self.verdicts else None, "k": len(self.verdicts),
                "rejected_rubrics": self.rejected_rubrics}


@dataclass
class RubricDrop:
    id: str
    stage: str
    reason: str


def rubric_problems(text: str, subjective_words: list[str], max_chars: int = 300) -> list[str]:
    """Mechanically checkable reasons a rubric is not atomic / objective (empty list: accepted).

    Compound: splitting outside quoted strings on and/or/;/"as well as" gives two parts that each
    carry a check verb ("contains 'lodging' and 'boarding'" is one check; "is in English and uses
    bullet points" is two)."""
    t = text.strip()
    if not t:
        return ["empty"]
    problems = []
    if len(t) > max_chars:
        problems.append(f"longer than {max_chars} characters")
    bare = _QUOTED.sub(" QUOTED ", t.lower())
    parts = re.split(r"\band\b|\bor\b|;|\bas well as\b|\balso\b", bare)
    if sum(bool(_CHECK_VERBS.search(p)) for p in parts) >= 2:
        problems.append("compound: more than one check")
    if len(re.findall(r"[.!?](\s|$)", t.rstrip(".!? ") + " ")) >= 1:
        problems.append("compound: several sentences")
    words = set(re.findall(r"[a-z][a-z\-]*", bare))
    bad = sorted(w for w in subjective_words if (w in words if " " not in w else w in bare))
    if bad:
        problems.append(f"subjective wording {bad}")
    return problems


def calibration_keep(passes: list[bool]) -> tuple[bool, str]:
    """pass@k filter (RECIPE 4.2): drop when none or all of the k samples pass every rubric."""
    k, n = len(passes), sum(passes)
    if k == 0:
        return False, "no graded samples"
    if n == 0:
        return False, f"0 of {k} samples pass: too hard or rubrics unreachable"
    if n == k:
        return False, f"{k} of {k} samples pass: no learning signal"
    return True, f"{n} of {k} samples pass"


def _conversation_text(messages: list[dict]) -> str:
    return "\n".join(f"[{m['role']}] {m.get('content') or ''}" for m in messages)


@dataclass
class JudgedBatch:
    """Verdicts of `RubricJudge.grade_many`, per response per rubric, and what decided them."""

    verdicts: list[list[bool]]
    mechanical: int = 0  # rubrics decided by data/rubric_checks.py
    judged: int = 0  # rubrics sent to the judge
    calls: int = 0  # judge requests
    malformed: int = 0  # judge replies that did not parse, or an endpoint failure: their rubrics fail


class RubricJudge:
    """The instruction-following judge of rubric chat (RECIPE 4.2), prompt `rubric_judge_<version>`."""

    def __init__(self, client: LLMClient, prompt_version: str = "v1", max_tokens: int = 1024):
        self.client, self.max_tokens = client, max_tokens
        self.prompt = load_prompt(f"rubric_judge_{prompt_version}")
        self.prompt_version = prompt_version

    async def judge(self, messages: list[dict], response: str, rubrics: list[str]) -> list[bool]:
        """One call grading every rubric against the response; LLMOutputError when the reply is malformed."""
        listing = "\n".join(f"{i}. {r}" for i, r in enumerate(rubrics, 1))
        prompt = self.prompt.format(conversation=_conversation_text(messages), response=response, rubrics=listing)
        out = await self.client.chat_json([{"role": "user", "content": prompt}], required={"verdicts": list},
                                          max_tokens=self.max_tokens)
        verdicts: dict[int, bool] = {}
        for v in out["verdicts"]:
            if not isinstance(v, dict) or not isinstance(v.get("index"), int) or not isinstance(v.get("pass"), bool):
                raise LLMOutputError(f"verdict must be {{'index': int, 'pass': bool}}, got {v!r:.120}")
            if v["index"] in verdicts:
                raise LLMOutputError(f"judge gave two verdicts for criterion {v['index']}")
            verdicts[v["index"]] = v["pass"]
        if sorted(verdicts) != list(range(1, len(rubrics) + 1)):
            raise LLMOutputError(f"judge graded criteria {sorted(verdicts)}, expected 1..{len(rubrics)}")
        return [verdicts[i] for i in range(1, len(rubrics) + 1)]

    async def grade(self, messages: list[dict], response: str, rubrics: list[str],
                    tally: Optional["JudgedBatch"] = None) -> list[bool]:
        """Mechanical checks where a rubric has a known form, the judge for the rest. Without `tally` a
        malformed reply raises; with it, that response's judged rubrics fail and the tally counts it."""
        verdicts = [check_rubric(r, response) for r in rubrics]
        todo = [i for i, v in enumerate(verdicts) if v is None]
        if tally is not None:
            tally.mechanical += len(rubrics) - len(todo)
            tally.judged += len(todo)
            tally.calls += bool(todo)
        if todo:
            try:
                judged = await self.judge(messages, response, [rubrics[i] for i in todo])
            except (LLMOutputError, LLMError):
                if tally is None:
                    raise
                tally.malformed += 1
                judged = [False] * len(todo)
            for i, v in zip(todo, judged):
                verdicts[i] = v
        return [bool(v) for v in verdicts]

    async def grade_many(self, jobs: list[tuple[list[dict], str, list[str]]]) -> JudgedBatch:
        """Grade (messages, response, rubrics) jobs concurrently (the client bounds the requests in flight).
        A malformed reply or a failed request fails that response's judged rubrics and is counted: a
        training step never stops on the judge."""
        out = JudgedBatch([])
        out.verdicts = list(await asyncio.gather(*(self.grade(*job, tally=out) for job in jobs)))
        return out


class RubricPipeline:
    def __init__(self, generator: LLMClient, judge: LLMClient, policy: LLMClient, samples: int = 4,
                 sample_temperature: float = 0.6, max_tokens: int = 1024, prompt_version: str = "v1",
                 max_rubric_chars: int = 300):
        self.generator, self.judge, self.policy = generator, judge, policy
        self.samples = samples
        self.sample_temperature = sample_temperature
        self.max_tokens = max_tokens
        self.gen_prompt = load_prompt(f"rubric_generate_{prompt_version}")
        self.grader = RubricJudge(judge, prompt_version, max_tokens)
        self.internal = load_lines(f"internal_constraints_{prompt_version}")
        self.subjective = load_lines(f"subjective_words_{prompt_version}")
        self.max_rubric_chars = max_rubric_chars

    async def generate(self, item: RubricItem) -> None:
        prompt = self.gen_prompt.format(conversation=_conversation_text(item.messages),
                                        internal_constraints="\n".join(f"- {c}" for c in self.internal))
        out = await self.generator.chat_json([{"role": "user", "content": prompt}],
                                             required={"reference": str, "rubrics": list}, max_tokens=self.max_tokens)
        rubrics = []
        for i, r in enumerate(out["rubrics"]):
            if not isinstance(r, dict) or not isinstance(r.get("text"), str) or r.get("kind") not in PRECEDENCE:
                raise LLMOutputError(f"rubric {i} must be {{'kind': one of {PRECEDENCE}, 'text': str}}, got {r!r:.120}")
            rubrics.append(Rubric(r["text"], r["kind"]))
        item.reference = out["reference"]
        item.rubrics = sorted(rubrics, key=lambda r: PRECEDENCE.index(r.kind))  # stable: keeps order within a kind

    def validate(self, item: RubricItem) -> None:
        kept = []
        for r in item.rubrics:
            problems = rubric_problems(r.text, self.subjective, self.max_rubric_chars)
            if problems:
                item.rejected_rubrics.append({"text": r.text, "kind": r.kind, "problems": problems})
            else:
                kept.append(r)
        item.rubrics = kept

    async def grade(self, item: RubricItem, response: str) -> list[bool]:
        """Per-rubric verdicts: mechanical checks where the rubric has a known form (rubric_checks),
        the LLM judge for the rest (not called at all when every rubric is mechanical); a malformed
        judge reply raises (the calibration then drops the prompt at its 'judge' stage)."""
        return await self.grader.grade(item.messages, response, [r.text for r in item.rubrics])

    async def process(self, item: RubricItem, calibrate: bool = True) -> RubricItem | RubricDrop:
        stage = "generate"
        try:
            if not item.rubrics:
                await self.generate(item)
            stage = "validate"
            self.validate(item)
            if not item.rubrics:
                return RubricDrop(item.id, stage, f"no valid rubric left ({len(item.rejected_rubrics)} rejected)")
            if not calibrate:
                return item
            stage = "sample"
            replies = await asyncio.gather(*[
                self.policy.chat(item.messages, temperature=self.sample_temperature, max_tokens=self.max_tokens,
                                 sample_index=i) for i in range(self.samples)])
            item.samples = [r.text for r in replies]
            stage = "judge"
            item.verdicts = list(await asyncio.gather(*[self.grade(item, s) for s in item.samples]))
        except (LLMError, LLMOutputError) as e:
            return RubricDrop(item.id, stage, str(e))
        keep, why = calibration_keep([all(v) for v in item.verdicts])
        return item if keep else RubricDrop(item.id, "calibrate", why)

    async def run(self, items: list[RubricItem], progress: bool = False,
                  calibrate: bool = True) -> tuple[list[RubricItem], list[RubricDrop]]:
        kept, dropped = [], []
        bar = tqdm(total=len(items), desc="rubrics", disable=not progress)

        async def one(it):
            out = await self.process(it, calibrate)
            bar.update(1)
            return out

        for out in await asyncio.gather(*[one(it) for it in items]):
            (dropped if isinstance(out, RubricDrop) else kept).append(out)
        bar.close()
        return kept, dropped


def item_from_row(row: dict, where: str) -> RubricItem:
    """A chat row {id, messages[, rubrics]} (rubrics given as strings count as explicit requirements)."""
    if not isinstance(row.get("messages"), list) or not row["messages"]:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    if row["messages"][-1].get("role") != "user":
        raise DataError(f"{where}: the conversation must end with the user turn to answer")
    rubrics = [Rubric(r, "explicit") if isinstance(r, str) else Rubric(r["text"], r.get("kind", "explicit"))
               for r in row.get("rubrics") or []]
    bad = [r.kind for r in rubrics if r.kind not in PRECEDENCE]
    if bad:
        raise DataError(f"{where}: rubric kind(s) {bad} not in {PRECEDENCE}")
    rubrics.sort(key=lambda r: PRECEDENCE.index(r.kind))
    return RubricItem(str(row.get("id", where)), row["messages"], rubrics, row.get("reference"))
