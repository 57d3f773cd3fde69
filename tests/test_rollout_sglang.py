"""SGLang launcher and client without a GPU: the launch line, the routed-experts wire format, the
client against a fake server that answers with SGLang-shaped JSON, and launch failures."""
import asyncio
import base64
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from megatron_search.config import load_config
from megatron_search.rollout.engine.base import EngineError, decode_routed_experts, encode_routed_experts
from megatron_search.rollout.engine.process import ServerProcess
from megatron_search.rollout.engine.types import GenerateRequest, SamplingParams
from megatron_search.rollout.sglang.client import SGLangClient, sglang_command


def test_more_than_one_data_parallel_replica_per_engine_is_refused():
    from megatron_search.config import ConfigError

    # SGLang 0.5.23 asserts dp_size == 1 in every weight-update call (managers/tokenizer_control_mixin.py)
    with pytest.raises(ConfigError, match=r"rollout.sglang.dp: 2: SGLang 0.5.23 refuses weight updates"):
        load_config(None, ["rollout.sglang.dp=2"])


def test_launch_line_carries_the_flags_this_project_needs():
    cfg = load_config(None, ["rollout.sglang.tp=8", "rollout.sglang.ep=8",
                             "rollout.sglang.extra_args=[--attention-backend,fa3]"])
    argv = sglang_command(cfg.rollout.sglang, "/ckpt/qwen", 30000, routed_experts=True, seed=7, weight_version="3")
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    pairs = dict(zip(argv[3::1], argv[4::1]))
    for flag, value in {"--model-path": "/ckpt/qwen", "--tp-size": "8", "--ep-size": "8", "--dp-size": "1",
                        "--host": "127.0.0.1", "--port": "30000", "--mem-fraction-static": "0.8",
                        "--random-seed": "7", "--weight-version": "3"}.items():
        assert pairs[flag] == value, flag
    for flag in ("--skip-tokenizer-init", "--enable-memory-saver", "--enable-return-routed-experts"):
        assert flag in argv
    assert argv[-2:] == ["--attention-backend", "fa3"]
    plain = sglang_command(load_config(None, ["rollout.sglang.enable_memory_saver=false"]).rollout.sglang,
                           "/m", 1, routed_experts=False)
    assert "--enable-return-routed-experts" not in plain and "--enable-memory-saver" not in plain
    # SGLang 0.5.23 applies a request's sampling_seed only under deterministic inference (sampling_batch_info.py)
    det = sglang_command(load_config(None, ["rollout.sglang.deterministic_inference=true"]).rollout.sglang, "/m", 1,
                         routed_experts=False)
    assert "--enable-deterministic-inference" in det and "--enable-deterministic-inference" not in plain
    assert "--base-gpu-id" not in plain  # the first engine on a node starts at GPU 0
    second = sglang_command(cfg.rollout.sglang, "/m", 30010, routed_experts=False, base_gpu_id=8)
    assert second[second.index("--base-gpu-id") + 1] == "8"


def test_routed_experts_wire_format():
    e = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2)
    s = encode_routed_experts(e)
    assert base64.b64decode(s) == e.astype("<i4").tobytes()
    np.testing.assert_array_equal(decode_routed_experts(s, 3, 2, expected_rows=5), e)
    with pytest.raises(EngineError, match="do not split"):
        decode_routed_experts(s, 4, 2)
    with pytest.raises(EngineError, match="expected 4"):
        decode_routed_experts(s, 3, 2, expected_rows=4)


def fake_sglang(seen: list):
    """Answers /generate the way SGLang does with --skip-tokenizer-init and routed experts on."""

    async def generate(request):
        body = await request.json()
        seen.append(body)
        out = [7, 8, 151645]
        rows = len(body["input_ids"]) + len(out) - 1 - body.get("routed_experts_start_len", 0)
        experts = np.full((rows, 2, 2), 3, dtype=np.int32)
        return web.json_response({"output_ids": out, "meta_info": {
            "id": "x", "finish_reason": {"type": "stop", "matched": 151645}, "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": 3, "cached_tokens": 2, "weight_version": "12",
            "output_token_logprobs": [[-0.5, 7, None], [-1.5, 8, None], [-0.25, 151645, None]],
            "routed_experts": encode_routed_experts(experts)}})

    async def update(request):
        seen.append(await request.json())
        return web.json_response({"success": False, "message": "Failed to update weights: shape mismatch"}, status=400)

    async def model_info(request):
        return web.json_response({"model_path": "/ckpt", "is_generation": True, "weight_version": "12"})

    app = web.Application()
    app.router.add_get("/get_model_info", model_info)
    app.router.add_post("/generate", generate)
    app.router.add_post("/update_weights_from_disk", update)
    return app


