"""SearXNG backend against a local aiohttp server on 127.0.0.1: parsing, retries, timeouts, errors.

A stalling or failing server must give a tool error result and e_i += 1, never a crash.
"""
import asyncio
import threading
import time

import pytest
from aiohttp import web

from megatron_search.search import SearchBackendError, SearchTool, ToolCall, build_backend
from megatron_search.search.searxng import SearxngBackend
from megatron_search.config.rollout import SearchConfig

PAYLOAD = {"query": "q", "results": [
    {"title": "First", "url": "https://a.example/1", "content": "first snippet"},
    {"title": "", "url": "https://a.example/2", "content": None},
    {"title": "no url"},
    {"title": "Third", "url": "https://a.example/3", "content": "third"},
]}


class FakeSearxng:
    """aiohttp app in a background thread; `mode` picks the behaviour, `hits` counts requests."""

    def __init__(self):
        self.mode = "ok"
        self.hits = self.inflight = self.peak = 0
        self.seen = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10), "test server did not start"

    async def handle(self, request):
        self.hits += 1
        self.seen.append((dict(request.query), request.headers.get("Authorization")))
        if self.mode == "stall":
            await asyncio.sleep(3)
        if self.mode == "delay":  # counts its own requests in flight (stalled ones of earlier tests may linger)
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
            await asyncio.sleep(0.05)
            self.inflight -= 1
        if self.mode == "500":
            return web.Response(status=500, text="boom")
        if self.mode == "404":
            return web.Response(status=404, text="nope")
        if self.mode == "html":
            return web.Response(text="<html>not json</html>", content_type="text/html")
        if self.mode == "flaky" and self.hits == 1:
            return web.Response(status=503)
        return web.json_response(PAYLOAD)

    def _serve(self, ready):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/search", self.handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        async def shutdown():
            await self.runner.cleanup()
            # Handlers still sleeping for clients that timed out: cancel them before the loop stops.
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def server():
    s = FakeSearxng()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def reset(server):
    server.mode, server.hits, server.seen, server.peak = "ok", 0, [], 0


def backend(server, **kw):
    kw.setdefault("timeout_s", 0.3)
    kw.setdefault("retries", 2)
    kw.setdefault("backoff_s", 0.01)
    return SearxngBackend(server.url, **kw)


def test_parses_results_and_sends_json_query(server):
    hits = backend(server).search("who founded Y Combinator", 2)
    assert [(h.title, h.url, h.snippet) for h in hits] == [
        ("First", "https://a.example/1", "first snippet"), ("https://a.example/2", "https://a.example/2", "")]
    assert server.seen[0][0] == {"q": "who founded Y Combinator", "format": "json"}
    assert server.seen[0][1] is None
    assert [h.doc_id for h in backend(server).search("q", 10)] == [
        "https://a.example/1", "https://a.example/2", "https://a.example/3"]


def test_retries_after_503_then_succeeds(server):
    server.mode = "flaky"
    assert len(backend(server).search("q", 10)) == 3 and server.hits == 2


def test_500_retried_then_clear_error(server):
    server.mode = "500"
    with pytest.raises(SearchBackendError, match=r"HTTP 500 \(3 attempt"):
        backend(server, retries=2).search("q", 5)
    assert server.hits == 3


def test_404_and_non_json_are_not_retried(server):
    server.mode = "404"
    with pytest.raises(SearchBackendError, match=r"HTTP 404 \(1 attempt"):
        backend(server).search("q", 5)
    server.mode = "html"
    with pytest.raises(SearchBackendError, match="not JSON"):
        backend(server).search("q", 5)
    assert server.hits == 2


def test_stalling_server_times_out_into_tool_error_and_counts_e(server):
    server.mode = "stall"
    tool = SearchTool(backend(server, timeout_s=0.2, retries=1))
    session = tool.session()

    async def go():
        try:
            return await session.execute_all([ToolCall("search_web", {"query": "slow"})])
        finally:
            await tool.backend.aclose()

    start = time.perf_counter()
    (result,) = asyncio.run(go())
    assert time.perf_counter() - start < 2.0  # two 0.2 s attempts, not the server's 3 s stall
    assert result.failed and not result.ok and "timed out after 0.2 s (2 attempt(s))" in result.text
    assert session.stats.failed == 1 and session.stats.calls == 1 and session.stats.effective_calls == 0
    assert server.hits == 2


