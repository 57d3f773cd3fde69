"""Reward model under the policy's layouts (2 gloo processes): TP=2 + sequence parallel, EP=2 and
PP=2 give the 1-process last-token values, symmetric-BT loss, grad norm and the logged accuracy /
margin sums (reduced over DP and PP) from the same weights."""
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from _mp import run_spawned
    from _rm_parallel_worker import layouts_worker, reference_worker

    out = tmp_path_factory.mktemp("rm_parallel")
    run_spawned(reference_worker, 1, str(out))
    run_spawned(layouts_worker, 2, str(out))
    ref = json.loads((out / "reference.json").read_text())
    return ref, [json.loads((out / f"layouts_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("layout", ["tp2_sp", "ep2", "pp2"])
def test_rm_layout_matches_one_process(runs, layout):
    ref, ranks = runs
    assert len(set(ref["values"])) == len(ref["values"])  # distinct rows, distinct values
    for r in ranks:
        got = r[layout]
        assert got["values"] == pytest.approx(ref["values"], abs=1e-5), (layout, got["values"], ref["values"])
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4), layout
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), layout
        assert got["pairs"] == ref["pairs"] == 4 and got["correct"] == ref["correct"], layout
        assert got["margin_sum"] == pytest.approx(ref["margin_sum"], abs=1e-5), layout
