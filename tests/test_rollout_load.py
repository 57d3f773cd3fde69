"""Load and faults (issue 25.4): 256 concurrent rollouts, a slow search backend, malformed engine replies.

1. The agent loop against a fake engine and a fake SearXNG (tests/_fault_servers.py, own process, 127.0.0.1):
   256 rollouts in flight at once (the engine holds first turns at a barrier until all 256 are in), one
   planned case per rollout: clean, search timeout, search HTTP 500, and seven engine faults (500, bad
   JSON, truncated body, NaN logprob, wrong types, dropped connection, no answer). Every rollout is either
   finished or lost with the class the plan predicts; nothing is left running or open afterwards.
2. The local engine server (tiny random Qwen3-MoE) under 256 concurrent rollouts while 16 clients send a
   /generate and hang up: every rollout finishes, the server keeps serving, its connections and file
   descriptors go back to where they were, and the client side leaks nothing.
Only "stops by itself" waits are timed (generous deadlines); every count is exact.
"""
import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from megatron_search.chat.format import ChatFormat
from megatron_search.chat.tokenizer import BPETokenizer, ChatEncoder, QwenTokenizer
from megatron_search.rollout.agent.loop import AgentSettings, AgentTask, SearchAgent
from megatron_search.rollout.engine.auth import bearer_header, key_from_env
from megatron_search.rollout.engine.base import EngineError, MalformedReply
from megatron_search.rollout.engine.failures import FAILURE_KINDS, RolloutFailed, failure_counts
from megatron_search.rollout.engine.types import GenerateRequest, Rollout, SamplingParams
from megatron_search.rollout.local.launch import launch_local_server
from megatron_search.rollout.local.scripted import ScriptedEngine
from megatron_search.rollout.sglang.client import SGLangClient
from megatron_search.search.base import SearchBackend, SearchResult
from megatron_search.search.searxng import SearxngBackend
from megatron_search.search.tool import SearchTool

N = 256
# case -> (search query kind of turn 0, engine fault, class the client must report)
CASES = {
    "clean": ("fast", None, None),
    "search_timeout": ("slow", None, None),
    "search_error": ("fail", None, None),
    "http_500": ("fast", "http_500", "engine_error"),
    "bad_json": ("fast", "bad_json", "malformed_reply"),
    "truncated": ("fast", "truncated", "engine_unreachable"),
    "nan_logprob": ("fast", "nan_logprob", "malformed_reply"),
    "wrong_types": ("fast", "wrong_types", "malformed_reply"),
    "drop": ("fast", "drop", "engine_unreachable"),
    "hang": ("fast", "hang", "engine_timeout"),
}
ENGINE_TIMEOUT_S = 8.0  # the client's request limit; only the "hang" case may reach it
SEARCH_TIMEOUT_S, SLOW_S = 0.3, 1.5


class NoSearch(SearchBackend):
    def search(self, query, k):
        return [SearchResult("t", "u", "s", "d")]


