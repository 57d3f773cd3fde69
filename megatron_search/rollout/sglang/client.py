"""SGLang servers: launch them, wait until healthy, and drive them over the native HTTP API.

`SGLangClient` implements `Engine` over HTTP and talks to SGLang and to the local CPU engine
server alike (same paths and fields; only the `/update_weights_from_tensor` payload differs:
SGLang takes its in-process serializer's string, the local server base64 safetensors;
`tensor_format="auto"` asks the server which it is). Routed experts need (MoE layers, top_k):
pass `moe_shape` for SGLang servers (the local server reports it). Servers run as `process.ServerProcess`;
`sglang_command` builds the launch line from the config; `launch_router` fronts several servers
with sglang-router.

Engines are authenticated (rollout/engine/auth.py): a client sends `Authorization: Bearer <key>` (its
`api_key`, default the key in the variable `auth.use_key_env` names); the servers started here get
the job's key through the environment (`auth.job_key`), SGLang through rollout/sglang/serve.py, so
no key is ever on a command line; the key is never logged or shown in a repr.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import aiohttp

from megatron_search.rollout.engine.auth import bearer_header, client_key_env, job_key, key_from_env
from megatron_search.rollout.engine.base import (LOCAL_ENGINE_NAME, Engine, EngineError, EngineTimeout,
                                                 EngineUnreachable, MalformedReply, MemoryTag, ModelInfo, PauseMode,
                                                 decode_routed_experts)
from megatron_search.rollout.engine.process import ENGINE_PORT_STRIDE, ServerProcess
from megatron_search.rollout.engine.tensor_payload import LOCAL_TENSOR_FORMAT, serialize_named_tensors
from megatron_search.rollout.engine.types import FinishReason, GenerateRequest, GenerateResult

TensorFormat = Literal["auto", "safetensors_base64", "sglang"]
DISK_LOAD_FORMAT = "safetensors"  # what the exporter writes (weights/safetensors_writer.py)


class SGLangClient(Engine):
    """HTTP client for one engine server (SGLang or the local CPU engine) or an sglang-router.

    `api_key`: sent as `Authorization: Bearer` on every request; None = the key in the environment variable
    `auth.client_key_env()` (rollout.api_key_env), or no header when that is unset."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 3600.0,
        moe_shape: Optional[tuple[int, int]] = None,
        tensor_format: TensorFormat = "auto",
        tp_size: int = 1,
        max_connections: int = 0,
        api_key: Optional[str] = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.moe_shape = moe_shape
        self.tensor_format = tensor_format
        self.tp_size = tp_size
        self.max_connections = max_connections
        env = client_key_env()
        self._api_key = api_key if api_key is not None else key_from_env(env)
        self._key_source = "given to SGLangClient" if api_key is not None else f"read from ${env}, rollout.api_key_env"
        self._session: Optional[aiohttp.ClientSession] = None
        self._retired: list[aiohttp.ClientSession] = []  # replaced after a 5xx (_retire), closed once idle
        self._inflight: dict[aiohttp.ClientSession, int] = {}

    def __repr__(self) -> str:  # never the key
        return f"SGLangClient({self.base_url!r}, api_key={'set' if self._api_key else 'none'})"

    # -- transport ------------------------------------------------------------------------------
    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            conn = aiohttp.TCPConnector(limit=self.max_connections)
            self._session = aiohttp.ClientSession(timeout=self.timeout, connector=conn,
                                                  headers=bearer_header(self._api_key))
        return self._session

    async def _call(self, path: str, payload: Optional[dict] = None, method: str = "POST") -> Any:
        """One request. Failures by class (rollout/engine/failures.py): EngineTimeout, EngineUnreachable (no complete
        answer), EngineError (an error status or `success: false`), MalformedReply (a JSON answer that does not parse)."""
        url = f"{self.base_url}{path}"
        sess = self._sess()
        self._inflight[sess] = self._inflight.get(sess, 0) + 1
        try:
            async with sess.request(method, url, json=payload) as resp:
                raw = await resp.read()
                status, content_type = resp.status, resp.content_type
        except asyncio.TimeoutError as e:  # first: aiohttp's timeouts are ClientErrors too
            raise EngineTimeout(f"{url}: no answer within {self.timeout.total} s") from e
        except (aiohttp.ClientError, OSError) as e:
            raise EngineUnreachable(f"{url}: {type(e).__name__}: {e}") from e
        finally:
            self._inflight[sess] = self._inflight.get(sess, 1) - 1  # close() may have forgotten it meanwhile
        if status >= 500:
            self._retire(sess)
        await self._close_retired()
        text = raw.decode("utf-8", errors="replace")
        if status == 401:
            raise EngineError(f"{url}: HTTP 401: the engine wants an API key and this client sent "
                              f"{'a different one' if self._api_key else 'none'} ({self._key_source})")
        if status != 200:
            raise EngineError(f"{url}: HTTP {status}: {text[:1000]}")
        if content_type != "application/json":
            return text
        try:
            body = json.loads(raw)
        except ValueError as e:  # not JSON, or not UTF-8
            raise MalformedReply(f"{url}: the answer is not valid JSON ({e}): {text[:200]!r}") from None
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"{url}: {body.get('message')}")
        return body

    def _retire(self, sess: aiohttp.ClientSession) -> None:
        """After a 5xx, later requests go through a new session. A 5xx is often the server's exception handler:
        Starlette re-raises after sending it and uvicorn then closes that connection, which the pool has already
        taken back, so the next request on it got "connection reset" (measured on vLLM 0.32.0: an engine that
        answered would have been counted down). Requests in flight on the old session finish there."""
        if self._session is sess:
            self._session = None
            self._retired.append(sess)

    async def _close_retired(self) -> None:
        idle = [r for r in self._retired if not self._inflight.get(r)]  # detached before any await: concurrent
        self._retired = [r for r in self._retired if r not in idle]    # callers never close the same session twice
        for sess in idle:
            self._inflight.pop(sess, None)
            await sess.close()

    async def _get_object(self, path: str) -> dict:
        """GET a route that answers a JSON object (a MalformedReply otherwise)."""
        body = await self._call(path, method="GET")
        if not isinstance(body, dict):
            raise MalformedReply(f"{self.base_url}{path}: the answer is not a JSON object: {str(body)[:200]!r}")
        return body

    async def close(self) -> None:
        for sess in [*self._retired, self._session]:
            if sess is not None:
                await sess.close()
        self._session, self._retired, self._inflight = None, [], {}

    # -- generation -----------------------------------------------------------------------------
    async def _moe_shape(self) -> tuple[int, int]:
        if self.moe_shape is None:
            info = await self._get_object("/get_model_info")
            if not info.get("num_moe_layers"):
                raise EngineError(
                    f"{self.base_url}: cannot decode routed_experts without (MoE layers, top_k); "
                    "pass moe_shape to SGLangClient (from the model's config.json)"
                )
            self.moe_shape = (int(info["num_moe_layers"]), int(info["moe_top_k"]))
        return self.moe_shape

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        payload: dict[str, Any] = {
            "input_ids": list(request.input_ids),
            "sampling_params": request.sampling.to_json(),
            "return_logprob": request.return_logprob,
            "stream": False,
        }
        if request.return_logprob:
            payload["logprob_start_len"] = -1  # output tokens only
        if request.return_routed_experts:
            payload["return_routed_experts"] = True
            payload["routed_experts_start_len"] = request.routed_experts_start_len
        if request.rid is not None:
            payload["rid"] = request.rid
        body = await self._call("/generate", payload)
        return await self._parse_generate(request, body)

    async def _parse_generate(self, request: GenerateRequest, body: Any) -> GenerateResult:
        """The /generate answer, checked field by field: anything that does not fit is a MalformedReply."""
        where = f"{self.base_url}/generate"
        if not isinstance(body, dict):
            raise MalformedReply(f"{where}: the answer is a JSON {type(body).__name__}, not an object")
        meta = body.get("meta_info") or {}
        if not isinstance(meta, dict):
            raise MalformedReply(f"{where}: meta_info is a {type(meta).__name__}, not an object")
        output_ids = body.get("output_ids")
        if not isinstance(output_ids, list):
            raise MalformedReply(f"{where}: response has no output_ids (is the server started with --skip-tokenizer-init?)")
        if not all(_is_int(t) for t in output_ids):
            raise MalformedReply(f"{where}: output_ids must be a list of integers")
        logprobs = None
        if request.return_logprob:
            logprobs = _output_logprobs(where, meta.get("output_token_logprobs"), output_ids)
        experts = None
        if request.return_routed_experts:
            if "routed_experts" not in meta:
                raise MalformedReply(f"{where}: no routed_experts in meta_info "
                                     "(start SGLang with --enable-return-routed-experts)")
            layers, top_k = await self._moe_shape()
            rows = len(request.input_ids) + len(output_ids) - 1 - request.routed_experts_start_len
            experts = decode_routed_experts(meta["routed_experts"], layers, top_k, expected_rows=rows)
        try:
            finish = FinishReason.from_json(meta.get("finish_reason"))
        except ValueError as e:
            raise MalformedReply(f"{where}: {e}") from None
        counts = {k: meta.get(k, d) for k, d in (("prompt_tokens", len(request.input_ids)), ("cached_tokens", 0))}
        bad = [k for k, v in counts.items() if not _is_int(v)]
        if bad:
            raise MalformedReply(f"{where}: meta_info.{bad[0]} must be an integer, got {counts[bad[0]]!r:.40}")
        return GenerateResult(
            output_ids=list(output_ids),
            output_logprobs=logprobs,
            finish_reason=finish,
            weight_version=str(meta.get("weight_version", "default")),
            prompt_tokens=counts["prompt_tokens"],
            cached_tokens=counts["cached_tokens"],
            routed_experts_NLK=experts,
        )

    # -- weights --------------------------------------------------------------------------------
    async def _tensor_format(self) -> str:
        """'auto': ask the server once; the local CPU engine names itself in /get_model_info."""
        if self.tensor_format == "auto":
            info = await self._get_object("/get_model_info")
            self.tensor_format = LOCAL_TENSOR_FORMAT if info.get("engine") == LOCAL_ENGINE_NAME else "sglang"
        return self.tensor_format

    def _serialize(self, named_tensors) -> list[str]:
        if self.tensor_format == LOCAL_TENSOR_FORMAT:
            return [serialize_named_tensors(named_tensors)]
        # optional: sglang (installed only on GPU hosts; SGLang's own tensor payload)
        from sglang.srt.utils import MultiprocessingSerializer

        # One payload per TP rank, each serialized on its own as SGLang's HTTP client does: a payload of
        # host tensors (shared-memory handles) opens once only, so ranks cannot share one.
        named = list(named_tensors)
        return [MultiprocessingSerializer.serialize(named, output_str=True) for _ in range(self.tp_size)]

    async def update_weights_from_tensor(self, named_tensors, weight_version=None, flush_cache=True, abort_all_requests=False):
        await self._tensor_format()
        payload = {
            "serialized_named_tensors": self._serialize(named_tensors),
            "load_format": None,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self._call("/update_weights_from_tensor", payload)

    async def update_weights_from_disk(self, model_path, weight_version=None, abort_all_requests=False):
        # load_format named: SGLang's None means the server's own, which for an engine started with
        # --load-format dummy is the dummy loader, and its disk update refuses any loader but the default one.
        payload = {"model_path": str(model_path), "load_format": DISK_LOAD_FORMAT,
                   "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self._call("/update_weights_from_disk", payload)

    async def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                        group_name="weight_update_group", backend="gloo"):
        await self._call("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend,
        })

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                              weight_version=None, flush_cache=True, abort_all_requests=False,
                                              load_format=None):
        payload = {
            "names": list(names), "dtypes": [str(d).replace("torch.", "") for d in dtypes],
            "shapes": [list(s) for s in shapes], "group_name": group_name, "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self._call("/update_weights_from_distributed", payload)

    async def destroy_weights_update_group(self, group_name="weight_update_group"):
        await self._call("/destroy_weights_update_group", {"group_name": group_name})

    async def begin_weight_update(self) -> None:
        await self._call("/begin_weight_update", {})

    async def end_weight_update(self) -> None:
        await self._call("/end_weight_update", {})

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> None:
        await self._call("/update_weight_version", {"new_version": str(new_version),
                                                    "abort_all_requests": bool(abort_all_requests)})

    async def local_memory(self) -> Optional[dict]:
        """The local CPU engine's held bytes ({weights, kv_cache}); None for SGLang, which has no such endpoint."""
        if await self._tensor_format() != LOCAL_TENSOR_FORMAT:
            return None
        return await self._get_object("/local/memory")

    # -- control --------------------------------------------------------------------------------
    async def flush_cache(self) -> None:
        await self._call("/flush_cache", method="POST")

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        await self._call("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._call("/continue_generation", {})

    async def release_memory_occupation(self, tags: Optional[Sequence[MemoryTag]] = None) -> None:
        await self._call("/release_memory_occupation", {"tags": list(tags) if tags else None})

    async def resume_memory_occupation(self, tags: Optional[Sequence[MemoryTag]] = None) -> None:
        await self._call("/resume_memory_occupation", {"tags": list(tags) if tags else None})

    async def health(self) -> bool:
        """Up and taking requests, without generating: GET /ready. (SGLang 0.5.23's /health runs a one-token
        generation, which on an engine whose memory is released reads unmapped memory and kills it.)"""
        try:
            await self._call("/ready", method="GET")
            return True
        except EngineError:
            return False

    async def health_generate(self) -> None:
        """SGLang's heartbeat: GET /health_generate answers 200 once the scheduler produces output (its own
        one-token request, or any running one); raises EngineError otherwise (rollout/engine/health.py times it)."""
        await self._call("/health_generate", method="GET")

    async def get_model_info(self) -> ModelInfo:
        info = await self._get_object("/get_model_info")
        version = info.get("weight_version")
        if version is None:
            version = (await self._get_object("/get_weight_version")).get("weight_version", "default")
        return ModelInfo(
            model_path=str(info.get("model_path")), weight_version=str(version),
            is_generation=bool(info.get("is_generation", True)),
            num_moe_layers=int(info.get("num_moe_layers") or 0), moe_top_k=int(info.get("moe_top_k") or 0),
        )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _output_logprobs(where: str, rows: Any, output_ids: list[int]) -> list[float]:
    """SGLang's `output_token_logprobs` rows [logprob, token id, text]: one per output id, same ids, finite logprobs."""
    if not isinstance(rows, list) or len(rows) != len(output_ids):
        n = len(rows) if isinstance(rows, list) else 0
        raise MalformedReply(f"{where}: {n} output_token_logprobs for {len(output_ids)} output ids")
    for i, r in enumerate(rows):
        if not (isinstance(r, list) and len(r) >= 2 and isinstance(r[0], (int, float)) and not isinstance(r[0], bool)
                and _is_int(r[1])):
            raise MalformedReply(f"{where}: output_token_logprobs[{i}] must be [logprob, token id, ...], got {r!r:.60}")
    if [r[1] for r in rows] != output_ids:
        raise MalformedReply(f"{where}: output_token_logprobs token ids differ from output_ids")
    logprobs = [float(r[0]) for r in rows]
    bad = next((i for i, lp in enumerate(logprobs) if not math.isfinite(lp)), None)
    if bad is not None:
        raise MalformedReply(f"{where}: output_token_logprobs[{bad}] is {logprobs[bad]} (logprobs must be finite)")
    return logprobs




def sglang_command(
    sg, model_path: str, port: int, routed_experts: bool, seed: int = 0,
    weight_version: str = "default", skip_tokenizer_init: bool = True, base_gpu_id: int = 0,
    api_key_env: Optional[str] = None,
) -> list[str]:
    """`python -m sglang.launch_server` argv for one server from an `SGLangConfig`; engines that share a node
    pass disjoint `base_gpu_id`s (the server uses GPUs base_gpu_id .. base_gpu_id + TP x DP - 1). With
    `api_key_env` the server starts through rollout/sglang/serve.py, which gives SGLang the key in `$api_key_env`
    as its --api-key without it ever being in argv or the log. `routed_experts`: the server records every token's
    experts, so requests may ask for them (routing replay or agreement; without it SGLang returns none)."""
    head = [sys.executable, "-m", "sglang.launch_server"]
    if api_key_env:
        head = [sys.executable, "-m", "megatron_search.rollout.sglang.serve", "--api-key-env", api_key_env]
    argv = [
        *head,
        "--model-path", model_path,
        "--host", sg.host, "--port", str(port),
        "--tp-size", str(sg.tp), "--ep-size", str(sg.ep), "--dp-size", str(sg.dp),
        "--mem-fraction-static", str(sg.mem_fraction_static),
        "--dtype", sg.dtype,
        "--random-seed", str(seed),
        "--weight-version", weight_version,
    ]
    if skip_tokenizer_init:
        argv.append("--skip-tokenizer-init")  # token in, token out: the transcript is never re-tokenised
    if sg.enable_memory_saver:
        argv.append("--enable-memory-saver")
    if sg.deterministic_inference:
        argv.append("--enable-deterministic-inference")  # per-request sampling_seed honoured only with it
    if routed_experts:
        argv.append("--enable-return-routed-experts")
    if sg.context_length:
        argv += ["--context-length", str(sg.context_length)]
    if base_gpu_id:
        argv += ["--base-gpu-id", str(base_gpu_id)]
    return argv + list(sg.extra_args)


def launch_sglang_servers(cfg, output_dir: str | Path, model_path: Optional[str] = None,
                          routed_experts: bool = False) -> list[ServerProcess]:
    """Start `rollout.num_engines` SGLang servers and wait for each to be healthy (`routed_experts`: sglang_command)."""
    sg = cfg.rollout.sglang
    dummy = not (model_path or sg.model_path)  # the policy is pushed before the first rollout
    model_path = model_path or sg.model_path or str(cfg.model.engine_dir())
    key_env = cfg.rollout.api_key_env
    job_key(key_env)  # from the environment, or generated for this job and exported
    env = dict(os.environ)
    if cfg.rollout.return_original_logprob:
        env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    servers = []
    try:
        for i in range(cfg.rollout.num_engines):  # all on this host: each on its own GPUs
            port = sg.base_port + ENGINE_PORT_STRIDE * i
            argv = sglang_command(sg, model_path, port, routed_experts, seed=cfg.model.seed + i,
                                  skip_tokenizer_init=sg.skip_tokenizer_init, base_gpu_id=i * sg.tp * sg.dp,
                                  api_key_env=key_env)
            if dummy:
                argv += ["--load-format", "dummy"]
            server = ServerProcess(argv, Path(output_dir) / sg.log_dir / f"server_{i}.log", env)
            servers.append(server)
        for i, server in enumerate(servers):
            server.wait_healthy(f"http://{sg.host}:{sg.base_port + ENGINE_PORT_STRIDE * i}", sg.startup_timeout_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def launch_router(worker_urls: Sequence[str], host: str, port: int, log_path: str | Path,
                  timeout_s: float = 120.0, api_key_env: Optional[str] = None) -> ServerProcess:
    """sglang-router in front of several servers (cache-aware routing); its URL speaks the same API. With
    `api_key_env` it requires the key in that variable and sends it to the workers (through sglang_serve)."""
    head = [sys.executable, "-m", "sglang_router.launch_router"]
    env = None
    if api_key_env:
        head = [sys.executable, "-m", "megatron_search.rollout.sglang.serve", "--api-key-env", api_key_env,
                "--module", "sglang_router.launch_router"]
        env = dict(os.environ)
        env[api_key_env] = job_key(api_key_env)
    argv = [*head, "--worker-urls", *worker_urls, "--host", host, "--port", str(port)]
    router = ServerProcess(argv, log_path, env)
    router.wait_healthy(f"http://{host}:{port}", timeout_s)
    return router
