"""The vLLM client (rollout/vllm/client.py) against the local engine serving vLLM 0.33.0's API (rollout/local/vllm_api.py).

A server subprocess (started by launch.start_engines with rollout.engine=vllm, rollout.vllm.server=local)
serves the tiny random Qwen3-MoE (seed 0); the test process rebuilds the same model and checks what comes
back over vLLM's routes against plain uncached HF forwards: logprobs at the sampling temperature (the
convention of our SGLang path), routed experts equal to the router's top-k from routed_experts_prompt_start,
seeded sampling, a disk weight update (/collective_rpc reload_weights) that makes greedy output exactly the
pushed model's, sleep level 2 and wake-up by tags, the retract mapping (pause keep + reset_prefix_cache with
reset_running_requests), vLLM's key rule, its refusals, the config checks and the `vllm serve` line.
"""
import asyncio
import os

import aiohttp
import pytest
import torch
from safetensors.torch import save_file

from megatron_search.config import ConfigError, load_config
from megatron_search.rollout.engine.auth import bearer_header, key_from_env
from megatron_search.rollout.engine.base import EngineError
from megatron_search.rollout.engine.types import GenerateRequest, SamplingParams
from megatron_search.rollout.launch import start_engines
from megatron_search.rollout.local.runner import load_hf_model
from megatron_search.rollout.vllm.client import VLLMClient, vllm_command, vllm_env

