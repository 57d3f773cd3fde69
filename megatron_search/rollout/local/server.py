"""HTTP server for the local CPU engine with SGLang's native API (the subset this project uses).

Same paths, request fields and response shapes as SGLang, so `SGLangClient` drives both:
/generate (token ids in, `output_ids` + `meta_info` out), /update_weights_from_tensor,
/update_weights_from_disk, /init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group, /flush_cache, /pause_generation, /continue_generation,
/release_memory_occupation, /resume_memory_occupation, /ready, /health (generates, as SGLang's), /health_generate,
/get_model_info, /get_weight_version, and OpenAI-compatible /v1/chat/completions.
Binds 127.0.0.1 unless told otherwise.

With a key in `$rollout.api_key_env` (or `--api-key-env NAME`) the server refuses what SGLang started
with `--api-key` refuses: 401 on every route but OPTIONS and /health*, /ready*, /metrics* without
`Authorization: Bearer <key>` (rollout/engine/auth.py). Bad input is a 4xx naming the field that changes
nothing (rollout/local/http_input.py: body limits per route, JSON objects, typed fields; weight updates
are checked whole before the first write, rollout/local/weights.py).

Run: python -m megatron_search.rollout.local.server [config.yaml] [key=value ...] [--port N] [--device cuda]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import uuid
from typing import Any, Callable, Optional

import torch
from aiohttp import web

from megatron_search.config import ConfigError, load_config
from megatron_search.rollout.engine.auth import EngineKeyError, key_from_env, request_allowed
from megatron_search.rollout.engine.base import LOCAL_ENGINE_NAME, EngineError, encode_routed_experts
from megatron_search.rollout.engine.tensor_payload import (LOCAL_TENSOR_FORMAT, WeightUpdateError,
                                                           deserialize_named_tensors)
from megatron_search.rollout.engine.types import GenerateRequest, SamplingParams
from megatron_search.rollout.local.chat_endpoint import ChatEndpoint
from megatron_search.rollout.local.engine import LocalEngine
from megatron_search.rollout.local.http_input import BODY_LIMITS, BadRequest, field, int_in, list_field, read_json
from megatron_search.rollout.local.vllm_api import add_vllm_routes, require_vllm_key
from megatron_search.rollout.local.weights import check_dtypes

log = logging.getLogger(__name__)
ENGINE_KEY = web.AppKey("engine", LocalEngine)
CHAT_KEY = web.AppKey("chat", object)
API_KEY = web.AppKey("api_key", str)
SIZES_KEY = web.AppKey("parameter_sizes", tuple)  # (largest parameter's elements, all parameters' elements)
SGLANG_ROUTED_EXPERTS_KEY = web.AppKey("sglang_routed_experts", bool)  # --enable-return-routed-experts
TENSOR_ROUTE = "/update_weights_from_tensor"
DEFAULT_LIMITS = {"default": 64 << 20, TENSOR_ROUTE: 1 << 31}


def body_limits(cfg) -> dict:
    """Per-route body limits: rollout.local.max_request_mb, and for TENSOR_ROUTE one weight-sync bucket as the
    client sends it (base64 of the safetensors blob: 4/3 of the bucket, whose size is the larger of
    Config.weight_bucket_bytes and the largest tensor, which travels whole) plus that much headroom."""
    default = cfg.rollout.local.max_request_mb << 20
    bucket = max(cfg.weight_bucket_bytes(), cfg.largest_weight_bytes())
    return {"default": default, TENSOR_ROUTE: 4 * -(-bucket // 3) + default}


def _ok(message: str = "Succeeded") -> web.Response:
    return web.json_response({"success": True, "message": message})


def _refusal(message: str, status: int = 400) -> web.Response:
    return web.json_response({"success": False, "message": message, "error": {"message": message}}, status=status)


def handler(fn: Callable) -> Callable:
    """Map bad input to 400 (413 for an oversized body) and engine refusals to 400 with SGLang's {success, message}."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request, request.app[ENGINE_KEY])
        except BadRequest as e:
            return _refusal(str(e), e.status)
        except (ValueError, WeightUpdateError, EngineError) as e:
            return _refusal(str(e))

    return wrapped


@web.middleware
async def require_api_key(request: web.Request, handler: Callable) -> web.StreamResponse:
    """SGLang's --api-key rule (rollout/engine/auth.py): Bearer key on every route but OPTIONS and /health*, /ready*,
    /metrics*; 401 with SGLang's body otherwise, before the body is read."""
    if not request_allowed(request.method, request.path, request.headers.get("Authorization"),
                           request.app.get(API_KEY)):
        return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


