"""Agent loop driven by the scripted engine: exact multi-turn tool flows, token-in/token-out.

Expected transcripts are assembled here by hand from the chat text of each turn, tokenised with
the real Qwen tokenizer; expected logprobs/experts come from the scripted engine's formulas.
"""
import asyncio

import numpy as np
import pytest

from megatron_search.chat.format import ChatFormat
from megatron_search.chat.tokenizer import ChatEncoder, QwenTokenizer
from megatron_search.rollout.agent.loop import AgentSettings, AgentTask, SearchAgent
from megatron_search.rollout.local.scripted import ScriptedEngine, scripted_experts, scripted_logprob
from megatron_search.search.base import SearchBackend, SearchBackendError, SearchResult
from megatron_search.search.tool import SearchTool

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DOC = SearchResult(title="France", url="https://example.org/france", snippet="Paris is the capital of France.", doc_id="d1")


@pytest.fixture(scope="module")
def tok():
    return QwenTokenizer()


class FixedBackend(SearchBackend):
    name = "fixed"

    def __init__(self, fail: Exception | None = None):
        self.fail = fail
        self.queries = []

    def search(self, query, k):
        self.queries.append(query)
        if self.fail is not None:
            raise self.fail
        return [DOC]


def json_call(query: str) -> str:
    return '<tool_call>\n{"name": "search_web", "arguments": {"query": "%s"}}\n</tool_call>' % query


def xml_call(query: str) -> str:
    return f"<tool_call>\n<function=search_web>\n<parameter=query>\n{query}\n</parameter>\n</function>\n</tool_call>"


class TurnScript:
    """Responder: the n-th assistant turn of a rollout (n = assistant headers in the input) gets turns[n]."""

    def __init__(self, tok, turns: list[str]):
        self.tok = tok
        self.turns = [tok.encode(t) for t in turns]
        self.header = tok.encode("<|im_start|>assistant")

    def __call__(self, ids):
        h = self.header
        n = sum(1 for i in range(len(ids) - len(h) + 1) if ids[i : i + len(h)] == h)
        return self.turns[min(n - 1, len(self.turns) - 1)]


def make_agent(tok, style, turns, backend=None, **settings):
    enc = ChatEncoder(tok, ChatFormat(style))
    engine = ScriptedEngine(TurnScript(tok, turns), moe_shape=(2, 2), num_experts=8)
    tool = SearchTool(backend or FixedBackend(), max_results=10, max_query_chars=250, max_calls=5)
    base = dict(max_new_tokens=256, max_total_tokens=4096, temperature=1.0, return_routed_experts=True)
    base.update(settings)
    return SearchAgent(engine, enc, tool, AgentSettings(**base)), engine, enc