MODEL = "configs/models/tiny_qwen3_moe"
VLLM = ["rollout.engine=vllm", "rollout.vllm.server=local"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    cfg = load_config(None, VLLM + ["rollout.local.seed=0", "grpo.routing_replay=true",
                                    "rollout.local.startup_timeout_s=300"])
    eng = start_engines(cfg, tmp_path_factory.mktemp("vllm_srv"), routed_experts=cfg.grpo.wants_routed_experts())
    assert len(eng.servers) == 1 and isinstance(eng.clients[0], VLLMClient)
    yield eng
    eng.stop_servers()


@pytest.fixture(scope="module")
def model_a():
    return load_hf_model(MODEL, seed=0)


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


async def with_client(url, fn, moe_shape=None):
    c = VLLMClient(url, 300, moe_shape)
    try:
        return await fn(c)
    finally:
        await c.close()


@torch.no_grad()
def plain(model, ids, temperature):
    """Log-softmax(logits / T) of each next token, and the router's top-2 experts per position and layer."""
    out = model(input_ids=torch.tensor([ids]), use_cache=False, output_router_logits=True)
    logits = out.logits[0, :-1].double() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    experts = torch.stack([torch.topk(torch.softmax(r.float(), -1), 2).indices for r in out.router_logits], 1)
    return logp, experts.numpy()


@torch.no_grad()
def greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids


@pytest.mark.multiprocess
def test_generate_logprobs_experts_and_seeds(engines, model_a):
    url = engines.servers[0].url
    prompt = [5, 17, 300, 42, 8, 99, 1000, 7]
    start = 3
    req = GenerateRequest(prompt, SamplingParams(max_new_tokens=12, temperature=0.7, seed=1234, ignore_eos=True),
                          return_routed_experts=True, routed_experts_start_len=start)

    async def go(c):
        return await c.generate(req), await c.generate(req), await c.generate(
            GenerateRequest(prompt, SamplingParams(max_new_tokens=12, temperature=0.7, seed=99, ignore_eos=True)))
    a, b, other = run(with_client(url, go, moe_shape=(4, 2)))
    assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs  # same seed, same draw
    assert other.output_ids != a.output_ids
    assert len(a.output_ids) == 12 and a.finish_reason.type == "length"
    ids = prompt + a.output_ids
    logp, experts = plain(model_a, ids, 0.7)
    assert torch.allclose(torch.tensor(a.output_logprobs, dtype=torch.float64), logp[len(prompt) - 1:], atol=1e-4)
    assert a.routed_experts_NLK.shape == (len(ids) - 1 - start, 4, 2)
    assert (a.routed_experts_NLK == experts[start:len(ids) - 1]).all()
    assert a.prompt_tokens == len(prompt) and a.weight_version == "default"


@pytest.mark.multiprocess
def test_stop_token_and_model_info(engines, model_a):
    url = engines.servers[0].url
    prompt = [11, 12, 13]
    first = greedy(model_a, prompt, 3)[3:]  # the greedy continuation; stop on its third token

    async def go(c):
        res = await c.generate(GenerateRequest(prompt, SamplingParams(max_new_tokens=10, temperature=0.0,
                                                                      stop_token_ids=(first[2],))))
        return res, await c.get_model_info(), await c.health(), await c.local_memory()
    res, info, healthy, mem = run(with_client(url, go))
    want = first[:first.index(first[2]) + 1]  # up to the stop token's first appearance, which is kept
    assert res.output_ids == want and res.finish_reason.type == "stop" and res.finish_reason.matched == first[2]
    assert info.weight_version == "default" and info.model_path and healthy and mem["weights"] > 0


@pytest.mark.multiprocess
def test_disk_update_sleep_wake_and_retract(engines, model_a, tmp_path):
    url = engines.servers[0].url
    model_b = load_hf_model(MODEL, seed=1)
    save_file({k: v.contiguous() for k, v in model_b.state_dict().items()}, str(tmp_path / "model.safetensors"))
    prompt = [3, 1, 4, 1, 5]
    want_a, want_b = greedy(model_a, prompt, 6)[5:], greedy(model_b, prompt, 6)[5:]
    assert want_a != want_b
    greedy_req = GenerateRequest(prompt, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))

    async def go(c):
        out = {"before": (await c.generate(greedy_req)).output_ids}
        # the colocated cycle: sleep (both), wake the weights, load them, wake the KV cache
        await c.release_memory_occupation(["weights", "kv_cache"])
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/is_sleeping") as r:
                out["asleep"] = (await r.json())["is_sleeping"]
        out["mem_asleep"] = (await c.local_memory())["weights"]
        await c.resume_memory_occupation(["weights"])
        await c.pause_generation("abort")
        await c.update_weights_from_disk(str(tmp_path), weight_version="v2")
        await c.continue_generation()
        await c.resume_memory_occupation(["kv_cache"])
        res = await c.generate(greedy_req)
        out["after"], out["version"] = res.output_ids, res.weight_version
        # retract: a long request frozen by pause(keep), preempted by the flush, finished after resume
        long = asyncio.ensure_future(c.generate(GenerateRequest(prompt, SamplingParams(
            max_new_tokens=400, temperature=0.0, ignore_eos=True))))
        await asyncio.sleep(1.0)
        await c.pause_generation("retract")
        await c.flush_cache()
        await c.update_weight_version("v3", abort_all_requests=False)
        await c.continue_generation()
        done = await long
        out["long"] = (len(done.output_ids), done.finish_reason.type, done.weight_version)
        return out
    out = run(with_client(url, go))
    assert out["before"] == want_a and out["after"] == want_b and out["version"] == "v2"
    assert out["asleep"] is True and out["mem_asleep"] == 0
    assert out["long"] == (400, "length", "v3")


