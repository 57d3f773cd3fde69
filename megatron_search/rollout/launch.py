"""Start (or attach to) the rollout engines a config asks for and hand back one client per engine.

- `rollout.engine_urls` set: attach to running servers (disaggregated), start nothing.
- `rollout.engine = "local"`: `rollout.num_engines` local CPU engine servers (processes).
- `rollout.engine = "sglang"`: SGLang servers (`rollout.sglang`), optionally behind sglang-router.
- `rollout.engine = "vllm"`: vLLM servers (`rollout.vllm`), or local engines serving vLLM's API; `VLLMClient`s.
Every client is an `SGLangClient` (VLLMClient is one); callers never branch on the engine kind.

Every engine is authenticated with the key in `$rollout.api_key_env`: attached engines must already
hold it; engines started here get it (generated for the job when the variable is unset, and exported
so later processes and clients of this one share it) through the environment (rollout/engine/auth.py).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_search.config import dump_config
from megatron_search.rollout.engine.auth import job_key, key_from_env, use_key_env
from megatron_search.rollout.engine.process import ServerProcess
from megatron_search.rollout.local.launch import launch_local_server
from megatron_search.rollout.sglang.client import SGLangClient, launch_router, launch_sglang_servers
from megatron_search.rollout.vllm.client import VLLMClient, launch_vllm_servers


@dataclass
class RolloutEngines:
    """Clients for the engines, and the server processes this call started (stopped by `close`)."""

    clients: list[SGLangClient]  # one per server: weight updates, flush, pause go to all of them
    servers: list[ServerProcess] = field(default_factory=list)
    router: Optional[SGLangClient] = None  # sglang-router in front of the servers, when configured
    restart_timeout_s: float = 120.0  # health wait of a restarted server (rollout.local / rollout.sglang startup)

    def started(self, i: int) -> bool:
        """Whether this job started engine i's server (it can be restarted) or only attached to it."""
        return i < len(self.servers) and self.servers[i].url == self.clients[i].base_url

    def restart(self, i: int) -> None:
        """Blocking: engine i's server killed (what is left of it) and started again at the same URL."""
        if not self.started(i):
            raise ValueError(f"engine {i} ({self.clients[i].base_url}) was attached, not started by this job")
        self.servers[i].restart(self.restart_timeout_s)

    def for_generation(self) -> list[SGLangClient]:
        """Where to send /generate: the router if there is one, else every server (spread by the caller)."""
        return [self.router] if self.router is not None else list(self.clients)

    async def aclose(self) -> None:
        for c in self.clients + ([self.router] if self.router else []):
            await c.close()
        self.stop_servers()

    def stop_servers(self) -> None:
        for s in reversed(self.servers):
            s.stop()
        self.servers = []


def start_engines(cfg, output_dir: str | os.PathLike, routed_experts: bool = False) -> RolloutEngines:
    """Engines for `cfg` (see module doc); logs and the resolved config go under `output_dir`. `routed_experts`:
    servers started here record each token's experts (--enable-return-routed-experts), for routing replay or
    agreement; engines at rollout.engine_urls must have been started so."""
    r = cfg.rollout
    arch = cfg.model.architecture
    moe_shape = (arch.num_layers, arch.moe_top_k) if arch.num_experts else None
    timeout = r.sglang.request_timeout_s
    use_key_env(r.api_key_env)  # clients built from URLs alone (weight sync, references) read the same variable
    if r.engine == "vllm":  # vLLM servers, or the local engine serving vLLM's API (rollout/vllm/client.py)
        return start_vllm_engines(cfg, output_dir, moe_shape, routed_experts)
    if r.engine_urls:
        key = key_from_env(r.api_key_env)
        return RolloutEngines([SGLangClient(u, timeout, moe_shape, tp_size=r.sglang.tp, api_key=key)
                               for u in r.engine_urls])
    key = job_key(r.api_key_env)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if r.engine == "local":
        servers = _launch_local_servers(cfg, out, key, routed_experts, "local_engine")
        return RolloutEngines([SGLangClient(s.url, timeout, moe_shape, api_key=key) for s in servers], servers,
                              restart_timeout_s=r.local.startup_timeout_s)
    servers = launch_sglang_servers(cfg, out, routed_experts=routed_experts)
    if r.sglang.use_router and len(servers) > 1:
        try:
            router = launch_router([s.url for s in servers], r.sglang.host, r.sglang.router_port,
                                   out / r.sglang.log_dir / "router.log", api_key_env=r.api_key_env)
        except BaseException:
            for s in servers:
                s.stop()
            raise
        clients = [SGLangClient(s.url, timeout, moe_shape, "sglang", tp_size=r.sglang.tp, api_key=key) for s in servers]
        return RolloutEngines(clients, servers + [router],
                              SGLangClient(router.url, timeout, moe_shape, "sglang", api_key=key),
                              restart_timeout_s=r.sglang.startup_timeout_s)
    return RolloutEngines([SGLangClient(s.url, timeout, moe_shape, "sglang", tp_size=r.sglang.tp, api_key=key)
                           for s in servers], servers, restart_timeout_s=r.sglang.startup_timeout_s)


def _launch_local_servers(cfg, out: Path, key: str, routed_experts: bool, log_stem: str) -> list[ServerProcess]:
    """rollout.num_engines local engine servers reading `cfg` (written once under `out`), started together."""
    r = cfg.rollout
    config_path = out / "rollout_engine_config.yaml"
    tmp = config_path.with_suffix(".tmp")
    tmp.write_text(dump_config(cfg))
    os.replace(tmp, config_path)

    def launch(i: int) -> ServerProcess:
        return launch_local_server(str(config_path), [], out / f"{log_stem}_{i}.log", r.local.startup_timeout_s,
                                   host=r.local.host, api_key=key, api_key_env=r.api_key_env,
                                   routed_experts=routed_experts)

    return _launch_together(launch, r.num_engines)


def _launch_together(launch, n: int) -> list[ServerProcess]:
    """launch(0..n-1) at once (each blocks until its server is healthy; they load their models side by side);
    if any fails, the others are stopped and the first error raised."""
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(launch, i) for i in range(n)]
        wait(futures)
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for f in futures:
            if f.exception() is None:
                f.result().stop()
        raise failed[0]
    return [f.result() for f in futures]


def start_vllm_engines(cfg, output_dir: str | os.PathLike, moe_shape: Optional[tuple[int, int]],
                       routed_experts: bool = False) -> RolloutEngines:
    """rollout.engine=vllm for launch.start_engines: attach to rollout.engine_urls, or start `rollout.num_engines`
    vLLM servers (rollout.vllm.server=vllm) or local engine servers speaking vLLM's API (server=local)."""
    r = cfg.rollout
    timeout = r.vllm.request_timeout_s
    if r.engine_urls:
        key = key_from_env(r.api_key_env)
        return RolloutEngines([VLLMClient(u, timeout, moe_shape, api_key=key) for u in r.engine_urls])
    key = job_key(r.api_key_env)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if r.vllm.server == "vllm":
        servers = launch_vllm_servers(cfg, out, routed_experts=routed_experts)
    else:  # the servers read rollout.engine=vllm from the config: vLLM's API
        servers = _launch_local_servers(cfg, out, key, routed_experts, "local_vllm_engine")
    return RolloutEngines([VLLMClient(s.url, timeout, moe_shape, api_key=key) for s in servers], servers)
