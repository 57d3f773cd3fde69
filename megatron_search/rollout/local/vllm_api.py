"""vLLM 0.33.0's HTTP API (the subset VLLMClient uses) in front of the local engine: `local_server --api vllm`.

The routes, fields and answers are vLLM's (rollout/vllm/client.py lists them); what vLLM refuses is refused
(empty or negative token ids, temperature < 0, top_p outside (0, 1], max_tokens < 1, a routed-experts
start past the prompt, an unknown pause mode or sleep level, --api-key on /v1 /v2 /inference /cohere),
and what vLLM would accept but this engine does not do is refused with a 400 naming it (streaming,
n > 1, top-k logprobs, text output, per-id aborts, `wait` pauses, sleep level 0); an RPC method other
than reload_weights and our worker extension's is vLLM's 500. Unknown request fields are refused too, where
vLLM's pydantic models ignore them: a misspelt field here is a bug in the client, not a default.

vLLM semantics kept: /health answers 200 while the engine lives (asleep too); /sleep pauses with its
mode and frees memory by level (2: weights and KV cache; 1: the KV cache, weights "offloaded" where they
already are, host memory); /wake_up resumes scheduling once everything is back; a reload from disk
neither waits for idleness nor flushes (the client resets the prefix cache); /reset_prefix_cache answers
success=false while requests hold cache, and with reset_running_requests=true retracts them first.
"""
from __future__ import annotations

import hashlib
import secrets
import time
import uuid
from typing import Any, Callable, Optional

from aiohttp import web

from megatron_search.rollout.engine.base import LOCAL_ENGINE_NAME, EngineError
from megatron_search.rollout.engine.tensor_payload import WeightUpdateError
from megatron_search.rollout.engine.types import GenerateRequest, SamplingParams
from megatron_search.rollout.local.engine import LocalEngine
from megatron_search.rollout.local.http_input import BadRequest, check_value, field, list_field, read_json
from megatron_search.rollout.local.weights import load_named_tensors, read_safetensors_dir
from megatron_search.rollout.vllm.client import GENERATE_ROUTE, encode_npy_experts
from megatron_search.rollout.vllm.launcher import EXTENSION

VLLM_GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")  # vllm/entrypoints/serve/middleware/authenticate.py
ROUTED_EXPERTS_KEY = web.AppKey("vllm_routed_experts", bool)  # --enable-return-routed-experts
SLEEP_KEY = web.AppKey("vllm_sleep", dict)
# Own keys: local_server runs as __main__, so its AppKeys are not the ones a re-import would see.
VLLM_ENGINE_KEY = web.AppKey("vllm_engine", LocalEngine)
VLLM_API_KEY = web.AppKey("vllm_api_key", str)
SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "seed", "stop_token_ids", "ignore_eos", "logprobs",
                 "detokenize", "skip_special_tokens", "routed_experts_prompt_start", "n"}
GENERATE_KEYS = {"request_id", "token_ids", "sampling_params", "model", "output_mode", "stream", "priority"}


def vllm_request_allowed(method: str, path: str, authorization: Optional[str], key: Optional[str]) -> bool:
    """vLLM 0.33.0's AuthenticationMiddleware: with a key, every path under /v1 /v2 /inference /cohere needs
    `Authorization: Bearer <key>` (scheme case-insensitive), except OPTIONS; everything else is open."""
    if not key or method == "OPTIONS" or not path.startswith(VLLM_GUARDED_PREFIX):
        return True
    scheme, _, param = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(hashlib.sha256(param.encode()).digest(), hashlib.sha256(key.encode()).digest())


@web.middleware
async def require_vllm_key(request: web.Request, handler: Callable) -> web.StreamResponse:
    """vLLM's 401 (body {"error": "Unauthorized"}) before the body is read."""
    if not vllm_request_allowed(request.method, request.path, request.headers.get("Authorization"),
                                request.app.get(VLLM_API_KEY)):
        return web.json_response({"error": "Unauthorized"}, status=401)
    return await handler(request)


