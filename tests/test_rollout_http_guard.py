"""The local engine server under bad input and without the API key (issue 25, items 2 and 5).

One server subprocess (tiny Qwen3-MoE, seed 0) started by launch_local_server with a known key in
$MS_TEST_ENGINE_KEY, 1 MiB body limit and 1 MiB weight-sync buckets. Expected answers are written
out here from SGLang 0.5.23's rule (srt/utils/auth.py: Bearer key on every route but OPTIONS and
/health*, /ready*, /metrics*; 401 {"error": "Unauthorized"}) and from the server's documented
limits, not read back from its code. After every refused request the server must still be healthy
and serve, and a refused weight update must leave every parameter's sha256 as it was.
"""
import asyncio
import base64
import json
import secrets

import aiohttp
import pytest
import torch
from safetensors.torch import save

from megatron_search.rollout.engine.base import EngineError
from megatron_search.rollout.engine.types import GenerateRequest, SamplingParams
from megatron_search.rollout.local.launch import launch_local_server
from megatron_search.rollout.local.runner import load_hf_model
from megatron_search.rollout.sglang.client import SGLangClient

pytestmark = pytest.mark.multiprocess

MODEL = "configs/models/tiny_qwen3_moe"
KEY_ENV = "MS_TEST_ENGINE_KEY"
KEY = secrets.token_urlsafe(32)
MIB = 1 << 20
TENSOR_LIMIT = 4 * -(-MIB // 3) + MIB  # base64 of a 1 MiB bucket + 1 MiB headroom (rollout.local.max_request_mb)
PROMPT = [11, 22, 33, 44, 55]
# Every route the server registers, with the method a client uses; all but /health* need the key.
GUARDED = [("POST", p) for p in (
    "/generate", "/update_weights_from_tensor", "/update_weights_from_disk", "/init_weights_update_group",
    "/update_weights_from_distributed", "/destroy_weights_update_group", "/begin_weight_update",
    "/end_weight_update", "/update_weight_version", "/pause_generation", "/continue_generation",
    "/release_memory_occupation", "/resume_memory_occupation", "/v1/chat/completions")] + [
    ("GET", p) for p in ("/flush_cache", "/get_model_info", "/get_weight_version", "/local/weights_sha256",
                         "/local/memory", "/no_such_route")]
OPEN = [("GET", "/health"), ("POST", "/health"), ("GET", "/health_generate")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("guard") / "engine.log"
    srv = launch_local_server(None, [f"model.hf_config={MODEL}", "rollout.local.seed=0", "rollout.local.max_request_mb=1",
                                     "rollout.weight_bucket_mb=1"], log, timeout_s=300, api_key=KEY,
                              api_key_env=KEY_ENV)
    yield srv
    srv.stop()


def call(url, method="POST", path="/generate", *, key=KEY, json_body=None, data=None, headers=None):
    """(status, parsed body or text) of one raw request."""
    async def go():
        h = dict(headers or {})
        if key is not None:
            h["Authorization"] = f"Bearer {key}"
        async with aiohttp.ClientSession() as s:
            async with s.request(method, url + path, json=json_body, data=data, headers=h) as r:
                text = await r.text()
                try:
                    return r.status, json.loads(text)
                except ValueError:
                    return r.status, text
    return asyncio.run(go())


def greedy(url):
    async def go():
        c = SGLangClient(url, api_key=KEY)
        try:
            return (await c.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=4, temperature=0.0)))).output_ids
        finally:
            await c.close()
    return asyncio.run(go())


def sha(url):
    status, body = call(url, "GET", "/local/weights_sha256")
    assert status == 200, body
    return body["sha256"]


def assert_serving(server, want_tokens=None):
    """Alive, healthy, and generating (the same greedy tokens as before, when given)."""
    assert server.proc.poll() is None
    assert call(server.url, "GET", "/health", key=None)[0] == 200
    out = greedy(server.url)
    if want_tokens is not None:
        assert out == want_tokens


def message(body) -> str:
    return body["message"] if "message" in body else body["error"]["message"]


# --- authentication ------------------------------------------------------------------------------

def test_routes_sglang_guards_need_the_key_and_nothing_else_does(server):
    for method, path in GUARDED:
        for key, extra in ((None, {}), ("wrong-" + KEY, {}), (None, {"Authorization": KEY}),
                           (None, {"Authorization": f"Basic {KEY}"}), (None, {"Authorization": f"Bearer  {KEY}"})):
            status, body = call(server.url, method, path, key=key, headers=extra, json_body={})
            assert (status, body) == (401, {"error": "Unauthorized"}), (method, path, key, extra)
    for method, path in OPEN:
        assert call(server.url, method, path, key=None)[0] == 200, (method, path)
    # OPTIONS passes the key check (SGLang lets it through to routing); no route answers it: 405, not 401
    assert call(server.url, "OPTIONS", "/generate", key=None)[0] == 405
    # with the key: served (scheme case-insensitive, as SGLang), and an unknown route is then a 404
    assert call(server.url, "GET", "/get_model_info")[0] == 200
    assert call(server.url, "GET", "/get_model_info", key=None, headers={"Authorization": f"bearer {KEY}"})[0] == 200
    assert call(server.url, "GET", "/no_such_route")[0] == 404
    assert_serving(server)