def _flag(body: dict, name: str, default: bool, where: str) -> bool:
    return field(body, name, bool, default, where)


def _version(body: dict, name: str, where: str) -> Optional[str]:
    return field(body, name, str, None, where)


def parse_generate(body: dict) -> GenerateRequest:
    path = "/generate"
    if field(body, "stream", bool, False, path):
        raise BadRequest(f"{path}: stream=true is not supported by the local engine")
    if body.get("text") is not None:
        raise BadRequest(f"{path}: send input_ids (token in, token out); text prompts need a tokenizer the local engine does not run")
    ids = field(body, "input_ids", list, where=path)
    if ids and isinstance(ids[0], list):
        raise BadRequest(f"{path}: batched input_ids are not supported; send one request per sequence")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest(f"{path}: input_ids must be a list of integers")
    sp = field(body, "sampling_params", dict, {}, path)
    try:
        sampling = SamplingParams.from_json(sp)
        return GenerateRequest(
            input_ids=ids,
            sampling=sampling,
            return_logprob=_flag(body, "return_logprob", False, path),
            return_routed_experts=_flag(body, "return_routed_experts", False, path),
            routed_experts_start_len=field(body, "routed_experts_start_len", int, 0, path),
            rid=field(body, "rid", str, None, path),
        )
    except BadRequest:
        raise
    except (TypeError, ValueError) as e:
        raise BadRequest(f"{path}: {e}") from None


def parse_announced_tensors(body: dict, sizes: tuple[int, int], where: str) -> tuple[list, list, list]:
    """names / dtypes / shapes of an /update_weights_from_distributed call, checked before anything is received:
    equal lengths, known dtypes, shapes of non-negative ints, no tensor larger than the served model's largest
    parameter and no more than twice its elements in all (HF tensors map onto parameters or slices of them;
    the margin covers tensors the engine skips, like mtp.*)."""
    names = list_field(body, "names", str, where=where)
    dtypes = list_field(body, "dtypes", str, where=where)
    shapes = list_field(body, "shapes", list, where=where)
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest(f"{where}: {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes; one each per tensor")
    try:
        check_dtypes(dtypes)
    except WeightUpdateError as e:
        raise BadRequest(f"{where}: field 'dtypes': {e}") from None
    largest, total = sizes
    announced = 0
    for i, shape in enumerate(shapes):
        numel = 1
        for d in shape:
            if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                raise BadRequest(f"{where}: shapes[{i}] ({names[i]}) must be a list of non-negative integers, got {shape}")
            numel *= d
        if numel > largest:
            raise BadRequest(f"{where}: {names[i]}: shape {shape} has {numel} elements, more than the served model's "
                             f"largest parameter ({largest})")
        announced += numel
    if announced > 2 * total:
        raise BadRequest(f"{where}: the announced tensors hold {announced} elements, more than twice the served "
                         f"model's {total}")
    return names, dtypes, shapes


