"""vLLM servers (vLLM 0.33.0): launch them, wait until healthy, and drive them over vLLM's own HTTP API.

`VLLMClient` implements `Engine` against the routes vLLM 0.33.0 serves (read from its source,
docs/ROLLOUT.md "vLLM" maps each one):

  generate            POST /inference/v1/generate (token ids in, token ids out; `--enable-scale-out`):
                      sampling_params {max_tokens, temperature, top_p, seed, stop_token_ids, ignore_eos,
                      logprobs: 0, detokenize: false, routed_experts_prompt_start}; the answer's
                      choices[0] carries token_ids, logprobs.content[i].logprob, finish_reason / stop_reason,
                      routed_experts (base64 `.npy`, [seqlen - 1 - start, layers, top_k]) and weight_versions
  logprobs            `--logprobs-mode processed_logprobs`: log-softmax after temperature (and top-p, which
                      the config refuses below 1), our and SGLang's convention; `raw_logprobs` with
                      rollout.return_original_logprob (SGLANG_RETURN_ORIGINAL_LOGPROB's counterpart)
  pause / continue    POST /pause?mode=abort|keep, POST /resume; SGLang's `retract` is `keep` plus
                      /reset_prefix_cache?reset_running_requests=true at the flush (running requests lose
                      their KV and re-prefill on the new weights, as SGLang's retract)
  weights             disk: POST /collective_rpc {method: reload_weights, kwargs: {weights_path}}, then
                      /reset_prefix_cache and /update_weight_version; the weight-transfer API
                      (/init_weight_transfer_engine, /start_weight_update, /update_weights,
                      /finish_weight_update) for the NCCL backend's requests
  sleep / wake        POST /sleep?level=2 (weights and KV freed; weights come back by the next update),
                      POST /release_kv_cache_memory (KV only), POST /wake_up?tags=...
  health              GET /health (open), a one-token generate as the heartbeat (vLLM has no
                      /health_generate), GET /v1/models and /weight_info for model info

The RL, sleep, cache and RPC routes exist only with VLLM_SERVER_DEV_MODE=1 and are not guarded by
`--api-key` (vLLM guards /v1, /v2, /inference, /cohere): servers bind 127.0.0.1, or the cluster's
private network in the Slurm plan. The key reaches vLLM as $VLLM_API_KEY, which vLLM reads when
--api-key is absent: never on a command line.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import io
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence
from urllib.parse import urlencode

import numpy as np

from megatron_search.config.rollout import VLLM_VERSION  # noqa: F401 (re-exported)

from megatron_search.rollout.engine.auth import job_key
from megatron_search.rollout.engine.base import (EngineError, EngineTimeout, EngineUnreachable, MalformedReply,
                                                 MemoryTag, ModelInfo, PauseMode)
from megatron_search.rollout.engine.process import ENGINE_PORT_STRIDE, ServerProcess
from megatron_search.rollout.engine.base import LOCAL_ENGINE_NAME
from megatron_search.rollout.sglang.client import SGLangClient
from megatron_search.rollout.engine.types import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from megatron_search.rollout.vllm.launcher import EXTENSION

GENERATE_ROUTE = "/inference/v1/generate"
LAUNCHER = "megatron_search.rollout.vllm.launcher"
VLLM_PAUSE_MODE = {"abort": "abort", "retract": "keep", "in_place": "keep"}


class VLLMClient(SGLangClient):
    """HTTP client for one vLLM 0.33.0 server (or the local engine serving vLLM's API subset).

    Transport, errors and the API key are SGLangClient's (Authorization: Bearer on every request); every
    Engine method is vLLM's. `moe_shape` (MoE layers, top_k) checks the routed experts vLLM returns."""

    def __init__(self, base_url: str, timeout_s: float = 3600.0, moe_shape: Optional[tuple[int, int]] = None,
                 max_connections: int = 0, api_key: Optional[str] = None):
        super().__init__(base_url, timeout_s, moe_shape, tensor_format="auto", max_connections=max_connections,
                         api_key=api_key)
        self._pause_mode: Optional[str] = None  # ours (abort / retract / in_place) while paused
        self._owned_by: Optional[str] = None
        self._reload: Optional[str] = None  # the disk reload's RPC method, once asked (_reload_method)

    def __repr__(self) -> str:  # never the key
        return f"VLLMClient({self.base_url!r}, api_key={'set' if self._api_key else 'none'})"

    async def _post(self, path: str, payload: Optional[dict] = None, **query) -> Any:
        q = [(k, v) for k, vs in query.items() for v in (vs if isinstance(vs, list) else [vs]) if v is not None]
        return await self._call(path + (f"?{urlencode(q)}" if q else ""), payload if payload is not None else {})

    # -- generation -----------------------------------------------------------------------------
    def generate_payload(self, request: GenerateRequest) -> dict:
        """The /inference/v1/generate body for `request` (vLLM's GenerateRequest and SamplingParams fields)."""
        sp = request.sampling
        params: dict[str, Any] = {
            "max_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
            "stop_token_ids": list(sp.stop_token_ids), "ignore_eos": sp.ignore_eos,
            "detokenize": False, "skip_special_tokens": False,
        }
        if sp.seed is not None:
            params["seed"] = sp.seed
        if request.return_logprob:
            params["logprobs"] = 0  # the sampled token's logprob only
        if request.return_routed_experts:
            params["routed_experts_prompt_start"] = request.routed_experts_start_len
        payload: dict[str, Any] = {"token_ids": list(request.input_ids), "sampling_params": params,
                                   "output_mode": "tokens", "stream": False}
        if request.rid is not None:
            payload["request_id"] = request.rid
        return payload

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        body = await self._call(GENERATE_ROUTE, self.generate_payload(request))
        return await self._parse_vllm(request, body)

    async def _parse_vllm(self, request: GenerateRequest, body: Any) -> GenerateResult:
        where = f"{self.base_url}{GENERATE_ROUTE}"
        if not isinstance(body, dict):
            raise MalformedReply(f"{where}: the answer is a JSON {type(body).__name__}, not an object")
        choices = body.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise MalformedReply(f"{where}: expected exactly one choice, got {str(choices)[:100]!r}")
        c = choices[0]
        ids = c.get("token_ids")
        if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
            raise MalformedReply(f"{where}: choices[0].token_ids must be a list of non-negative integers")
        logprobs = _vllm_logprobs(where, c.get("logprobs"), ids) if request.return_logprob else None
        finish = _finish(where, c.get("finish_reason"), c.get("stop_reason"), ids)
        experts = None
        if request.return_routed_experts:
            rows = len(request.input_ids) + len(ids) - 1 - request.routed_experts_start_len
            experts = decode_npy_experts(where, c.get("routed_experts"), rows, self.moe_shape)
        usage = body.get("usage") or {}
        if not isinstance(usage, dict):
            raise MalformedReply(f"{where}: usage must be an object")
        prompt_tokens = usage.get("prompt_tokens", len(request.input_ids))
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens", 0) if isinstance(details, dict) else None
        for name, v in (("usage.prompt_tokens", prompt_tokens), ("usage.prompt_tokens_details.cached_tokens", cached)):
            if not _is_int(v):
                raise MalformedReply(f"{where}: {name} must be an integer, got {v!r:.40}")
        return GenerateResult(output_ids=list(ids), output_logprobs=logprobs, finish_reason=finish,
                              weight_version=await self._span_version(where, c.get("weight_versions")),
                              prompt_tokens=prompt_tokens, cached_tokens=cached or 0, routed_experts_NLK=experts)

    async def _span_version(self, where: str, spans: Any) -> str:
        """The version of the last weight-version span (the weights that sampled the last token); an answer
        without spans (no token sampled) takes the server's current version."""
        if spans:
            if not isinstance(spans, list) or not all(isinstance(s, dict) and isinstance(s.get("version"), str)
                                                      for s in spans):
                raise MalformedReply(f"{where}: weight_versions must be a list of {{version, start, end}} spans")
            return spans[-1]["version"]
        return await self.weight_version()

    async def weight_version(self) -> str:
        body = await self._get_object("/weight_info")
        if not isinstance(body.get("weight_version"), str):
            raise MalformedReply(f"{self.base_url}/weight_info: no weight_version string in {str(body)[:100]!r}")
        return body["weight_version"]

    # -- weights --------------------------------------------------------------------------------
    async def update_weights_from_disk(self, model_path, weight_version=None, abort_all_requests=False):
        """vLLM's in-place reload (worker.reload_weights(weights_path=...), through our worker extension where the
        server has it: `_reload_method`), then the prefix-cache reset SGLang's disk load does itself, then the
        version."""
        method = await self._reload_method()
        if abort_all_requests:
            await self._post("/abort_requests", {})
        self._check_reload(method, await self._post("/collective_rpc", {"method": method,
                                                                         "kwargs": {"weights_path": str(model_path)}}))
        await self.flush_cache()
        if weight_version is not None:
            await self.update_weight_version(str(weight_version), abort_all_requests=False)

    async def _reload_method(self) -> str:
        """The /collective_rpc method of a disk reload, read once from the server's own config (/server_info, JSON):
        our worker extension's (rollout/vllm/worker_ext.py, which the launcher adds) where the server runs it; vLLM's
        own `reload_weights` otherwise, except on vLLM's CPU build, whose reload leaves the MoE experts in the wrong
        layout (the engine would serve weights that are neither the old nor the new ones): that server is refused.
        (Not a probe RPC: on vLLM's multiprocess executor a failed worker call leaves the other workers' answers
        queued for the next one.)"""
        if self._reload is None:
            body = await self._get_object("/server_info?config_format=json")
            vc = body.get("vllm_config")
            if not isinstance(vc, dict):
                raise MalformedReply(f"{self.base_url}/server_info: no vllm_config object in {str(body)[:200]!r}")
            ext = (vc.get("parallel_config") or {}).get("worker_extension_cls") or ""
            device = (vc.get("device_config") or {}).get("device")
            if ext == EXTENSION:
                self._reload = "megatron_search_reload_weights"
            elif device == "cpu":
                raise EngineError(
                    f"{self.base_url}: vLLM's CPU build without megatron-search's worker extension (it runs "
                    f"{ext or 'none'}): its reload_weights does not pre-pack the MoE experts again "
                    "(UnquantizedFusedMoEMethod runs process_weights_after_loading on the first load only), so the "
                    "served experts would not be the pushed ones. Start it with `python -m "
                    "megatron_search.rollout.vllm.launcher serve ...` (rollout.vllm.python does) or pass "
                    f"--worker-extension-cls {EXTENSION}")
            else:
                self._reload = "reload_weights"
        return self._reload

    def _check_reload(self, method: str, body: Any) -> None:
        """Every worker's answer to the reload: our extension answers {"repacked_layers": n} or {"error": ...} per
        worker (it never raises, see worker_ext.py); vLLM's reload_weights answers nothing (HTTP 200, no body)."""
        if method != "megatron_search_reload_weights":
            return
        results = body.get("results") if isinstance(body, dict) else None
        if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
            raise MalformedReply(f"{self.base_url}/collective_rpc {method}: expected one object per worker, got "
                                 f"{str(body)[:200]!r}")
        failed = [(i, r["error"]) for i, r in enumerate(results) if "error" in r]
        if failed:
            raise EngineError(f"{self.base_url}: the weight reload failed on {len(failed)} of {len(results)} workers "
                              f"(worker {failed[0][0]}: {failed[0][1]})")

    async def update_weights_from_tensor(self, named_tensors, weight_version=None, flush_cache=True,
                                         abort_all_requests=False):
        raise EngineError(f"{self.base_url}: tensor weight updates into vLLM are not supported: vLLM 0.33.0's IPC "
                          "backend opens a CUDA IPC handle keyed by each receiving GPU, which the owner-parallel sender "
                          "does not produce; use rollout.weight_sync=disk")

    async def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                        group_name="weight_update_group", backend="nccl"):
        """vLLM's NCCL weight-transfer backend: the engine joins at `rank_offset` of a `world_size` group whose
        rank 0 is the trainer. vLLM rendezvouses through its StatelessProcessGroup (TCPStore) + PyNccl, so the
        trainer must open the group with vLLM's trainer side (config refuses weight_sync=distributed for now)."""
        if backend != "nccl":
            raise EngineError(f"{self.base_url}: vLLM's weight-transfer groups are NCCL only, got backend {backend!r}")
        await self._post("/init_weight_transfer_engine", {"init_info": {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size)}})

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                              weight_version=None, flush_cache=True, abort_all_requests=False,
                                              load_format=None):
        if load_format is not None:
            raise EngineError(f"{self.base_url}: vLLM's NCCL backend sets packing at init, not per update "
                              f"(load_format {load_format!r})")
        if abort_all_requests:
            await self._post("/abort_requests", {})
        await self._post("/update_weights", {"update_info": {
            "names": list(names), "dtype_names": [str(d).replace("torch.", "") for d in dtypes],
            "shapes": [list(s) for s in shapes]}})
        if weight_version is not None:
            await self.update_weight_version(str(weight_version), abort_all_requests=False)
        if flush_cache:
            await self.flush_cache()

    async def destroy_weights_update_group(self, group_name="weight_update_group"):
        await self._post("/shutdown_weight_transfer_engine", {})

    async def begin_weight_update(self) -> None:
        await self._post("/start_weight_update", {})

    async def end_weight_update(self) -> None:
        await self._post("/finish_weight_update", {})

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> None:
        if abort_all_requests:
            await self._post("/abort_requests", {})  # no ids: every request the server tracks
        await self._post("/update_weight_version", {"new_version": str(new_version)})

    async def local_memory(self) -> Optional[dict]:
        """The local engine's held bytes ({weights, kv_cache}); None for vLLM itself."""
        if await self._server() != LOCAL_ENGINE_NAME:
            return None
        return await self._get_object("/local/memory")

    # -- control --------------------------------------------------------------------------------
    async def flush_cache(self) -> None:
        """/reset_prefix_cache; after a `retract` pause (vLLM's keep) with reset_running_requests, which preempts
        the frozen requests (their KV freed, recomputed on resume). vLLM answers success=false while blocks are held."""
        try:  # success=false is an EngineError from _call already
            body = await self._post("/reset_prefix_cache",
                                    reset_running_requests="true" if self._pause_mode == "retract" else None)
        except (EngineUnreachable, EngineTimeout, MalformedReply):
            raise
        except EngineError as e:
            raise EngineError(f"{self.base_url}/reset_prefix_cache: not reset ({e}); vLLM resets only when no "
                              "running request holds cache blocks") from None
        if not (isinstance(body, dict) and body.get("success") is True):
            raise MalformedReply(f"{self.base_url}/reset_prefix_cache: expected {{success: true}}, got {str(body)[:200]}")

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        if mode not in VLLM_PAUSE_MODE:
            raise ValueError(f"pause_generation: mode must be abort, retract or in_place, got {mode!r}")
        await self._post("/pause", mode=VLLM_PAUSE_MODE[mode])
        self._pause_mode = mode

    async def continue_generation(self) -> None:
        await self._post("/resume", {})
        self._pause_mode = None

    async def release_memory_occupation(self, tags: Optional[Sequence[MemoryTag]] = None) -> None:
        """Both (or weights): /sleep?level=2 (weights and KV discarded; the weights return with the next update,
        as SGLang's release without a CPU backup); KV cache only: /release_kv_cache_memory."""
        tags = set(tags or ("weights", "kv_cache"))
        if tags == {"kv_cache"}:
            await self._post("/release_kv_cache_memory", {})
        elif tags == {"weights", "kv_cache"}:
            await self._post("/sleep", level=2, mode="abort")
        else:
            raise EngineError(f"release_memory_occupation: vLLM frees weights only together with the KV cache "
                              f"(/sleep?level=2), got tags {sorted(tags)}")

    async def resume_memory_occupation(self, tags: Optional[Sequence[MemoryTag]] = None) -> None:
        await self._post("/wake_up", tags=list(tags) if tags else None)

    async def health(self) -> bool:
        try:
            await self._call("/health", method="GET")
            return True
        except EngineError:
            return False

    async def health_generate(self) -> None:
        """The heartbeat: vLLM has no /health_generate, so one greedy token through /inference/v1/generate (it
        answers once the scheduler has stepped it); raises EngineError otherwise."""
        await self.generate(GenerateRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0),
                                            return_logprob=False))

    async def _models(self) -> dict:
        body = await self._get_object("/v1/models")
        data = body.get("data")
        if not isinstance(data, list) or not data or not isinstance(data[0], dict):
            raise MalformedReply(f"{self.base_url}/v1/models: no model in {str(body)[:200]!r}")
        return data[0]

    async def _server(self) -> str:
        if self._owned_by is None:
            self._owned_by = str((await self._models()).get("owned_by"))
        return self._owned_by

    async def get_model_info(self) -> ModelInfo:
        m = await self._models()
        layers, top_k = self.moe_shape or (0, 0)
        return ModelInfo(model_path=str(m.get("root") or m.get("id")), weight_version=await self.weight_version(),
                         num_moe_layers=layers, moe_top_k=top_k)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _vllm_logprobs(where: str, logprobs: Any, ids: list[int]) -> list[float]:
    """logprobs.content: one entry per output token, the sampled token's id and a finite logprob."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or len(content) != len(ids):
        n = len(content) if isinstance(content, list) else 0
        raise MalformedReply(f"{where}: {n} logprobs.content entries for {len(ids)} output tokens "
                             "(is sampling_params.logprobs set?)")
    out = []
    for i, (e, tok) in enumerate(zip(content, ids)):
        lp = e.get("logprob") if isinstance(e, dict) else None
        if not isinstance(e, dict) or e.get("token_id") != tok or not isinstance(lp, (int, float)) \
                or isinstance(lp, bool) or not math.isfinite(lp):
            raise MalformedReply(f"{where}: logprobs.content[{i}] must be {{token_id: {tok}, logprob: finite}}, "
                                 f"got {e!r:.80}")
        out.append(float(lp))
    return out


def _finish(where: str, reason: Any, stop_reason: Any, ids: list[int]) -> FinishReason:
    """vLLM's finish_reason (stop / length / abort) and stop_reason (the matched stop token id; None at EOS) as
    SGLang's {type, matched}: a stop matched the last output token either way."""
    if reason not in ("stop", "length", "abort"):
        return FinishReason("abort", message=f"finish_reason {reason!r}")
    if reason == "stop":
        matched = stop_reason if _is_int(stop_reason) else (ids[-1] if ids else None)
        return FinishReason("stop", matched=matched)
    return FinishReason(reason)