@pytest.mark.parametrize("style,think,call", [("qwen3", "", json_call), ("qwen3_5", "Let me search.\n</think>\n\n", xml_call)])
def test_two_turn_search_flow_is_token_exact(tok, style, think, call):
    turn0 = f"{think}{call('capital of France')}<|im_end|>"
    turn1 = f"{think}The answer is <answer>Paris</answer>.<|im_end|>"
    agent, engine, enc = make_agent(tok, style, [turn0, turn1])
    r = asyncio.run(agent.run(AgentTask(QUESTION)))

    prompt = enc.prompt_ids(QUESTION, agent.tools)
    t0, t1 = tok.encode(turn0), tok.encode(turn1)
    result_text = "[1] France\nURL: https://example.org/france\nParis is the capital of France."
    gen_prefix = "<think>\n" if style == "qwen3_5" else ""
    tool_ids = tok.encode(f"\n<|im_start|>user\n<tool_response>\n{result_text}\n</tool_response><|im_end|>\n"
                          f"<|im_start|>assistant\n{gen_prefix}")
    assert r.token_ids == prompt + t0 + tool_ids + t1
    n0, nt = len(prompt) + len(t0), len(prompt) + len(t0) + len(tool_ids)
    assert r.loss_mask == [0] * len(prompt) + [1] * len(t0) + [0] * len(tool_ids) + [1] * len(t1)
    want_lp = [0.0] * len(prompt) + [scripted_logprob(t, i) for i, t in enumerate(t0)] + [0.0] * len(tool_ids) \
        + [scripted_logprob(t, i) for i, t in enumerate(t1)]
    assert r.logprobs == pytest.approx(want_lp, abs=0)
    assert (r.tool_calls, r.failed_executions, sum(r.broken_calls.values())) == (1, 0, 0)
    assert r.final_answer == "Paris" and r.stop_reason == "answer"
    assert [(s.start, s.end, s.source) for s in r.segments] == [
        (0, len(prompt), "prompt"), (len(prompt), n0, "model"), (n0, nt, "tool"), (nt, len(r.token_ids), "model")]
    assert r.weight_versions == ["scripted-0"]
    # token in: the second request is exactly the first transcript plus the tool ids, never re-tokenised
    assert engine.requests[1].input_ids == prompt + t0 + tool_ids
    # routed experts: one row per fed token, rows asked incrementally, aligned to token_ids
    assert engine.requests[1].routed_experts_start_len == n0 - 1
    assert r.routed_experts_NLK.shape == (len(r.token_ids) - 1, 2, 2)
    np.testing.assert_array_equal(r.routed_experts_NLK, scripted_experts(r.token_ids, 0, len(r.token_ids) - 1, 2, 2, 8))
    assert r.metadata["queries"] == ["capital of France"]


@pytest.mark.parametrize("failure", [SearchBackendError("timed out after 10 s"), TimeoutError("read timeout"),
                                     RuntimeError("index corrupt")])
def test_backend_failure_is_a_tool_error_not_a_crash(tok, failure):
    turns = [json_call("capital of France") + "<|im_end|>", "<answer>Paris</answer><|im_end|>"]
    backend = FixedBackend(fail=failure)
    agent, engine, _ = make_agent(tok, "qwen3", turns, backend=backend)
    r = asyncio.run(agent.run(AgentTask(QUESTION)))
    assert (r.tool_calls, r.failed_executions) == (1, 1)
    assert sum(r.broken_calls.values()) == 0
    assert r.stop_reason == "answer" and r.final_answer == "Paris"
    tool_text = tok.decode(r.token_ids[r.segments[2].start : r.segments[2].end])
    assert "<tool_response>\nError: the search failed" in tool_text
    assert backend.queries == ["capital of France"]


def test_broken_call_classes_are_counted(tok):
    long_query = "x" * 251
    turn0 = ('<tool_call>\n{"name": "search_web", "arguments": {"query": "a"}\n</tool_call>\n'  # invalid JSON
             '<tool_call>\n{"name": "browse", "arguments": {"url": "u"}}\n</tool_call>\n'
             + json_call(long_query) + "<|im_end|>")
    turns = [turn0, "<answer>?</answer><|im_end|>"]
    agent, _, _ = make_agent(tok, "qwen3", turns)
    r = asyncio.run(agent.run(AgentTask(QUESTION)))
    assert r.tool_calls == 3 and r.failed_executions == 0
    assert r.broken_calls == {"malformed": 1, "tool_choice_none": 0, "over_budget": 0, "unknown_tool": 1, "bad_arguments": 1}
    r = asyncio.run(agent.run(AgentTask(QUESTION, tool_choice="none")))
    assert r.broken_calls["malformed"] == 1 and r.broken_calls["tool_choice_none"] == 2


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_budget_enforced(tok, budget):
    # the model calls twice per turn for three turns (6 calls), then answers
    two = json_call("q1") + "\n" + json_call("q2") + "<|im_end|>"
    turns = [two, two, two, "<answer>done</answer><|im_end|>"]
    backend = FixedBackend()
    agent, _, enc = make_agent(tok, "qwen3", turns, backend=backend)
    r = asyncio.run(agent.run(AgentTask(QUESTION, budget=budget)))
    assert r.tool_calls == 6
    assert r.broken_calls["over_budget"] == 6 - budget
    assert len(backend.queries) == budget
    # the budget sentence is in the prompt the engine saw
    system = tok.decode(r.token_ids[: r.prompt_len])
    assert f"budget of {budget} tool call" in system