def generate_response(req: GenerateRequest, res, rid: str) -> dict:
    """SGLang's /generate body: `output_ids` plus `meta_info`."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": res.finish_reason.to_json(),
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": len(res.output_ids),
        "cached_tokens": res.cached_tokens,
        "weight_version": res.weight_version,
    }
    if res.output_logprobs is not None:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(res.output_logprobs, res.output_ids)]
    if res.routed_experts_NLK is not None:
        meta["routed_experts"] = encode_routed_experts(res.routed_experts_NLK)
    return {"output_ids": res.output_ids, "meta_info": meta}


@handler
async def generate(request: web.Request, engine: LocalEngine) -> web.Response:
    req = parse_generate(await read_json(request))
    if req.return_routed_experts and not request.app[SGLANG_ROUTED_EXPERTS_KEY]:
        # SGLang without --enable-return-routed-experts records none and answers without them (0.5.23)
        req = dataclasses.replace(req, return_routed_experts=False)
    res = await engine.generate(req)
    return web.json_response(generate_response(req, res, req.rid or uuid.uuid4().hex))


@handler
async def update_weights_from_tensor(request: web.Request, engine: LocalEngine) -> web.Response:
    path = TENSOR_ROUTE
    body = await read_json(request)
    payloads = list_field(body, "serialized_named_tensors", str, where=path)
    fmt = body.get("load_format")
    if fmt not in (None, LOCAL_TENSOR_FORMAT):
        raise BadRequest(f"{path}: load_format {fmt!r} is SGLang's in-process format; the local engine takes {LOCAL_TENSOR_FORMAT!r}")
    if len(payloads) != 1:
        raise BadRequest(f"{path}: serialized_named_tensors must hold exactly one string (one TP rank), got {len(payloads)}")
    version = _version(body, "weight_version", path)
    flush, abort = _flag(body, "flush_cache", True, path), _flag(body, "abort_all_requests", False, path)
    named = deserialize_named_tensors(payloads[0])
    await engine.update_weights_from_tensor(named, weight_version=version, flush_cache=flush, abort_all_requests=abort)
    return _ok(f"updated {len(named)} tensors")


@handler
async def update_weights_from_disk(request: web.Request, engine: LocalEngine) -> web.Response:
    p = "/update_weights_from_disk"
    body = await read_json(request)
    model_path = field(body, "model_path", str, where=p)
    fmt = field(body, "load_format", str, None, p)
    if fmt not in (None, "auto", "safetensors"):  # the local engine reads safetensors only
        raise BadRequest(f"{p}: load_format {fmt!r}: the local engine loads 'safetensors' (or 'auto')")
    await engine.update_weights_from_disk(model_path, weight_version=_version(body, "weight_version", p),
                                          abort_all_requests=_flag(body, "abort_all_requests", False, p))
    return _ok(f"loaded {model_path}")


@handler
async def init_weights_update_group(request: web.Request, engine: LocalEngine) -> web.Response:
    p = "/init_weights_update_group"
    body = await read_json(request)
    address = field(body, "master_address", str, where=p)
    port = int_in(field(body, "master_port", int, where=p), "master_port", 1, 65535, p)
    world_size = int_in(field(body, "world_size", int, where=p), "world_size", 2, 1 << 20, p)
    rank_offset = int_in(field(body, "rank_offset", int, where=p), "rank_offset", 1, world_size - 1, p)
    group = field(body, "group_name", str, "weight_update_group", p)
    if not group:
        raise BadRequest(f"{p}: field 'group_name' must not be empty")
    await engine.init_weights_update_group(address, port, rank_offset, world_size, group,
                                           field(body, "backend", str, "gloo", p))
    return _ok("joined the weight update group")


@handler
async def update_weights_from_distributed(request: web.Request, engine: LocalEngine) -> web.Response:
    p = "/update_weights_from_distributed"
    body = await read_json(request)
    names, dtypes, shapes = parse_announced_tensors(body, request.app[SIZES_KEY], p)
    await engine.update_weights_from_distributed(
        names, dtypes, shapes, group_name=field(body, "group_name", str, "weight_update_group", p),
        weight_version=_version(body, "weight_version", p), flush_cache=_flag(body, "flush_cache", True, p),
        abort_all_requests=_flag(body, "abort_all_requests", False, p),
        load_format=field(body, "load_format", str, None, p),
    )
    return _ok(f"received {len(names)} tensors")


@handler
async def destroy_weights_update_group(request: web.Request, engine: LocalEngine) -> web.Response:
    body = await read_json(request)
    await engine.destroy_weights_update_group(field(body, "group_name", str, "weight_update_group", "/destroy_weights_update_group"))
    return _ok()


@handler
async def flush_cache(request: web.Request, engine: LocalEngine) -> web.Response:
    await engine.flush_cache()
    return web.Response(text="Cache flushed.\n")


@handler
async def begin_weight_update(request: web.Request, engine: LocalEngine) -> web.Response:
    await read_json(request)  # SGLang takes a (field-less) JSON object here: anything else is refused
    await engine.begin_weight_update()
    return _ok("weight-update session open")


@handler
async def end_weight_update(request: web.Request, engine: LocalEngine) -> web.Response:
    await read_json(request)
    await engine.end_weight_update()
    return _ok("weight-update session closed")


@handler
async def update_weight_version(request: web.Request, engine: LocalEngine) -> web.Response:
    p = "/update_weight_version"
    body = await read_json(request)
    version = field(body, "new_version", str, where=p)
    await engine.update_weight_version(version, _flag(body, "abort_all_requests", True, p))
    return web.json_response({"success": True, "message": f"Weight version updated to {version}.", "new_version": version})


@handler
async def pause_generation(request: web.Request, engine: LocalEngine) -> web.Response:
    body = await read_json(request)
    await engine.pause_generation(field(body, "mode", str, "abort", "/pause_generation"))
    return _ok("paused")


@handler
async def continue_generation(request: web.Request, engine: LocalEngine) -> web.Response:
    await read_json(request)
    await engine.continue_generation()
    return _ok("continued")


@handler
async def release_memory_occupation(request: web.Request, engine: LocalEngine) -> web.Response:
    body = await read_json(request)
    await engine.release_memory_occupation(list_field(body, "tags", str, None, "/release_memory_occupation"))
    return _ok("released")


@handler
async def resume_memory_occupation(request: web.Request, engine: LocalEngine) -> web.Response:
    body = await read_json(request)
    await engine.resume_memory_occupation(list_field(body, "tags", str, None, "/resume_memory_occupation"))
    return _ok("resumed")


@handler
async def ready(request: web.Request, engine: LocalEngine) -> web.Response:
    """SGLang's /ready: 200 while the server takes requests (not paused); generates nothing."""
    if await engine.health():
        return web.Response(text="")
    return web.Response(status=503, text="paused")


