"""The rubric pipeline end to end against an OpenAI-compatible server started in the test: the
local CPU engine serving the tiny Qwen3-MoE over /v1/chat/completions (rollout/local/chat_endpoint.py).

What a random tiny model writes is noise, so this exercises the protocol, not the quality: four
real policy samples per prompt over HTTP, mechanical grading, the pass@4 decision, a generator
reply that is not JSON dropped with its reason, and a re-run served entirely from the cache.
"""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from megatron_search.chat.format import ChatFormat
from megatron_search.chat.tokenizer import BPETokenizer
from megatron_search.data.llm_client import LLMClient
from megatron_search.data.rubric_checks import check_rubric
from megatron_search.data.rubric_demo import demo_rubric_rows
from megatron_search.data.rubrics import RubricItem, RubricPipeline, calibration_keep, item_from_row
from megatron_search.data.world import build_world
from megatron_search.rollout.local.chat_endpoint import ChatEndpoint
from megatron_search.rollout.local.engine import LocalEngine
from megatron_search.rollout.local.server import build_app

MODEL = "configs/models/tiny_qwen3_moe"


@pytest.fixture(scope="module")
def world():
    return build_world(5, 60, filler_docs=5)


@pytest.fixture(scope="module")
def chat(world):
    # the tiny model samples any of its 2,048 ids: the tokenizer needs exactly that many (a richer corpus)
    texts = [d.text for seed in (6, 7) for d in build_world(seed, 300).documents]
    texts += [r["messages"][0]["content"] for r in demo_rubric_rows(world, 30)]
    tok = BPETokenizer.train(texts * 2, vocab_size=2048)
    assert tok.vocab_size == 2048
    return ChatEndpoint(tok, ChatFormat("qwen3"), "tiny-qwen3-moe", default_max_tokens=16)


def _run_pipeline(world, chat, cache_dir, serve: bool = True):
    rows = demo_rubric_rows(world, 2, seed=4)
    rows.append({"id": "needs-generation", "messages": [{"role": "user", "content": "Plan a two-day visit to a city."}]})

    async def go():
        runner, url = None, "http://127.0.0.1:9"  # nothing listens there: any request would fail
        if serve:
            engine = LocalEngine(MODEL, seed=0, max_running_requests=8)
            runner = web.AppRunner(build_app(engine, chat))
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        client = LLMClient(url, model="tiny", cache_dir=cache_dir, timeout_s=120, retries=0)
        try:
            pipe = RubricPipeline(client, client, client, samples=4, sample_temperature=1.0, max_tokens=16)
            kept, dropped = await pipe.run([item_from_row(r, f"row{i}") for i, r in enumerate(rows)])
            return kept, dropped, client.http_requests
        finally:
            await client.close()
            if runner is not None:
                await runner.cleanup()

    return asyncio.run(go())


def test_rubric_pipeline_against_the_local_engine(world, chat, tmp_path):
    kept, dropped, requests = _run_pipeline(world, chat, tmp_path / "cache")
    by_id = {d.id: d for d in dropped}
    # the tiny model cannot write rubric JSON: generation fails with the parse error as the reason
    gen = by_id.pop("needs-generation")
    assert gen.stage == "generate" and "not JSON" in gen.reason
    # the two demo prompts went through sampling and grading: 4 samples each over HTTP
    graded = kept + [d for d in dropped if d.id != "needs-generation"]
    assert len(graded) == 2 and requests == 1 + 2 * 4
    for d in by_id.values():
        assert d.stage == "calibrate" and d.reason.split(" samples pass")[0][-6:].strip() in ("0 of 4", "4 of 4")
    for item in kept:
        assert isinstance(item, RubricItem) and len(item.samples) == 4
        # verdicts are the rubric checks of the served samples, recomputed here
        assert item.verdicts == [[bool(check_rubric(r.text, s)) for r in item.rubrics] for s in item.samples]
        assert calibration_keep([all(v) for v in item.verdicts])[0]
    # a re-run is served from the cache: no server at all, no request, same outcome
    kept2, dropped2, requests2 = _run_pipeline(world, chat, tmp_path / "cache", serve=False)
    assert requests2 == 0
    assert [k.to_dict() for k in kept2] == [k.to_dict() for k in kept]
    assert [vars(d) for d in dropped2] == [vars(d) for d in dropped]


def _serve(app_factory):
    """Start an aiohttp app on a free 127.0.0.1 port; returns (runner, url)."""
    async def start():
        runner = web.AppRunner(app_factory())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    return start()


def _verdict_server(seen: list):
    """An OpenAI-compatible judge that passes a criterion iff the response contains "Paris" (well-formed JSON)."""
    import json

    async def completions(request):
        prompt = (await request.json())["messages"][-1]["content"]
        seen.append(prompt)
        response = prompt.split("Response to grade:\n", 1)[1].split("\n\nCriteria:", 1)[0]
        criteria = [l for l in prompt.split("Criteria:\n", 1)[1].split("\n\n")[0].splitlines() if l.strip()]
        verdicts = [{"index": i, "pass": "Paris" in response, "reason": "-"} for i in range(1, len(criteria) + 1)]
        return web.json_response({"choices": [{"message": {"content": json.dumps({"verdicts": verdicts})},
                                               "finish_reason": "stop"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    return app


@pytest.mark.multiprocess
def test_rubric_judge_batches_counts_malformed_and_leaves_mechanical_rubrics_alone(chat):
    """GRPO's rubric judge (reward.rubric_judge) over HTTP: a judge that replies in form decides the
    rubrics the mechanical checks cannot, one request per response; the local engine serving the random
    tiny model replies noise, which fails those rubrics and is counted; mechanical rubrics never reach it."""
    from megatron_search.data.rubrics import RubricJudge

    convo = [{"role": "user", "content": "What is the capital of France? Reply warmly."}]
    mechanical, judged = 'The answer contains "Paris"', "The tone is warm and friendly"
    assert check_rubric(mechanical, "x") is not None and check_rubric(judged, "x") is None
    jobs = [(convo, "Paris, of course!", [mechanical, judged]), (convo, "Lyon.", [mechanical, judged]),
            (convo, "Paris.", [mechanical])]

    async def go():
        seen: list = []
        runner, url = await _serve(lambda: _verdict_server(seen))
        engine = LocalEngine(MODEL, seed=0, max_running_requests=8)
        noise_runner, noise_url = await _serve(lambda: build_app(engine, chat))
        try:
            good = RubricJudge(LLMClient(url, retries=0), max_tokens=16)
            noise = RubricJudge(LLMClient(noise_url, retries=0), max_tokens=16)
            return await good.grade_many(jobs), seen, await noise.grade_many(jobs)
        finally:
            for j in (good, noise):
                await j.client.close()
            await runner.cleanup()
            await noise_runner.cleanup()

    ok, seen, bad = asyncio.run(go())
    assert ok.verdicts == [[True, True], [False, False], [True]]
    assert (ok.calls, ok.judged, ok.mechanical, ok.malformed) == (2, 2, 3, 0)
    # one request per response with undecided rubrics, listing only those (the versioned prompt's layout)
    assert len(seen) == 2 and all(f"1. {judged}" in p and mechanical not in p.split("Criteria:")[1] for p in seen)
    assert bad.verdicts == [[True, False], [False, False], [True]]  # noise fails the judged rubric only
    assert (bad.calls, bad.malformed) == (2, 2)