def test_client_against_sglang_shaped_answers():
    seen = []

    async def go():
        runner = web.AppRunner(fake_sglang(seen))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        client = SGLangClient(url, moe_shape=(2, 2))
        try:
            req = GenerateRequest([1, 2, 3, 4], SamplingParams(max_new_tokens=9, temperature=0.6, stop_token_ids=(151645,)),
                                  return_routed_experts=True, routed_experts_start_len=2)
            res = await client.generate(req)
            with pytest.raises(EngineError, match="shape mismatch"):
                await client.update_weights_from_disk("/ckpt", weight_version="13")
            assert await client._tensor_format() == "sglang"  # not the local engine: SGLang's payload format
            return res
        finally:
            await client.close()
            await runner.cleanup()

    res = asyncio.run(go())
    sent = seen[0]
    assert sent["input_ids"] == [1, 2, 3, 4] and sent["return_logprob"] is True
    assert sent["sampling_params"] == {"max_new_tokens": 9, "temperature": 0.6, "top_p": 1.0,
                                       "stop_token_ids": [151645], "ignore_eos": False}
    assert (sent["return_routed_experts"], sent["routed_experts_start_len"]) == (True, 2)
    assert res.output_ids == [7, 8, 151645] and res.output_logprobs == [-0.5, -1.5, -0.25]
    assert (res.finish_reason.type, res.finish_reason.matched, res.weight_version) == ("stop", 151645, "12")
    assert res.routed_experts_NLK.shape == (4 + 3 - 1 - 2, 2, 2)
    # load_format named: SGLang's None is the server's own (dummy, for an engine started without weights)
    assert seen[1] == {"model_path": "/ckpt", "load_format": "safetensors", "abort_all_requests": False,
                       "weight_version": "13"}


@pytest.mark.multiprocess
def test_server_that_dies_reports_its_log(tmp_path):
    server = ServerProcess([sys.executable, "-c", "import sys; print('boom: no GPU'); sys.exit(3)"], tmp_path / "s.log")
    with pytest.raises(EngineError, match="exited with code 3(.|\n)*boom: no GPU"):
        server.wait_healthy("http://127.0.0.1:9", timeout_s=30)
    server.stop()


def test_colocated_sglang_without_memory_saver_is_refused():
    from megatron_search.config import ConfigError

    with pytest.raises(ConfigError, match="enable_memory_saver: colocated engines release their memory"):
        load_config(None, ["rollout.engine=sglang", "rollout.mode=colocated", "rollout.sglang.enable_memory_saver=false"])
    load_config(None, ["rollout.engine=sglang", "rollout.mode=disaggregated", "rollout.sglang.enable_memory_saver=false"])


def test_client_sends_the_key_on_every_request_and_never_shows_it(monkeypatch):
    """An explicit key, the one in the variable use_key_env names, or none: the Authorization header of every
    request (GET and POST) says which, and neither repr nor a refusal message holds the key."""
    from megatron_search.rollout.engine import auth

    headers = []

    async def record(request):
        headers.append(request.headers.get("Authorization"))
        return web.json_response({"success": True, "weight_version": "1", "model_path": "/m"})

    async def go(client):
        try:
            await client.get_model_info()
            await client.begin_weight_update()
            return await client.health()
        finally:
            await client.close()

    async def run(make):
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", record)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            return await go(make(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"))
        finally:
            await runner.cleanup()

    given, from_env = "g" * 12 + "-given-key", "e" * 12 + "-env-key-1"
    monkeypatch.setenv("MS_TEST_CLIENT_KEY", from_env)
    monkeypatch.setattr(auth, "_client_key_env", "MS_TEST_CLIENT_KEY")
    assert asyncio.run(run(lambda u: SGLangClient(u, api_key=given)))
    assert asyncio.run(run(lambda u: SGLangClient(u)))
    monkeypatch.delenv("MS_TEST_CLIENT_KEY")
    assert asyncio.run(run(lambda u: SGLangClient(u)))
    assert headers == [f"Bearer {given}"] * 3 + [f"Bearer {from_env}"] * 3 + [None] * 3
    assert given not in repr(SGLangClient("http://x", api_key=given))
    with pytest.raises(auth.EngineKeyError, match=r"\$MS_TEST_CLIENT_KEY: the engine API key must be at least 16"):
        monkeypatch.setenv("MS_TEST_CLIENT_KEY", "short")
        SGLangClient("http://x")


