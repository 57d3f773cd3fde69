"""LR schedule values computed by hand."""
from __future__ import annotations

import math

import pytest

from megatron_search.trainer.lr import lr_at


def test_warmup_then_constant():
    assert [lr_at(s, 1.0, 0.0, "constant", 4, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_and_linear_decay_reach_min_lr_at_the_last_step():
    # warmup 2, total 7: decay over steps 2..6 (4 intervals)
    cos = [lr_at(s, 1.0, 0.1, "cosine", 2, 7) for s in range(9)]
    assert cos[:3] == [0.5, 1.0, 1.0]
    assert cos[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # halfway: 0.55
    assert cos[6] == pytest.approx(0.1) and cos[8] == pytest.approx(0.1)
    lin = [lr_at(s, 1.0, 0.2, "linear", 0, 5) for s in range(5)]
    assert lin == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])


def test_bad_schedule_and_step():
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_at(0, 1.0, 0.0, "exp", 0, 10)
    with pytest.raises(ValueError, match="step -1"):
        lr_at(-1, 1.0, 0.0, "constant", 0, 10)
