"""Engine health and rollout dispatch (issue 25.1) against scripted engines that die, hang or refuse.

Every job must end once: in the results with its own task and seed, or lost with its error. The
expected routes (which engine each job's attempts ran on) follow from the failure injected, and the
seeds each engine was asked for are read back from the engines' own request logs.
"""
import asyncio

import pytest

from megatron_search.chat.format import ChatFormat
from megatron_search.chat.tokenizer import ChatEncoder, QwenTokenizer
from megatron_search.config.rollout import EngineHealthConfig
from megatron_search.rollout.agent.dispatch import Dispatcher
from megatron_search.rollout.agent.loop import AgentSettings, AgentTask, SearchAgent
from megatron_search.rollout.engine.base import EngineError
from megatron_search.rollout.engine.health import DOWN, STALE, UP, EngineHealth
from megatron_search.rollout.local.scripted import ScriptedEngine
from megatron_search.search.base import SearchBackend
from megatron_search.search.tool import SearchTool

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tok():
    return QwenTokenizer()


class NoSearch(SearchBackend):
    name = "none"

    def search(self, query, k):
        return []


class FaultyEngine(ScriptedEngine):
    """A scripted engine that can die (from its `die_at`-th request on), hang, or refuse one seed."""

    def __init__(self, tok, url: str, die_at=None, hang=False, refuse_seed=None, delay=0.0):
        answer = tok.encode("<answer>Paris</answer><|im_end|>")
        super().__init__(lambda ids: answer)
        self.base_url = url
        self.die_at, self.hang, self.refuse_seed, self.delay = die_at, hang, refuse_seed, delay
        self.calls, self.dead = 0, False

    async def generate(self, request):
        self.calls += 1
        if self.die_at is not None and self.calls >= self.die_at:
            self.dead = True
        if self.dead:
            raise EngineError(f"{self.base_url}/generate: ClientConnectorError: connection refused")
        if self.hang:
            await asyncio.Event().wait()
        if request.sampling.seed == self.refuse_seed:
            raise EngineError(f"{self.base_url}/generate: HTTP 400: input_ids: bad")
        await asyncio.sleep(self.delay)
        return await super().generate(request)

    async def health_generate(self):
        if self.dead:
            raise EngineError(f"{self.base_url}/health_generate: connection refused")
        if self.hang:
            await asyncio.Event().wait()

    async def health(self):
        return not self.dead and not self.hang

    async def close(self):
        return None


class Fleet:
    """Stands in for rollout.launch.RolloutEngines: `started` engines can be restarted (they come back alive)."""

    def __init__(self, clients, started, fail_restart=False):
        self.clients, self._started, self.fail_restart = clients, started, fail_restart
        self.router = None
        self.restarted: list[int] = []

    def started(self, i):
        return self._started[i]

    def restart(self, i):
        if self.fail_restart:
            raise EngineError("server exited with code 1 before becoming healthy")
        self.restarted.append(i)
        c = self.clients[i]
        c.dead = c.hang = False
        c.die_at = None


def setup(tok, engines, started=None, max_attempts=3, concurrency=64, **health):
    fleet = Fleet(engines, started or [True] * len(engines))
    settings = EngineHealthConfig(**{"heartbeat_interval_s": 10.0, "heartbeat_timeout_s": 1.0, **health})
    hl = EngineHealth(fleet, settings)
    enc = ChatEncoder(tok, ChatFormat("qwen3"))
    tool = SearchTool(NoSearch(), max_results=2, max_query_chars=250, max_calls=2)
    agents = [SearchAgent(e, enc, tool, AgentSettings(max_new_tokens=64, max_total_tokens=2048)) for e in engines]
    return fleet, hl, Dispatcher(agents, list(range(len(engines))), hl, max_attempts, concurrency)


def jobs_round_robin(n, n_agents):
    return [(j % n_agents, AgentTask(QUESTION, seed=1000 + j, metadata={"job": j})) for j in range(n)]


