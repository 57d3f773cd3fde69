"""The GRPO run of the chaos test (tests/test_grpo_chaos.py), in a spawned process; the parent kills an engine.

Runs the real loop (run_grpo) at world size 1. After every weight update it records, on the driver,
each serving engine's per-parameter sha256 (/local/weights_sha256) and the sha256 of the trainer's
own export (export_hf_weights, loaded into a differently seeded HF model, as
tests/_sync_worker.py does). Writes them with the run's outcome (finished, or the
LostCapacityError's message) to <out>/chaos_result.json.
"""
from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path


def engine_digest(url: str) -> dict:
    from megatron_search.rollout.engine.auth import bearer_header, key_from_env

    req = urllib.request.Request(f"{url}/local/weights_sha256", headers=bearer_header(key_from_env()))
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def trainer_digest(run) -> dict:
    """sha256 per parameter of the trainer's HF export (one process: the whole model is here)."""
    from megatron_search.rollout.local.runner import load_hf_model
    from megatron_search.rollout.local.weights import load_named_tensors, weights_sha256
    from megatron_search.weights.export import export_hf_weights

    model = load_hf_model(str(run.cfg.model.resolved_hf_config()), seed=4321)
    for bucket in export_hf_weights(run.trainer.model, run.cfg.model.architecture, run.cfg.weight_bucket_bytes(),
                                    run.ctx.groups):
        load_named_tensors(model, bucket)
    return weights_sha256(model)


def main(rank: int, world: int, port: int, fx: dict, out: str, steps: int, overrides: list) -> None:
    import torch.distributed as dist

    from _grpo_fixture import grpo_overrides
    from megatron_search.config import load_config
    from megatron_search.train.grpo import run_grpo
    from megatron_search.train.grpo_run import GRPORun, LostCapacityError

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result: dict = {"pushes": []}
    push = GRPORun.push_weights

    def push_and_read_engines(self, step=None):
        push(self, step)
        if self.is_driver:
            off = self.colocate.offloader  # colocated: the parameters left after the push; back for the digest
            gone = "params" in off.offloaded_kinds()
            if gone:
                off.reload(("params",))
            digest = trainer_digest(self)
            if gone:
                off.offload(("params",))
            h = self.driver.health
            result["pushes"].append({
                "step": step, "version": str(self.trainer.iteration), "state": list(h.state),
                "engines": [engine_digest(c.base_url) if h.state[i] == "up" else None
                            for i, c in enumerate(self.driver.engines)],
                "trainer": digest})

    GRPORun.push_weights = push_and_read_engines
    try:
        cfg = load_config(None, grpo_overrides(fx, Path(out), steps) + list(overrides))
        run_grpo(cfg)
        result["finished"] = True
    except LostCapacityError as e:
        result.update(finished=False, error=str(e))
    finally:
        GRPORun.push_weights = push
        dist.destroy_process_group()
    (Path(out) / "chaos_result.json").write_text(json.dumps(result))