def _error(message: str, status: int = 400) -> web.Response:
    """vLLM's ErrorResponse body."""
    kind = "BadRequestError" if status == 400 else "RequestEntityTooLarge" if status == 413 else "InternalServerError"
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


def vllm_handler(fn: Callable) -> Callable:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request, request.app[VLLM_ENGINE_KEY])
        except BadRequest as e:
            return _error(str(e), e.status)
        except (ValueError, WeightUpdateError, EngineError) as e:
            return _error(str(e))

    return wrapped


def _query_bool(request: web.Request, name: str, default: bool) -> bool:
    v = request.query.get(name)
    if v is None:
        return default
    if v.lower() in ("true", "1", "yes", "on"):
        return True
    if v.lower() in ("false", "0", "no", "off"):
        return False
    raise BadRequest(f"{request.path}: query parameter {name!r} must be a boolean, got {v!r}")


def parse_vllm_generate(body: dict) -> tuple[GenerateRequest, str]:
    """vLLM's GenerateRequest (token_ids, sampling_params, ...) as ours, with vLLM's checks; returns (request, id)."""
    p = GENERATE_ROUTE
    unknown = sorted(set(body) - GENERATE_KEYS)
    if unknown:
        raise BadRequest(f"{p}: fields {unknown} are not in the local engine's subset of vLLM's GenerateRequest")
    if field(body, "stream", bool, False, p):
        raise BadRequest(f"{p}: stream=true is not supported by the local engine")
    if field(body, "output_mode", str, "tokens", p) != "tokens":
        raise BadRequest(f"{p}: output_mode must be 'tokens' (the local engine serves no tokenizer)")
    if field(body, "priority", int, 0, p) != 0:
        raise BadRequest(f"{p}: priority scheduling is not enabled (vLLM refuses priority != 0 without it)")
    ids = list_field(body, "token_ids", int, where=p)
    if not ids:
        raise BadRequest(f"{p}: token_ids must hold at least one token")
    if any(t < 0 for t in ids):
        raise BadRequest(f"{p}: token_ids must not contain negative values")
    sp = field(body, "sampling_params", dict, where=p)
    unknown = sorted(set(sp) - SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"{p}: sampling_params {unknown} are not in the local engine's subset")
    where = f"{p}: sampling_params"
    if field(sp, "n", int, 1, where) != 1:
        raise BadRequest(f"{where}.n must be 1 here (one sample per request)")
    logprobs = field(sp, "logprobs", int, None, where)
    if logprobs not in (None, 0):
        raise BadRequest(f"{where}.logprobs: only 0 (the sampled token) is served here, got {logprobs}")
    max_tokens = field(sp, "max_tokens", int, where=where)
    temperature = field(sp, "temperature", float, 1.0, where)
    top_p = field(sp, "top_p", float, 1.0, where)
    if max_tokens < 1:
        raise BadRequest(f"{where}.max_tokens must be at least 1, got {max_tokens}")
    if temperature < 0:
        raise BadRequest(f"{where}.temperature must be non-negative, got {temperature}")
    if not 0 < top_p <= 1:
        raise BadRequest(f"{where}.top_p must be in (0, 1], got {top_p}")
    seed = field(sp, "seed", int, None, where)
    if seed is not None and not -(1 << 63) <= seed < 1 << 63:
        raise BadRequest(f"{where}.seed must fit in 64 bits, got {seed}")
    start = field(sp, "routed_experts_prompt_start", int, 0, where)
    if not 0 <= start <= len(ids):
        raise BadRequest(f"{where}.routed_experts_prompt_start must be between 0 and the prompt length {len(ids)}, "
                         f"got {start}")
    for name in ("detokenize", "skip_special_tokens", "ignore_eos"):
        field(sp, name, bool, False, where)
    stops = list_field(sp, "stop_token_ids", int, [], where)
    rid = field(body, "request_id", str, None, p) or uuid.uuid4().hex
    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              stop_token_ids=tuple(stops), ignore_eos=field(sp, "ignore_eos", bool, False, where),
                              seed=None if seed is None else seed % (1 << 63))
    req = GenerateRequest(input_ids=ids, sampling=sampling, return_logprob=logprobs is not None,
                          return_routed_experts=False, routed_experts_start_len=start, rid=rid)
    return req, rid


