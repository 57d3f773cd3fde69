"""GRPO policy step on Megatron (1 process): the loss equals the recipe's objective computed
independently in float64, and neither micro-batching nor padding rows (mask 0, filling the last
micro-batch, or a whole micro-batch of them) change the loss or the gradient norm; at a sampling temperature T the engine's
logprobs are of logits / T, and so are the trained ones."""
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

sys.path.insert(0, str(Path(__file__).parent))


@pytest.mark.parametrize("overrides", [[], ["rollout.temperature=0.7"]], ids=["T1", "T0.7"])
def test_policy_update_matches_float64_objective(tmp_path, overrides):
    from _mp import run_spawned
    from _policy_step_worker import worker

    out = tmp_path / "r.json"
    run_spawned(worker, 1, overrides, str(out))
    r = json.loads(out.read_text())
    exp = r["expected_loss"]
    for run in ("4+0", "1+0", "3+2", "2+2"):
        assert abs(r[run]["loss"] - exp) <= 1e-5 * max(1.0, abs(exp)), (run, r)
        assert abs(r["4+0"]["grad_norm"] - r[run]["grad_norm"]) <= 1e-5 * r["4+0"]["grad_norm"], (run, r)