@handler
async def health_generate(request: web.Request, engine: LocalEngine) -> web.Response:
    """SGLang's rule: healthy once the engine produces output after the probe came in, its own one-token request
    or the next step of the running ones (a busy engine answers at its next step, not after its queue)."""
    steps = engine.steps
    probe = asyncio.ensure_future(engine.generate(
        GenerateRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0), return_logprob=False)))
    try:
        while not probe.done() and engine.steps == steps:
            await asyncio.wait({probe}, timeout=0.05)
        if probe.done():
            probe.result()  # its error, if it failed
    finally:
        probe.cancel()  # still queued: it runs its one token later, unobserved
    return web.Response(text="")


@handler
async def get_model_info(request: web.Request, engine: LocalEngine) -> web.Response:
    info = await engine.get_model_info()
    return web.json_response({
        "engine": LOCAL_ENGINE_NAME,
        "model_path": info.model_path, "tokenizer_path": None, "is_generation": info.is_generation,
        "weight_version": info.weight_version, "num_moe_layers": info.num_moe_layers, "moe_top_k": info.moe_top_k,
    })


@handler
async def get_weight_version(request: web.Request, engine: LocalEngine) -> web.Response:
    return web.json_response({"weight_version": engine.weight_version})


@handler
async def weights_sha256(request: web.Request, engine: LocalEngine) -> web.Response:
    """Not an SGLang endpoint (hence the /local prefix): per-parameter sha256, for bitwise weight-sync checks."""
    digest = await engine.weights_sha256()
    return web.json_response({"weight_version": engine.weight_version, "sha256": digest})


@handler
async def memory(request: web.Request, engine: LocalEngine) -> web.Response:
    """Not an SGLang endpoint: bytes of weights and prefix cache held now (colocated release/resume checks)."""
    return web.json_response(engine.memory_bytes())


def build_app(engine: LocalEngine, chat=None, api_key: Optional[str] = None,
              limits: Optional[dict] = None, api: str = "sglang", routed_experts: bool = False) -> web.Application:
    """The aiohttp app; `chat` (a ChatEndpoint) enables /v1/chat/completions; with `api_key` every route SGLang
    guards needs it (require_api_key); `limits`: body bytes per route (body_limits; default DEFAULT_LIMITS).
    api="vllm": vLLM 0.33.0's routes and key rule instead of SGLang's (rollout/local/vllm_api.py). `routed_experts` is
    either server's --enable-return-routed-experts: without it, requests get no routed experts back."""
    limits = dict(limits or DEFAULT_LIMITS)
    if api not in ("sglang", "vllm"):
        raise ValueError(f"api must be 'sglang' or 'vllm', got {api!r}")
    guard = require_api_key
    if api == "vllm":
        guard = require_vllm_key
    app = web.Application(client_max_size=max(limits.values()), middlewares=[guard] if api_key else [])
    app[ENGINE_KEY] = engine
    app[BODY_LIMITS] = limits
    if api_key:
        app[API_KEY] = api_key
    params = [p.numel() for p in engine.runner.model.parameters()]  # at start: shapes never change, storage may be released later
    app[SIZES_KEY] = (max(params, default=0), sum(params))
    app[SGLANG_ROUTED_EXPERTS_KEY] = routed_experts
    if api == "vllm":
        add_vllm_routes(app, engine, api_key, routed_experts)
        post, get = {}, {"/local/weights_sha256": weights_sha256, "/local/memory": memory}
    else:
        post, get = _sglang_routes()
    for path, fn in post.items():
        app.router.add_post(path, fn)
    for path, fn in get.items():
        app.router.add_route("GET", path, fn)
        app.router.add_route("POST", path, fn)
    if chat is not None:
        app[CHAT_KEY] = chat
        chat.engine = engine
        app.router.add_post("/v1/chat/completions", chat.handle)

    async def shutdown(_app):
        await engine.close()

    app.on_cleanup.append(shutdown)
    return app