STAND_IN = '''
"""Stand-in for `python -m sglang.launch_server` (test only): logs its arguments the way SGLang 0.5.23 does
(server_args=... with api_key and launch_command), writes the key split over two writes, prints it from a
spawned worker, records what it saw, then answers /health on --port until stopped."""
import http.server, json, multiprocessing as mp, os, sys, time

NAME = os.environ["PROBE_KEY_ENV"]

def cmdline():
    return open("/proc/self/cmdline", "rb").read().decode(errors="replace")

def worker(q):
    print("worker argv ends", sys.argv[-1], flush=True)
    q.put({"env": os.environ.get(NAME), "cmdline": cmdline()})

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass

if __name__ == "__main__":
    argv = sys.argv[1:]
    key = argv[argv.index("--api-key") + 1]
    print("server_args=" + repr({"api_key": key, "launch_command": " ".join(argv)}), flush=True)
    sys.stderr.write("split " + key[:7]); sys.stderr.flush(); time.sleep(0.3)
    sys.stderr.write(key[7:] + " end\\n"); sys.stderr.flush()
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=worker, args=(q,)); p.start()
    child = q.get(timeout=120); p.join()
    rec = {"key": key, "cmdline": cmdline(), "env": os.environ.get(NAME), "child": child}
    open(os.environ["PROBE_OUT"], "w").write(json.dumps(rec))
    port = int(argv[argv.index("--port") + 1])
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


@pytest.mark.multiprocess
def test_sglang_gets_the_key_from_the_environment_not_argv_and_logs_never_show_it(tmp_path, monkeypatch):
    """launch_sglang_servers through rollout/sglang/serve.py with a stand-in SGLang main: the key (generated for
    the job, the variable being unset) reaches SGLang's parser as --api-key in memory; it is on no process's
    command line, left in no worker's environment, and every copy SGLang's logging would print is redacted,
    also when written in pieces and from a spawned worker."""
    import json
    import socket

    from megatron_search.rollout.sglang.client import launch_sglang_servers

    pkg = tmp_path / "standin" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(STAND_IN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("MS_TEST_SGLANG_KEY", raising=False)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'standin'}:{Path.cwd()}")
    monkeypatch.setenv("PROBE_KEY_ENV", "MS_TEST_SGLANG_KEY")
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "record.json"))
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.mode=disaggregated", "rollout.sglang.model_path=/m",
                             f"rollout.sglang.base_port={port}", "rollout.sglang.startup_timeout_s=120",
                             "rollout.api_key_env=MS_TEST_SGLANG_KEY"])
    servers = launch_sglang_servers(cfg, tmp_path)
    try:
        key = os.environ["MS_TEST_SGLANG_KEY"]  # generated for this job and exported
        assert len(key) >= 40
        rec = json.loads((tmp_path / "record.json").read_text())
        argv = servers[0].argv
        assert argv[1:5] == ["-m", "megatron_search.rollout.sglang.serve", "--api-key-env", "MS_TEST_SGLANG_KEY"]
        assert rec["key"] == key and key not in " ".join(argv)
        assert key not in rec["cmdline"] and key not in rec["child"]["cmdline"]
        assert "megatron_search.rollout.sglang.serve" in rec["cmdline"]
        assert rec["env"] is None and rec["child"]["env"] is None
        assert key not in open(f"/proc/{servers[0].proc.pid}/cmdline").read()
    finally:
        for s in servers:
            s.stop()
    log = (tmp_path / cfg.rollout.sglang.log_dir / "server_0.log").read_text()
    assert key not in log
    assert "'api_key': '<redacted>'" in log and "--api-key <redacted>" in log
    assert "split <redacted> end" in log and "worker argv ends <redacted>" in log
