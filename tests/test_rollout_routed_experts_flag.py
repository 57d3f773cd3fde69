"""Routed experts are a server-level option, as in SGLang 0.5.23 and vLLM 0.33.0: a server started without
--enable-return-routed-experts records none and answers a request that asks for them without them (SGLang:
no capturer, no meta_info["routed_experts"]), and our client names the missing flag. The local engine's
HTTP server follows the same rule, in process here (aiohttp app on a free loopback port)."""
import asyncio

import pytest
from aiohttp import web

from megatron_search.rollout.engine.base import MalformedReply
from megatron_search.rollout.engine.types import GenerateRequest, SamplingParams
from megatron_search.rollout.local.engine import LocalEngine
from megatron_search.rollout.local.server import build_app
from megatron_search.rollout.sglang.client import SGLangClient

MODEL = "configs/models/tiny_qwen3_moe"
LAYERS, TOP_K = 4, 2  # its config.json: num_hidden_layers, num_experts_per_tok


async def _generate(engine: LocalEngine, routed_experts: bool, ask: bool):
    runner = web.AppRunner(build_app(engine, routed_experts=routed_experts))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    client = SGLangClient(url, 120.0, moe_shape=(LAYERS, TOP_K))
    try:
        req = GenerateRequest(input_ids=[5, 6, 7, 8], sampling=SamplingParams(max_new_tokens=3, temperature=0.0),
                              return_routed_experts=ask)
        return await client.generate(req)
    finally:
        await client.close()
        await runner.cleanup()


@pytest.fixture(scope="module")
def engine():
    return LocalEngine(MODEL, seed=0)


def test_experts_come_back_only_from_a_server_started_for_them(engine):
    res = asyncio.run(_generate(engine, routed_experts=True, ask=True))
    assert res.routed_experts_NLK.shape == (4 + len(res.output_ids) - 1, LAYERS, TOP_K)  # each fed token: prompt + output - 1
    with pytest.raises(MalformedReply, match="--enable-return-routed-experts"):
        asyncio.run(_generate(engine, routed_experts=False, ask=True))
    assert asyncio.run(_generate(engine, routed_experts=False, ask=False)).routed_experts_NLK is None


def test_the_launcher_passes_the_flag():
    from megatron_search.config import load_config
    from megatron_search.launch.slurm_plan import sglang_argv

    for overrides, expected in (([], False), (["grpo.routing_replay=true"], True),
                                (["grpo.routing_agreement=true"], True)):
        cfg = load_config(None, overrides)
        assert ("--enable-return-routed-experts" in sglang_argv(cfg, "/m", 30000, 1, 0, "")) == expected, overrides
