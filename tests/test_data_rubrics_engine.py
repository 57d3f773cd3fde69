"""The rubric pipeline end to end against an OpenAI-compatible server started in the test: the
local CPU engine serving the tiny Qwen3-MoE over /v1/chat/completions (rollout/chat_endpoint.py).

What a random tiny model writes is noise, so this exercises the protocol, not the quality: four
real policy samples per prompt over HTTP, mechanical grading, the pass@4 decision, a generator
reply that is not JSON dropped with its reason, and a re-run served entirely from the cache.
"""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from megatron_search.data.llm_client import LLMClient
from megatron_search.data.rubric_checks import check_rubric
from megatron_search.data.rubric_demo import demo_rubric_rows
from megatron_search.data.rubrics import RubricItem, RubricPipeline, calibration_keep, item_from_row
from megatron_search.data.world import build_world
from megatron_search.rollout.chat_endpoint import ChatEndpoint
from megatron_search.rollout.chat_format import ChatFormat
from megatron_search.rollout.local import LocalEngine
from megatron_search.rollout.local_server import build_app
from megatron_search.rollout.tokenizer import BPETokenizer

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