@pytest.mark.multiprocess
def test_vllm_key_rule_and_refusals(engines):
    url = engines.servers[0].url
    key = key_from_env()
    assert key

    async def go():
        out = {}
        async with aiohttp.ClientSession() as s:
            body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}}
            async with s.post(f"{url}/inference/v1/generate", json=body) as r:
                out["no_key"] = r.status
            async with s.post(f"{url}/inference/v1/generate", json=body, headers={"Authorization": "bearer " + key}) as r:
                out["lower_bearer"] = r.status
            async with s.get(f"{url}/v1/models") as r:
                out["models_no_key"] = r.status
            async with s.get(f"{url}/health") as r:
                out["health_no_key"] = r.status
            async with s.get(f"{url}/weight_info") as r:  # vLLM guards only /v1 /v2 /inference /cohere
                out["rl_route_no_key"] = r.status
            h = bearer_header(key)
            bad = {
                "empty": {"token_ids": [], "sampling_params": {"max_tokens": 1}},
                "negative": {"token_ids": [1, -2], "sampling_params": {"max_tokens": 1}},
                "top_p": {"token_ids": [1], "sampling_params": {"max_tokens": 1, "top_p": 0.0}},
                "temperature": {"token_ids": [1], "sampling_params": {"max_tokens": 1, "temperature": -1.0}},
                "max_tokens": {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
                "start": {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1, "routed_experts_prompt_start": 3}},
                "unknown": {"token_ids": [1], "sampling_params": {"max_tokens": 1, "max_new_tokens": 2}},
                "stream": {"token_ids": [1], "sampling_params": {"max_tokens": 1}, "stream": True},
            }
            for name, b in bad.items():
                async with s.post(f"{url}/inference/v1/generate", json=b, headers=h) as r:
                    out[name] = (r.status, (await r.json())["error"]["message"])
            async with s.post(f"{url}/pause?mode=sideways", headers=h) as r:
                out["pause_mode"] = r.status
            async with s.post(f"{url}/sleep?level=3", headers=h) as r:
                out["sleep_level"] = r.status
        return out
    out = run(go())
    assert out["no_key"] == 401 and out["lower_bearer"] == 200 and out["models_no_key"] == 401
    assert out["health_no_key"] == 200 and out["rl_route_no_key"] == 200
    for name in ("empty", "negative", "top_p", "temperature", "max_tokens", "start", "unknown", "stream"):
        assert out[name][0] == 400, (name, out[name])
    assert "routed_experts_prompt_start" in out["start"][1] and "max_new_tokens" in out["unknown"][1]
    assert out["pause_mode"] == 400 and out["sleep_level"] == 400

    async def bad_sleep(c):
        with pytest.raises(EngineError, match="weights only together"):
            await c.release_memory_occupation(["weights"])
        with pytest.raises(EngineError, match="not supported"):
            await c.update_weights_from_tensor([("x", torch.zeros(1))])
    run(with_client(url, bad_sleep))


def test_config_checks_and_launch_line():
    cfg = load_config(None, ["rollout.engine=vllm", "grpo.routing_replay=true"])
    assert cfg.rollout.resolved_weight_sync() == "disk"
    for bad, what in ((["rollout.weight_sync=tensor"], "weight_sync"), (["rollout.top_p=0.9"], "top_p"),
                      (["rollout.vllm.enable_sleep_mode=false"], "enable_sleep_mode")):
        with pytest.raises(ConfigError, match=what):
            load_config(None, ["rollout.engine=vllm", *bad])
    load_config(None, ["rollout.engine=vllm", "rollout.top_p=0.9", "rollout.return_original_logprob=true"])
    argv = vllm_command(cfg.rollout.vllm, "/m", 30010, routed_experts=True, seed=7)
    line = " ".join(argv)
    for flag in ("serve /m", "--port 30010", "--seed 7", "--logprobs-mode processed_logprobs", "--enable-scale-out",
                 "--enable-sleep-mode", "--enable-return-routed-experts", "--host 127.0.0.1",
                 "--enable-prompt-tokens-details"):
        assert flag in line, flag
    assert "--api-key" not in line and "--language-model-only" not in line  # Qwen3-MoE is a text model in vLLM
    raw = vllm_command(cfg.rollout.vllm, "/m", 1, routed_experts=False, original_logprob=True)
    assert "raw_logprobs" in raw and "--enable-return-routed-experts" not in raw
    os.environ.setdefault("MS_TEST_VLLM_KEY", "k" * 32)
    env = vllm_env("MS_TEST_VLLM_KEY", {})
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": os.environ["MS_TEST_VLLM_KEY"]}


@pytest.mark.multiprocess
def test_engine_urls_get_the_client_of_rollout_engine():
    """Attached URLs (rollout.engine_urls, eval model URLs) are driven with the API rollout.engine names."""
    from megatron_search.eval.run import open_engine
    from megatron_search.rollout.sglang.client import SGLangClient

    for engine, kind in (("vllm", VLLMClient), ("sglang", SGLangClient)):
        cfg = load_config(None, [f"rollout.engine={engine}", "rollout.engine_urls=[http://127.0.0.1:9]"])
        eng = start_engines(cfg, "/nonexistent-unused")
        client, owned = open_engine("http://127.0.0.1:9", cfg)
        assert type(eng.clients[0]) is kind and type(client) is kind and owned
