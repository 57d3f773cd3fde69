"""The local engine server over HTTP, driven by the same client class as SGLang servers.

A server subprocess serves the tiny random Qwen3-MoE (seed 0); the test process rebuilds the same
model and checks everything the server reports against plain uncached HF forwards: 64 concurrent
agent rollouts (logprobs within 1e-4 fp32, routed experts equal to the router top-k), weight
updates by HF name (tensor / disk / gloo group) changing greedy generations to exactly those of
the pushed model, error bodies, and /v1/chat/completions.
"""
import asyncio
import random
import socket

import aiohttp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from megatron_search.chat.format import ChatFormat
from megatron_search.chat.tokenizer import BPETokenizer, ChatEncoder
from megatron_search.config import load_config
from megatron_search.rollout.agent.loop import AgentSettings, AgentTask, SearchAgent
from megatron_search.rollout.engine.auth import bearer_header, key_from_env
from megatron_search.rollout.engine.base import EngineError
from megatron_search.rollout.engine.types import GenerateRequest, SamplingParams
from megatron_search.rollout.launch import start_engines
from megatron_search.rollout.local.runner import load_hf_model
from megatron_search.rollout.local.weights import weights_sha256
from megatron_search.rollout.sglang.client import SGLangClient
from megatron_search.rollout.sglang.weight_group import FLAT, open_weight_group, send_flat_bucket, send_named_tensors
from megatron_search.search.base import SearchBackend, SearchResult
from megatron_search.search.tool import SearchTool

pytestmark = pytest.mark.multiprocess

MODEL = "configs/models/tiny_qwen3_moe"
WORDS = "the of and a to in is was for on that with as by search web answer question paris capital river city".split()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    # enough distinct words that the BPE fills all 2,048 ids the tiny model can sample
    rng = random.Random(0)
    words = WORDS + ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(4000)]
    texts = [" ".join(rng.choice(words) for _ in range(50)) for _ in range(800)]
    tok = BPETokenizer.train(texts, vocab_size=2048)
    assert tok.vocab_size == 2048
    path = tok.save(tmp_path_factory.mktemp("tok"))
    return tok, str(path)


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory):
    # started the way training starts it (rollout.launch.start_engines), chat endpoint on model.tokenizer
    cfg = load_config(None, [f"model.tokenizer={tokenizer[1]}", "rollout.local.seed=0",
                             "rollout.local.max_running_requests=64", "rollout.local.startup_timeout_s=300"])
    engines = start_engines(cfg, tmp_path_factory.mktemp("srv"), routed_experts=True)  # requests below ask for them
    assert len(engines.servers) == 1 and engines.clients[0].base_url == engines.servers[0].url
    assert key_from_env() is not None  # the job's key (generated here unless set), which raw requests below send
    yield engines.servers[0]
    engines.stop_servers()


@pytest.fixture(scope="module")
def model_a():
    return load_hf_model(MODEL, seed=0)


class OneDoc(SearchBackend):
    def search(self, query, k):
        return [SearchResult("t", "u", "s", "d")]