def json_call(query: str) -> str:
    return '<tool_call>\n{"name": "search_web", "arguments": {"query": "%s"}}\n</tool_call><|im_end|>' % query


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def tcp_to(ports: set[int], pid: int = None) -> int:
    """Established TCP connections of process `pid` (default this one) to or from `ports`."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED
               and ((c.raddr and c.raddr.port in ports) or (c.laddr and c.laddr.port in ports)))


async def settle(check, deadline_s: float = 30.0) -> bool:
    """Wait until `check()` holds: the "stops by itself" property, with a generous deadline."""
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.05)
    return True


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def plan_for(tok) -> tuple[list[str], dict]:
    """Case of each rollout and the fake engine's plan (turn ids; fault turn 0 or 1 alternately)."""
    names = list(CASES)
    cases = [names[i % len(names)] for i in range(N)]
    turns, faults = {}, {}
    for i, case in enumerate(cases):
        query, fault, _ = CASES[case]
        turns[i] = [tok.encode(json_call(f"{query} {i}")), tok.encode(f"<answer>A{i}</answer><|im_end|>")]
        if fault is not None:
            faults[i] = (i // len(names)) % 2, fault
    return cases, {"turns": turns, "faults": faults, "barrier": N, "barrier_timeout_s": 60.0, "slow_s": SLOW_S}


@pytest.fixture
def fault_servers(tmp_path):
    tok = QwenTokenizer()
    cases, plan = plan_for(tok)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    ports_file = tmp_path / "ports.json"
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_fault_servers.py")),
                             str(tmp_path / "plan.json"), str(ports_file)])
    try:
        deadline = time.monotonic() + 60
        while not ports_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "fake servers did not start"
            time.sleep(0.05)
        yield tok, cases, plan, json.loads(ports_file.read_text()), proc
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.multiprocess
def test_256_rollouts_under_faults_all_classified_nothing_leaks(fault_servers):
    tok, cases, plan, ports, proc = fault_servers
    engine_url, search_url = (f"http://127.0.0.1:{ports[k]}" for k in ("engine", "search"))
    settings = AgentSettings(max_new_tokens=64, max_total_tokens=4096, max_turns=4, concurrency=N)
    seen = {}

    async def go():
        gc.collect()  # what earlier tests left for the collector closes now, not during the count
        fds0, tasks0 = open_fds(), asyncio.all_tasks()
        client = SGLangClient(engine_url, timeout_s=ENGINE_TIMEOUT_S)
        backend = SearxngBackend(search_url, timeout_s=SEARCH_TIMEOUT_S, retries=1, backoff_s=0.01)
        agent = SearchAgent(client, ChatEncoder(tok, ChatFormat("qwen3")),
                            SearchTool(backend, max_results=3, call_timeout_s=30.0), settings)
        tasks = [AgentTask([{"role": "user", "content": f"question {i}"}], seed=i) for i in range(N)]
        start = time.monotonic()
        results = await agent.run_many(tasks, progress=False, return_failures=True)
        seen["run_s"] = time.monotonic() - start
        seen["tasks_left"] = asyncio.all_tasks() - tasks0
        seen["fds_open"], seen["conns_open"] = open_fds() - fds0, tcp_to(set(ports.values()))
        await client.close()
        await backend.aclose()
        seen["closed"] = await settle(lambda: open_fds() <= fds0 and tcp_to(set(ports.values())) == 0)
        seen["fds_after"], seen["tasks_after"] = open_fds() - fds0, asyncio.all_tasks() - tasks0
        return results

    results = asyncio.run(go())
    engine_stats, search_stats = get_json(f"{engine_url}/stats"), get_json(f"{search_url}/stats")

    # every rollout finished or lost with the class its case predicts
    assert len(results) == N
    want = dict.fromkeys(FAILURE_KINDS, 0)
    for case in cases:
        if CASES[case][2] is not None:
            want[CASES[case][2]] += 1
    assert failure_counts(results) == want
    assert want == {"engine_error": 26, "engine_unreachable": 51, "engine_timeout": 25, "malformed_reply": 76,
                    "internal": 0}
    for i, (case, r) in enumerate(zip(cases, results)):
        query, fault, kind = CASES[case]
        if kind is not None:
            assert isinstance(r, RolloutFailed) and (r.index, r.kind) == (i, kind), (i, case, r)
            continue
        assert isinstance(r, Rollout), (i, case, r)
        r.check()
        assert (r.stop_reason, r.final_answer, r.tool_calls) == ("answer", f"A{i}", 1)
        assert r.search_failures == {"search_timeout": int(query == "slow"), "search_error": int(query == "fail")}
        assert r.failed_executions == int(query != "fast")
        assert r.weight_versions == ["fake-0"]
    # the servers saw exactly the plan: 256 first turns at once, each fault once, two attempts per failed search
    assert engine_stats["peak_inflight"] == N
    injected = {f: sum(1 for c in cases if CASES[c][1] == f) for _, f, _ in CASES.values() if f}
    assert engine_stats["injected"] == injected
    n = {c: cases.count(c) for c in CASES}
    fault_turn1 = sum(1 for i, c in enumerate(cases) if CASES[c][1] and plan["faults"][i][0] == 1)
    assert engine_stats["requests"] == N + n["clean"] + n["search_timeout"] + n["search_error"] + fault_turn1
    assert search_stats["slow"] == 2 * n["search_timeout"] and search_stats["fail"] == 2 * n["search_error"]
    assert search_stats["fast"] == n["clean"] + fault_turn1
    # nothing left running or open, on either side
    assert seen["tasks_left"] == set() and seen["tasks_after"] == set()
    # <= 0: an earlier test's objects collected meanwhile may close fds of their own; a leak is a positive count
    assert seen["closed"] and seen["fds_after"] <= 0, seen
    assert asyncio.run(settle(lambda: get_json(f"{engine_url}/stats")["open_connections"] == 0))
    assert proc.poll() is None
    print(f"\nload: {N} rollouts in {seen['run_s']:.1f} s, peak in flight {engine_stats['peak_inflight']}, "
          f"failures {failure_counts(results)}, search {search_stats}, fds/conns open before close "
          f"{seen['fds_open']}/{seen['conns_open']}, after close {seen['fds_after']}/0")