def test_stop_reasons(tok):
    # a turn longer than max_new_tokens
    agent, _, _ = make_agent(tok, "qwen3", ["word " * 50], max_new_tokens=8)
    r = asyncio.run(agent.run(AgentTask(QUESTION)))
    assert r.stop_reason == "length" and r.num_model_tokens == 8 and r.final_answer is None
    # a policy that never stops calling
    agent, _, _ = make_agent(tok, "qwen3", [json_call("again") + "<|im_end|>"], max_turns=3)
    r = asyncio.run(agent.run(AgentTask(QUESTION)))
    assert r.stop_reason == "max_turns" and r.tool_calls == 3 and r.broken_calls["over_budget"] == 0
    # the transcript budget runs out: the loop ends on a model turn, experts stay aligned
    agent, _, enc = make_agent(tok, "qwen3", [json_call("again") + "<|im_end|>"], max_total_tokens=260)
    r = asyncio.run(agent.run(AgentTask(QUESTION)))
    assert r.stop_reason == "max_total_tokens" and len(r.token_ids) <= 260
    assert r.segments[-1].source == "model" and r.routed_experts_NLK.shape[0] == len(r.token_ids) - 1
    # ids beyond the tokenizer (a padded model vocab): the episode ends, the tokens stay recorded
    agent, engine, _ = make_agent(tok, "qwen3", ["x"])
    engine.responder = lambda ids: [151_900, 151_901]
    r = asyncio.run(agent.run(AgentTask(QUESTION)))
    assert r.stop_reason == "undecodable" and r.token_ids[-2:] == [151_900, 151_901] and r.loss_mask[-1] == 1


class SlowScripted(ScriptedEngine):
    """Counts how many generate calls overlap (the engine yields to the loop while 'computing')."""

    inflight = peak = 0

    async def generate(self, request):
        SlowScripted.inflight += 1
        SlowScripted.peak = max(SlowScripted.peak, SlowScripted.inflight)
        await asyncio.sleep(0.002)
        try:
            return await super().generate(request)
        finally:
            SlowScripted.inflight -= 1


def test_run_many_keeps_order_and_concurrency_limit(tok):
    enc = ChatEncoder(tok, ChatFormat("qwen3"))

    def responder(ids):  # answer with the number written in the question
        text = tok.decode(ids)
        n = text.rsplit("question ", 1)[1].split("<|im_end|>")[0]
        return tok.encode(f"<answer>{n}</answer><|im_end|>")

    engine = SlowScripted(responder)
    agent = SearchAgent(engine, enc, SearchTool(FixedBackend()), AgentSettings(concurrency=8))
    tasks = [AgentTask([{"role": "user", "content": f"question {i}"}]) for i in range(40)]
    out = asyncio.run(agent.run_many(tasks, progress=False))
    assert [r.final_answer for r in out] == [str(i) for i in range(40)]
    assert SlowScripted.peak == 8


def test_settings_come_from_the_config():
    from megatron_search.config import load_config

    cfg = load_config(None, ["rollout.max_new_tokens=333", "rollout.temperature=0.9", "grpo.routing_replay=true"])
    t = AgentSettings.for_training(cfg.rollout, cfg.grpo.wants_routed_experts())
    assert (t.max_new_tokens, t.temperature, t.concurrency, t.return_routed_experts) == (333, 0.9, 64, True)
    e = AgentSettings.for_eval(cfg)  # RECIPE 8: 8192 output tokens, temperature 0.6
    assert (e.max_new_tokens, e.temperature, e.return_routed_experts) == (8192, 0.6, False)