def vllm_generate_response(req: GenerateRequest, res, rid: str, model: str) -> dict:
    """vLLM's GenerateTokensResponse for one choice."""
    stop = res.finish_reason
    matched = stop.matched if stop.type == "stop" else None
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": stop.type,
        # vLLM: the stop token id when a stop_token_ids entry ended generation; None at EOS, length and abort
        "stop_reason": matched if matched in req.sampling.stop_token_ids else None,
        "token_ids": list(res.output_ids),
        "logprobs": None if res.output_logprobs is None else {"content": [
            {"token_id": t, "logprob": lp, "rank": None, "top_logprobs": []}
            for t, lp in zip(res.output_ids, res.output_logprobs)]},
        "routed_experts": None if res.routed_experts_NLK is None else encode_npy_experts(res.routed_experts_NLK),
        "sampling_mask": None,
        "weight_versions": [{"version": res.weight_version, "start": 0, "end": len(res.output_ids)}]
        if res.output_ids else [],
    }
    n_out = len(res.output_ids)
    return {
        "request_id": f"generate-tokens-{rid}", "model": model, "created": int(time.time()), "output_mode": "tokens",
        "usage": {"prompt_tokens": res.prompt_tokens, "completion_tokens": n_out,
                  "total_tokens": res.prompt_tokens + n_out,
                  "prompt_tokens_details": {"cached_tokens": res.cached_tokens}},
        "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
        "mm_placeholders": None, "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
        "choices": [choice],
    }


@vllm_handler
async def generate(request: web.Request, engine: LocalEngine) -> web.Response:
    req, rid = parse_vllm_generate(await read_json(request))
    if request.app[ROUTED_EXPERTS_KEY] and engine.runner.num_moe_layers:
        req = GenerateRequest(req.input_ids, req.sampling, req.return_logprob, True, req.routed_experts_start_len,
                              req.rid)
    res = await engine.generate(req)
    return web.json_response(vllm_generate_response(req, res, rid, str(engine.model_path)))


@vllm_handler
async def abort_requests(request: web.Request, engine: LocalEngine) -> web.Response:
    body = await read_json(request)
    ids = list_field(body, "request_ids", str, None, request.path)
    if ids:
        raise BadRequest(f"{request.path}: aborting by request id is not in the local engine's subset; send no ids "
                         "to abort every request")
    n = len(engine._running) + len(engine._waiting)
    await engine._control(lambda: None, abort_all=True)
    return web.json_response({"status": "aborted", "aborted": n})


PAUSE_MODES = {"abort": "abort", "keep": "in_place"}


def _pause_mode(request: web.Request) -> str:
    mode = request.query.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        raise BadRequest(f"{request.path}: mode must be one of abort, wait, keep (vLLM's PauseMode), got {mode!r}")
    if mode == "wait":
        raise BadRequest(f"{request.path}: mode=wait is not in the local engine's subset (abort or keep)")
    return PAUSE_MODES[mode]


@vllm_handler
async def pause(request: web.Request, engine: LocalEngine) -> web.Response:
    _query_bool(request, "clear_cache", True)  # deprecated in vLLM; checked, no effect here (abort clears anyway)
    await engine.pause_generation(_pause_mode(request))
    return web.json_response({"status": "paused"})


@vllm_handler
async def resume(request: web.Request, engine: LocalEngine) -> web.Response:
    await engine.continue_generation()
    return web.json_response({"status": "resumed"})


@vllm_handler
async def is_paused(request: web.Request, engine: LocalEngine) -> web.Response:
    return web.json_response({"is_paused": bool(engine._paused)})