def first_turn_seeds(engine):
    return sorted(r.sampling.seed // 1000 for r in engine.requests)


def test_rollouts_of_a_dead_engine_run_again_on_a_live_one_exactly_once(tok):
    # engine 1 dies at its third request: its first two are still running and get cancelled when the failure
    # of the third shows (a probe fails), the rest fail at once; all six of its jobs move to engine 0
    e0, e1 = FaultyEngine(tok, "http://e0", delay=0.2), FaultyEngine(tok, "http://e1", die_at=3, delay=0.2)
    _, health, disp = setup(tok, [e0, e1])
    jobs = jobs_round_robin(12, 2)
    out = asyncio.run(disp.run(jobs))
    assert len(out) == 12 and all(r.rollout is not None and r.error is None for r in out)
    assert [r.rollout.metadata["job"] for r in out] == list(range(12))
    assert [r.agents for r in out] == [[0] if j % 2 == 0 else [1, 0] for j in range(12)]
    assert sum(r.retries for r in out) == 6
    # same task, same seed: engine 0 sampled every job's first turn once; engine 1 finished none
    assert first_turn_seeds(e0) == [1000 + j for j in range(12)] and e1.requests == []
    assert health.state == [UP, DOWN] and "connection refused" in health.reason[1]
    assert health.take_counts()["engine/marked_down"] == 1.0


def test_a_request_a_healthy_engine_refuses_is_lost_not_retried(tok):
    e0, e1 = FaultyEngine(tok, "http://e0"), FaultyEngine(tok, "http://e1", refuse_seed=1003 * 1000)
    _, health, disp = setup(tok, [e0, e1])
    out = asyncio.run(disp.run(jobs_round_robin(6, 2)))
    lost = [j for j, r in enumerate(out) if r.rollout is None]
    assert lost == [3] and out[3].agents == [1] and "HTTP 400" in str(out[3].error)
    assert all(r.retries == 0 for r in out)
    assert health.state == [UP, UP]
    assert first_turn_seeds(e1) == [1001, 1005]


def test_an_engine_that_hangs_misses_its_heartbeat_and_its_rollouts_move(tok):
    e0, e1 = FaultyEngine(tok, "http://e0"), FaultyEngine(tok, "http://e1", hang=True)
    _, health, disp = setup(tok, [e0, e1], heartbeat_interval_s=0.05, heartbeat_timeout_s=0.2)
    out = asyncio.run(asyncio.wait_for(disp.run(jobs_round_robin(6, 2)), 10))
    assert [r.agents for r in out] == [[0], [1, 0], [0], [1, 0], [0], [1, 0]]
    assert all(r.rollout is not None for r in out)
    assert health.state == [UP, DOWN] and health.reason[1] == "no heartbeat answer within 0.2 s"


def test_attempts_are_bounded_and_with_no_engine_serving_rollouts_are_lost(tok):
    engines = [FaultyEngine(tok, f"http://e{i}", die_at=1) for i in range(3)]
    _, health, disp = setup(tok, engines, max_attempts=2, concurrency=1)
    out = asyncio.run(disp.run(jobs_round_robin(4, 3)))
    assert all(r.rollout is None for r in out)
    # job 0: engine 0 dies, engine 1 dies (2 attempts, the limit); job 1: engine 1 is down, so it starts on the
    # least busy serving engine (2), which dies, and no engine is left; jobs 2, 3: nothing serves
    assert [r.agents for r in out] == [[0, 1], [2], [], []]
    assert str(out[3].error) == "no engine is serving"
    assert health.state == [DOWN, DOWN, DOWN]


def test_recovery_restarts_ours_waits_for_attached_and_bounds_restarts(tok):
    e0, e1, e2 = (FaultyEngine(tok, f"http://e{i}") for i in range(3))
    fleet, health, _ = setup(tok, [e0, e1, e2], started=[True, False, True], max_restarts=1, reattach_timeout_s=1.0)

    async def scenario():
        e0.dead = e1.dead = True  # engine 0 (ours) and 1 (attached) die between two updates
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, setattr, e1, "dead", False)  # the attached one is brought back by someone else
        live = await health.recover()
        assert live == {0: 1, 1: 1, 2: 0} and health.state == [STALE, STALE, UP]
        assert fleet.restarted == [0] and health.serving() == [2]
        health.synced(live)
        assert health.state == [UP, UP, UP]
        counts, gauges = health.take_counts(), health.gauges()
        assert (counts["engine/restarts"], counts["engine/marked_down"], gauges["engine/down"]) == (1.0, 2.0, 0.0)
        assert health.take_counts()["engine/restarts"] == 0.0  # taken
        e0.dead = True  # it dies again: max_restarts=1 is spent, it stays down (lost capacity)
        live = await health.recover()
        assert live == {1: 1, 2: 0} and health.state[0] == DOWN and health.unrecovered == {0}
        assert fleet.restarted == [0] and health.lost_share() == pytest.approx(1 / 3)
        assert health.gauges() == {"engine/down": 1.0, "engine/unrecovered": 1.0, "engine/restarts_total": 1.0}

    asyncio.run(scenario())


def test_a_failed_restart_or_an_attached_engine_not_back_is_unrecovered(tok):
    e0, e1 = FaultyEngine(tok, "http://e0"), FaultyEngine(tok, "http://e1")
    fleet, health, _ = setup(tok, [e0, e1], started=[True, False], reattach_timeout_s=0.2)
    fleet.fail_restart = True
    e0.dead = e1.dead = True
    live = asyncio.run(health.recover())
    assert live == {} and health.unrecovered == {0, 1} and health.lost_share() == 1.0
    assert health.take_counts()["engine/restart_failures"] == 1.0
