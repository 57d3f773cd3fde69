"""Graders: matcher grades, judge-reply parsing (scripted replies, malformed ones included), SimpleQA summary."""
import asyncio

import pytest

from megatron_search.data.llm_client import ChatReply
from megatron_search.eval.graders import (LLMJudgeGrader, MatchGrader, is_abstention, parse_facts_verdict,
                                          parse_frames_decision, parse_simpleqa_grade, simpleqa_summary)


class ScriptedJudge:
    """Stands in for LLMClient: replies from a list, records the prompts it was sent."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.prompts = []

    async def chat(self, messages, temperature=0.0, max_tokens=512):
        self.prompts.append(messages[0]["content"])
        return ChatReply(self.replies.pop(0), "stop", False, {})


@pytest.mark.parametrize("reply,want", [
    ("Grade: CORRECT", "CORRECT"),
    ("The answer names someone else.\nGrade: INCORRECT", "INCORRECT"),
    ("grade: not attempted", "NOT_ATTEMPTED"),
    ("Grade: **NOT_ATTEMPTED**", "NOT_ATTEMPTED"),
    ("B", "INCORRECT"),  # simple-evals letter reply
    ("It is not CORRECT... wait. Grade: CORRECT", "CORRECT"),  # the labelled line wins
    ("CORRECT", "CORRECT"),
    ("I think it is CORRECT or maybe INCORRECT", None),  # conflicting, no label
    ("The gold answer is Paris.", None),  # names no grade
    ("", None),
    ("INCORRECTLY", None),  # not a whole word
])
def test_parse_simpleqa_grade(reply, want):
    assert parse_simpleqa_grade(reply) == want


@pytest.mark.parametrize("reply,want", [
    ("Same entity.\nDecision: TRUE", True),
    ("decision: false", False),
    ("The answer says 1911 but the truth is 1912, so TRUE is wrong.\nDecision: FALSE", False),
    ("TRUE", True),
    ("TRUE or FALSE, hard to say", None),
    ("Maybe.", None),
])
def test_parse_frames_decision(reply, want):
    assert parse_frames_decision(reply) == want


@pytest.mark.parametrize("reply,want", [
    ("The response names the reference river.\nVerdict: CORRECT", "CORRECT"),
    ("It says A or B without choosing.\nverdict: not attempted", "NOT_ATTEMPTED"),
    ("Gives only one of the two founders.\nVerdict: **INCORRECT**", "INCORRECT"),
    ("Not CORRECT at first sight, but it is. Verdict: CORRECT", "CORRECT"),  # the labelled line wins
    ("Grade: CORRECT", "CORRECT"),  # a single grade word without the label still counts
    ("CORRECT or INCORRECT, unclear", None),
    ("B", None),  # SimpleQA's letter replies are not part of this protocol
    ("", None),
])
def test_parse_facts_verdict(reply, want):
    assert parse_facts_verdict(reply) == want


def test_match_grader_grades_and_scores():
    g = MatchGrader("substring")
    run = lambda pred: asyncio.run(g.grade("x", "q", ["Ivo Brand"], pred))
    r = run("It was Ivo Brand.")
    assert (r.grade, r.exact, r.substring) == ("CORRECT", False, True)
    assert r.f1 == pytest.approx(2 * 0.5 * 1.0 / 1.5)  # "it was ivo brand" vs "ivo brand": precision 2/4, recall 1
    r = run("Orrin Vale")
    assert (r.grade, r.exact, r.substring, r.f1) == ("INCORRECT", False, False, 0.0)
    assert run(None).grade == "NOT_ATTEMPTED"
    assert run("I could not find reliable evidence about it.").grade == "NOT_ATTEMPTED"
    assert asyncio.run(MatchGrader("exact").grade("x", "q", ["Ivo Brand"], "It was Ivo Brand.")).grade == "INCORRECT"


def test_abstention_phrases():
    assert is_abstention("I don't know.") and is_abstention("  ") and is_abstention(None)
    assert not is_abstention("The founder is Ivo Brand.")


def test_llm_judge_simpleqa_protocol_with_malformed_replies():
    judge = ScriptedJudge(["Grade: CORRECT", "no idea what to say", "Grade: NOT_ATTEMPTED", "CORRECT and INCORRECT"])
    g = LLMJudgeGrader(judge)
    preds = ["Ivo Brand", "Orrin", "It is unclear", "Ivo"]
    out = [asyncio.run(g.grade("simpleqa", "Who founded Talbeck Works?", ["Ivo Brand"], p)) for p in preds]
    assert [o.grade for o in out] == ["CORRECT", "INCORRECT", "NOT_ATTEMPTED", "INCORRECT"]
    assert [o.judge_malformed for o in out] == [False, True, False, True]
    assert out[1].judge_reply == "no idea what to say"
    assert "Who founded Talbeck Works?" in judge.prompts[0] and "Gold answer: Ivo Brand" in judge.prompts[0]
    assert "Answer to grade: Orrin" in judge.prompts[1]
    # no final answer: NOT_ATTEMPTED without asking the judge
    assert asyncio.run(g.grade("simpleqa", "q", ["x"], None)).grade == "NOT_ATTEMPTED"
    assert len(judge.prompts) == 4


def test_llm_judge_frames_protocol():
    judge = ScriptedJudge(["Decision: TRUE", "Decision: FALSE", "Decision: FALSE", "whatever"])
    g = LLMJudgeGrader(judge)
    preds = ["Jane Ballou", "Jane Smith", "I could not find reliable evidence.", "Jane"]
    out = [asyncio.run(g.grade("frames", "Her name?", ["Jane Ballou"], p)) for p in preds]
    assert [o.grade for o in out] == ["CORRECT", "INCORRECT", "NOT_ATTEMPTED", "INCORRECT"]
    assert [o.judge for o in out] == ["TRUE", "FALSE", "FALSE", None]
    assert out[3].judge_malformed
    assert "Ground-truth answer: Jane Ballou" in judge.prompts[0]


def test_llm_judge_facts_protocol():
    judge = ScriptedJudge(["Verdict: CORRECT", "Both parts are needed.\nVerdict: INCORRECT",
                           "It does not commit.\nVerdict: NOT_ATTEMPTED", "no verdict here"])
    g = LLMJudgeGrader(judge)
    gold = ["Ivo Brand and Orrin Vale"]
    preds = ["Talbeck Works was founded by Ivo Brand and Orrin Vale [1].", "Ivo Brand.",
             "Sources disagree: it may be Ivo Brand or someone else.", "Ivo Brand and Orrin Vale"]
    out = [asyncio.run(g.grade("facts", "Name the two founders of Talbeck Works.", gold, p)) for p in preds]
    assert [o.grade for o in out] == ["CORRECT", "INCORRECT", "NOT_ATTEMPTED", "INCORRECT"]
    assert [o.judge for o in out] == ["CORRECT", "INCORRECT", "NOT_ATTEMPTED", None]
    assert [o.judge_malformed for o in out] == [False, False, False, True]
    assert {o.protocol for o in out} == {"facts"}
    first = judge.prompts[0]  # the Facts Open prompt, not SimpleQA's
    assert "Reference answer: Ivo Brand and Orrin Vale" in first and "every part must be given" in first
    assert "Assistant's response: Talbeck Works was founded by Ivo Brand and Orrin Vale [1]." in first
    assert "Verdict: NOT_ATTEMPTED" in first and "Gold answer:" not in first
    # no final answer: NOT_ATTEMPTED under the set's protocol, judge not asked
    none = asyncio.run(g.grade("facts", "q", ["x"], None))
    assert (none.grade, none.protocol, len(judge.prompts)) == ("NOT_ATTEMPTED", "facts", 4)
    # protocols are chosen by set name: a renamed set is mapped explicitly, other sets get SimpleQA's
    g2 = LLMJudgeGrader(ScriptedJudge(["Verdict: CORRECT", "Grade: CORRECT"]), protocols={"facts_open": "facts"})
    assert [g2.protocol(b) for b in ("facts_open", "facts", "frames", "demo")] == ["facts", "simpleqa", "simpleqa", "simpleqa"]
    assert asyncio.run(g2.grade("facts_open", "q", ["x"], "x")).protocol == "facts"
    assert asyncio.run(g2.grade("demo", "q", ["x"], "x")).protocol == "simpleqa"
    with pytest.raises(ValueError, match="unknown protocol"):
        LLMJudgeGrader(judge, protocols={"facts": "facts_grounding"})
    assert asyncio.run(MatchGrader("exact").grade("facts", "q", ["x"], "x")).protocol == "exact"


def test_simpleqa_summary_by_hand():
    grades = ["CORRECT"] * 3 + ["INCORRECT"] * 1 + ["NOT_ATTEMPTED"] * 4
    s = simpleqa_summary(grades)
    # correct 3/8, attempted 4, accuracy given attempted 3/4, F1 = 2 * 0.375 * 0.75 / 1.125 = 0.5
    assert s["correct"] == 0.375 and s["incorrect"] == 0.125 and s["not_attempted"] == 0.5
    assert s["accuracy_given_attempted"] == 0.75 and s["f1"] == pytest.approx(0.5)
    assert simpleqa_summary(["NOT_ATTEMPTED"])["f1"] == 0.0
    with pytest.raises(ValueError, match="unknown grade"):
        simpleqa_summary(["RIGHT"])


def test_judge_over_http_with_the_openai_compatible_client():
    """build_grader(eval.grader=llm) -> LLMClient -> a scripted /v1/chat/completions server."""
    from aiohttp import web

    from megatron_search.config import load_config
    from megatron_search.eval.graders import build_grader

    replies = ["Grade: CORRECT", "I cannot decide.", "Decision: FALSE"]
    seen = []

    async def handler(request):
        body = await request.json()
        seen.append(body)
        return web.json_response({"choices": [{"message": {"content": replies[len(seen) - 1]},
                                               "finish_reason": "stop"}]})

    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            cfg = load_config(None, ["eval.grader=llm", f"eval.judge_base_url=http://127.0.0.1:{port}",
                                     "eval.judge_model=judge-x"])
            g = build_grader(cfg.eval)
            out = [await g.grade("simpleqa", "Who?", ["Ivo Brand"], "Ivo Brand"),
                   await g.grade("facts", "Who?", ["Ivo Brand"], "Orrin"),
                   await g.grade("frames", "Who?", ["Ivo Brand"], "Orrin")]
            await g.client.close()
            return out
        finally:
            await runner.cleanup()

    out = asyncio.run(main())
    assert [(o.grade, o.judge_malformed) for o in out] == [("CORRECT", False), ("INCORRECT", True), ("INCORRECT", False)]
    assert [b["model"] for b in seen] == ["judge-x"] * 3 and all(b["temperature"] == 0.0 for b in seen)
    assert "Decision: TRUE" in seen[2]["messages"][0]["content"]  # the FRAMES prompt for the frames set