def test_requests_queued_for_a_slot_do_not_time_out(server):
    """max_connections bounds the requests in flight; the per-attempt timeout starts when one is sent, so 40
    searches through 2 slots (the last waits about 1 s) all succeed under a 0.5 s timeout."""
    server.mode = "delay"
    b = backend(server, timeout_s=0.5, retries=0, max_connections=2)

    async def go():
        try:
            return await asyncio.gather(*(b.asearch(f"q{i}", 3) for i in range(40)))
        finally:
            await b.aclose()

    assert [len(r) for r in asyncio.run(go())] == [3] * 40
    assert server.hits == 40 and server.peak == 2
    with pytest.raises(ValueError, match="max_connections"):
        backend(server, max_connections=0)


def test_server_error_in_agent_path_counts_e_per_call(server):
    server.mode = "500"
    tool = SearchTool(backend(server, retries=0))
    session = tool.session()

    async def go():
        out = await session.execute_all([ToolCall("search_web", {"query": q}) for q in ("a", "b", "c")])
        await tool.backend.aclose()
        return out

    results = asyncio.run(go())
    assert [r.failed for r in results] == [True, True, True] and session.stats.failed == 3


def test_connection_refused_is_an_error_not_a_crash():
    b = SearxngBackend("http://127.0.0.1:9", timeout_s=0.5, retries=1, backoff_s=0.01)
    with pytest.raises(SearchBackendError, match="connection failed"):
        b.search("q", 3)


def test_api_key_goes_in_header_and_never_in_repr(server, monkeypatch):
    monkeypatch.setenv("MS_TEST_SEARCH_KEY", "sekrit-123")
    b = build_backend(SearchConfig(backend="searxng", url=server.url, api_key_env="MS_TEST_SEARCH_KEY"))
    b.search("q", 1)
    assert server.seen[0][1] == "Bearer sekrit-123"
    assert "sekrit" not in repr(b) and "MS_TEST_SEARCH_KEY" in repr(b)
    monkeypatch.delenv("MS_TEST_SEARCH_KEY")
    with pytest.raises(SearchBackendError, match="MS_TEST_SEARCH_KEY.*not set"):
        build_backend(SearchConfig(backend="searxng", url=server.url, api_key_env="MS_TEST_SEARCH_KEY"))


def test_a_commercial_api_plugs_into_the_http_base(server, monkeypatch):
    """The extension point: a subclass defines request() and parse(); retries/timeouts are inherited."""
    from megatron_search.search import SearchResult, read_api_key
    from megatron_search.search.searxng import HTTPSearchBackend

    class VendorAPI(HTTPSearchBackend):
        name = "vendor"

        def request(self, query, k):
            return f"{self.base_url}/search", {"q": query, "format": "json", "count": str(k)}, {
                "Authorization": f"Token {read_api_key(self.api_key_env)}"}

        def parse(self, payload, k):
            return [SearchResult(r["title"], r["url"], r.get("content") or "", r["url"])
                    for r in payload["results"] if r.get("url")][:k]

    monkeypatch.setenv("MS_VENDOR_KEY", "v-key")
    server.mode = "flaky"  # first attempt 503, then success
    api = VendorAPI(server.url, timeout_s=1.0, retries=1, backoff_s=0.01, api_key_env="MS_VENDOR_KEY")
    assert [h.title for h in api.search("q", 2)] == ["First", ""]
    assert server.hits == 2 and server.seen[-1] == ({"q": "q", "format": "json", "count": "2"}, "Token v-key")
    assert "v-key" not in repr(api)


def test_search_tool_from_config(tmp_path):
    import json

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "1", "title": "Seine", "url": "u", "text": "river in Paris"}) + "\n")
    tool = SearchTool.from_config(SearchConfig(corpus=str(corpus), max_calls=2, max_results=3, max_query_chars=20))
    session = tool.session()
    assert (session.budget, tool.max_results, tool.max_query_chars) == (2, 3, 20)
    (res,) = asyncio.run(session.execute_all([ToolCall("search_web", {"query": "Paris river"})]))
    assert res.ok and res.results[0].doc_id == "1"