@vllm_handler
async def start_weight_update(request: web.Request, engine: LocalEngine) -> web.Response:
    """vLLM opens a weight-update session only on a configured weight-transfer engine (/init_weight_transfer_engine,
    which the local engine does not serve): otherwise its 500, as measured on vLLM 0.32.0."""
    raise BadRequest("Call to collective_rpc method failed: Weight transfer not configured (the local engine serves "
                     "no /init_weight_transfer_engine)", 500)


@vllm_handler
async def finish_weight_update(request: web.Request, engine: LocalEngine) -> web.Response:
    return await start_weight_update(request)


@vllm_handler
async def update_weight_version(request: web.Request, engine: LocalEngine) -> web.Response:
    version = field(await read_json(request), "new_version", str, where=request.path)
    await engine.update_weight_version(version, abort_all_requests=False)
    return web.json_response({"success": True, "new_version": version})


@vllm_handler
async def weight_info(request: web.Request, engine: LocalEngine) -> web.Response:
    return web.json_response({"weight_version": engine.weight_version})


@vllm_handler
async def reset_prefix_cache(request: web.Request, engine: LocalEngine) -> web.Response:
    reset_running = _query_bool(request, "reset_running_requests", False)
    _query_bool(request, "reset_external", False)
    if reset_running and engine._paused and engine._running:
        await engine.pause_generation("retract")  # preempt the kept requests: KV freed, recomputed on resume
    try:
        await engine.flush_cache()
    except EngineError:
        return web.json_response({"success": False})  # vLLM: blocks still held; the caller may retry
    return web.json_response({"success": True})


@vllm_handler
async def sleep(request: web.Request, engine: LocalEngine) -> web.Response:
    level = request.query.get("level", "1")
    if level not in ("0", "1", "2"):
        raise BadRequest(f"{request.path}: level must be an integer in [0, 2], got {level!r}")
    if level == "0":
        raise BadRequest(f"{request.path}: level 0 is not in the local engine's subset (1 or 2)")
    await engine.pause_generation(_pause_mode(request))
    tags = ["weights", "kv_cache"] if level == "2" else ["kv_cache"]
    await engine.release_memory_occupation(tags)
    request.app[SLEEP_KEY]["asleep"] = set(tags)
    return web.json_response({"status": "sleeping", "level": int(level)})


@vllm_handler
async def release_kv_cache_memory(request: web.Request, engine: LocalEngine) -> web.Response:
    if not engine._paused:
        raise BadRequest("Call to release_kv_cache_memory method failed: release_kv_cache_memory() requires a "
                         "completed pause first", 500)  # vLLM's 500 (measured on 0.32.0)
    await engine.release_memory_occupation(["kv_cache"])
    request.app[SLEEP_KEY]["asleep"].add("kv_cache")
    return web.json_response({"status": "kv_cache_released"})


@vllm_handler
async def wake_up(request: web.Request, engine: LocalEngine) -> web.Response:
    asleep: set = request.app[SLEEP_KEY]["asleep"]
    tags = request.query.getall("tags", []) or None
    if tags is not None:
        bad = sorted(set(tags) - {"weights", "kv_cache", "scheduling"})
        if bad:
            raise BadRequest(f"{request.path}: unknown tags {bad} (weights, kv_cache)")
    wake = sorted(asleep if tags is None else asleep & set(tags))
    if wake:
        await engine.resume_memory_occupation(wake)
        asleep -= set(wake)
    if not asleep:
        await engine.continue_generation()  # vLLM resumes scheduling once fully awake
    return web.json_response({"status": "awake" if not asleep else "sleeping", "tags": tags})


@vllm_handler
async def is_sleeping(request: web.Request, engine: LocalEngine) -> web.Response:
    return web.json_response({"is_sleeping": bool(request.app[SLEEP_KEY]["asleep"])})


RPC_METHODS = ("reload_weights", "megatron_search_reload_weights")


