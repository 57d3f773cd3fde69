"""HTTP server for the local CPU engine with SGLang's native API (the subset this project uses).

Same paths, request fields and response shapes as SGLang, so `SGLangClient` drives both:
/generate (token ids in, `output_ids` + `meta_info` out), /update_weights_from_tensor,
/update_weights_from_disk, /init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group, /flush_cache, /pause_generation, /continue_generation,
/release_memory_occupation, /resume_memory_occupation, /health, /health_generate,
/get_model_info, /get_weight_version, and OpenAI-compatible /v1/chat/completions.
Binds 127.0.0.1 unless told otherwise.

Run: python -m megatron_search.rollout.local_server [config.yaml] [key=value ...] [--port N] [--device cuda]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import uuid
from typing import Any, Callable, Optional

from aiohttp import web

from .engine import EngineError, encode_routed_experts
from .local import LocalEngine
from .local_weights import LOCAL_TENSOR_FORMAT, WeightUpdateError, deserialize_named_tensors
from .sglang import LOCAL_ENGINE_NAME
from .types import GenerateRequest, SamplingParams

log = logging.getLogger(__name__)
ENGINE_KEY = web.AppKey("engine", LocalEngine)
CHAT_KEY = web.AppKey("chat", object)


class BadRequest(ValueError):
    """The request body is wrong; the message names the field."""


async def _json(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except json.JSONDecodeError as e:
        raise BadRequest(f"{request.path}: body is not valid JSON ({e.msg} at {e.pos})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"{request.path}: body must be a JSON object")
    return body


def _field(body: dict, name: str, kind, default: Any = ..., path: str = "") -> Any:
    if name not in body or body[name] is None:
        if default is ...:
            raise BadRequest(f"{path}: missing required field {name!r}")
        return default
    value = body[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadRequest(f"{path}: field {name!r} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _ok(message: str = "Succeeded") -> web.Response:
    return web.json_response({"success": True, "message": message})


def handler(fn: Callable) -> Callable:
    """Map bad input to 400 and engine refusals to 400 with SGLang's {success, message} body."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request, request.app[ENGINE_KEY])
        except (BadRequest, ValueError, WeightUpdateError, EngineError) as e:
            return web.json_response({"success": False, "message": str(e), "error": {"message": str(e)}}, status=400)

    return wrapped


def parse_generate(body: dict) -> GenerateRequest:
    path = "/generate"
    if body.get("stream"):
        raise BadRequest(f"{path}: stream=true is not supported by the local engine")
    if body.get("text") is not None:
        raise BadRequest(f"{path}: send input_ids (token in, token out); text prompts need a tokenizer the local engine does not run")
    ids = _field(body, "input_ids", list, path=path)
    if ids and isinstance(ids[0], list):
        raise BadRequest(f"{path}: batched input_ids are not supported; send one request per sequence")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest(f"{path}: input_ids must be a list of integers")
    sp = _field(body, "sampling_params", dict, {}, path)
    try:
        sampling = SamplingParams.from_json(sp)
        return GenerateRequest(
            input_ids=ids,
            sampling=sampling,
            return_logprob=bool(body.get("return_logprob", False)),
            return_routed_experts=bool(body.get("return_routed_experts", False)),
            routed_experts_start_len=int(body.get("routed_experts_start_len") or 0),
            rid=body.get("rid"),
        )
    except (TypeError, ValueError) as e:
        raise BadRequest(f"{path}: {e}") from None


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
    req = parse_generate(await _json(request))
    res = await engine.generate(req)
    return web.json_response(generate_response(req, res, req.rid or uuid.uuid4().hex))


@handler
async def update_weights_from_tensor(request: web.Request, engine: LocalEngine) -> web.Response:
    path = "/update_weights_from_tensor"
    body = await _json(request)
    payloads = _field(body, "serialized_named_tensors", list, path=path)
    fmt = body.get("load_format")
    if fmt not in (None, LOCAL_TENSOR_FORMAT):
        raise BadRequest(f"{path}: load_format {fmt!r} is SGLang's in-process format; the local engine takes {LOCAL_TENSOR_FORMAT!r}")
    if len(payloads) != 1 or not isinstance(payloads[0], str):
        raise BadRequest(f"{path}: serialized_named_tensors must hold exactly one string (one TP rank), got {len(payloads)}")
    named = deserialize_named_tensors(payloads[0])
    await engine.update_weights_from_tensor(
        named, weight_version=body.get("weight_version"), flush_cache=bool(body.get("flush_cache", True)),
        abort_all_requests=bool(body.get("abort_all_requests", False)),
    )
    return _ok(f"updated {len(named)} tensors")


@handler
async def update_weights_from_disk(request: web.Request, engine: LocalEngine) -> web.Response:
    body = await _json(request)
    model_path = _field(body, "model_path", str, path="/update_weights_from_disk")
    await engine.update_weights_from_disk(model_path, weight_version=body.get("weight_version"),
                                          abort_all_requests=bool(body.get("abort_all_requests", False)))
    return _ok(f"loaded {model_path}")


@handler
async def init_weights_update_group(request: web.Request, engine: LocalEngine) -> web.Response:
    p = "/init_weights_update_group"
    body = await _json(request)
    await engine.init_weights_update_group(
        _field(body, "master_address", str, path=p), _field(body, "master_port", int, path=p),
        _field(body, "rank_offset", int, path=p), _field(body, "world_size", int, path=p),
        _field(body, "group_name", str, "weight_update_group", p), _field(body, "backend", str, "gloo", p),
    )
    return _ok("joined the weight update group")