# --- the pieces, one by one -------------------------------------------------------------------------------

GOOD = {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "v",
                                            "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]]}}


def with_meta(**meta):
    return {"output_ids": [5, 6], "meta_info": dict(GOOD["meta_info"], **meta)}


@pytest.mark.parametrize("body,match", [
    ([1, 2], "a JSON list, not an object"),
    ({"output_ids": [5, 6], "meta_info": [1]}, "meta_info is a list"),
    ({"output_ids": [5, True], "meta_info": GOOD["meta_info"]}, "output_ids must be a list of integers"),
    (with_meta(output_token_logprobs=[[-0.5, 5]]), "1 output_token_logprobs for 2 output ids"),
    (with_meta(output_token_logprobs=[[-0.5, 5], ["x", 6]]), r"output_token_logprobs\[1\] must be"),
    (with_meta(output_token_logprobs=[[-0.5, 5], [-0.1, 7]]), "token ids differ"),
    (with_meta(output_token_logprobs=[[-0.5, 5], [float("-inf"), 6]]), r"output_token_logprobs\[1\] is -inf"),
    (with_meta(finish_reason={"kind": "stop"}), "finish_reason must be"),
    (with_meta(prompt_tokens="12"), "meta_info.prompt_tokens must be an integer"),
])
def test_every_malformed_generate_answer_is_a_malformed_reply(body, match):
    client = SGLangClient("http://127.0.0.1:9")
    request = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4))
    assert asyncio.run(client._parse_generate(request, GOOD)).output_logprobs == [-0.5, -0.25]
    with pytest.raises(MalformedReply, match=match):
        asyncio.run(client._parse_generate(request, body))


def test_run_many_stops_cleanly_on_a_loss_and_classifies_in_process_failures():
    """Default mode: the first loss cancels the rollouts still running and is raised; nothing is left behind.
    With return_failures an in-process engine's refusal is engine_error and any other exception internal."""
    tok = QwenTokenizer()
    answer = tok.encode("<answer>x</answer><|im_end|>")
    started, cancelled = [], []

    class Engine(ScriptedEngine):
        async def generate(self, request):
            seed = request.sampling.seed // 1000
            started.append(seed)
            if seed == 0:
                raise EngineError("scripted engine is paused")
            if seed == 1:
                raise KeyError("a bug")
            try:
                await asyncio.sleep(0 if seed % 2 else 3600)  # even seeds would never finish
            except asyncio.CancelledError:
                cancelled.append(seed)
                raise
            return await super().generate(request)

    agent = SearchAgent(Engine(lambda ids: answer), ChatEncoder(tok, ChatFormat("qwen3")), SearchTool(NoSearch()),
                        AgentSettings(concurrency=4))
    tasks = [AgentTask([{"role": "user", "content": "q"}], seed=i) for i in range(8)]

    async def default_mode():
        with pytest.raises(EngineError, match="paused"):
            await agent.run_many(tasks, progress=False)
        return asyncio.all_tasks() - {asyncio.current_task()}

    assert asyncio.run(default_mode()) == set()
    sleepers = [seed for seed in started if seed % 2 == 0 and seed > 0]
    assert sleepers and sorted(cancelled) == sorted(sleepers)  # every rollout left in flight was cancelled

    async def classified():
        short = [t for t in tasks if t.seed % 2 or t.seed == 0]
        return await agent.run_many(short, progress=False, return_failures=True)

    results = asyncio.run(classified())
    assert [type(r).__name__ for r in results] == ["RolloutFailed", "RolloutFailed", "Rollout", "Rollout", "Rollout"]
    assert (results[0].kind, results[1].kind) == ("engine_error", "internal")
    assert failure_counts(results) == {"engine_error": 1, "engine_unreachable": 0, "engine_timeout": 0,
                                       "malformed_reply": 0, "internal": 1}


