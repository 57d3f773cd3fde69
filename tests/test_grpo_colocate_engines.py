"""The colocated cycle's engine bookkeeping (train/grpo_colocate.py) against scripted engines: an engine marked
down while alive is released best effort; when it answers again before a push it is the same process (an
attached engine) and gets its weights back, while a restarted one (started by this job) holds its whole memory
and has its KV cache released until after the push; every release is pause -> release -> continue."""
import asyncio
from pathlib import Path
from types import SimpleNamespace

import torch

from megatron_search.config import load_config
from megatron_search.rollout.engine.base import EngineError
from megatron_search.train.grpo_colocate import ColocatedCycle


class Engine:
    def __init__(self, fail_release: bool = False):
        self.calls, self.fail_release = [], fail_release

    async def pause_generation(self, mode):
        self.calls.append(("pause", mode))

    async def release_memory_occupation(self, tags):
        if self.fail_release:
            raise EngineError("release refused")
        self.calls.append(("release", tuple(tags)))

    async def resume_memory_occupation(self, tags):
        self.calls.append(("resume", tuple(tags)))

    async def continue_generation(self):
        self.calls.append(("continue",))


def _cycle(engines, started=lambda i: False):
    health = SimpleNamespace(state=["up"] * len(engines), incarnation=[0] * len(engines), marked=[])
    health.serving = lambda: [i for i, s in enumerate(health.state) if s != "down"]
    health.mark_down = lambda i, why: (health.marked.append(i), health.state.__setitem__(i, "down"))
    driver = SimpleNamespace(engines=engines, rollout_engines=SimpleNamespace(started=started), health=health,
                             run=asyncio.run)
    trainer = SimpleNamespace(ddp=[torch.nn.Linear(2, 2)], optimizer=None)
    cfg = load_config(None, ["rollout.mode=colocated"])
    return ColocatedCycle(cfg, trainer, driver, Path("unused"), True), health


def test_a_down_engine_released_while_alive_gets_its_weights_back_when_it_answers_again():
    engines = [Engine(), Engine()]
    cycle, health = _cycle(engines)
    cycle.released = cycle._release(["weights", "kv_cache"], {0: 0})
    assert engines[0].calls == [("pause", "abort"), ("release", ("weights", "kv_cache")), ("continue",)]
    health.state[1] = "down"  # missed a heartbeat, still alive
    cycle._release_down()
    assert engines[1].calls == engines[0].calls and cycle.released_down == {1: 0}
    health.state[1], health.incarnation[1] = "up", 1  # answers again (attached: the same process)
    engines[1].calls.clear()
    cycle.adopt_restarted({0: 0, 1: 1}, step=3)
    assert engines[1].calls == [("resume", ("weights",))] and cycle.released == {0: 0, 1: 1}
    assert not cycle.released_down and engines[0].calls[-1] == ("continue",)  # engine 0 untouched


def test_a_restarted_engine_keeps_its_weights_and_releases_its_kv_cache_until_after_the_push():
    engines = [Engine(), Engine()]
    cycle, health = _cycle(engines, started=lambda i: True)
    cycle.released = {0: 0, 1: 0}
    health.incarnation[1] = 1  # started again by this job: a new process holding its whole memory
    cycle.adopt_restarted({0: 0, 1: 1}, step=2)
    assert engines[1].calls == [("pause", "abort"), ("release", ("kv_cache",)), ("continue",)]
    assert cycle.released == {0: 0, 1: 1} and engines[0].calls == []
    assert [m.name for m in cycle.ledger.moments] == ["push: engine restarted"]


def test_an_engine_that_fails_its_release_is_marked_down_and_not_left_paused():
    engines = [Engine(fail_release=True)]
    cycle, health = _cycle(engines)
    assert cycle._release(["weights", "kv_cache"], {0: 0}) == {}
    assert health.marked == [0] and engines[0].calls == [("pause", "abort"), ("continue",)]