@vllm_handler
async def collective_rpc(request: web.Request, engine: LocalEngine) -> web.Response:
    """vLLM's reload_weights(weights_path=...) and our worker extension's reload (rollout/vllm/worker_ext.py;
    the launcher starts vLLM with it): an in-place reload from an HF safetensors directory, between steps, without
    a flush (vLLM's reload resets LoRA, encoder and multimodal caches, not the prefix cache). Any other method is
    vLLM's 500 "Method ... is not implemented"."""
    p = request.path
    body = await read_json(request)
    method = field(body, "method", str, where=p)
    if method not in RPC_METHODS:
        raise BadRequest(f"Call to collective_rpc method failed: Method {method!r} is not implemented.", 500)
    if field(body, "args", list, [], p):
        raise BadRequest(f"{p}: {method} takes keyword arguments here (kwargs.weights_path)")
    kwargs = field(body, "kwargs", dict, {}, p)
    unknown = sorted(set(kwargs) - {"weights_path"})
    if unknown:  # vLLM: a TypeError from the worker method, answered 500
        raise BadRequest(f"Call to collective_rpc method failed: {method}() got unexpected keyword arguments "
                         f"{unknown}", 500)
    path = check_value(kwargs.get("weights_path"), str, "kwargs.weights_path", p)

    def run():
        if "weights" in engine._released:
            raise EngineError("reload_weights: the weights are asleep; POST /wake_up?tags=weights first")
        load_named_tensors(engine.runner.model, read_safetensors_dir(path))
    await engine._control(run)
    return web.json_response({"results": [None if method == "reload_weights" else {"repacked_layers": 0}]})


@vllm_handler
async def server_info(request: web.Request, engine: LocalEngine) -> web.Response:
    """vLLM's /server_info?config_format=json, the fields the client reads: the local engine is a CPU server that
    runs our worker extension (what the launcher starts)."""
    if request.query.get("config_format", "text") not in ("text", "json"):
        raise BadRequest(f"{request.path}: config_format must be text or json")
    config = {"device_config": {"device": "cpu"}, "parallel_config": {"worker_extension_cls": EXTENSION},
              "model_config": {"model": str(engine.model_path)}}
    if request.query.get("config_format", "text") == "text":
        config = f"model='{engine.model_path}', device_config=cpu, worker_extension_cls={EXTENSION}"
    return web.json_response({"vllm_config": config})


@vllm_handler
async def health(request: web.Request, engine: LocalEngine) -> web.Response:
    return web.Response(status=200)


@vllm_handler
async def models(request: web.Request, engine: LocalEngine) -> web.Response:
    path = str(engine.model_path)
    return web.json_response({"object": "list", "data": [{
        "id": path, "object": "model", "created": int(time.time()), "owned_by": LOCAL_ENGINE_NAME, "root": path,
        "parent": None, "max_model_len": None, "permission": []}]})


def add_vllm_routes(app: web.Application, engine: LocalEngine, api_key: Optional[str], routed_experts: bool) -> None:
    """vLLM's routes on the local server's app (with --api vllm); /local/* stay (local_server adds them).
    `api_key`: what require_vllm_key checks (None: every route open)."""
    app[VLLM_ENGINE_KEY] = engine
    if api_key:
        app[VLLM_API_KEY] = api_key
    app[ROUTED_EXPERTS_KEY] = routed_experts
    app[SLEEP_KEY] = {"asleep": set()}
    for path, fn in {GENERATE_ROUTE: generate, "/abort_requests": abort_requests,
                     "/inference/v1/abort_requests": abort_requests, "/pause": pause, "/resume": resume,
                     "/start_weight_update": start_weight_update, "/finish_weight_update": finish_weight_update,
                     "/update_weight_version": update_weight_version, "/reset_prefix_cache": reset_prefix_cache,
                     "/sleep": sleep, "/release_kv_cache_memory": release_kv_cache_memory, "/wake_up": wake_up,
                     "/collective_rpc": collective_rpc}.items():
        app.router.add_post(path, fn)
    for path, fn in {"/is_paused": is_paused, "/weight_info": weight_info, "/is_sleeping": is_sleeping,
                     "/health": health, "/v1/models": models, "/server_info": server_info}.items():
        app.router.add_get(path, fn)