def _sglang_routes() -> tuple[dict, dict]:
    """SGLang's routes: (POST only, GET and POST)."""
    post = {
        "/generate": generate,
        "/update_weights_from_tensor": update_weights_from_tensor,
        "/update_weights_from_disk": update_weights_from_disk,
        "/init_weights_update_group": init_weights_update_group,
        "/update_weights_from_distributed": update_weights_from_distributed,
        "/destroy_weights_update_group": destroy_weights_update_group,
        "/begin_weight_update": begin_weight_update,
        "/end_weight_update": end_weight_update,
        "/update_weight_version": update_weight_version,
        "/pause_generation": pause_generation,
        "/continue_generation": continue_generation,
        "/release_memory_occupation": release_memory_occupation,
        "/resume_memory_occupation": resume_memory_occupation,
    }
    # /health generates one token, as SGLang 0.5.23's does (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION defaults on)
    return post, {"/flush_cache": flush_cache, "/ready": ready, "/health": health_generate,
                  "/health_generate": health_generate,
                  "/get_model_info": get_model_info, "/get_weight_version": get_weight_version,
                  "/local/weights_sha256": weights_sha256, "/local/memory": memory}


async def serve(engine: LocalEngine, host: str, port: int, chat=None, port_file: Optional[str] = None,
                api_key: Optional[str] = None, limits: Optional[dict] = None, api: str = "sglang",
                routed_experts: bool = False) -> None:
    """Serve until cancelled; prints the URL and writes the bound port to `port_file` (atomically)."""
    runner = web.AppRunner(build_app(engine, chat, api_key, limits, api, routed_experts), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]
    if port_file:
        tmp = f"{port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(str(bound))
        os.replace(tmp, port_file)
    print(f"local engine serving http://{host}:{bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Local engine (CPU or one CUDA device) with SGLang's HTTP API")
    p.add_argument("config", nargs="?", default=None, help="YAML config (default: the tiny CPU model)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    p.add_argument("--host", default=None, help="default: rollout.local.host (127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="default: rollout.local.port (0 = free port)")
    p.add_argument("--port-file", default=None, help="write the bound port here once serving")
    p.add_argument("--tokenizer", default=None, help="tokenizer for /v1/chat/completions; default: model.tokenizer")
    p.add_argument("--device", default=None, help="where the model runs: cpu, cuda or cuda:N; default rollout.local.device")
    p.add_argument("--api-key-env", default=None, metavar="NAME",
                   help="environment variable holding the API key every guarded route needs (the key itself is never "
                        "an argument); default rollout.api_key_env; unset or empty: no key, every route open")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="record each token's routed experts so requests may ask for them (SGLang's and vLLM's flag)")
    p.add_argument("--api", choices=("sglang", "vllm"), default=None,
                   help="HTTP API served: SGLang's, or vLLM 0.33.0's subset (rollout/local/vllm_api.py); default vllm "
                        "when rollout.engine=vllm (rollout.vllm.server=local), else sglang")
    args = p.parse_args(argv)
    overrides = list(args.overrides)
    config = args.config
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides.insert(0, config)
        config = None
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    key_env = args.api_key_env or cfg.rollout.api_key_env
    try:
        api_key = key_from_env(key_env)
    except EngineKeyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("API key: %s", f"required on every route but /health* (from ${key_env})" if api_key
             else f"none (${key_env} unset): every route is open")
    device = args.device or cfg.rollout.local.device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            print(f"error: device {device} (--device / rollout.local.device): no CUDA device is visible",
                  file=sys.stderr)
            return 2
        # fp32 means fp32: the IS ratio compares these logprobs with fp32 training (no TF32 matmuls or convs)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    api = args.api or ("vllm" if cfg.rollout.engine == "vllm" else "sglang")
    engine = LocalEngine.from_config(cfg, device=device)
    chat = ChatEndpoint.from_config(cfg, args.tokenizer)
    host = args.host or cfg.rollout.local.host
    port = cfg.rollout.local.port if args.port is None else args.port
    try:
        asyncio.run(serve(engine, host, port, chat, args.port_file, api_key, body_limits(cfg), api,
                          routed_experts=args.enable_return_routed_experts))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