# --- 2. the local engine server under load ---------------------------------------------------------------

WORDS = "the of and a to in is was for on that with as by search web answer question paris capital river city".split()
HANGUPS = 16


@pytest.fixture(scope="module")
def bpe():
    """A BPE tokenizer filling the tiny model's 2,048 ids (as tests/test_rollout_http.py builds it)."""
    rng = random.Random(0)
    words = WORDS + ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                     for _ in range(4000)]
    tok = BPETokenizer.train([" ".join(rng.choice(words) for _ in range(50)) for _ in range(800)], vocab_size=2048)
    return tok


class CountingClient(SGLangClient):
    """Counts /generate calls in flight (the agent's real concurrency at the server)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.inflight = self.peak = 0

    async def generate(self, request):
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            return await super().generate(request)
        finally:
            self.inflight -= 1


async def hang_up(port: int, n_ids: int) -> None:
    """Send one /generate and close without reading the answer."""
    body = json.dumps({"input_ids": list(range(1, n_ids + 1)), "sampling_params": {"max_new_tokens": 16}}).encode()
    auth = "".join(f"{k}: {v}\r\n" for k, v in bearer_header(key_from_env()).items())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


@pytest.mark.multiprocess
def test_local_server_256_concurrent_rollouts_and_hangups(bpe, tmp_path):
    server = launch_local_server(None, ["rollout.local.seed=0", f"rollout.local.max_running_requests={N}"],
                                 tmp_path / "engine.log", timeout_s=300)
    port = int(server.url.rsplit(":", 1)[1])
    pid = server.proc.pid
    settings = AgentSettings(max_new_tokens=6, max_total_tokens=1024, max_turns=2, concurrency=N)
    seen = {}

    async def go():
        warm = SGLangClient(server.url)
        await warm.generate(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=2)))
        await warm.close()
        assert await settle(lambda: tcp_to({port}, pid) == 0)
        server_fds0 = psutil.Process(pid).num_fds()
        gc.collect()  # what earlier tests left for the collector closes now, not during the count
        fds0, tasks0 = open_fds(), asyncio.all_tasks()
        client = CountingClient(server.url)
        agent = SearchAgent(client, ChatEncoder(bpe, ChatFormat("qwen3")), SearchTool(NoSearch()), settings)
        tasks = [AgentTask([{"role": "user", "content": f"question {i}: {WORDS[i % len(WORDS)]}"}], seed=i)
                 for i in range(N)]
        start = time.monotonic()
        results, *_ = await asyncio.gather(agent.run_many(tasks, progress=False, return_failures=True),
                                           *(hang_up(port, 64 + i) for i in range(HANGUPS)))
        seen["run_s"] = time.monotonic() - start
        seen["tasks_left"] = asyncio.all_tasks() - tasks0
        seen["conns_open"] = tcp_to({port})
        after = await client.generate(GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0.0)))
        seen["serving"] = len(after.output_ids) == 3 and await client.health()
        await client.close()
        seen["client_closed"] = await settle(lambda: open_fds() <= fds0 and tcp_to({port}) == 0)
        seen["server_closed"] = await settle(
            lambda: tcp_to({port}, pid) == 0 and psutil.Process(pid).num_fds() <= server_fds0, deadline_s=60)
        seen["server_fds"] = (server_fds0, psutil.Process(pid).num_fds())
        seen["tasks_after"] = asyncio.all_tasks() - tasks0
        return results, client.peak

    try:
        results, peak = asyncio.run(go())
        alive = server.proc.poll() is None
    finally:
        server.stop()
    assert failure_counts(results) == dict.fromkeys(FAILURE_KINDS, 0), [r for r in results if not isinstance(r, Rollout)][:3]
    assert peak == N
    for r in results:
        r.check()
        assert 1 <= r.num_model_tokens <= 2 * settings.max_new_tokens and r.weight_versions == ["default"]
    assert alive and seen["serving"]
    assert seen["tasks_left"] == set() and seen["tasks_after"] == set()
    assert seen["client_closed"] and seen["server_closed"], seen
    print(f"\nlocal server: {N} rollouts + {HANGUPS} hang-ups in {seen['run_s']:.1f} s, peak in flight {peak}, "
          f"client conns open before close {seen['conns_open']}, server fds before/after {seen['server_fds']}")