@torch.no_grad()
def plain_scores(model, ids):
    out = model(input_ids=torch.tensor([ids]), use_cache=False, output_router_logits=True)
    logp = torch.log_softmax(out.logits[0, :-1].double(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    experts = torch.stack([torch.topk(torch.softmax(r.float(), -1), 2).indices for r in out.router_logits], 1)
    return logp, experts.numpy()


@torch.no_grad()
def plain_greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[-n:]


def test_agent_64_concurrent_rollouts_over_http(server, tokenizer, model_a):
    tok, _ = tokenizer
    enc = ChatEncoder(tok, ChatFormat("qwen3"))
    settings = AgentSettings(max_new_tokens=12, max_total_tokens=1024, temperature=1.0, concurrency=64,
                             return_routed_experts=True)

    async def go():
        client = SGLangClient(server.url)
        agent = SearchAgent(client, enc, SearchTool(OneDoc()), settings)
        tasks = [AgentTask([{"role": "user", "content": f"question {i}: {WORDS[i % len(WORDS)]}"}], seed=i)
                 for i in range(64)]
        try:
            return await agent.run_many(tasks, progress=False)
        finally:
            await client.close()

    rollouts = asyncio.run(go())
    assert len(rollouts) == 64
    worst = 0.0
    for r in rollouts:
        r.check()
        assert r.weight_versions == ["default"] and r.num_model_tokens > 0
        ref_lp, ref_experts = plain_scores(model_a, r.token_ids)
        got = torch.tensor(r.logprobs[1:], dtype=torch.float64)
        model_pos = torch.tensor(r.loss_mask[1:], dtype=torch.bool)  # logprob of token t sits at t-1 in ref
        worst = max(worst, float((got - ref_lp)[model_pos].abs().max()))
        assert torch.all(got[~model_pos] == 0)
        assert r.routed_experts_NLK.shape == (len(r.token_ids) - 1, 4, 2)
        np.testing.assert_array_equal(r.routed_experts_NLK, ref_experts[:-1])
    assert worst < 1e-4, worst


async def served_sha256(url: str) -> dict[str, str]:
    async with aiohttp.ClientSession(headers=bearer_header(key_from_env())) as s:
        async with s.get(f"{url}/local/weights_sha256") as resp:
            return (await resp.json())["sha256"]


def test_weight_updates_over_http(server, model_a, tmp_path):
    model_b = load_hf_model(MODEL, seed=1)
    prompt = [11, 22, 33, 44, 55, 66]
    want_a, want_b = plain_greedy(model_a, prompt, 6), plain_greedy(model_b, prompt, 6)
    assert want_a != want_b
    greedy = GenerateRequest(prompt, SamplingParams(max_new_tokens=6, temperature=0.0))
    save_file({n: p.detach().clone() for n, p in model_a.named_parameters()}, str(tmp_path / "model.safetensors"))

    async def go():
        client = SGLangClient(server.url)
        try:
            await client.begin_weight_update()
            await client.update_weights_from_tensor(list(model_b.named_parameters()), weight_version="v1")
            r = await client.generate(greedy)
            assert (r.output_ids, r.weight_version) == (want_b, "v1")

            await client.update_weights_from_disk(str(tmp_path), weight_version="v2")
            r = await client.generate(greedy)
            assert (r.output_ids, r.weight_version) == (want_a, "v2")

            # trainer = rank 0 of a gloo group; the engine joins as rank 1 and receives broadcasts
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            _, group = await asyncio.gather(
                client.init_weights_update_group("127.0.0.1", port, 1, 2, "wg", "gloo"),
                asyncio.to_thread(open_weight_group, "127.0.0.1", port, 0, 2, "wg"))
            named = [(n, p.detach()) for n, p in model_b.named_parameters()]
            await asyncio.gather(
                client.update_weights_from_distributed([n for n, _ in named], [t.dtype for _, t in named],
                                                       [list(t.shape) for _, t in named], "wg", weight_version="v3"),
                asyncio.to_thread(send_named_tensors, group, named))
            r = await client.generate(greedy)
            assert (r.output_ids, r.weight_version) == (want_b, "v3")

            # flattened buckets without a version (the weight sync's): each is copied into the model while the
            # next is received; a bucket refused after its bytes arrived (a bad name at its end) writes nothing
            flat = [(n, p.detach()) for n, p in model_a.named_parameters()]
            good, rest = flat[:len(flat) // 2], flat[len(flat) // 2:]
            bad = rest + [("lm_headd.weight", torch.zeros(4, 64))]
            for bucket in (good, bad):
                push = client.update_weights_from_distributed(
                    [n for n, _ in bucket], [t.dtype for _, t in bucket], [list(t.shape) for _, t in bucket], "wg",
                    weight_version=None, flush_cache=False, load_format=FLAT)
                sent = asyncio.to_thread(send_flat_bucket, group, bucket)
                if bucket is good:
                    await asyncio.gather(push, sent)
                else:
                    with pytest.raises(EngineError, match="lm_headd.weight: no such parameter"):
                        await asyncio.gather(push, sent)
            held = await served_sha256(server.url)
            want = {**weights_sha256(model_b), **{n: h for n, h in weights_sha256(model_a).items()
                                                 if n in dict(good)}}
            assert held == want and any(held[n] != weights_sha256(model_a)[n] for n, _ in rest)
            await client.destroy_weights_update_group("wg")

            with pytest.raises(EngineError, match="lm_headd.weight: no such parameter"):
                await client.update_weights_from_tensor([("lm_headd.weight", torch.zeros(2048, 64))])
            await client.end_weight_update()
            await client.update_weights_from_disk(str(tmp_path), weight_version="default")
            assert (await client.generate(greedy)).output_ids == want_a
        finally:
            await client.close()

    asyncio.run(go())


def test_errors_and_control_endpoints(server):
    async def go():
        client = SGLangClient(server.url)
        try:
            async with aiohttp.ClientSession(headers=bearer_header(key_from_env())) as s:
                async with s.post(f"{server.url}/generate", json={"input_ids": "abc"}) as resp:
                    assert resp.status == 400 and "input_ids" in (await resp.json())["message"]
                async with s.post(f"{server.url}/generate", json={"input_ids": [1, 2], "sampling_params": {"topk": 3}}) as resp:
                    assert resp.status == 400 and "topk" in (await resp.json())["message"]
            with pytest.raises(EngineError, match="outside the vocabulary"):
                await client.generate(GenerateRequest([5000]))
            info = await client.get_model_info()
            assert (info.num_moe_layers, info.moe_top_k) == (4, 2)
            await client.pause_generation("in_place")
            await client.continue_generation()
            await client.flush_cache()
            assert await client.health()
        finally:
            await client.close()

    asyncio.run(go())


def test_openai_chat_completions(server, tokenizer, model_a):
    tok, _ = tokenizer
    enc = ChatEncoder(tok, ChatFormat("qwen3"))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the capital of paris"}]
    prompt = enc.prompt_ids(messages)
    ids = plain_greedy(model_a, prompt, 8)
    if tok.im_end_id in ids:
        ids = ids[: ids.index(tok.im_end_id) + 1]

    async def go():
        async with aiohttp.ClientSession(headers=bearer_header(key_from_env())) as s:
            body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
            async with s.post(f"{server.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

    out = asyncio.run(go())
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert (choice["message"]["content"] or "") == enc.parse_turn(ids).content
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                            "total_tokens": len(prompt) + len(ids)}
