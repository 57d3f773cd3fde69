"""Start the local engine server (rollout/local/server.py) as a subprocess and wait until it is healthy."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from megatron_search.rollout.engine.auth import check_key, client_key_env, job_key
from megatron_search.rollout.engine.base import EngineError
from megatron_search.rollout.engine.process import ServerProcess


def launch_local_server(config: Optional[str] = None, overrides: Sequence[str] = (), log_path: str | Path = "local_engine.log",
                        timeout_s: float = 120.0, tokenizer: Optional[str] = None, env: Optional[dict] = None,
                        host: str = "127.0.0.1", device: Optional[str] = None, api_key: Optional[str] = None,
                        api_key_env: Optional[str] = None, routed_experts: bool = False) -> ServerProcess:
    """Start the local engine server on `host` (free port; model on `device`, default CPU) and wait until it is healthy.

    It requires `api_key` (default: this job's key, `auth.job_key`), handed over in the environment variable
    `api_key_env` (default `auth.client_key_env()`, so clients of this process find it)."""
    port_file = Path(str(log_path) + ".port")
    port_file.unlink(missing_ok=True)
    key_env = api_key_env or client_key_env()
    env = dict(os.environ if env is None else env)
    env[key_env] = check_key(api_key, "launch_local_server(api_key=...)") if api_key else job_key(key_env)
    argv = [sys.executable, "-m", "megatron_search.rollout.local.server"]
    argv += ([config] if config else []) + list(overrides) + ["--host", host, "--port", "0", "--port-file", str(port_file),
                                                              "--api-key-env", key_env]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    if device:
        argv += ["--device", device]
    if routed_experts:
        argv.append("--enable-return-routed-experts")  # as SGLang's and vLLM's flag
    server = ServerProcess(argv, log_path, env)
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if server.proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise EngineError(f"local engine server did not start (log {log_path}):\n{server.log_tail()}")
        time.sleep(0.1)
    port = int(port_file.read_text())
    server.argv[server.argv.index("--port") + 1] = str(port)  # a restart (ServerProcess.restart) keeps the URL
    server.wait_healthy(f"http://{host}:{port}", max(1.0, deadline - time.monotonic()))
    return server
