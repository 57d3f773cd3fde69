"""Checks our SGLang client against sglang's own code (run in its own process: importing sglang sets
environment variables and patches transformers). Prints one JSON object on its last line.

1. Every request SGLangClient sends is captured by a stand-in HTTP server, then validated the way
   SGLang's server validates it: the endpoint's request type (pydantic over sglang's msgspec structs
   and dataclasses), every key we send a field of that type (SGLang silently drops unknown keys),
   GenerateReqInput normalised as the tokenizer manager does, and each TP rank's tensor payload opened
   with sglang's MultiprocessingSerializer and compared bitwise with what was sent.
2. Rendezvous: our trainer-side open_weight_group (rank 0) and sglang's init_custom_process_group
   (rank 1, as an SGLang server calls it) meet, and a broadcast arrives bitwise.
3. API key: for every route the local server serves, the auth level SGLang's http_server.py gives it
   (read from its decorators; routes it lacks get NORMAL, as its middleware does), and our
   request_allowed against sglang's decide_request_auth over methods x Authorization headers; and that
   --api-key is the only way in (no environment variable) and ends up in what SGLang logs.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing as mp
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _sglang_shim  # noqa: E402

_sglang_shim.install()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from aiohttp import web  # noqa: E402

SGLANG_VERSION = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _capture_server(seen: list):
    from megatron_search.rollout.engine.base import encode_routed_experts

    async def any_post(request: web.Request):
        body = await request.json() if request.can_read_body else None
        seen.append((request.path, body))
        if request.path == "/generate":
            out = [7, 8, 9]
            rows = len(body["input_ids"]) + len(out) - 1 - body.get("routed_experts_start_len", 0)
            return web.json_response({"output_ids": out, "meta_info": {
                "finish_reason": {"type": "length", "length": 3}, "prompt_tokens": len(body["input_ids"]),
                "weight_version": "1", "output_token_logprobs": [[-0.5, t, None] for t in out],
                "routed_experts": encode_routed_experts(np.zeros((rows, 2, 2), dtype=np.int32))}})
        if request.path == "/flush_cache":
            return web.Response(text="Cache flushed.")
        return web.json_response({"success": True, "message": "ok"})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", any_post)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def _drive(named):
    from megatron_search.rollout.sglang.client import SGLangClient
    from megatron_search.rollout.engine.types import GenerateRequest, SamplingParams

    seen: list = []
    runner, url = await _capture_server(seen)
    c = SGLangClient(url, moe_shape=(2, 2), tensor_format="sglang", tp_size=2)
    try:
        await c.generate(GenerateRequest([1, 2, 3, 4], SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9,
                                                                       seed=5), return_logprob=True,
                                         return_routed_experts=True, routed_experts_start_len=2, rid="r-1"))
        for mode in ("abort", "retract", "in_place"):
            await c.pause_generation(mode)
        await c.begin_weight_update()
        await c.update_weights_from_tensor(named, weight_version="7", flush_cache=False)
        await c.update_weights_from_tensor(named, weight_version=None, flush_cache=True, abort_all_requests=True)
        await c.init_weights_update_group("127.0.0.1", 29511, 1, 3, "wg_r0", "gloo")
        await c.update_weights_from_distributed([n for n, _ in named], [t.dtype for _, t in named],
                                                [list(t.shape) for _, t in named], "wg_r0", weight_version="8",
                                                load_format="flattened_bucket")
        await c.destroy_weights_update_group("wg_r0")
        await c.end_weight_update()
        await c.update_weights_from_disk("/ckpt/v9", weight_version="9")
        await c.update_weight_version("10")
        await c.release_memory_occupation(["weights", "kv_cache"])
        await c.release_memory_occupation(None)
        await c.resume_memory_occupation(["weights"])
        await c.flush_cache()
        await c.continue_generation()
    finally:
        await c.close()
        await runner.cleanup()
    return seen


def _fields(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls.__struct_fields__)


def check_requests() -> dict:
    from pydantic import TypeAdapter
    from sglang.srt.managers import io_struct as io
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payload

    types = {
        "/generate": io.GenerateReqInput, "/pause_generation": io.PauseGenerationReqInput,
        "/continue_generation": io.ContinueGenerationReqInput,
        "/begin_weight_update": io.BeginWeightUpdateReqInput, "/end_weight_update": io.EndWeightUpdateReqInput,
        "/update_weights_from_tensor": io.UpdateWeightsFromTensorReqInput,
        "/init_weights_update_group": io.InitWeightsUpdateGroupReqInput,
        "/update_weights_from_distributed": io.UpdateWeightsFromDistributedReqInput,
        "/destroy_weights_update_group": io.DestroyWeightsUpdateGroupReqInput,
        "/update_weights_from_disk": io.UpdateWeightFromDiskReqInput,
        "/update_weight_version": io.UpdateWeightVersionReqInput,
        "/release_memory_occupation": io.ReleaseMemoryOccupationReqInput,
        "/resume_memory_occupation": io.ResumeMemoryOccupationReqInput,
    }
    g = torch.Generator().manual_seed(0)
    named = [("model.embed_tokens.weight", torch.randn(8, 4, generator=g)),
             ("lm_head.weight", torch.randn(8, 4, generator=g).bfloat16())]
    seen = asyncio.run(_drive(named))
    report = {"checked": [], "problems": []}
    for path, body in seen:
        if path == "/flush_cache":  # a query-string endpoint (timeout); our client sends no body
            report["checked"].append(path)
            continue
        cls = types.get(path)
        if cls is None:
            report["problems"].append(f"{path}: no SGLang request type for this endpoint")
            continue
        unknown = set(body or {}) - _fields(cls)
        if unknown:
            report["problems"].append(f"{path}: keys SGLang would drop silently: {sorted(unknown)}")
        try:
            req = TypeAdapter(cls).validate_python(body or {})
        except Exception as e:
            report["problems"].append(f"{path}: {cls.__name__} refuses {body}: {e}")
            continue
        if path == "/generate":
            from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSampling

            req.normalize_batch_and_arguments()
            flags = (req.is_single, req.return_logprob, req.logprob_start_len, req.rid, req.return_routed_experts,
                     req.routed_experts_start_len)
            if flags != (True, True, -1, "r-1", True, 2):
                report["problems"].append(f"/generate normalised unexpectedly: {flags}")
            try:  # the scheduler builds SamplingParams(**sampling_params) and verifies it
                sp = SGLangSampling(**req.sampling_params)
                sp.verify(2048)
                if (sp.max_new_tokens, sp.temperature, sp.top_p, sp.sampling_seed) != (3, 0.7, 0.9, 5):
                    report["problems"].append(f"/generate sampling params read as {sp.__dict__}")
            except Exception as e:
                report["problems"].append(f"/generate sampling_params {req.sampling_params}: {e}")
        if path == "/update_weights_from_distributed" and req.load_format != "flattened_bucket":
            report["problems"].append(f"{path}: load_format {req.load_format!r}, the sync sends flattened buckets")
        if path == "/update_weights_from_tensor":
            if len(req.serialized_named_tensors) != 2:
                report["problems"].append(f"{path}: {len(req.serialized_named_tensors)} payloads for TP 2")
            for rank, payload in enumerate(req.serialized_named_tensors):
                got = MultiprocessingSerializer.deserialize(normalize_serialized_named_tensor_payload(payload))
                same = [n for n, _ in got] == [n for n, _ in named] and all(
                    a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(got, named))
                if not same:
                    report["problems"].append(f"{path}: TP rank {rank}'s payload does not reproduce the tensors")
        report["checked"].append(path)
    return report


def _engine_side(port: int, q) -> None:
    """What an SGLang server does on /init_weights_update_group + /update_weights_from_distributed."""
    _sglang_shim.install()
    from sglang.srt.utils.common import init_custom_process_group

    import torch.distributed as dist

    pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1,
                                   group_name="wg_contract")
    t = torch.empty(3, 5, dtype=torch.bfloat16)
    dist.broadcast(t, src=0, group=pg)
    q.put(t.float().tolist())


def check_rendezvous() -> dict:
    from megatron_search.rollout.sglang.weight_group import broadcast, open_weight_group

    port = _free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_engine_side, args=(port, q))
    p.start()
    group = open_weight_group("127.0.0.1", port, 0, 2, "wg_contract", "gloo", timeout_s=60)
    sent = torch.arange(15, dtype=torch.float32).reshape(3, 5).bfloat16()
    broadcast(group, sent, src=0)
    got = q.get(timeout=60)
    p.join(timeout=60)
    return {"rendezvous_equal": torch.equal(torch.tensor(got).bfloat16(), sent), "engine_exit": p.exitcode}


LOCAL_ROUTES = [  # everything rollout/local_server.build_app registers, and one route nobody serves
    "/generate", "/update_weights_from_tensor", "/update_weights_from_disk", "/init_weights_update_group",
    "/update_weights_from_distributed", "/destroy_weights_update_group", "/begin_weight_update", "/end_weight_update",
    "/update_weight_version", "/pause_generation", "/continue_generation", "/release_memory_occupation",
    "/resume_memory_occupation", "/flush_cache", "/ready", "/health", "/health_generate", "/get_model_info",
    "/get_weight_version", "/local/weights_sha256", "/local/memory", "/v1/chat/completions", "/no_such_route"]


def _sglang_route_levels() -> dict:
    """{path: auth level name} from the @app.<method>/@app.api_route and @auth_level decorators of http_server.py."""
    import ast
    import importlib.util

    src = Path(importlib.util.find_spec("sglang.srt.entrypoints.http_server").origin).read_text()  # not imported:
    # its imports (uvicorn, fastapi, the tokenizer manager) are not installed here
    levels = {}
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        paths, level = [], "NORMAL"
        for d in node.decorator_list:
            if not isinstance(d, ast.Call) or not isinstance(d.func, (ast.Attribute, ast.Name)):
                continue
            name = d.func.attr if isinstance(d.func, ast.Attribute) else d.func.id
            if name in ("get", "post", "put", "api_route") and d.args and isinstance(d.args[0], ast.Constant):
                paths.append(d.args[0].value)
            elif name == "auth_level" and d.args and isinstance(d.args[0], ast.Attribute):
                level = d.args[0].attr
        for path in paths:
            levels[path] = level
    return levels


def check_auth() -> dict:
    from sglang.srt.environ import Envs
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    from megatron_search.rollout.engine.auth import request_allowed

    key = "k3y-0123456789-abcdef"
    sglang_levels = _sglang_route_levels()
    levels = {path: sglang_levels.get(path, "NORMAL") for path in LOCAL_ROUTES}
    headers = [None, "", key, f"Bearer {key}", f"bearer {key}", f"BEARER {key}", f"Bearer  {key}", f"Bearer {key} ",
               f"Bearer {key[:-1]}", f"Basic {key}", "Bearer", f"Token {key}"]
    mismatches, cases = [], 0
    for path, level in levels.items():
        for method in ("GET", "POST", "PUT", "OPTIONS"):
            for h in headers:
                want = decide_request_auth(method=method, path=path, authorization_header=h, api_key=key,
                                           admin_api_key=None, auth_level=AuthLevel[level])
                got = request_allowed(method, path, h, key)
                cases += 1
                if got != want.allowed or (not want.allowed and want.error_status_code != 401):
                    mismatches.append([method, path, h, level, got, want.allowed, want.error_status_code])
    args = prepare_server_args(["--model-path", "configs/models/tiny_qwen3_moe", "--api-key", key])
    logged = args.resolved_dict()  # what engine.py logs as server_args={...} at startup
    env_names = [n for n in vars(Envs) if "API_KEY" in n and "EXA" not in n]
    return {"auth_cases": cases, "auth_mismatches": mismatches, "auth_levels": levels,
            "local_routes_sglang_lacks": sorted(p for p in LOCAL_ROUTES if p not in sglang_levels),
            "api_key_flag": args.api_key == key, "sglang_logs_key": logged.get("api_key") == key
            and key in (args.launch_command or ""), "api_key_env_vars": env_names}


def check_launch() -> dict:
    """Our launch line (rollout/sglang/client.py sglang_command, every optional flag on) parsed by SGLang's own
    argument parser: each flag accepted and landing in the field it is meant for."""
    from sglang.srt.server_args import prepare_server_args

    from megatron_search.config import load_config
    from megatron_search.rollout.sglang.client import sglang_command

    sg = load_config(None, ["rollout.sglang.deterministic_inference=true", "rollout.sglang.context_length=4096"]
                     ).rollout.sglang
    argv = sglang_command(sg, "configs/models/tiny_qwen3_moe", 30011, routed_experts=True, seed=5,
                          weight_version="7", base_gpu_id=2)
    args = prepare_server_args(argv[3:])  # after `python -m sglang.launch_server`
    return {"launch_fields": {k: getattr(args, k, None) for k in (
        "enable_deterministic_inference", "enable_memory_saver", "enable_return_routed_experts", "skip_tokenizer_init",
        "random_seed", "weight_version", "base_gpu_id", "context_length", "mem_fraction_static", "port")}}


if __name__ == "__main__":
    import sglang

    result = {"sglang": sglang.__version__, **check_requests(), **check_rendezvous(), **check_auth(), **check_launch()}
    print(json.dumps(result))