@handler
async def update_weights_from_distributed(request: web.Request, engine: LocalEngine) -> web.Response:
    p = "/update_weights_from_distributed"
    body = await _json(request)
    names = _field(body, "names", list, path=p)
    await engine.update_weights_from_distributed(
        names, _field(body, "dtypes", list, path=p), _field(body, "shapes", list, path=p),
        group_name=_field(body, "group_name", str, "weight_update_group", p),
        weight_version=body.get("weight_version"), flush_cache=bool(body.get("flush_cache", True)),
        abort_all_requests=bool(body.get("abort_all_requests", False)), load_format=body.get("load_format"),
    )
    return _ok(f"received {len(names)} tensors")


@handler
async def destroy_weights_update_group(request: web.Request, engine: LocalEngine) -> web.Response:
    body = await _json(request)
    await engine.destroy_weights_update_group(_field(body, "group_name", str, "weight_update_group", "/destroy_weights_update_group"))
    return _ok()


@handler
async def flush_cache(request: web.Request, engine: LocalEngine) -> web.Response:
    await engine.flush_cache()
    return web.Response(text="Cache flushed.\n")


@handler
async def begin_weight_update(request: web.Request, engine: LocalEngine) -> web.Response:
    await engine.begin_weight_update()
    return _ok("weight-update session open")


@handler
async def end_weight_update(request: web.Request, engine: LocalEngine) -> web.Response:
    await engine.end_weight_update()
    return _ok("weight-update session closed")


@handler
async def update_weight_version(request: web.Request, engine: LocalEngine) -> web.Response:
    p = "/update_weight_version"
    body = await _json(request)
    version = _field(body, "new_version", str, path=p)
    await engine.update_weight_version(version, bool(body.get("abort_all_requests", True)))
    return web.json_response({"success": True, "message": f"Weight version updated to {version}.", "new_version": version})


@handler
async def pause_generation(request: web.Request, engine: LocalEngine) -> web.Response:
    body = await _json(request)
    await engine.pause_generation(_field(body, "mode", str, "abort", "/pause_generation"))
    return _ok("paused")


@handler
async def continue_generation(request: web.Request, engine: LocalEngine) -> web.Response:
    await engine.continue_generation()
    return _ok("continued")


@handler
async def release_memory_occupation(request: web.Request, engine: LocalEngine) -> web.Response:
    body = await _json(request)
    await engine.release_memory_occupation(_field(body, "tags", list, None, "/release_memory_occupation"))
    return _ok("released")


@handler
async def resume_memory_occupation(request: web.Request, engine: LocalEngine) -> web.Response:
    body = await _json(request)
    await engine.resume_memory_occupation(_field(body, "tags", list, None, "/resume_memory_occupation"))
    return _ok("resumed")


@handler
async def health(request: web.Request, engine: LocalEngine) -> web.Response:
    if await engine.health():
        return web.Response(text="")
    return web.Response(status=503, text="weights are released")


@handler
async def health_generate(request: web.Request, engine: LocalEngine) -> web.Response:
    await engine.generate(GenerateRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0), return_logprob=False))
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
    from .local_weights import weights_sha256 as digest

    return web.json_response({"weight_version": engine.weight_version,
                              "sha256": await asyncio.to_thread(digest, engine.runner.model)})


@handler
async def memory(request: web.Request, engine: LocalEngine) -> web.Response:
    """Not an SGLang endpoint: bytes of weights and prefix cache held now (colocated release/resume checks)."""
    return web.json_response(engine.memory_bytes())


def build_app(engine: LocalEngine, chat=None) -> web.Application:
    """The aiohttp app; `chat` (a ChatEndpoint) enables /v1/chat/completions."""
    app = web.Application(client_max_size=1 << 31)
    app[ENGINE_KEY] = engine
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
    for path, fn in post.items():
        app.router.add_post(path, fn)
    for path, fn in {"/flush_cache": flush_cache, "/health": health, "/health_generate": health_generate,
                     "/get_model_info": get_model_info, "/get_weight_version": get_weight_version,
                     "/local/weights_sha256": weights_sha256, "/local/memory": memory}.items():
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


async def serve(engine: LocalEngine, host: str, port: int, chat=None, port_file: Optional[str] = None) -> None:
    """Serve until cancelled; prints the URL and writes the bound port to `port_file` (atomically)."""
    runner = web.AppRunner(build_app(engine, chat), access_log=None)
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
    from megatron_search.config import ConfigError, load_config

    p = argparse.ArgumentParser(description="Local engine (CPU or one CUDA device) with SGLang's HTTP API")
    p.add_argument("config", nargs="?", default=None, help="YAML config (default: the tiny CPU model)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    p.add_argument("--host", default=None, help="default: rollout.local.host (127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="default: rollout.local.port (0 = free port)")
    p.add_argument("--port-file", default=None, help="write the bound port here once serving")
    p.add_argument("--tokenizer", default=None, help="tokenizer for /v1/chat/completions; default: model.tokenizer")
    p.add_argument("--device", default=None, help="where the model runs: cpu, cuda or cuda:N; default rollout.local.device")
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = args.device or cfg.rollout.local.device
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"error: device {device} (--device / rollout.local.device): no CUDA device is visible",
                  file=sys.stderr)
            return 2
        # fp32 means fp32: the IS ratio compares these logprobs with fp32 training (no TF32 matmuls or convs)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    engine = LocalEngine.from_config(cfg, device=device)
    from .chat_endpoint import ChatEndpoint

    chat = ChatEndpoint.from_config(cfg, args.tokenizer)
    host = args.host or cfg.rollout.local.host
    port = cfg.rollout.local.port if args.port is None else args.port
    try:
        asyncio.run(serve(engine, host, port, chat, args.port_file))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
