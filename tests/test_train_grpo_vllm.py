"""GRPO through vLLM's API on CPU (issue 23): rollout.engine=vllm with the local engine serving vLLM 0.33.0's
route subset (rollout.vllm.server=local), so every rollout, weight push, sleep and wake goes through VLLMClient.
Two steps with routing replay on: the agent loop over /inference/v1/generate, the colocated cycle (/sleep level 2,
/wake_up by tags), disk weight sync (/collective_rpc reload_weights + /update_weight_version), the engine's routed
experts replayed in training (agreement exactly 1)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_train_grpo import check_run, scalars  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    from _grpo_fixture import build

    return build(tmp_path_factory.mktemp("grpo_world_vllm"))


def test_grpo_two_steps_through_vllm_api(fx, tmp_path):
    from _grpo_fixture import grpo_worker
    from _mp import run_spawned

    layouts = [("vllm", ["rollout.engine=vllm", "rollout.vllm.server=local", "grpo.routing_replay=true"])]
    run_spawned(grpo_worker, 1, layouts, fx, str(tmp_path))
    run = tmp_path / "vllm"
    check_run(run, 2)  # rewards, finite losses, mismatch KL < 1e-3, weights trained, the colocated cycle
    # the engine served vLLM's routes only (SGLang's are not registered in that mode: any SGLang call would 404)
    engine_cfg = (run / "engines" / "rollout_engine_config.yaml").read_text()
    assert "engine: vllm" in engine_cfg and "server: local" in engine_cfg
    forced = scalars(run, "train/routing_agreement")
    assert forced and all(a == 1.0 for a in forced)
    # the weights reached the engine from disk (/collective_rpc reload_weights); only the served version is kept
    kept = sorted((run / "weight_sync").rglob("weights_v*"))
    assert len(kept) == 1 and list(kept[0].glob("*.safetensors")), kept