def test_client_sends_the_key_and_says_why_it_is_refused(server, monkeypatch):
    assert len(greedy(server.url)) == 4
    monkeypatch.setenv("MEGATRON_SEARCH_ENGINE_KEY", secrets.token_urlsafe(32))  # a different job's key

    async def go():
        wrong = SGLangClient(server.url)  # reads the default variable: the other key
        try:
            with pytest.raises(EngineError, match="HTTP 401: .* sent a different one"):
                await wrong.generate(GenerateRequest(PROMPT))
        finally:
            await wrong.close()
    asyncio.run(go())
    assert KEY not in repr(SGLangClient(server.url, api_key=KEY))


def test_key_is_in_neither_argv_nor_log(server):
    cmdline = open(f"/proc/{server.proc.pid}/cmdline", "rb").read()
    assert KEY.encode() not in cmdline and b"--api-key-env\0" + KEY_ENV.encode() in cmdline
    environ = open(f"/proc/{server.proc.pid}/environ", "rb").read().split(b"\0")
    assert f"{KEY_ENV}={KEY}".encode() in environ  # handed over in the environment
    call(server.url, "POST", "/generate", key="wrong-" + KEY, json_body={"input_ids": [1]})
    log = server.log_path.read_text()
    assert f"from ${KEY_ENV}" in log and KEY not in log


# --- bad input: every class answered 4xx with a message, nothing changed ---------------------------

@pytest.mark.parametrize("path,data,status,needle", [
    ("/generate", b'{"input_ids": [1, 2', 400, "not valid JSON"),
    ("/update_weights_from_disk", b'[1, 2]', 400, "must be a JSON object"),
    ("/update_weight_version", b'\xff\xfe{"new_version": "x"}', 400, "not UTF-8"),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', 400, "NaN is not JSON"),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": 1e999}}', 400, "temperature"),
])
def test_malformed_bodies(server, path, data, status, needle):
    got, body = call(server.url, "POST", path, data=data, headers={"Content-Type": "application/json"})
    assert got == status and needle in message(body), body
    assert_serving(server)


@pytest.mark.parametrize("path,body,needle", [
    ("/generate", {"input_ids": "abc"}, "input_ids"),
    ("/generate", {"input_ids": [1, True]}, "input_ids"),
    ("/generate", {"input_ids": [1], "return_logprob": "yes"}, "'return_logprob' must be a boolean"),
    ("/generate", {"input_ids": [1], "routed_experts_start_len": "0"}, "'routed_experts_start_len' must be an integer"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens must be int"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": ["a"]}}, "stop_token_ids"),
    ("/generate", {"input_ids": [1], "sampling_params": {"sampling_seed": 1 << 64}}, "sampling_seed"),
    ("/generate", {"input_ids": [1], "sampling_params": []}, "'sampling_params' must be an object"),
    ("/release_memory_occupation", {"tags": [["weights"]]}, "'tags[0]' must be a string"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": [7]}, "'serialized_named_tensors[0]' must be a string"),
    ("/update_weights_from_disk", {"model_path": 3}, "'model_path' must be a string"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 70000, "rank_offset": 1,
                                    "world_size": 2}, "'master_port' must be in [1, 65535]"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 0,
                                    "world_size": 2}, "'rank_offset' must be in [1, 1]"),
    ("/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": [3], "shapes": [[2048, 64]]},
     "'dtypes[0]' must be a string"),
    ("/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[2048, -64]]},
     "shapes[0] (lm_head.weight) must be a list of non-negative integers"),
    ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [1]]},
     "2 names, 1 dtypes and 2 shapes"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1 << 20, 1 << 20]]},
     "more than the served model's largest parameter"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["complex_float"], "shapes": [[1]]},
     "unknown dtype"),
    ("/pause_generation", {"mode": 1}, "'mode' must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": {"name": 3}}]},
     "tools[0] must be an object with function.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
     "'temperature' must be a number"),
])
def test_wrong_types_and_values(server, path, body, needle):
    status, got = call(server.url, "POST", path, json_body=body)
    assert status == 400 and needle in message(got), got
    assert_serving(server)


