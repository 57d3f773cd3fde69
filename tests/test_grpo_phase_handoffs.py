"""GRPO's phase hand-offs on 2 gloo processes: which group each uses, and a stop signal agreed across ranks.

While rank 0 (the driver) rolls out, packs the batch or evaluates, the other ranks wait in the hand-off that
follows. On a GPU cluster that wait must not be an NCCL collective (a kernel spinning beside the engines'
decode, killed by the watchdog after 600 s): every hand-off goes over the host group (gloo, long timeout,
distributed/init.host_group). A SIGUSR1 that reaches one rank only stops every rank at the same point, each
saving its part of the same checkpoint (a rank saving while another starts a step would hang both): between
steps, or during the rollouts (the longest phase), with a checkpoint of the step's start.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = [pytest.mark.e2e, pytest.mark.multiprocess]


def _worker(rank: int, world: int, port: int, fx: dict, root: str) -> None:
    import os
    import signal

    import torch.distributed as dist

    from _grpo_fixture import grpo_overrides
    from megatron_search.config import load_config
    from megatron_search.distributed import init as dist_init
    from megatron_search.train import batch_scatter, grpo_run
    from megatron_search.train.grpo import run_grpo

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    calls = []

    def spy(name, fn):
        def wrapped(*args, group=None, **kw):
            host = dist_init.host_group()
            calls.append({"call": name, "caller": sys._getframe(1).f_code.co_name,
                          "host_group": group is host and host is not None and host is not dist.group.WORLD})
            return fn(*args, group=group, **kw)
        return wrapped

    grpo_run.dist.broadcast_object_list = spy("broadcast_object_list", dist.broadcast_object_list)
    grpo_run.coll.all_reduce = spy("all_reduce", grpo_run.coll.all_reduce)
    batch_scatter.dist.broadcast_object_list = grpo_run.dist.broadcast_object_list
    end_step, check_capacity = grpo_run.GRPORun.end_step, grpo_run.GRPORun.check_capacity
    when = {}

    def end_step_then_signal(self, step):
        end_step(self, step)
        if rank == 1 and when["at"] == "between_steps" and step == 0:  # one rank only, between its checks
            os.kill(os.getpid(), signal.SIGUSR1)

    def signal_during_rollouts(self, step):
        if rank == 1 and when["at"] == "during_rollouts" and step == 1:  # while the driver rolls out step 1
            os.kill(os.getpid(), signal.SIGUSR1)
        check_capacity(self, step)

    grpo_run.GRPORun.end_step = end_step_then_signal
    grpo_run.GRPORun.check_capacity = signal_during_rollouts
    try:
        for at in ("between_steps", "during_rollouts"):
            when["at"] = at
            calls.clear()
            cfg = load_config(None, grpo_overrides(fx, Path(root) / at, steps=3) + [f"parallel.world_size={world}",
                                                                                  "parallel.ep=2"])
            run_grpo(cfg)
            (Path(root) / at / f"rank{rank}.json").write_text(json.dumps({"calls": list(calls)}))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    from _grpo_fixture import build

    return build(tmp_path_factory.mktemp("handoff_world"))


def test_handoffs_use_the_host_group_and_a_one_rank_signal_stops_every_rank(fx, tmp_path):
    from _mp import run_spawned

    run_spawned(_worker, 2, fx, str(tmp_path), timeout_s=300)
    # between steps: after step 0 on both ranks (3 steps were asked for), one checkpoint of iteration 1. During
    # step 1's rollouts: a checkpoint of step 1's start (iteration 1: the policy untouched), and no step 1 update.
    for at in ("between_steps", "during_rollouts"):
        saved = sorted(p.name for p in (tmp_path / at / "checkpoints").glob("step_*"))
        assert saved == ["step_00000001"], (at, saved)
        trainer = json.loads((tmp_path / at / "checkpoints" / "step_00000001" / "trainer.json").read_text())
        assert trainer["iteration"] == 1, at
    assert not (tmp_path / "during_rollouts" / "final_weights").exists()  # it stopped before the last step
    ranks = [json.loads((tmp_path / "between_steps" / f"rank{r}.json").read_text()) for r in range(2)]
    for r, got in enumerate(ranks):
        # the hand-offs: every object broadcast and the stop vote of the loop, and the batch scatter's first
        # message (whether there is a batch: the others wait for it while the driver scores and packs); the
        # scatter's later collectives carry the batch itself, between ranks that are all ready
        handoffs = [c for c in got["calls"] if c["caller"] in ("_broadcast", "_any_rank")]
        scatter = [c for c in got["calls"] if c["caller"] == "scatter" and c["call"] == "broadcast_object_list"]
        assert {c["caller"] for c in handoffs} == {"_broadcast", "_any_rank"} and scatter, (r, got["calls"])
        off_host = [c for c in handoffs if not c["host_group"]]
        assert not off_host, (r, off_host)
        assert scatter[0]["host_group"], (r, scatter)
