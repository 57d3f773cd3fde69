"""Engine server subprocesses: one process group and one log file per server, a health wait, restart, stop.
Used by every launcher (SGLang, vLLM, the local engine server)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from megatron_search.rollout.engine.auth import bearer_header, key_from_env
from megatron_search.rollout.engine.base import EngineError

class ServerProcess:
    """One server subprocess (own process group, own log file) and its base URL."""

    def __init__(self, argv: list[str], log_path: str | Path, env: Optional[dict] = None):
        self.argv = argv
        self.env = env
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.url: Optional[str] = None
        self._start()

    def _start(self) -> None:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)

    def restart(self, timeout_s: float) -> str:
        """Kill what is left of the server (its whole process group: SGLang's scheduler processes too) and run the
        same command again, appending to the same log; wait until it is healthy at the same URL."""
        if self.url is None:
            raise EngineError(f"server (log {self.log_path}) never became healthy: there is no URL to restart it at")
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()
        self._start()
        return self.wait_healthy(self.url, timeout_s)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, url: str, timeout_s: float, poll_s: float = 0.5) -> str:
        """Poll GET {url}/health until 200; raise with the log tail if the process dies or time runs out.
        (SGLang leaves /health open under --api-key; the key, when the environment has one, goes along
        for servers that guard it, such as sglang-router.)"""
        deadline = time.monotonic() + timeout_s
        probe = urllib.request.Request(f"{url}/health", headers=bearer_header(key_from_env()))
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(f"server exited with code {self.proc.returncode} before becoming healthy "
                                  f"(log {self.log_path}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(probe, timeout=5) as r:
                    if r.status == 200:
                        self.url = url
                        return url
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(poll_s)
        self.stop()
        raise EngineError(f"server at {url} not healthy after {timeout_s:.0f} s (log {self.log_path}):\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's process group (ours: start_new_session), SIGKILL after `grace_s`."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


ENGINE_PORT_STRIDE = 10  # an SGLang server takes a few ports after its HTTP one