@pytest.mark.parametrize("path,body,needle", [
    ("/update_weights_from_disk", {}, "missing required field 'model_path'"),
    ("/update_weight_version", {"abort_all_requests": False}, "missing required field 'new_version'"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2},
     "missing required field 'master_port'"),
    ("/update_weights_from_distributed", {"names": [], "dtypes": []}, "missing required field 'shapes'"),
    ("/update_weights_from_tensor", {}, "missing required field 'serialized_named_tensors'"),
    ("/generate", {"sampling_params": {}}, "missing required field 'input_ids'"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0] (user) needs a 'content'"),
])
def test_missing_fields(server, path, body, needle):
    status, got = call(server.url, "POST", path, json_body=body)
    assert status == 400 and needle in message(got), got
    assert_serving(server)


def test_oversized_bodies_are_refused_and_a_weight_bucket_is_not(server):
    before = sha(server.url)
    # 1 MiB + 1 byte over the default limit, with a Content-Length and chunked without one
    status, body = call(server.url, "POST", "/generate", data=b" " * (MIB + 1))
    assert status == 413 and f"limit of {MIB} bytes" in message(body), body

    async def chunks():
        for _ in range(3):
            yield b" " * (MIB // 2)
    status, body = call(server.url, "POST", "/update_weight_version", data=chunks())
    assert status == 413 and "exceeds the limit" in message(body), body
    status, body = call(server.url, "POST", "/update_weights_from_tensor", data=b" " * (TENSOR_LIMIT + 1))
    assert status == 413 and f"limit of {TENSOR_LIMIT} bytes" in message(body), body
    assert sha(server.url) == before
    assert_serving(server)

    # one bucket of weights (embedding + lm_head = 1 MiB, 1.33 MiB as base64): over the default limit, admitted here
    model = load_hf_model(MODEL, seed=3)
    named = [(n, p.detach()) for n, p in model.named_parameters() if n in ("model.embed_tokens.weight", "lm_head.weight")]
    assert sum(t.numel() * 4 for _, t in named) == MIB
    payload = {"serialized_named_tensors": [base64.b64encode(save(dict(named))).decode()], "flush_cache": True}
    assert MIB < len(json.dumps(payload)) < TENSOR_LIMIT
    assert call(server.url, "POST", "/begin_weight_update", json_body={})[0] == 200
    try:
        status, body = call(server.url, "POST", "/update_weights_from_tensor", json_body=payload)
        assert status == 200, body
    finally:
        assert call(server.url, "POST", "/end_weight_update", json_body={})[0] == 200
    after = sha(server.url)
    assert {n for n in before if before[n] != after[n]} == {"model.embed_tokens.weight", "lm_head.weight"}
    # put the seed-0 weights back for the other tests
    assert call(server.url, "POST", "/begin_weight_update", json_body={})[0] == 200
    original = [(n, p.detach()) for n, p in load_hf_model(MODEL, seed=0).named_parameters() if n in dict(named)]
    payload["serialized_named_tensors"] = [base64.b64encode(save(dict(original))).decode()]
    try:
        assert call(server.url, "POST", "/update_weights_from_tensor", json_body=payload)[0] == 200
    finally:
        call(server.url, "POST", "/end_weight_update", json_body={})
    assert sha(server.url) == before


def test_a_weight_update_failing_midway_leaves_the_previous_weights_serving(server, tmp_path):
    before, tokens = sha(server.url), greedy(server.url)
    new = load_hf_model(MODEL, seed=7)
    named = [(n, p.detach().clone()) for n, p in new.named_parameters()][:5]
    bad_shape = named[:2] + [(named[2][0], torch.zeros(3, 3))] + named[3:]  # the third tensor does not fit
    bad_name = named[:4] + [("model.layers.0.mlp.experts.9.up_proj.weight", torch.zeros(64, 64))]  # expert 9 of 4
    bad_dtype = named[:3] + [(named[3][0], torch.ones(named[3][1].shape, dtype=torch.int32))]

    async def go():
        c = SGLangClient(server.url, api_key=KEY)
        try:
            await c.begin_weight_update()
            for update, needle in ((bad_shape, "does not match the model's"), (bad_name, "expert 9 out of range"),
                                   (bad_dtype, "not a floating point weight")):
                with pytest.raises(EngineError, match=needle):
                    await c.update_weights_from_tensor(update, weight_version="bad")
            await c.end_weight_update()
            (tmp_path / "ok.safetensors").write_bytes(save(dict(named)))
            (tmp_path / "zz_corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
            with pytest.raises(EngineError, match="zz_corrupt.safetensors is not a readable safetensors file"):
                await c.update_weights_from_disk(str(tmp_path), weight_version="bad")
            return (await c.get_model_info()).weight_version
        finally:
            await c.close()

    assert asyncio.run(go()) == "default"  # no refused update recorded its version
    assert sha(server.url) == before
    assert_serving(server, tokens)