def decode_npy_experts(where: str, data: Any, rows: int, moe_shape: Optional[tuple[int, int]]) -> np.ndarray:
    """vLLM's routed_experts: base64 of an `.npy` array [rows, MoE layers, top_k] (uint8 / uint16 / int32), as int32."""
    if not isinstance(data, str):
        raise MalformedReply(f"{where}: no routed_experts in the answer (start vLLM with --enable-return-routed-experts)")
    try:
        arr = np.load(io.BytesIO(base64.b64decode(data.encode("ascii"), validate=True)), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise MalformedReply(f"{where}: routed_experts is not a base64 .npy array ({type(e).__name__}: {e})") from None
    if arr.ndim != 3 or arr.dtype.kind not in "iu":
        raise MalformedReply(f"{where}: routed_experts must be an integer array [tokens, layers, top_k], "
                             f"got {arr.dtype} {arr.shape}")
    if arr.shape[0] != rows:
        raise MalformedReply(f"{where}: routed_experts has {arr.shape[0]} rows, expected {rows} (seqlen - 1 - start)")
    if moe_shape is not None and tuple(arr.shape[1:]) != tuple(moe_shape):
        raise MalformedReply(f"{where}: routed_experts rows are {tuple(arr.shape[1:])} (layers, top_k), the model's "
                             f"are {tuple(moe_shape)}")
    return arr.astype(np.int32)


def encode_npy_experts(experts_NLK: np.ndarray) -> str:
    """vLLM's encoding (vllm.utils.serial_utils.numpy2base64): base64 of np.save's bytes."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(experts_NLK), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# --- processes ------------------------------------------------------------------------------------

def vllm_command(v, model_path: str, port: int, routed_experts: bool, seed: int = 0,
                 original_logprob: bool = False, language_model_only: bool = False) -> list[str]:
    """argv of one server from a `VLLMConfig` (vLLM 0.33.0 flags): `rollout.vllm.python` (or this interpreter) running
    our launcher (rollout/vllm/launcher.py: `vllm serve` plus our worker extension). No key here: the server reads
    $VLLM_API_KEY (vllm_env). `language_model_only` (Qwen3.5, a vision-language class in vLLM: `vllm_language_only`):
    --language-model-only, without which vLLM builds the multimodal processor at start-up, and that needs the
    tokenizer --skip-tokenizer-init leaves out (multimodal/processing/processor.py); it also keeps no vision tower
    that the pushes (text weights) would never fill."""
    argv = [
        v.python or sys.executable, "-m", LAUNCHER, "serve", model_path,
        "--host", v.host, "--port", str(port),
        "--tensor-parallel-size", str(v.tp), "--data-parallel-size", str(v.dp),
        "--gpu-memory-utilization", str(v.gpu_memory_utilization),
        "--dtype", v.dtype, "--seed", str(seed),
        "--logprobs-mode", "raw_logprobs" if original_logprob else "processed_logprobs",
        "--enable-scale-out",  # /inference/v1/generate: token ids in and out
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
        "--skip-tokenizer-init",  # token ids in and out: the weight-sync directories carry no tokenizer
        "--enable-prefix-caching" if v.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if language_model_only:
        argv.append("--language-model-only")
    if v.enable_expert_parallel:
        argv.append("--enable-expert-parallel")
    if v.enable_sleep_mode:
        argv.append("--enable-sleep-mode")
    if routed_experts:
        argv.append("--enable-return-routed-experts")
    if v.max_model_len:
        argv += ["--max-model-len", str(v.max_model_len)]
    return argv + list(v.extra_args)


def vllm_language_only(cfg) -> bool:
    """Whether the served model is a vision-language class in vLLM whose text model we train (Qwen3.5:
    Qwen3_5MoeForConditionalGeneration)."""
    return cfg.model.architecture.model_type == "qwen3_5_moe"


def vllm_env(key_env: str, base: Optional[dict] = None, python: Optional[str] = None) -> dict:
    """The server's environment: the RL / sleep / cache / RPC routes on (VLLM_SERVER_DEV_MODE=1), the job's key
    as $VLLM_API_KEY (vLLM's --api-key without the command line), and, for another interpreter (`python`: vLLM's
    own venv), this package on its PYTHONPATH (the launcher and the worker extension import from it)."""
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["VLLM_API_KEY"] = job_key(key_env)
    if python and python != sys.executable:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_path(), env.get("PYTHONPATH")) if p)
    return env


def package_path() -> str:
    """A directory holding only `megatron_search` (a link to this package), for another venv's PYTHONPATH: the
    folder this package sits in may be a site-packages whose other packages must not shadow vLLM's pins."""
    pkg = Path(__file__).resolve().parents[2]
    d = Path(tempfile.gettempdir()) / f"megatron-search-path-{hashlib.sha256(str(pkg).encode()).hexdigest()[:12]}"
    link = d / "megatron_search"
    if not link.exists():
        d.mkdir(parents=True, exist_ok=True)
        try:
            link.symlink_to(pkg, target_is_directory=True)
        except FileExistsError:  # another process made it first
            pass
    return str(d)


def launch_vllm_servers(cfg, output_dir: str | Path, model_path: Optional[str] = None,
                        routed_experts: bool = False) -> list[ServerProcess]:
    """Start `rollout.num_engines` vLLM servers on this host (each on its own GPUs) and wait until each is healthy."""
    v = cfg.rollout.vllm
    dummy = not (model_path or v.model_path)  # the policy is pushed before the first rollout
    model_path = model_path or v.model_path or str(cfg.model.engine_dir())
    servers: list[ServerProcess] = []
    try:
        for i in range(cfg.rollout.num_engines):
            port = v.base_port + ENGINE_PORT_STRIDE * i
            env = vllm_env(cfg.rollout.api_key_env, python=v.python)
            gpus = v.tp * v.dp
            visible = env.get("CUDA_VISIBLE_DEVICES")
            ids = visible.split(",") if visible else [str(g) for g in range(gpus * cfg.rollout.num_engines)]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i * gpus:(i + 1) * gpus])  # vLLM has no --base-gpu-id
            argv = vllm_command(v, model_path, port, routed_experts, seed=cfg.model.seed + i,
                                original_logprob=cfg.rollout.return_original_logprob,
                                language_model_only=vllm_language_only(cfg))
            if dummy:
                argv += ["--load-format", "dummy"]
            servers.append(ServerProcess(argv, Path(output_dir) / v.log_dir / f"server_{i}.log", env))
        for i, server in enumerate(servers):
            server.wait_healthy(f"http://{v.host}:{v.base_port + ENGINE_PORT_STRIDE * i}", v.startup_timeout_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def serve_argv(vllm_argv: Sequence[str], api_key_env: str, gpus: Optional[Sequence[int]] = None) -> list[str]:
    """argv that runs `vllm_argv` (vllm_command's, interpreter first) through this module's main: the key travels
    in $api_key_env, never in argv; `gpus` become CUDA_VISIBLE_DEVICES (vLLM has no --base-gpu-id)."""
    head = [sys.executable, "-m", "megatron_search.rollout.vllm.client", "--api-key-env", api_key_env]
    if gpus is not None:
        head += ["--gpus", ",".join(str(g) for g in gpus)]
    return head + ["--", *vllm_argv]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m megatron_search.rollout.vllm.client --api-key-env NAME [--gpus 0,1] -- <vllm_command's argv>`:
    exec it with VLLM_API_KEY from $NAME (generated for the job when unset), VLLM_SERVER_DEV_MODE=1 and the GPUs,
    so the Slurm plan's command line carries no key (rollout/sglang/serve.py does the same for SGLang)."""
    p = argparse.ArgumentParser(description="vLLM server with the job's API key from the environment")
    p.add_argument("--api-key-env", required=True, metavar="NAME")
    p.add_argument("--gpus", default=None, help="CUDA_VISIBLE_DEVICES for the server (comma-separated)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    if not rest:
        p.error("nothing to run after --")
    env = vllm_env(args.api_key_env, python=rest[0])
    if args.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = args.gpus
    os.execvpe(rest[0], rest, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
