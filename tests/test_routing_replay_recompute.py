"""Routing replay under activation recomputation: the recomputed forward inside backward replays the
engine's experts, so the gradient is the one of the forward that computed the loss.

Same weights, same rollouts, experts forced to random choices (not what the router would pick).
Reference: the gradient with replay and no recomputation. Full recompute, selective recompute of
the MoE module, and pi_old passes (updates_per_batch=2, a forward-only pass first) must give it
bit for bit, at 1 process and at PP=2, where 1F1B runs a second micro-batch's forward before the
first one's backward (so a recompute that took the latest targets would route wrongly). The control,
the router's own choices, gives a clearly different gradient: the comparison can fail.
"""
from __future__ import annotations

import pytest
import torch

from _mp import run_spawned
from _replay_recompute_worker import worker

pytestmark = pytest.mark.multiprocess

ARCHS = {"qwen3_moe": "configs/models/tiny_qwen3_moe", "qwen3_5_moe": "configs/models/tiny_qwen3_5_moe"}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def runs(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"replay_{request.param}")
    (out / "1").mkdir()
    (out / "2").mkdir()
    run_spawned(worker, 1, ARCHS[request.param], [], str(out / "1"), str(out))
    run_spawned(worker, 2, ARCHS[request.param], ["parallel.pp=2"], str(out / "2"), str(out))
    return out


def _load(out, name, world, rank):
    return torch.load(out / str(world) / f"{name}_rank{rank}.pt")


def _max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) / (float(b[k].abs().max()) + 1e-30) for k in a)


@pytest.mark.parametrize("name", ["replay_full", "replay_selective_moe"])
@pytest.mark.parametrize("world", [1, 2])
def test_recomputed_forward_replays_the_engine_experts(runs, name, world):
    for rank in range(world):
        ref, got = _load(runs, "replay", world, rank), _load(runs, name, world, rank)
        bad = [k for k in ref if not torch.equal(ref[k], got[k])]
        assert not bad, (name, world, rank, bad[:5], _max_rel_diff(got, ref))


@pytest.mark.parametrize("world", [1, 2])
def test_pi_old_pass_then_updates_under_recompute(runs, world):
    for rank in range(world):
        ref, got = _load(runs, "replay_updates2", world, rank), _load(runs, "replay_full_updates2", world, rank)
        bad = [k for k in ref if not torch.equal(ref[k], got[k])]
        assert not bad, (world, rank, bad[:5])
        m = torch.load(runs / str(world) / f"metrics_rank{rank}.pt")
        assert m["replay_full_updates2"]["loss"] == m["replay_updates2"]["loss"]


@pytest.mark.parametrize("world", [1, 2])
def test_control_without_replay_differs(runs, world):
    for rank in range(world):
        assert _max_rel_diff(_load(runs, "natural_full", world, rank), _load(runs, "replay", world, rank)) > 1e-2
