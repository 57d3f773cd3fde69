"""LLM client (retries, timeouts, cache, concurrency, JSON parsing, API key hygiene) against a small
aiohttp stub server, and the rubric pipeline's validator, judge parsing and pass@4 calibration."""
from __future__ import annotations

import asyncio
import itertools
import json

import pytest
from aiohttp import web

from megatron_search.data.llm_client import ChatReply, LLMClient, LLMError, LLMOutputError, parse_json_reply
from megatron_search.data.prompts import load_lines
from megatron_search.data.rubrics import RubricPipeline, calibration_keep, item_from_row, rubric_problems


class Stub:
    """Serves scripted (status, body, delay) replies in order; records requests and concurrency."""

    def __init__(self, script):
        self.script = list(script)
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.inflight = self.max_inflight = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append(await request.json())
        self.headers.append(dict(request.headers))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        status, body, delay = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        try:
            await asyncio.sleep(delay)
        finally:
            self.inflight -= 1
        if status == 200 and isinstance(body, str):
            body = {"choices": [{"message": {"role": "assistant", "content": body}, "finish_reason": "stop"}],
                    "usage": {"completion_tokens": 3}}
        return web.json_response(body, status=status)


async def _serve(stub: Stub):
    app = web.Application()
    app.router.add_post("/v1/chat/completions", stub.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def scenario(script, body, **client_kw):
    stub = Stub(script)

    async def go():
        runner, url = await _serve(stub)
        try:
            async with LLMClient(url, **{"backoff_s": 0.01, **client_kw}) as client:
                return await body(client)
        finally:
            await runner.cleanup()

    return stub, asyncio.run(go())


MSG = [{"role": "user", "content": "hi"}]


def test_retries_transient_errors_then_succeeds():
    stub, reply = scenario([(503, {"error": "busy"}, 0), (429, {"error": "slow down"}, 0), (200, "hello", 0)],
                           lambda c: c.chat(MSG), retries=3)
    assert reply.text == "hello" and len(stub.requests) == 3 and not reply.cached


def test_client_errors_fail_at_once_and_retries_run_out():
    async def body(c):
        with pytest.raises(LLMError, match=r"HTTP 400: .*bad field"):
            await c.chat(MSG)
    stub, _ = scenario([(400, {"error": "bad field"}, 0)], body, retries=3)
    assert len(stub.requests) == 1

    async def body2(c):
        with pytest.raises(LLMError, match=r"failed after 3 attempts \(TimeoutError"):
            await c.chat(MSG)
    stub, _ = scenario([(200, "late", 0.5)], body2, retries=2, timeout_s=0.05)
    assert len(stub.requests) == 3


def test_cache_serves_repeats_and_separates_samples(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_LLM_KEY", "sk-secret-123")

    async def body(c):
        a = await c.chat(MSG, temperature=0.6)
        b = await c.chat(MSG, temperature=0.6)
        s1 = await c.chat(MSG, temperature=0.6, sample_index=1)
        return a, b, s1, c

    stub, (a, b, s1, client) = scenario([(200, "one", 0), (200, "two", 0)], body, cache_dir=tmp_path,
                                        api_key_env="TEST_LLM_KEY")
    assert (a.text, a.cached) == ("one", False) and (b.text, b.cached) == ("one", True)
    assert (s1.text, s1.cached) == ("two", False)
    assert len(stub.requests) == 2 and client.http_requests == 2
    assert stub.headers[0]["Authorization"] == "Bearer sk-secret-123"
    assert "sk-secret" not in repr(client)
    for f in tmp_path.rglob("*.json"):
        assert "sk-secret" not in f.read_text()
    # a fresh client on the same cache sends nothing
    stub2, again = scenario([(500, {}, 0)], lambda c: c.chat(MSG, temperature=0.6), cache_dir=tmp_path)
    assert again.text == "one" and again.cached and stub2.requests == []


def test_missing_api_key_env_is_an_error(monkeypatch):
    monkeypatch.delenv("NOPE_KEY", raising=False)
    with pytest.raises(LLMError, match="NOPE_KEY"):
        LLMClient("http://127.0.0.1:1", api_key_env="NOPE_KEY")


def test_concurrency_limit():
    async def body(c):
        return await asyncio.gather(*[c.chat([{"role": "user", "content": str(i)}]) for i in range(6)])
    stub, replies = scenario([(200, "ok", 0.05)], body, concurrency=2)
    assert len(replies) == 6 and stub.max_inflight == 2


def test_json_replies():
    assert parse_json_reply('Sure!\n```json\n{"a": 1}\n```') == {"a": 1}
    assert parse_json_reply('prefix {"a": [1, 2]} suffix', {"a": list}) == {"a": [1, 2]}
    with pytest.raises(LLMOutputError, match="reply is not JSON.*the model rambles"):
        parse_json_reply("the model rambles")
    with pytest.raises(LLMOutputError, match="lacks key 'rubrics'"):
        parse_json_reply('{"reference": "x"}', {"reference": str, "rubrics": list})
    with pytest.raises(LLMOutputError, match="should be list"):
        parse_json_reply('{"rubrics": "x"}', {"rubrics": list})

    async def body(c):
        with pytest.raises(LLMOutputError, match="not a chat-completions response"):
            await c.chat(MSG)
    scenario([(200, {"unexpected": True}, 0)], body)


SUBJ = load_lines("subjective_words_v1")


@pytest.mark.parametrize("text,ok", [
    ("The answer is in English.", True),
    ('The corrected sentence contains "lodging" and "boarding".', True),
    ('It uses "manpower" as one word.', True),
    ('It has no "u", "Plz" or "&".', True),
    ("The answer contains no citation markers of the form [type:index].", True),
    ("The answer is in English and uses bullet points.", False),
    ("The reply has a title; it lists three steps.", False),
    ("The tone is professional.", False),
    ("The answer is appropriate for a child.", False),
    ("The answer is short. It names the city.", False),
    ("", False),
])
def test_rubric_validator(text, ok):
    assert (rubric_problems(text, SUBJ) == []) is ok


def test_calibration_filter_on_every_pass_pattern():
    for pattern in itertools.product([False, True], repeat=4):
        keep, why = calibration_keep(list(pattern))
        assert keep is (1 <= sum(pattern) <= 3), pattern
        assert why.startswith(f"{sum(pattern)} of 4")
    assert calibration_keep([]) == (False, "no graded samples")


class ScriptedLLM:
    """In-process LLM double for the pipeline's control flow (the HTTP path is tested above and end to
    end against the local engine): replies are functions of the prompt."""

    def __init__(self, reply):
        self.reply = reply
        self.prompts: list[str] = []

    async def chat(self, messages, temperature=0.0, max_tokens=0, sample_index=0, extra=None):
        self.prompts.append(messages[-1]["content"])
        return ChatReply(self.reply(messages, sample_index), "stop", False, {})

    async def chat_json(self, messages, required=None, **kw):
        return parse_json_reply((await self.chat(messages, **kw)).text, required)


GENERATED = {"reference": "She will share the manpower planning. We have to arrange lodging and boarding.",
             "rubrics": [{"kind": "essential", "text": "The corrected sentence keeps the meaning of the original."},
                         {"kind": "internal", "text": "The answer contains no citation markers of the form [type:index]."},
                         {"kind": "explicit", "text": "The answer is in English."},
                         {"kind": "essential", "text": "The correction is natural and fluent."}]}


def _judge_passing(n_pass):
    """Judge double: sample i passes every rubric iff its text ends with a digit < n_pass."""
    def reply(messages, _):
        prompt = messages[-1]["content"]
        sample = prompt.split("Response to grade:\n", 1)[1].split("\n", 1)[0]
        crit = [l for l in prompt.split("Criteria:\n", 1)[1].split("\n\n")[0].splitlines() if l.strip()]
        assert crit == ["1. The corrected sentence keeps the meaning of the original."]  # only the non-mechanical one
        return json.dumps({"verdicts": [{"index": 1, "pass": int(sample[-1]) < n_pass, "reason": "-"}]})
    return reply


def _run(pipe, items):
    return asyncio.run(pipe.run(items))


def test_rubric_pipeline_precedence_validation_and_calibration():
    gen = ScriptedLLM(lambda m, i: "```json\n" + json.dumps(GENERATED) + "\n```")
    policy = ScriptedLLM(lambda m, i: f"We have to arrange lodging and boarding for the whole team, sample {i}")
    row = {"id": "c1", "messages": [{"role": "user", "content": "She will share u man power planning. Plz correct swntence."}]}
    kept, dropped = _run(RubricPipeline(gen, ScriptedLLM(_judge_passing(2)), policy), [item_from_row(row, "x:1")])
    assert dropped == [] and len(kept) == 1
    item = kept[0]
    assert [r.kind for r in item.rubrics] == ["explicit", "internal", "essential"]  # precedence order
    assert item.rejected_rubrics[0]["text"] == "The correction is natural and fluent."
    assert item.to_dict()["pass_at_k"] == 2 and item.to_dict()["k"] == 4
    assert len({p for p in policy.prompts}) == 1 and len(policy.prompts) == 4  # 4 samples of the same prompt
    # all four pass -> dropped at calibration; none pass -> dropped too
    for n_pass, why in ((4, "4 of 4 samples pass"), (0, "0 of 4 samples pass")):
        kept, dropped = _run(RubricPipeline(gen, ScriptedLLM(_judge_passing(n_pass)), policy), [item_from_row(row, "x:1")])
        assert kept == [] and dropped[0].stage == "calibrate" and dropped[0].reason.startswith(why)


def test_rubric_pipeline_drops_bad_llm_output_with_reason():
    row = {"id": "c2", "messages": [{"role": "user", "content": "Plan my week."}]}
    policy = ScriptedLLM(lambda m, i: f"plan {i}")
    bad_gen = ScriptedLLM(lambda m, i: "I think rubrics are great")
    _, dropped = _run(RubricPipeline(bad_gen, bad_gen, policy), [item_from_row(row, "x:1")])
    assert dropped[0].stage == "generate" and "not JSON" in dropped[0].reason
    gen = ScriptedLLM(lambda m, i: json.dumps(GENERATED))
    wrong_judge = ScriptedLLM(lambda m, i: json.dumps({"verdicts": [{"index": 2, "pass": True}]}))
    _, dropped = _run(RubricPipeline(gen, wrong_judge, policy), [item_from_row(row, "x:1")])
    assert dropped[0].stage == "judge" and "expected 1..1" in dropped[0].reason
    only_subjective = ScriptedLLM(lambda m, i: json.dumps({"reference": "r", "rubrics": [{"kind": "explicit", "text": "It is good."}]}))
    _, dropped = _run(RubricPipeline(only_subjective, gen, policy), [item_from_row(row, "x:1")])
    assert dropped[0].stage == "validate" and "no valid rubric" in dropped[0].reason


def test_mechanical_rubric_checks():
    from megatron_search.data.rubric_checks import check_rubric

    good = "She will share the manpower planning. We have to arrange lodging and boarding."
    bad = "Plz u share man power [web:1] & lodging"
    cases = {
        "The answer is in English.": (True, True),
        "The answer is in French.": (False, False),
        'The corrected sentence contains "lodging" and "boarding".': (True, False),
        'It uses "manpower" as one word.': (True, False),
        'It has no "u", "Plz" or "&".': (True, False),
        "The answer contains no citation markers of the form [type:index].": (True, False),
        "The answer has at most 8 words.": (False, True),
        "The answer uses bullet points.": (False, False),
        "The tone is warm.": (None, None),
    }
    for rubric, (g, b) in cases.items():
        assert (check_rubric(rubric, good), check_rubric(rubric, bad)) == (g, b), rubric
    assert check_rubric("The answer uses bullet points.", "- a\n- b") is True
    assert check_rubric("The answer is in French.", "Nous devons organiser le logement et les repas.") is True


def test_demo_rubric_rows_are_valid_and_graded_without_an_llm():
    from megatron_search.data.rubric_checks import check_rubric
    from megatron_search.data.rubric_demo import demo_rubric_rows
    from megatron_search.data.world import build_world

    rows = demo_rubric_rows(build_world(3, 60, filler_docs=5), 6, seed=1)
    for row in rows:
        item = item_from_row(row, "demo")
        assert [r.kind for r in item.rubrics] == sorted((r.kind for r in item.rubrics), key=["explicit", "internal", "essential"].index)
        assert all(rubric_problems(r.text, SUBJ) == [] for r in item.rubrics)
        assert all(check_rubric(r.text, row["reference"]) is True for r in item.rubrics)  # the reference passes
        assert not all(check_rubric(r.text, row["messages"][-1]["content"]) for r in item.rubrics)  # the request does not

    def no_llm(m, i):
        raise AssertionError("the LLM judge must not be called for mechanical rubrics")

    policy = ScriptedLLM(lambda m, i: rows[0]["reference"] if i < 3 else "u & Plz")
    kept, dropped = _run(RubricPipeline(ScriptedLLM(no_llm), ScriptedLLM(no_llm), policy), [item_from_row(rows[0], "d")])
    assert dropped == [] and kept[0].to_dict()["pass_at_k"] == 3
