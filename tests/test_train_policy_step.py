"""GRPO policy step on Megatron (1 process): the loss equals the recipe's objective computed
independently in float64, and neither micro-batching, padding rows (mask 0, filling the last
micro-batch, or a whole micro-batch of them), cutting each micro-batch to its longest row nor a token budget
change the loss or the gradient norm; the positions computed are counted by hand; at a sampling temperature T the
engine's logprobs are of logits / T, and so are the trained ones."""
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

sys.path.insert(0, str(Path(__file__).parent))

# Rows end their trained tokens at 16, 5, 9, 2 of 16 positions; "+2" adds two padding rows (length 0, width 1).
# positions computed / (rows x 16), and micro-batches, by hand from the grouping longest-first:
POSITIONS = {
    "4+0": (64 / 64, 1),  # one micro-batch [16, 9, 5, 2] at width 16
    "1+0": ((16 + 9 + 5 + 2) / 64, 4),  # each row at its own length
    "3+2": ((3 * 16 + 3 * 2) / 96, 2),  # [16, 9, 5] at 16, [2, 0, 0] at 2
    "2+2": ((2 * 16 + 2 * 5 + 2 * 1) / 96, 3),  # [16, 9], [5, 2], [0, 0] at one position
    "2+0 untrimmed": (1.0, 2),
    "budget20": ((16 + 2 * 9 + 2) / 64, 3),  # [16], [9, 5] (2 x 9 = 18 <= 20), [2]
    "budget20+2": ((16 + 2 * 9 + 3 * 2) / 96, 3),  # [16], [9, 5], [2, 0, 0] (3 x 2 <= 20)
}


@pytest.mark.parametrize("overrides", [[], ["rollout.temperature=0.7"],
                                       ["grpo.loss_aggregation=seq_mean_token_sum_norm"],
                                       ["grpo.loss_aggregation=token_mean"]],
                         ids=["T1", "T0.7", "sum_norm", "token_mean"])
def test_policy_update_matches_float64_objective(tmp_path, overrides):
    from _mp import run_spawned
    from _policy_step_worker import worker

    out = tmp_path / "r.json"
    run_spawned(worker, 1, overrides, str(out))
    r = json.loads(out.read_text())
    exp = r["expected_loss"]
    for run, (ratio, count) in POSITIONS.items():
        assert abs(r[run]["loss"] - exp) <= 1e-5 * max(1.0, abs(exp)), (run, r)
        assert abs(r["4+0"]["grad_norm"] - r[run]["grad_norm"]) <= 1e-5 * r["4+0"]["grad_norm"], (run, r)
        assert r[run]["positions_vs_longest"] == pytest.approx(ratio, rel=1e-12), (run, r[run])
        assert r[run]["micro_batches"] == count, (run, r[run])
    # one micro-batch: the logged entropy is the trained tokens' mean entropy of softmax(logits / T), float64
    ent = r["expected_entropy"]
    assert 0 < ent and abs(r["4+0"]["entropy"] - ent) <= 1e-5 * ent, (r["4+0"]["entropy"], ent)


@pytest.mark.parametrize("ep", [1, 2])
def test_policy_update_two_data_parallel_ranks(tmp_path, ep):
    """Ranks with rows of different lengths: each cuts its own micro-batches (EP=1), or both agree on each
    micro-batch's width (EP=2 under the allgather dispatcher, which gathers equal shapes over the expert group);
    a token budget agrees on the micro-batch count (rank 1 splits its [4, 3, 2] to make 3). The loss is the
    float64 objective of all 8 rows and the gradient norm that of the untrimmed run."""
    from _mp import run_spawned
    from _policy_step_worker import worker_dp

    out = tmp_path / "r.json"
    run_spawned(worker_dp, 2, [f"parallel.ep={ep}"], str(out))
    r = json.loads(out.read_text())
    exp, ref = r["expected_loss"], r["4 untrimmed"]
    for run in ("4 untrimmed", "1", "2") + (("budget20",) if ep == 1 else ()):
        assert abs(r[run]["loss"] - exp) <= 1e-5 * max(1.0, abs(exp)), (run, r)
        assert abs(r[run]["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"], (run, r)
    # positions over both ranks / (8 rows x 16), by hand
    if ep == 1:
        assert r["1"]["positions_vs_longest"] == pytest.approx((16 + 9 + 5 + 2 + 16 + 4 + 3 + 2) / 128)
        assert r["budget20"]["micro_batches"] == 3
        assert r["budget20"]["positions_vs_longest"] == pytest.approx((16 + 18 + 2 + 16 + 4 + 2 * 3) / 128)
    else:  # widths agreed per micro-batch: max(16, 16), max(9, 4), max(5, 3), max(2, 2)
        assert r["1"]["positions_vs_longest"] == pytest.approx(2 * (16 + 9 + 5 + 2) / 128)
        assert "allgather" in r["budget20"]["error"]
