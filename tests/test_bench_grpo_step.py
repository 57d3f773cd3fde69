"""tools/bench_grpo_step.py --micro-batches: the positions it prints for padded, cut and token-budget micro-batches
equal those counted here from the same lengths (sorting and grouping redone by hand, in plain Python)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]


def _expected(lengths, width, budget):
    order = sorted(lengths, reverse=True)
    cut = sum(order) / (len(order) * width)  # one row per micro-batch: each at its own length
    groups = []
    for n in order:
        if groups and (len(groups[-1]) + 1) * groups[-1][0] <= budget:
            groups[-1].append(n)
        else:
            groups.append([n])
    return cut, sum(len(g) * g[0] for g in groups) / (len(order) * width), len(groups)


def test_bench_prints_positions_against_the_longest():
    sys.path.insert(0, str(REPO / "tools"))
    from bench_grpo_step import rollout_lengths

    rows, width = 12, 48
    out = subprocess.run([sys.executable, str(REPO / "tools/bench_grpo_step.py"), "--micro-batches", "--rows",
                          str(rows), "--width", str(width), "--repeats", "1"], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.findall(r"positions vs longest ([0-9.]+) .*micro-batches +(\d+) .*time vs padded ([0-9.]+)", out.stdout)
    assert len(found) == 3, out.stdout
    cut, budget, groups = _expected(rollout_lengths(rows, width), width, 2 * width)
    assert float(found[0][0]) == 1.0 and float(found[0][2]) == 1.0
    assert float(found[1][0]) == pytest.approx(cut, abs=5e-4)
    assert float(found[2][0]) == pytest.approx(budget, abs=5e-4) and int(found[2][1]) == groups
    assert max(rollout_lengths(rows, width)) == width and cut < 0.9  # the case the bench is for: a long tail
